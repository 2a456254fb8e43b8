"""A shared CS system (`cs_system serve`), jobs submitted to it with csrun_wse --cs_ip, and csctl.

Jobs are found in `csctl get jobs -o json` by a label each test gives them;
waiting is polling that JSON (a phase is a state, not a moment).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cs_runtime.wire.protocol import Message, Msg, ProtocolError, decode, encode
from tests.cluster_utils import (alive, assert_matches_oracle, descendants, kill_tree, wse_command,
                                 write_params)

pytestmark = pytest.mark.cluster  # every test here starts processes (see tests/conftest.py)

SHM = Path("/dev/shm")
WAIT_S = 240   # generous: two cores shared with other test runs


class Server:
    """`cs_system serve` on a free port, with its own owner credential folder."""

    def __init__(self, tmp: Path, num_csx: int = 1):
        self.tmp = tmp
        self.log = open(tmp / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cs_runtime.cli.cs_system", "serve", "--port", "0", "--num_csx", str(num_csx)],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env=self.env("owner"))
        line = self.proc.stdout.readline()   # the server says where it serves once it does
        found = re.search(r" at (\S+:\d+)", line)
        assert found, f"no address in {line!r}; log: {(tmp / 'server.log').read_text()[-2000:]}"
        self.address = found.group(1)
        self.submitters: list[subprocess.Popen] = []

    def env(self, user: str) -> dict:
        return {**os.environ, "CS_USER_DIR": str(self.tmp / user)}

    def submit(self, params: Path, model_dir: Path, label: str, user: str = "owner") -> subprocess.Popen:
        cmd = wse_command(params, model_dir, extra_launcher=("--cs_ip", self.address, "--job_label", f"case={label}"))
        out = open(self.tmp / f"{label}.log", "w")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env(user))
        self.submitters.append(proc)
        return proc

    def csctl(self, *args: str, user: str = "owner") -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cs_runtime.cli.csctl", "--cs_ip", self.address, *args],
                              capture_output=True, text=True, timeout=60, env=self.env(user))

    def jobs(self) -> dict[str, dict]:
        """{label: job row} of every job that has a case label."""
        result = self.csctl("get", "jobs", "-o", "json")
        assert result.returncode == 0, result.stderr
        return {j["labels"]["case"]: j for j in json.loads(result.stdout)["jobs"] if "case" in j["labels"]}

    def wait_for(self, label: str, phases: set[str], on_poll=None) -> dict:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            jobs = self.jobs()
            if on_poll is not None:
                on_poll(jobs)
            if label in jobs and jobs[label]["phase"] in phases:
                return jobs[label]
            time.sleep(0.2)   # polling interval
        raise AssertionError(f"job {label} never reached {phases}: {self.jobs().get(label)}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        for proc in self.submitters:
            if proc.poll() is None:
                kill_tree(proc)
        if self.proc.poll() is None:
            kill_tree(self.proc)
        self.log.close()


@pytest.fixture
def server(tmp_path):
    srv = Server(tmp_path)
    try:
        yield srv
    finally:
        srv.stop()


def job_processes(job: dict) -> list[int]:
    """Every live process of the job: its services (csctl lists them) and its submitter's tasks."""
    return [s["pid"] for s in job["services"] if alive(s["pid"])] + tasks_of(job["job_id"])


def tasks_of(job_id: str) -> list[int]:
    """The chief and workers of the job (its id is in the environment each was started with)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"CS_JOB_ID={job_id}".encode() in env and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def job_segments(job_id: str) -> list[str]:
    return [p.name for p in SHM.glob(f"cs-{job_id}-*")] if SHM.is_dir() else []


def test_two_jobs_submitted_together_queue_and_both_match_the_oracle(server, oracle, tmp_path):
    params = oracle[0]
    first = server.submit(params, tmp_path / "a", "a")
    second = server.submit(params, tmp_path / "b", "b")
    seen: dict[str, set] = {"a": set(), "b": set()}

    def record(jobs):
        for label, job in jobs.items():
            seen[label].add(job["phase"])
        # One CS system: never two jobs on it at once.
        assert sum(j["phase"] in ("COMPILING", "RUNNING") for j in jobs.values()) <= 1, jobs

    server.wait_for("a", {"SUCCEEDED", "FAILED"}, record)
    server.wait_for("b", {"SUCCEEDED", "FAILED"}, record)
    assert first.wait(WAIT_S) == 0 and second.wait(WAIT_S) == 0, (tmp_path / "a.log").read_text()[-3000:]
    jobs = server.jobs()
    assert {jobs["a"]["phase"], jobs["b"]["phase"]} == {"SUCCEEDED"}
    assert "RUNNING" in seen["a"] | seen["b"]
    later = max(("a", "b"), key=lambda label: jobs[label]["name"].split("-")[1].zfill(9))
    assert "QUEUED" in seen[later]   # it waited for the other
    assert jobs[later]["systems"] == ["cs0"] and jobs[later]["user"]
    assert_matches_oracle(tmp_path / "a", oracle)
    assert_matches_oracle(tmp_path / "b", oracle)


def test_failed_jobs_do_not_stop_the_system_and_the_next_job_matches_the_oracle(server, oracle, tmp_path):
    bad = write_params(tmp_path, "bad.yaml", optimizer={"learning_rat": 0.1})
    assert server.submit(bad, tmp_path / "bad", "bad-params").wait(WAIT_S) != 0
    failed = server.jobs()["bad-params"]
    assert failed["phase"] == "FAILED"
    # The params were checked before anything started; csctl says why the job never ran.
    assert "optimizer.learning_rat: unknown key: did you mean learning_rate?" in failed["reason"], failed
    shown = server.csctl("get", "job", failed["name"])   # one job by name, with why it failed
    assert shown.returncode == 0 and shown.stdout.splitlines()[1].split()[0] == failed["name"], shown
    assert "did you mean learning_rate?" in shown.stdout.splitlines()[-1]
    # A service crash mid-training: the CS system fails that job only.
    long_params = write_params(tmp_path, "long.yaml", runconfig={"max_steps": 100000, "checkpoint_steps": 0})
    crashing = server.submit(long_params, tmp_path / "crash", "crash")
    running = server.wait_for("crash", {"RUNNING"})
    wse = [s["pid"] for s in running["services"] if s["role"] == "wse"]
    assert len(wse) == 1 and b"-m\0wse" in Path(f"/proc/{wse[0]}/cmdline").read_bytes()
    os.kill(wse[0], signal.SIGKILL)
    assert crashing.wait(WAIT_S) != 0
    failed = server.wait_for("crash", {"FAILED", "SUCCEEDED", "CANCELLED"})
    assert failed["phase"] == "FAILED" and "wse 0" in failed["reason"] and "SIGKILL" in failed["reason"]
    # Its chief killed with kill -9: the submitter reports it, the CS system stops the job's services.
    killed = server.submit(long_params, tmp_path / "killed", "killed")
    victim = server.wait_for("killed", {"RUNNING"})
    chief = [pid for pid in tasks_of(victim["job_id"]) if b"-m\0chief" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(chief) == 1
    os.kill(chief[0], signal.SIGKILL)
    assert killed.wait(WAIT_S) != 0
    ended = server.wait_for("killed", {"FAILED", "SUCCEEDED", "CANCELLED"})
    assert ended["phase"] == "FAILED" and "chief 0" in ended["reason"] and "SIGKILL" in ended["reason"]
    assert job_processes(ended) == [] and job_segments(victim["job_id"]) == []
    good = server.submit(oracle[0], tmp_path / "good", "good")
    assert good.wait(WAIT_S) == 0, (tmp_path / "good.log").read_text()[-3000:]
    assert server.jobs()["good"]["phase"] == "SUCCEEDED"
    assert_matches_oracle(tmp_path / "good", oracle)
    assert job_processes(running) == [] and job_segments(running["job_id"]) == []


def test_owner_labels_and_cancels_a_running_job_others_are_refused(server, oracle, tmp_path):
    long_params = write_params(tmp_path, "long.yaml", runconfig={"max_steps": 100000, "checkpoint_steps": 0})
    running = server.submit(long_params, tmp_path / "long", "long")
    job = server.wait_for("long", {"RUNNING"})
    # Submitted once the long job holds the system (submitted together, either may reach the server first).
    waiting = server.submit(oracle[0], tmp_path / "next", "next")
    server.wait_for("next", {"QUEUED"})
    number = job["name"].split("-")[1]

    refused = server.csctl("cancel", "job", number, user="someone-else")
    assert refused.returncode == 1
    assert refused.stderr.strip() == (f"csctl: permission denied: {job['name']} belongs to {job['user']}, and only "
                                      "its owner may cancel it (this request does not carry the owner credential "
                                      "it was submitted with)")
    assert server.csctl("label", "job", number, "team=x", user="someone-else").returncode == 1
    assert server.jobs()["long"]["phase"] == "RUNNING" and server.jobs()["long"]["labels"] == {"case": "long"}

    labelled = server.csctl("label", "job", job["name"], "team=vision", "prio=high")
    assert labelled.returncode == 0, labelled.stderr
    assert server.jobs()["long"]["labels"] == {"case": "long", "team": "vision", "prio": "high"}
    table = server.csctl("get", "jobs").stdout.splitlines()
    assert table[0].split() == ["NAME", "AGE", "DURATION", "PHASE", "SYSTEMS", "USER", "LABELS"]
    row = next(line.split() for line in table if line.startswith(job["name"] + " "))
    assert row[3:] == ["RUNNING", "cs0", job["user"], "case=long,prio=high,team=vision"]

    assert tasks_of(job["job_id"]) and all(alive(s["pid"]) for s in job["services"])
    cancelled = server.csctl("cancel", "job", number)
    assert cancelled.returncode == 0 and cancelled.stdout.strip() == f"{job['name']} cancelled", cancelled.stderr
    assert server.jobs()["long"]["phase"] == "CANCELLED"
    assert running.wait(60) != 0
    assert job_processes(server.jobs()["long"]) == [] and job_segments(job["job_id"]) == []
    again = server.csctl("cancel", "job", number)
    assert again.stderr.strip() == f"csctl: {job['name']} has already ended (CANCELLED)"
    # The system is free again: the queued job runs, and right.
    assert waiting.wait(WAIT_S) == 0, (tmp_path / "next.log").read_text()[-3000:]
    assert_matches_oracle(tmp_path / "next", oracle)


def test_csctl_errors_are_one_line(server, tmp_path):
    missing = server.csctl("cancel", "job", "99")
    assert (missing.returncode, missing.stderr) == (1, f"csctl: no job wsjob-99 on {server.address}\n")
    bad_label = server.csctl("label", "job", "1", "no spaces=x")
    assert bad_label.returncode == 1 and bad_label.stderr.startswith("csctl: label key 'no spaces'")
    with socket_free_port() as port:
        gone = subprocess.run([sys.executable, "-m", "cs_runtime.cli.csctl", "--cs_ip", f"127.0.0.1:{port}", "get", "jobs"],
                              capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1
    assert gone.stderr.startswith(f"csctl: the CS system at 127.0.0.1:{port} is unreachable")
    assert len(gone.stderr.strip().splitlines()) == 1


def test_server_stops_on_sigterm_leaving_nothing_behind(tmp_path):
    server = Server(tmp_path)
    try:
        long_params = write_params(tmp_path, "long.yaml", runconfig={"max_steps": 100000, "checkpoint_steps": 0})
        submitter = server.submit(long_params, tmp_path / "long", "long")
        job = server.wait_for("long", {"RUNNING"})
        started = [pid for pid, _ in descendants(server.proc.pid)]
        assert {s["pid"] for s in job["services"]} <= set(started) and len(job["services"]) == 3
        assert tasks_of(job["job_id"]) and job_segments(job["job_id"])
        assert server.stop() == 0
        assert submitter.wait(60) != 0   # told its job was cancelled
    finally:
        server.cleanup()
    assert [pid for pid in started if alive(pid)] == []
    assert [s["pid"] for s in job["services"] if alive(s["pid"])] == [] and tasks_of(job["job_id"]) == []
    assert list(SHM.glob(f"cs-*-l{server.proc.pid}")) == [] and job_segments(job["job_id"]) == []
    leftovers = [d for d in Path(tempfile.gettempdir()).glob("cs*-*") if (d / "launcher.pid").is_file()
                 and (d / "launcher.pid").read_text() == str(server.proc.pid)]
    assert leftovers == []
    assert "the CS system stopped (SIGTERM)" in (tmp_path / "long.log").read_text()


def test_front_door_messages_are_validated():
    good = {"name": "wsjob-3", "owner": "ab" * 32}
    assert decode(encode(Message(Msg.CANCEL, meta=good))).meta == good
    for meta, why in (({**good, "name": "job-3"}, "not wsjob-<number>"),
                      ({**good, "owner": "xyz"}, "owner credential"),
                      ({**good, "labels": {"a b": "c"}}, "label key")):
        kind = Msg.LABEL if "labels" in meta else Msg.CANCEL
        with pytest.raises(ProtocolError, match=why):
            decode(encode(Message(kind, meta=meta)))
    submit = {"user": "u", "num_csx": 1, "owner": "ab" * 32, "labels": {}, "keys": {"server_public": "x"}}
    with pytest.raises(ProtocolError, match="keys"):
        decode(encode(Message(Msg.SUBMIT, meta=submit)))


class socket_free_port:
    """A port nobody listens on (bound, read, closed)."""

    def __enter__(self) -> int:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc) -> None:
        pass
