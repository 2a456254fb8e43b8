"""Layer-pipelined mode and multi-replica: against the CPU oracle, and checkpoints across modes."""
from __future__ import annotations

import re

import pytest

from tests.cluster_utils import assert_matches_oracle, run_wse, write_params

pytestmark = pytest.mark.cluster  # every test here starts processes (see tests/conftest.py)


def pipelined_params(tmp_path, name="pipe.yaml", **runconfig):
    return write_params(tmp_path, name, runconfig={"execution_strategy": "pipelined", **runconfig})


@pytest.mark.parametrize("extra", [(), ("--multireplica",)])
def test_pipelined_equals_cpu_oracle_and_streams_no_weights(tmp_path, oracle, extra):
    result = run_wse(pipelined_params(tmp_path), tmp_path / "m", extra=extra)
    assert result.returncode == 0, result.stderr[-3000:]
    mode = "pipelined x2" if extra else "pipelined"
    assert f"| Train Device=WSE, Mode={mode}, Step=100," in result.stdout, result.stdout
    # Measured on the WSE's sockets: nothing but the step command arrives per step.
    assert re.search(r"WeightBytes/step=0 \(received by the WSE sockets\)", result.stdout), result.stdout
    assert_matches_oracle(tmp_path / "m", oracle)


def test_weight_streaming_counts_its_weight_bytes(tmp_path, oracle):
    result = run_wse(oracle[0], tmp_path / "m")
    assert result.returncode == 0, result.stderr[-2000:]
    found = re.search(r"WSEBytesIn/step=(\d+)", result.stdout)
    params = 784 * 64 + 64 + 64 * 32 + 32 + 32 * 10 + 10
    # one group of small layers (protocol.layer_groups): its weights arrive once a step,
    # forward and at once backward (fwd_bwd), float32
    assert found and int(found.group(1)) == 4 * params


@pytest.mark.parametrize("first,second", [("weight_streaming", "pipelined"), ("pipelined", "weight_streaming")])
def test_checkpoint_from_one_mode_resumes_in_the_other(tmp_path, oracle, first, second):
    half = write_params(tmp_path, "a.yaml", runconfig={"max_steps": 50, "execution_strategy": first})
    full = write_params(tmp_path, "b.yaml", runconfig={"execution_strategy": second})
    assert run_wse(half, tmp_path / "m").returncode == 0
    result = run_wse(full, tmp_path / "m")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"Mode={second}" in result.stdout
    assert_matches_oracle(tmp_path / "m", oracle)


def test_compiler_picks_pipelined_for_a_model_that_fits(tmp_path):
    params = write_params(tmp_path, runconfig={"execution_strategy": None, "max_steps": 5, "log_steps": 5})
    result = run_wse(params, tmp_path / "m")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Mode=pipelined" in result.stdout
