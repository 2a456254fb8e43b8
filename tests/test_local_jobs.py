"""csctl on this user's jobs that run here without a shared CS system (cs_runtime/launch/local_jobs.py).

No process is started here: the registry is exercised with this test's own
process (whose SIGTERM a handler catches); the whole path, a csrun_wse job
listed and cancelled from another process: tests/test_local_jobs_cluster.py.
"""
from __future__ import annotations

import json
import os
import signal

import pytest

from cs_runtime.cli import csctl
from cs_runtime.launch import local_jobs


@pytest.fixture
def registry(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("CS_SYSTEM", raising=False)
    return tmp_path / "cs_emulator" / "jobs"


def csctl_out(argv, capsys) -> str:
    csctl.main(argv)
    return capsys.readouterr().out


def test_a_registered_job_is_listed_labelled_and_gone_when_it_ends(registry, capsys):
    job = local_jobs.register("wsjob-abc123", 2, {"name": "bert_pt"})
    assert job.name == "wsjob-1" and (registry / "wsjob-1.json").is_file()
    assert registry.stat().st_mode & 0o777 == 0o700 and (registry / "wsjob-1.json").stat().st_mode & 0o777 == 0o600
    second = local_jobs.register("wsjob-def456", 1)
    table = csctl_out(["get", "jobs"], capsys).splitlines()
    assert table[0].split() == ["NAME", "AGE", "DURATION", "PHASE", "SYSTEMS", "USER", "LABELS"]
    assert [row.split()[0] for row in table[1:]] == ["wsjob-1", "wsjob-2"]
    assert table[1].split()[3:] == ["RUNNING", "cs0,cs1", job.user, "name=bert_pt"]
    assert csctl_out(["label", "job", "1", "team=nlp"], capsys).strip() == "wsjob-1 labelled"
    listed = json.loads(csctl_out(["get", "job", "wsjob-1", "-o", "json"], capsys))
    assert listed["labels"] == {"name": "bert_pt", "team": "nlp"}
    local_jobs.unregister(job)
    local_jobs.unregister(second)
    assert csctl_out(["get", "jobs"], capsys).splitlines()[1:] == []


def test_cancel_sends_the_jobs_process_sigterm(registry, capsys):
    got = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: got.append(signum))
    try:
        job = local_jobs.register("wsjob-abc123", 1)
        assert csctl_out(["cancel", "job", job.name], capsys).strip() == f"{job.name} cancelled"
    finally:
        signal.signal(signal.SIGTERM, previous)
        local_jobs.unregister(job)
    assert got == [signal.SIGTERM]


def test_an_entry_of_an_ended_or_reused_process_is_dropped(registry, capsys):
    job = local_jobs.register("wsjob-abc123", 1)
    entry = registry / f"{job.name}.json"
    data = json.loads(entry.read_text())
    entry.write_text(json.dumps({**data, "pid_start": data["pid_start"] + 1}))   # this pid, another process
    assert local_jobs.jobs() == [] and not entry.exists()
    with pytest.raises(SystemExit) as err:
        csctl.main(["cancel", "job", job.name])
    assert str(err.value) == f"csctl: no job {job.name} of this user on this machine (csctl get jobs lists them)"


@pytest.mark.parametrize("change, says", [
    ({"pid": "1234"}, "pid must be of type int"), ({"name": "job-1"}, "name, job_id, pid or num_csx out of range"),
    ({"labels": {"bad key": "x"}}, "label key 'bad key'"), ({"extra": 1}, "not a job entry"),
])
def test_a_malformed_entry_is_one_line_naming_it(registry, change, says):
    job = local_jobs.register("wsjob-abc123", 1)
    entry = registry / f"{job.name}.json"
    entry.write_text(json.dumps({**json.loads(entry.read_text()), **change}))
    with pytest.raises(local_jobs.LocalJobError, match=says) as err:
        local_jobs.jobs()
    assert str(err.value).startswith(str(entry)) and "\n" not in str(err.value)
    entry.unlink()


def test_a_registry_others_may_write_is_refused(registry):
    registry.mkdir(parents=True)
    os.chmod(registry, 0o777)
    with pytest.raises(local_jobs.LocalJobError, match="must be a folder of this user's only"):
        local_jobs.register("wsjob-abc123", 1)


def test_a_job_the_registry_cannot_take_runs_unlisted_and_says_so(registry, capsys):
    from cs_runtime.launch.job import JobOptions, register_local
    registry.mkdir(parents=True)
    os.chmod(registry, 0o755)      # not this user's alone: nothing is written there
    assert register_local("wsjob-abc123", JobOptions(command=["true"])) is None
    err = capsys.readouterr().err
    assert err.startswith("csrun: this job is not listed by csctl: ") and err.count("\n") == 1
    assert not list(registry.iterdir())
