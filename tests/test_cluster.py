"""Whole-cluster tests: real processes on loopback, checked against the CPU oracle."""
from __future__ import annotations

import re
import signal
import subprocess
import time

import numpy as np
import pytest

from tests.cluster_utils import (alive, assert_matches_oracle, descendants, final_weights, kill_tree, relative_error,
                                 run_cpu, run_wse, state_needs_table_frames, train_losses, wse_command, write_params)

pytestmark = pytest.mark.cluster  # every test here starts processes (see tests/conftest.py)

ROLE_PATTERNS = {"chief": "-m chief ", "worker": "-m worker ", "memoryx": "-m cs_runtime.memoryx",
                 "swarmx": "-m cs_runtime.swarmx", "wse": "-m wse"}


@pytest.mark.parametrize("num_csx,workers", [(1, 1), (2, 2)])
def test_weight_streaming_equals_cpu_oracle(tmp_path, oracle, num_csx, workers):
    result = run_wse(oracle[0], tmp_path / "wse", num_csx=num_csx, workers=workers)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"\| Train Device=WSE, Mode=weight_streaming, Step=100, Loss=[\d.]+, Rate=[\d.]+ samples/sec, "
                     r"GlobalRate=[\d.]+ samples/sec", result.stdout), result.stdout
    assert_matches_oracle(tmp_path / "wse", oracle)


def test_five_kinds_of_process_and_none_left(tmp_path):
    params = write_params(tmp_path, runconfig={"max_steps": 100, "log_steps": 10})
    proc = subprocess.Popen(wse_command(params, tmp_path / "m", num_csx=2), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        seen: dict[str, set] = {role: set() for role in ROLE_PATTERNS}
        head = []
        for line in proc.stdout:  # once training runs, every process is up
            head.append(line)
            if "| Train" in line:
                break
        for pid, args in descendants(proc.pid):
            for role, pattern in ROLE_PATTERNS.items():
                if pattern in args + " ":
                    seen[role].add(pid)
        counts = {role: len(pids) for role, pids in seen.items()}
        assert counts == {"chief": 1, "worker": 2, "memoryx": 1, "swarmx": 1, "wse": 2}, "".join(head)
        proc.stdout.read()
        assert proc.wait(timeout=120) == 0
        left = [pid for pids in seen.values() for pid in pids if alive(pid)]
        assert left == []
    finally:
        kill_tree(proc)


def run_until_training(tmp_path, num_csx=1):
    params = write_params(tmp_path, runconfig={"max_steps": 100000, "log_steps": 5})
    proc = subprocess.Popen(wse_command(params, tmp_path / "m", num_csx=num_csx), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "| Train" in line:
            break
    pids = {role: [pid for pid, args in descendants(proc.pid) if pattern in args + " "]
            for role, pattern in ROLE_PATTERNS.items()}
    return proc, pids


@pytest.mark.parametrize("role", ["wse", "memoryx", "swarmx", "worker", "chief"])
def test_a_dead_process_stops_the_job_without_orphans(tmp_path, role):
    proc, pids = run_until_training(tmp_path)
    try:
        victim = pids[role][0]
        subprocess.run(["kill", "-9", str(victim)], check=True)
        t0 = time.monotonic()
        output = proc.stdout.read()
        assert proc.wait(timeout=15) != 0
        assert time.monotonic() - t0 < 10
        failed = [l for l in output.splitlines() if "job failed" in l]
        assert len(failed) == 1 and re.search(rf"{role} 0 on \S+ \(pid {victim}\)", failed[0]), output[-2000:]
        everyone = [pid for p in pids.values() for pid in p]
        assert [pid for pid in everyone if alive(pid)] == []
    finally:
        kill_tree(proc)


def test_a_hung_process_is_named_and_stopped(tmp_path):
    proc, pids = run_until_training(tmp_path)
    try:
        victim = pids["swarmx"][0]
        subprocess.run(["kill", "-STOP", str(victim)], check=True)
        output = proc.stdout.read()
        assert proc.wait(timeout=30) != 0
        assert re.search(rf"swarmx 0 on \S+ \(pid {victim}\) stopped answering", output), output[-2000:]
        everyone = [pid for p in pids.values() for pid in p]
        assert [pid for pid in everyone if alive(pid)] == []
    finally:
        kill_tree(proc)


def test_ctrl_c_stops_everything(tmp_path):
    proc, pids = run_until_training(tmp_path)
    try:
        proc.send_signal(signal.SIGINT)
        output = proc.stdout.read()
        assert proc.wait(timeout=15) == 130  # 128 + SIGINT, as a shell reports a Ctrl-C
        assert "csrun: job stopped: interrupted by SIGINT" in output and "job failed" not in output
        # The chief says how far the run got and how to go on, once.
        stopped = [l for l in output.splitlines() if l.startswith("| Stopped at step")]
        assert len(stopped) == 1 and "interrupted by SIGINT" in stopped[0], output[-2000:]
        assert "resume" in stopped[0] or "no checkpoint yet" in stopped[0]
        everyone = [pid for p in pids.values() for pid in p]
        assert [pid for pid in everyone if alive(pid)] == []
    finally:
        kill_tree(proc)


def test_resume_from_checkpoint_equals_uninterrupted_run(tmp_path, oracle):
    params_half = write_params(tmp_path, "half.yaml", runconfig={"max_steps": 50})
    first = run_wse(params_half, tmp_path / "m")
    assert first.returncode == 0, first.stderr[-2000:]
    # Same model_dir, full length: resumes from checkpoint_50 by itself and says so.
    second = run_wse(oracle[0], tmp_path / "m")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resuming" in second.stderr
    assert_matches_oracle(tmp_path / "m", oracle)


def test_explicit_checkpoint_path_on_cpu_is_exact(tmp_path, oracle):
    params_half = write_params(tmp_path, "half.yaml", runconfig={"max_steps": 50})
    assert run_cpu(params_half, tmp_path / "a").returncode == 0
    result = run_cpu(oracle[0], tmp_path / "b", "train", "--checkpoint_path",
                     str(tmp_path / "a" / "checkpoint_50.npz"))
    assert result.returncode == 0, result.stderr
    resumed, full = final_weights(tmp_path / "b"), oracle[2]
    for name in full:
        np.testing.assert_array_equal(resumed[name], full[name])


def test_train_and_eval_reports_accuracy(tmp_path, oracle):
    result = run_wse(oracle[0], tmp_path / "m", mode="train_and_eval", num_csx=2)
    assert result.returncode == 0, result.stderr[-2000:]
    cpu = run_cpu(oracle[0], tmp_path / "c", "train_and_eval")
    pattern = r"\| Eval Device=(\w+)(?:, Mode=\w+)?, Step=100, Loss=([\d.]+), Accuracy=([\d.]+)"
    wse_eval, cpu_eval = re.search(pattern, result.stdout), re.search(pattern, cpu.stdout)
    assert wse_eval and cpu_eval, result.stdout + cpu.stdout
    assert abs(float(wse_eval.group(2)) - float(cpu_eval.group(2))) < 1e-4
    assert float(wse_eval.group(3)) > 0.5  # real digits, learned


def test_bad_params_fail_at_start_naming_the_key(tmp_path):
    params = write_params(tmp_path, optimizer={"learning_rat": 0.1})
    result = run_wse(params, tmp_path / "m")
    assert result.returncode != 0
    assert "optimizer.learning_rat" in result.stdout + result.stderr


# 300 dense layers trained with Adam: 2,400 arrays of weights and slots, whose names,
# dtypes and shapes (some 90 KB) outgrow a header in LOAD_MODEL and STATE.
DEEP_LAYERS, DEEP_STEPS = 300, 4


@pytest.mark.parametrize("strategy", ["weight_streaming", "pipelined"])
def test_a_model_of_thousands_of_arrays_loads_trains_and_checkpoints_as_the_cpu_path(tmp_path, strategy):
    params = write_params(tmp_path, model={"hidden_sizes": [8] * (DEEP_LAYERS - 1), "dropout": 0.0},
                          optimizer={"optimizer_type": "adam", "learning_rate": 0.001},
                          runconfig={"max_steps": DEEP_STEPS, "log_steps": 1, "checkpoint_steps": DEEP_STEPS,
                                     "execution_strategy": strategy})
    cpu = run_cpu(params, tmp_path / "cpu")
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    result = run_wse(params, tmp_path / "wse", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Mode={strategy}, Step={DEEP_STEPS}," in result.stdout, result.stdout[-2000:]
    oracle, got = final_weights(tmp_path / "cpu"), final_weights(tmp_path / "wse")
    assert len(got) == 2 * DEEP_LAYERS and got.keys() == oracle.keys()
    assert state_needs_table_frames(tmp_path / "wse")
    np.testing.assert_allclose(train_losses(tmp_path / "wse"), train_losses(tmp_path / "cpu"), rtol=1e-5)
    for name in oracle:
        assert relative_error(got[name], oracle[name]) < 1e-5, name
