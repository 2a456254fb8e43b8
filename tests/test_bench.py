"""scripts/bench.py --quick: the smoke test of the benchmark (structure and sane numbers, no timings)."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from cs_runtime.numerics.kernels import gelu_path, mask_path
from cs_runtime.numerics.ops import norms_path
from cs_runtime.numerics.optim import momentum_path
from cs_runtime.numerics.precision import conversion_path
from cs_runtime.numerics.windows import depthwise_path

REPO = Path(__file__).resolve().parent.parent


def _positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@pytest.mark.cluster
def test_quick_bench_writes_rows_and_verdicts(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--quick", "--json", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["preset"] == "tiny" and got["steps"] >= 4
    assert got["conversions"] == conversion_path() and got["exact_gelu"] == gelu_path()
    assert got["dropout_masks"] == mask_path() and got["momentum_update"] == momentum_path()
    assert got["depthwise"] == depthwise_path() and got["layer_norm"] == norms_path()
    assert (f"16-bit conversions: {got['conversions']}; exact GELU: {got['exact_gelu']}; dropout masks: "
            f"{got['dropout_masks']}; momentum update: {got['momentum_update']}; depthwise convolution: "
            f"{got['depthwise']}; layer norm: {got['layer_norm']}") in result.stdout
    names = [row["name"] for row in got["rows"]]
    rows_by_name = {row["name"]: row for row in got["rows"]}
    assert names == ["cpu", "weight_streaming_1wse", "ws_1wse_float16"]
    for row in got["rows"]:
        for key in ("samples_per_sec", "ratio_vs_baseline", "flops_per_sec"):
            assert _positive_finite(row[key]), (row["name"], key, row.get(key))
        # the job's CPU a step: measured for every row (4 steps less 2: a number, not a timing)
        assert math.isfinite(row["cpu_ms_per_step"]), row
        if row["name"] != "cpu":
            assert row["cluster_ms_per_step"] == row["cpu_ms_per_step"] - rows_by_name["cpu"]["cpu_ms_per_step"]
        if row["name"] != "cpu":
            assert _positive_finite(row["weight_bytes_per_step"]), row
            assert _positive_finite(row["weight_stream_bytes_per_sec"]), row
    # 16-bit weights stream half the bytes of float32 ones
    rows = {row["name"]: row for row in got["rows"]}
    assert rows["ws_1wse_float16"]["weight_bytes_per_step"] * 2 == rows["weight_streaming_1wse"]["weight_bytes_per_step"]
    # the 16-bit target is defined on the large preset: shown here, not judged
    [verdict] = got["verdicts"]
    assert verdict["row"] == "ws_1wse_float16" and verdict["baseline"] == "weight_streaming_1wse"
    assert _positive_finite(verdict["ratio"]) and verdict["target_ratio"] == 0.9
    assert verdict["judged"] is False and verdict["defined_on"] == "large" and "met" not in verdict
    assert "verdict" in result.stdout and "not judged: defined on the large preset" in result.stdout


def _bench_module():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import bench
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return bench


def test_a_failed_torch_baseline_is_tried_again_then_skipped_with_its_error(monkeypatch):
    """The torch rows are a comparison, not ours: gloo's DDP ranks now and then abort at
    exit. Such a row is tried twice, then skipped with its last error line; a baseline of
    our own (the ceilings) that fails stops the bench."""
    bench = _bench_module()
    calls = []

    def failing(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, -6, stdout="", stderr="spawn...\nProcessExitedException: SIGABRT\n")
    monkeypatch.setattr(bench.subprocess, "run", failing)
    got = bench.baseline("ddp", "--steps", "3", optional=True)
    assert got == {"skipped": "failed twice (exit -6): ProcessExitedException: SIGABRT"} and len(calls) == 2
    with pytest.raises(SystemExit, match="baseline matmul failed"):
        bench.baseline("matmul")
    assert len(calls) == 3


def test_a_target_is_judged_on_its_own_preset_and_shown_elsewhere(capsys):
    """The verdicts: met or missed (by how much) on the target's preset; elsewhere the ratio
    alone; a target whose rows did not run, nothing."""
    bench = _bench_module()
    rows = [{"name": "weight_streaming_1wse", "samples_per_sec": 100.0},
            {"name": "ws_1wse_float16", "samples_per_sec": 80.0}]
    ceiling = {"protocol": 95.0, "zmq": 100.0, "protocol_shm": 50.0, "memcpy": 100.0}
    on_large = {v["target"]: v for v in bench.verdicts("large", rows, ceiling)}
    assert set(on_large) == {"float16 weight streaming, 1 WSE(s), vs float32", "protocol over tcp vs raw pyzmq",
                             "protocol by shared memory vs memcpy"}
    fp16 = on_large["float16 weight streaming, 1 WSE(s), vs float32"]
    assert fp16["judged"] and not fp16["met"] and fp16["margin"] == pytest.approx(0.8 / 0.9 - 1)
    assert on_large["protocol over tcp vs raw pyzmq"]["met"]
    assert "missed by 11%" in capsys.readouterr().out
    on_small = {v["target"]: v for v in bench.verdicts("small", rows, ceiling)}
    assert on_small["protocol over tcp vs raw pyzmq"]["judged"]                 # any preset
    assert not on_small["protocol by shared memory vs memcpy"]["judged"]
    assert not on_small["float16 weight streaming, 1 WSE(s), vs float32"]["judged"]
    assert "not judged: defined on the large preset" in capsys.readouterr().out


def test_the_step_budget_counts_every_node_and_leaves_the_executor_as_it_was(capsys):
    """--rows ops: the CPU path's step counts the program's nodes (a dense layer with dropout:
    5 forward and 4 backward; the last layer, its loss: 3 and 3), and the budget times each op
    kind, the update and the rest, then puts back what it timed (one step each, no timings judged)."""
    bench = _bench_module()
    from cs_runtime.numerics import executor, local_step
    before = (executor.run_node, executor._run_in_place, local_step.apply_update)
    assert bench.cpu_path_step([6, 5, 4, 3], 4).ops == 2 * 9 + 6
    budget = bench.budget_of_step([6, 5, 3], 4, steps=2)
    assert (executor.run_node, executor._run_in_place, local_step.apply_update) == before
    kinds = {"matmul", "vjp:matmul", "add", "relu", "dropout_mask", "dropout", "softmax_cross_entropy",
             "vjp:softmax_cross_entropy", "optimizer update", "the rest (executor, loss)"}
    assert kinds <= set(budget) and all(v >= 0 for k, v in budget.items() if k != "the rest (executor, loss)")
    assert "where a step of [6, 5, 3] goes" in capsys.readouterr().out


def test_the_models_preset_judges_each_model_and_path_against_torch():
    """The CPU path by its CPU-time rate against torch's, weight streaming by the chief's rate
    against torch's wall clock; 0.8 on the models preset, not judged elsewhere."""
    bench = _bench_module()
    rows = [{"name": "resnet18_torch_eager", "samples_per_sec": 40.0},
            {"name": "resnet18_cpu", "samples_per_sec": 34.0},
            {"name": "resnet18_torch_eager_wall", "samples_per_sec": 20.0},
            {"name": "resnet18_weight_streaming_1wse", "samples_per_sec": 15.0}]
    got = {v["row"]: v for v in bench.verdicts("models", rows, {})}
    assert set(got) == {"resnet18_cpu", "resnet18_weight_streaming_1wse"}
    assert got["resnet18_cpu"]["ratio"] == pytest.approx(0.85) and got["resnet18_cpu"]["met"]
    assert got["resnet18_weight_streaming_1wse"]["ratio"] == pytest.approx(0.75)
    assert not got["resnet18_weight_streaming_1wse"]["met"]
    assert not any(v["judged"] for v in bench.verdicts("small", rows, {}))
    assert set(bench.FOREIGN_MODELS) == {"resnet18", "mobilenet_v3_small", "llama_causal_lm", "gpt2_lm_head",
                                         "bert_masked_lm", "vit_tiny"}
