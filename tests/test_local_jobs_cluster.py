"""A csrun_wse job without --cs_ip, listed and cancelled by csctl from another process of the same user.

csctl runs as its own process (another shell's), finding the job through
this user's registry (cs_runtime/launch/local_jobs.py); waiting is polling
its JSON listing. Afterwards a job runs to its end on the same machine and
matches the CPU oracle, and leaves no entry behind.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cluster_utils import (alive, assert_matches_oracle, descendants, final_weights, kill_tree, run_cpu,
                                 train_losses, wait_until, wse_command, write_params)

pytestmark = pytest.mark.cluster  # starts a job's processes (see tests/conftest.py)

WAIT_S = 240   # generous: two cores shared with other test runs


def environment(tmp_path) -> dict:
    runtime = tmp_path / "run"
    runtime.mkdir(exist_ok=True)
    return {**{k: v for k, v in os.environ.items() if k != "CS_SYSTEM"}, "XDG_RUNTIME_DIR": str(runtime)}


def csctl(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cs_runtime.cli.csctl", *args], capture_output=True, text=True,
                          timeout=60, env=environment(tmp_path))


def listed(tmp_path) -> list[dict]:
    out = csctl(tmp_path, "get", "jobs", "-o", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["jobs"]


def test_a_local_job_is_listed_and_cancelled_from_another_process(tmp_path):
    params = write_params(tmp_path, "long.yaml", runconfig={"max_steps": 100000, "checkpoint_steps": 0})
    log = open(tmp_path / "long.log", "w")
    proc = subprocess.Popen(wse_command(params, tmp_path / "long", extra_launcher=("--job_label", "name=bert_pt")),
                            stdout=log, stderr=subprocess.STDOUT, env=environment(tmp_path))
    try:
        assert wait_until(lambda: listed(tmp_path) or proc.poll() is not None, WAIT_S), "never listed"
        assert proc.poll() is None, (tmp_path / "long.log").read_text()[-3000:]
        [job] = listed(tmp_path)
        assert job["labels"] == {"name": "bert_pt"} and job["phase"] == "RUNNING" and job["systems"] == ["cs0"]
        processes = descendants(proc.pid)
        assert len(processes) >= 4      # MemoryX, SwarmX, a WSE, the chief, an input worker
        cancelled = csctl(tmp_path, "cancel", "job", job["name"].split("-")[1])
        assert cancelled.returncode == 0 and cancelled.stdout.strip() == f"{job['name']} cancelled", cancelled.stderr
        assert proc.wait(120) == 143      # 128 + SIGTERM: stopped as Ctrl-C stops it
        assert not [pid for pid, _ in processes if alive(pid)]
        assert listed(tmp_path) == [] and not list((tmp_path / "run" / "cs_emulator" / "jobs").glob("*.json"))
        gone = csctl(tmp_path, "cancel", "job", job["name"])
        assert gone.returncode == 1 and gone.stderr.startswith(f"csctl: no job {job['name']} of this user")
    finally:
        kill_tree(proc)
        log.close()
    # The machine's next job runs to its end, matches the CPU path and leaves no entry.
    short = write_params(tmp_path, "short.yaml")
    cpu = run_cpu(short, tmp_path / "cpu")
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    done = subprocess.run(wse_command(short, tmp_path / "wse"), capture_output=True, text=True, timeout=WAIT_S,
                          env=environment(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert_matches_oracle(tmp_path / "wse", (short, train_losses(tmp_path / "cpu"), final_weights(tmp_path / "cpu")))
    assert not list((tmp_path / "run" / "cs_emulator" / "jobs").glob("*.json"))
