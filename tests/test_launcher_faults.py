"""The launcher's own faults: killed (kill -9) or stopped (SIGSTOP) mid-run.

- killed: its services notice (their parent-death signal, or the heartbeat's
  parent check), delete the job's shared-memory segments and key folder, and
  exit; its tasks die with it. Nothing of the job is left.
- stopped for longer than its processes wait for it: they leave the job, and
  on resuming the launcher names itself, not the first process it finds
  exited; with --max_restarts the job resumes and ends with the oracle's numbers.

    python -m pytest tests/test_launcher_faults.py -q
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from cs_runtime.process import orphan
from cs_runtime.process.directory_client import EXIT_DIRECTORY_LOST
from cs_runtime.launch.launcher import DIRECTORY_PATIENCE_S, Supervisor
from cs_runtime.wire import auth
from tests.cluster_utils import (alive, assert_matches_oracle, descendants, kill_tree, wait_until, wse_command,
                                 write_params)
from tests.test_cluster import ROLE_PATTERNS

SETTLE_S = 20.0   # deadline for the job's processes to be gone once the launcher is


def process_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def job_segments(shm_dir: str, job: str) -> list[str]:
    return sorted(p.name for p in Path(shm_dir).glob(f"cs-{job}-*"))


# --------------------------------------------------------------------------
# what a service deletes when its launcher is gone (no process started)
# --------------------------------------------------------------------------

def test_clean_up_takes_the_jobs_segments_and_the_dead_launchers_key_folder(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    for name in ("cs-job1-memoryx0-1-l77", "cs-job1-wse0-1-l77", "cs-job2-wse0-1-l78"):
        (shm / name).write_bytes(b"x")
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / auth.OWNER_FILE).write_text("77")
    said = orphan.clean_up("job1", str(shm), str(keys), launcher_pid=77)
    assert sorted(p.name for p in shm.iterdir()) == ["cs-job2-wse0-1-l78"]   # another job's stays
    assert not keys.exists() and said == f"2 segment(s), key folder {keys}"


def test_clean_up_leaves_a_key_folder_another_process_made(tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / auth.OWNER_FILE).write_text("78")
    assert orphan.clean_up("job1", "", str(keys), launcher_pid=77) == "nothing"
    assert keys.exists()


def test_the_start_of_any_command_removes_the_key_folders_of_dead_launchers(tmp_path, monkeypatch):
    import importlib
    from cs_runtime import cli
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    never_a_pid = 2**22 + 1   # above the kernel's PID_MAX_LIMIT
    made = {}
    for prefix, owner in ((auth.JOB_DIR_PREFIX, never_a_pid), (auth.SYSTEM_DIR_PREFIX, never_a_pid),
                          (auth.JOB_DIR_PREFIX, os.getpid())):
        folder = tmp_path / f"{prefix}{len(made)}"
        folder.mkdir(mode=0o700)
        (folder / auth.OWNER_FILE).write_text(str(owner))
        made[folder] = owner
    importlib.reload(cli)   # what `python -m cs_runtime.cli.<command>` and every console command run first
    assert [f.name for f in made if f.exists()] == [f"{auth.JOB_DIR_PREFIX}2"]   # a live maker's stays


@pytest.mark.cluster
def test_a_stopped_sibling_service_is_killed_before_the_running_ones(tmp_path, monkeypatch):
    """Every running service of an orphaned job kills the others at once; were the stopped one last,
    two running services could kill each other first and leave it stopped for good."""
    def service(role: str, job: str = "job1") -> subprocess.Popen:   # a process that waits on its stdin
        started_with = {**os.environ, "CS_JOB_ID": job, "CS_ROLE": role}
        return subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=started_with)
    running, stopped, other_job = [service("memoryx"), service("swarmx")], service("wse"), service("wse", "job2")
    everyone = running + [stopped, other_job]
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        assert wait_until(lambda: orphan._stopped(stopped.pid), 10.0)
        order = []
        monkeypatch.setattr(orphan.os, "kill", lambda pid, sig: order.append((pid, sig)))
        killed = orphan.kill_sibling_services("job1")
        assert killed == [pid for pid, _ in order] and {sig for _, sig in order} == {signal.SIGKILL}
        assert killed[0] == stopped.pid
        assert sorted(killed[1:]) == sorted(p.pid for p in running)   # and not job2's
    finally:
        monkeypatch.undo()
        for proc in everyone:
            proc.kill()
            proc.wait(timeout=10)


# --------------------------------------------------------------------------
# the failure line after the launcher's own stall (no process started)
# --------------------------------------------------------------------------

class FakeDirectory:
    def __init__(self):
        self.failure, self.peers, self.forgiven = "", {}, 0

    def serve_once(self, timeout_ms: int) -> None:
        pass

    def silent_peers(self, timeout: float, **_) -> list:
        return []

    def forgive_silence(self) -> None:
        self.forgiven += 1

    def close(self) -> None:
        pass


def fake_group(*exits: tuple[str, int]):
    """Tasks that have already exited with these codes, in the launcher's start order."""
    tasks = []
    for pid, (role, rc) in enumerate(exits, 100):
        proc = SimpleNamespace(pid=pid, poll=lambda: 0)
        tasks.append(SimpleNamespace(role=role, rank=0, label=f"{role} 0 on here (pid {pid})", proc=proc,
                                     ended_how=lambda rc: f"exited with exit code {rc}", rc=rc))
    return SimpleNamespace(tasks=tasks, exited=lambda: [(t, t.rc) for t in tasks], stop_all=lambda grace=3.0: None)


def test_a_stopped_launcher_names_itself_not_memoryx(capsys, monkeypatch):
    directory = FakeDirectory()
    group = fake_group(("memoryx", EXIT_DIRECTORY_LOST), ("wse", EXIT_DIRECTORY_LOST), ("chief", EXIT_DIRECTORY_LOST))
    supervisor = Supervisor(directory, group, finisher_role="chief", handle_signals=False)
    monkeypatch.setattr(supervisor, "_drain_status", lambda seconds: None)
    supervisor._last_turn -= DIRECTORY_PATIENCE_S + 3   # as if SIGSTOP had held it that long
    assert supervisor.run() == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"csrun: job failed: the launcher (pid {os.getpid()}) was stopped or stalled for 1")
    assert "memoryx 0 on here (pid 100) first" in line and supervisor.failure.retryable
    assert directory.forgiven == 1   # the peers' silence across the stall is not theirs


def test_a_real_failure_is_named_before_the_processes_that_lost_the_launcher(capsys, monkeypatch):
    group = fake_group(("memoryx", EXIT_DIRECTORY_LOST), ("wse", -signal.SIGKILL))
    supervisor = Supervisor(FakeDirectory(), group, finisher_role="chief", handle_signals=False)
    monkeypatch.setattr(supervisor, "_drain_status", lambda seconds: None)
    assert supervisor.run() == 1
    assert "job failed: wse 0 on here (pid 101)" in capsys.readouterr().err


def test_a_short_stall_of_the_launcher_is_not_held_against_its_peers():
    import zmq
    from cs_runtime.launch.directory import DirectoryServer, Peer
    from cs_runtime.process.directory_client import HEARTBEAT_TIMEOUT
    ctx = zmq.Context()
    directory = DirectoryServer(ctx, "job1", {"wse": 1}, host="127.0.0.1")
    try:
        peer = Peer("wse", 0, "here", 4242, {})
        directory.peers[("wse", 0)] = peer
        directory.liveness.add(peer)
        directory.liveness.heard(("wse", 0), peer, False, time.monotonic() - HEARTBEAT_TIMEOUT - 2)
        assert directory.silent_peers() == [peer]      # 7 s of silence: it would be declared hung ...
        directory.forgive_silence()                     # ... but the launcher itself was stopped for them
        assert directory.silent_peers() == []
    finally:
        directory.close()
        ctx.destroy(linger=0)


# --------------------------------------------------------------------------
# whole jobs
# --------------------------------------------------------------------------

def start_training(params: Path, model_dir: Path, *launcher_flags: str) -> tuple[subprocess.Popen, list[str]]:
    """A job (csrun_wse with `launcher_flags`), once its first progress line is out."""
    cmd = wse_command(params, model_dir, extra_launcher=launcher_flags)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "| Train" in line:
            return proc, seen
    raise AssertionError("job ended before training:\n" + "".join(seen[-40:]))


@pytest.mark.cluster
@pytest.mark.parametrize("stopped", ["", "wse"], ids=["all-running", "a-stopped-wse"])
def test_kill_9_of_the_launcher_leaves_no_process_segment_or_key_folder(tmp_path, stopped):
    """A stopped service cannot act on its own signal: a sibling that can kills it."""
    params = write_params(tmp_path, runconfig={"max_steps": 100000, "log_steps": 5})
    proc, _ = start_training(params, tmp_path / "m")
    job_pids = [pid for pid, args in descendants(proc.pid) if any(p in args + " " for p in ROLE_PATTERNS.values())]
    try:
        assert len(job_pids) == 5
        memoryx = next(pid for pid, args in descendants(proc.pid) if ROLE_PATTERNS["memoryx"] in args)
        env = process_env(memoryx)
        job, shm_dir, keys_dir = env["CS_JOB_ID"], env["CS_SHM_DIR"], env["CS_KEYS_DIR"]
        assert job_segments(shm_dir, job) and Path(keys_dir).is_dir()   # there is something to clean up
        if stopped:
            os.kill(next(pid for pid, args in descendants(proc.pid) if ROLE_PATTERNS[stopped] in args + " "),
                    signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert wait_until(lambda: not any(alive(pid) for pid in job_pids), SETTLE_S), \
            [pid for pid in job_pids if alive(pid)]
        assert job_segments(shm_dir, job) == []
        assert not Path(keys_dir).exists()
    finally:
        kill_tree(proc)
        for pid in job_pids:   # the launcher is gone: what this test failed to see go, it stops itself
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.cluster
def test_a_stopped_launcher_is_named_and_the_restart_ends_with_the_oracles_numbers(tmp_path, oracle):
    params = write_params(tmp_path, runconfig={"log_steps": 5})   # the oracle's maths, more progress lines
    proc, seen = start_training(params, tmp_path / "m", "--max_restarts", "1")
    chief = None
    try:
        job = {pid: args for pid, args in descendants(proc.pid) if any(p in args + " " for p in ROLE_PATTERNS.values())}
        chief = next(pid for pid, args in job.items() if ROLE_PATTERNS["chief"] in args + " ")
        # The chief stopped too, so that the job cannot end by itself while the launcher is stopped
        # (on a fast machine the rest of the run takes less than the processes' 10 s of patience).
        os.kill(chief, signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGSTOP)
        # Stopped until every other process of the job has given up on it (their own deadline, not ours).
        others = [pid for pid in job if pid != chief]
        gave_up = wait_until(lambda: not any(alive(pid) for pid in others), DIRECTORY_PATIENCE_S + SETTLE_S)
        os.kill(proc.pid, signal.SIGCONT)
        assert gave_up
        output = "".join(seen) + proc.stdout.read()
        assert proc.wait(timeout=180) == 0, output[-3000:]
        failed = [line for line in output.splitlines() if "job failed" in line]
        assert len(failed) == 1 and f"the launcher (pid {proc.pid}) was stopped or stalled for" in failed[0], \
            output[-3000:]
        assert "memoryx 0" in failed[0] and "exited with" not in failed[0]
        assert "restarting the whole job from the latest checkpoint (restart 1 of 1)" in output
        assert_matches_oracle(tmp_path / "m", oracle)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        kill_tree(proc)
        if chief is not None and alive(chief):
            os.kill(chief, signal.SIGKILL)


def key_folders_of(launcher_pid: int) -> list[Path]:
    """The job key folders the launcher `launcher_pid` made that are still there."""
    found = []
    for folder in Path(tempfile.gettempdir()).glob(f"{auth.JOB_DIR_PREFIX}*"):
        try:
            if (folder / auth.OWNER_FILE).read_text() == str(launcher_pid):
                found.append(folder)
        except OSError:
            continue
    return found


GONE_WITHIN_S = 5.0   # "at once": the folder's watcher acts on the launcher's death, not a later job


def kill_launcher_and_check_nothing_is_left(proc: subprocess.Popen, when: str) -> None:
    job = [pid for pid, _ in descendants(proc.pid)]   # its tasks, its services, the folder's watcher
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    try:
        assert wait_until(lambda: not key_folders_of(proc.pid), GONE_WITHIN_S), (when, key_folders_of(proc.pid))
        assert wait_until(lambda: not any(alive(pid) for pid in job), GONE_WITHIN_S), \
            (when, [(pid, args) for pid, args in descendants(1) if pid in job])
    finally:
        for pid in job:   # what this test failed to see go, it stops itself
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.cluster
def test_a_launcher_killed_during_start_up_leaves_nothing_of_the_job_within_seconds(tmp_path):
    """Before its services exist nobody else knows the key folder: its watcher removes it."""
    delay = random.uniform(0.1, 1.5)
    params = write_params(tmp_path, runconfig={"max_steps": 100000})
    proc = subprocess.Popen(wse_command(params, tmp_path / "m"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)   # the moment drawn for the kill, not a synchronisation
        assert proc.poll() is None
        kill_launcher_and_check_nothing_is_left(proc, f"killed {delay:.2f} s after its start")
    finally:
        kill_tree(proc)


@pytest.mark.cluster
def test_a_launcher_killed_just_after_a_restart_line_leaves_nothing_of_the_job_within_seconds(tmp_path):
    """Between two attempts the first one's services are gone and the next one's not yet there."""
    params = write_params(tmp_path, runconfig={"max_steps": 100000, "log_steps": 5})
    proc, _ = start_training(params, tmp_path / "m", "--max_restarts", "1")
    try:
        memoryx = next(pid for pid, args in descendants(proc.pid) if ROLE_PATTERNS["memoryx"] in args)
        os.kill(memoryx, signal.SIGKILL)
        for line in proc.stdout:
            if "restarting the whole job" in line:
                break
        else:
            raise AssertionError("no restart line")
        kill_launcher_and_check_nothing_is_left(proc, "killed just after its restart line")
    finally:
        kill_tree(proc)
