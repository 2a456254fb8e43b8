"""The input pipeline across workers: a slow or stalled worker is named by the chief with measured
rates (and the numbers stay the oracle's); cs_input_analyzer measures and recommends."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from tests.cluster_utils import BIN, FC_MNIST, REPO, assert_matches_oracle, tool

pytestmark = pytest.mark.cluster  # every test here starts processes (see tests/conftest.py)

SLOW_RUN = str(REPO / "tests" / "slow_input_run.py")


def test_slow_and_stalled_worker_show_as_input_bottleneck(tmp_path, oracle):
    import os
    cmd = [tool("csrun_wse"), "--num_workers_per_csx", "2", sys.executable, SLOW_RUN, "--mode", "train",
           "--params", str(oracle[0]), "--model_dir", str(tmp_path / "m")]
    env = {**os.environ, "SLOW_INPUT_S": "0.5", "STALL_INPUT_S": "8"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stderr
    slow = re.search(r"chief WARNING suspected input bottleneck: the WSE\(s\) waited for input (\d+)% of the last "
                     r"[\d.]+ s \(consuming [\d.]+ batches/s\); input workers: worker 0 on \S+ [\d.]+ batches/s "
                     r"\(busy \d+%\).*, worker 1 on \S+ ([\d.]+) batches/s \(busy (\d+)%\)", log)
    assert slow, log[-4000:]
    assert int(slow.group(1)) > 25 and float(slow.group(2)) < 3 and int(slow.group(3)) > 50
    stall = re.search(r"suspected input bottleneck: no step finished for [\d.]+ s; input workers: .*"
                      r"worker 1 on \S+ [\d.]+ batches/s \(busy \d+%\) silent for [\d.]+ s", log)
    assert stall, log[-4000:]
    assert_matches_oracle(tmp_path / "m", oracle)  # slow input changes the time, never the numbers


def analyzer() -> list[str]:
    found = BIN / "cs_input_analyzer"
    return [str(found)] if found.exists() else [sys.executable, "-m", "cs_runtime.cli.cs_input_analyzer"]


def test_input_analyzer_measures_and_recommends(tmp_path, oracle):
    report = tmp_path / "analysis.yaml"
    result = subprocess.run([*analyzer(), "--available-nodes", "3", "--cpus-per-node", "4", "--max-workers", "2",
                             "--seconds", "0.5", "--report", str(report), sys.executable, FC_MNIST,
                             "--params", str(oracle[0]), "--model_dir", str(tmp_path / "m")],
                            capture_output=True, text=True, timeout=180, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    data = yaml.safe_load(report.read_text())
    assert [row["workers"] for row in data["input"]] == [1, 2]
    for row in data["input"]:
        assert row["batches_per_sec"] > 0 and len(row["per_worker_batches_per_sec"]) == row["workers"]
        assert abs(row["samples_per_sec"] - row["batches_per_sec"] * 64) < 0.01 * row["samples_per_sec"] + 1
    assert data["wse"]["emulator_batches_per_sec"] > 0 and data["wse"]["compiler_estimated_samples_per_sec"] > 0
    rec = data["recommendation"]
    need = data["wse"]["emulator_batches_per_sec"] * 1.2
    covering = [row["workers"] for row in data["input"] if row["batches_per_sec"] >= need]
    if covering:  # the smallest measured count that keeps up
        assert rec["input_workers"] == covering[0]
    else:
        assert rec["input_workers"] > 2
    assert rec["total_nodes"] <= 3 and rec["total_nodes"] * rec["tasks_per_node"] >= rec["input_workers"] + 1
    assert rec["cpus_per_task"] == max(1, 4 // rec["tasks_per_node"])
    assert f"--tasks-per-node {rec['tasks_per_node']}" in result.stdout


def test_input_analyzer_writes_nothing_into_the_current_folder_unless_asked(tmp_path, oracle):
    """No --report and no --model_dir: the probes compile into a temporary folder, the cwd stays empty;
    --output_dir DIR: the report and the probes' compile output go there."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    base = [*analyzer(), "--max-workers", "1", "--seconds", "0.3"]
    command = [sys.executable, FC_MNIST, "--params", str(oracle[0])]
    result = subprocess.run([*base, *command], capture_output=True, text=True, timeout=180, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "report: not written" in result.stdout and "recommendation:" in result.stdout
    assert list(cwd.iterdir()) == []
    out = tmp_path / "analysis"
    result = subprocess.run([*base, "--output_dir", str(out), *command], capture_output=True, text=True,
                            timeout=180, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(cwd.iterdir()) == []
    assert yaml.safe_load((out / "input_analysis.yaml").read_text())["input"][0]["workers"] == 1
    assert (out / "model_dir" / "compile_report.txt").is_file()


def test_input_analyzer_unknown_flag_is_an_error():
    result = subprocess.run([*analyzer(), "--available_nodez", "3", sys.executable, FC_MNIST],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2 and "unrecognized arguments: --available_nodez" in result.stderr
