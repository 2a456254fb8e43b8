"""Tests of the compiler (cs_runtime/compiler, cs_runtime/compiler/hardware.py, cs_runtime/compiler/stage.py).

    python -m pytest tests/test_compiler.py -q

The plan reads the program the executor runs (costs.py: its ops, their shape
and FLOP rules); two end-to-end tests run csrun_cpu on a real script.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from cs_runtime.compiler import artifact, hardware
from cs_runtime.compiler.costs import listing, program_kernels, program_shapes
from cs_runtime.compiler.errors import CompileError
from cs_runtime.compiler.planner import Target, choose_strategy, make_plan, target_from_env
from cs_runtime.compiler.stage import compile_model, runnable
from cs_runtime.compiler.pictures import render_wafer
from cs_runtime.compiler.report import OVERALL_FIELDS, render_report
from cs_runtime.config import params_from_dict
from cs_runtime.numerics.model import LayerSpec, ModelSpec, mlp_spec
from cs_runtime.numerics.ops import OPS
from cs_runtime.numerics.program_layer import unit_of
from cs_runtime.run_args import RunArgs

ROOT = Path(__file__).resolve().parents[1]
FC_PARAMS = ROOT / "examples/fc_mnist/configs/params.yaml"


def fc_mnist(dropout: float = 0.1, activation: str = "relu") -> ModelSpec:
    return mlp_spec("fc_mnist", [784, 256, 128, 10], activation, dropout)


def small(dropout: float = 0.25, activation: str = "gelu") -> ModelSpec:
    return mlp_spec("small", [12, 9, 7, 5], activation, dropout)


def args_for(tmp_path: Path, params: dict | None = None, **flags: Any) -> RunArgs:
    return RunArgs(mode=flags.pop("mode", "train"), params_path="params.yaml",
                   params=params_from_dict(params or {}), model_dir=str(tmp_path / "model"),
                   checkpoint_path=None, validate_only=flags.pop("validate_only", False),
                   compile_only=flags.pop("compile_only", True))


# ---------------------------------------------------------------- the program's kernels

def test_kernels_are_the_programs_ops_costed_by_the_op_set() -> None:
    spec = runnable(fc_mnist())
    kernels = program_kernels(spec, train=False, copies=1)
    # One kernel per dense layer: the matmul, and its bias, activation and dropout joined to it;
    # the loss joins the last layer's kernel.
    assert [k.name for k in kernels] == ["fc0", "fc1", "fc2"]
    assert kernels[0].nodes == ("matmul", "add", "relu", "dropout_mask", "dropout")
    assert kernels[2].nodes[-1] == "softmax_cross_entropy"
    # Each kernel's forward FLOPs per sample are the op set's own rules (ops.py), summed.
    shapes, _, batch = program_shapes(spec)
    for layer, k in zip(spec.layers, kernels):
        unit = unit_of(layer)
        flops = sum(OPS[n.op].flops([shapes[i] for i in n.inputs], shapes[n.outputs[0]], n.attrs)
                    for n in unit.forward)
        assert k.cost.flops == pytest.approx(flops / batch)
    assert sum(k.cost.weight_bytes for k in kernels) == fc_mnist().num_params() * 4
    assert kernels[0].cost.host_bytes == 784 * 4 and kernels[1].cost.host_bytes == 0
    # Training: backward twice the forward, three times with a weight gradient.
    trained = program_kernels(spec, train=True, copies=2)
    assert trained[0].cost.flops == pytest.approx(3 * kernels[0].cost.flops)
    assert trained[0].cost.resident_bytes == 2 * trained[0].cost.weight_bytes


def test_a_transformer_has_a_kernel_per_weight_matrix() -> None:
    from cs_runtime.numerics.model import transformer_spec
    spec = runnable(transformer_spec("gpt", style="gpt2", vocab_size=50, max_len=8, hidden_size=16, num_layers=2,
                                     num_heads=2, ffn_features=32, dropout=0.1, attn_dropout=0.1, eps=1e-5,
                                     tied=True))
    names = [k.name for k in program_kernels(spec, True, 2)]
    assert names[:2] == ["embed.tokens", "embed.positions"]
    assert [n for n in names if n.startswith("block0")] == [
        "block0.layer_norm", "block0.qkv", "block0.self_attention", "block0.proj", "block0.fc", "block0.out"]
    # The tied head reads the embedding's table: a kernel of its own unit, not a second "embed.tokens".
    assert names[-1] == "lm_head.linear" and len(set(names)) == len(names)


def test_the_program_listing_is_what_runs() -> None:
    text = listing(runnable(fc_mnist()))
    assert "# unit fc0: params fc0.weight, fc0.bias" in text and "= matmul(x, fc0.weight)" in text


# ---------------------------------------------------------------- validation

def _error(spec: ModelSpec) -> str:
    with pytest.raises(ValueError) as info:
        compile_model(spec, RunArgs("train", "p.yaml", params_from_dict({}), "unused", None, True, False))
    return str(info.value)


def test_unsupported_op_names_layer_and_op() -> None:
    spec = ModelSpec("m", (LayerSpec("fc0", "dense", 8, 4), LayerSpec("vol", "conv3d", 4, 2)))
    msg = _error(spec)
    assert "layer vol (op conv3d)" in msg and "unsupported op" in msg


def test_width_mismatch_names_layer_and_op() -> None:
    spec = ModelSpec("m", (LayerSpec("fc0", "dense", 8, 4), LayerSpec("fc1", "dense", 5, 2)))
    msg = _error(spec)
    assert "fc1" in msg and "matmul" in msg and "4 and 5" in msg


@pytest.mark.parametrize("layer, why", [
    (LayerSpec("fc0", "dense", 8, 4, activation="swish"), "unsupported activation 'swish'"),
    (LayerSpec("fc0", "dense", 8, 4, dropout=1.0), "dropout 1.0 outside [0, 1)"),
    (LayerSpec("fc0", "dense", 8, 0), "out_features 0"),
])
def test_bad_layer_settings(layer: LayerSpec, why: str) -> None:
    msg = _error(ModelSpec("m", (layer,)))
    assert "layer fc0 (op dense)" in msg and why in msg


def test_unsupported_loss_and_empty_model() -> None:
    assert "unsupported loss" in _error(ModelSpec("m", (LayerSpec("fc0", "dense", 8, 4),), loss="hinge"))
    assert "no layers" in _error(ModelSpec("m", ()))


def test_validate_only_is_fast_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    start = time.perf_counter()
    out = compile_model(fc_mnist(), args_for(tmp_path, validate_only=True, compile_only=False))
    assert time.perf_counter() - start < 0.5
    assert out["execution_strategy"] == "pipelined"
    assert not (tmp_path / "model").exists()
    assert "nothing was compiled" in capsys.readouterr().out


# ---------------------------------------------------------------- plan and mode

def _plan(spec: ModelSpec, params: dict | None = None, target: Target = Target(), mode: str = "train"):
    return make_plan(runnable(spec), params_from_dict(params or {}), mode, target)


def test_mode_threshold_is_wafer_memory() -> None:
    wafer = hardware.WSE2.with_memory(1000)
    assert choose_strategy(1000, wafer, None)[0] == "pipelined"
    assert choose_strategy(1001, wafer, None)[0] == "weight_streaming"


def test_small_model_is_pipelined_large_is_weight_streamed() -> None:
    need = _plan(fc_mnist()).resident_bytes
    assert need == fc_mnist().num_params() * 4 * 2  # weight + gradient (sgd, no momentum)
    assert _plan(fc_mnist(), {"csconfig": {"wafer_memory_bytes": 2 * need}}).execution_strategy == "pipelined"
    ws = _plan(fc_mnist(), {"csconfig": {"wafer_memory_bytes": need - 1}})
    assert ws.execution_strategy == "weight_streaming" and "does not fit" in ws.strategy_reason


def test_pipelined_falls_back_when_the_regions_cannot_be_placed() -> None:
    # Exactly enough memory: every PE is needed, but strips are whole columns.
    need = _plan(fc_mnist()).resident_bytes
    plan = _plan(fc_mnist(), {"csconfig": {"wafer_memory_bytes": need}})
    assert plan.execution_strategy == "weight_streaming" and "columns" in plan.strategy_reason


def test_optimizer_state_counts_towards_the_threshold() -> None:
    sgd = _plan(fc_mnist()).resident_bytes
    assert _plan(fc_mnist(), {"optimizer": {"momentum": 0.9}}).resident_bytes == sgd * 3 // 2
    assert _plan(fc_mnist(), {"optimizer": {"optimizer_type": "adam"}}).resident_bytes == sgd * 2
    assert _plan(fc_mnist(), mode="eval").resident_bytes == sgd // 2


def test_execution_strategy_can_be_forced() -> None:
    forced = _plan(fc_mnist(), {"runconfig": {"execution_strategy": "weight_streaming"}})
    assert forced.execution_strategy == "weight_streaming" and "forced" in forced.strategy_reason
    tiny = {"csconfig": {"wafer_memory_bytes": 1000}}
    assert _plan(fc_mnist(), {**tiny, "runconfig": {"execution_strategy": "weight_streaming"}})
    with pytest.raises(CompileError, match="pipelined but the model needs"):
        _plan(fc_mnist(), {**tiny, "runconfig": {"execution_strategy": "pipelined"}})


def _overlap(a: dict, b: dict) -> bool:
    return a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"] and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"]


def test_pipelined_regions_are_disjoint_on_the_grid_and_balanced() -> None:
    plan = _plan(mlp_spec("wide", [1024, 4096, 4096, 1024, 10], "relu", 0.0))
    grid, ks = plan.grid, plan.kernels
    for i, k in enumerate(ks):
        r = k.rect
        assert r["x"] >= 0 and r["y"] >= 0 and r["x"] + r["w"] <= grid["cols"] and r["y"] + r["h"] <= grid["rows"]
        assert k.pes == r["w"] * r["h"] and all(not _overlap(r, o.rect) for o in ks[i + 1:])
    # The stages with weights run at about the same pace, and none is slower.
    rates = [k.compute_samples_per_s for k in ks if k.weight_bytes]
    assert max(rates) / min(rates) < 1.05
    assert min(k.compute_samples_per_s for k in ks) >= 0.99 * min(rates)
    assert plan.estimate.active_pes_pct > 90  # a model this size fills the wafer


def test_weight_streaming_gives_each_layer_the_whole_wafer() -> None:
    plan = _plan(fc_mnist(), {"runconfig": {"execution_strategy": "weight_streaming"}})
    whole = {"x": 0, "y": 0, "w": plan.grid["cols"], "h": plan.grid["rows"]}
    assert all(k.rect == whole and k.pes == hardware.CORES for k in plan.kernels)


def test_estimate_is_the_slower_of_compute_and_transmission_and_scales_with_systems() -> None:
    for params in ({}, {"runconfig": {"execution_strategy": "weight_streaming"}}):
        plan = _plan(fc_mnist(), params)
        one, steady = plan.estimate, min(plan.estimate.compute_samples_per_s, plan.estimate.transmission_samples_per_s)
        if plan.execution_strategy == "pipelined":   # the batch pays for the pipeline's fill and drain
            depth = 2 * len(plan.kernels)
            assert one.samples_per_s == pytest.approx(steady * 128 / (128 + depth - 1))
        else:
            assert one.samples_per_s == pytest.approx(steady)
        assert one.step_s == pytest.approx(128 / one.samples_per_s)
        assert 0 < one.active_pes_pct <= 100 and 0 < one.compute_utilization_pct <= 100
    ws = {"runconfig": {"execution_strategy": "weight_streaming"}}
    one, two = (_plan(fc_mnist(), ws, Target(num_csx=n)).estimate for n in (1, 2))
    assert two.samples_per_s >= one.samples_per_s


WS = {"runconfig": {"execution_strategy": "weight_streaming"}}
PIPE = {"runconfig": {"execution_strategy": "pipelined"}}


@pytest.mark.parametrize("mode", [WS, PIPE], ids=["weight_streaming", "pipelined"])
def test_estimates_respond_to_batch_width_sequence_and_systems(mode: dict) -> None:
    """As the hardware would: a bigger batch amortizes the weights' stream (weight streaming) or
    the pipeline's fill (pipelined); a wider model or a longer sequence costs more per sample."""
    def rate(spec: ModelSpec, batch: int = 128, target: Target = Target(), **sections: dict) -> float:
        params = {**mode, "train_input": {"batch_size": batch}, **sections}
        return _plan(spec, params, target=target).estimate.samples_per_s
    assert rate(fc_mnist(), 512) > rate(fc_mnist(), 128) > rate(fc_mnist(), 8)
    wide = mlp_spec("wide", [784, 1024, 1024, 10], "relu", 0.1)
    assert rate(wide) < rate(fc_mnist())
    if mode is WS:
        assert rate(fc_mnist(), 512, Target(num_csx=4)) > rate(fc_mnist(), 512)
        from cs_runtime.numerics.model import transformer_spec
        short, long = (transformer_spec("gpt", style="gpt2", vocab_size=500, max_len=n, hidden_size=64,
                                        num_layers=2, num_heads=2, ffn_features=256, dropout=0.0,
                                        attn_dropout=0.0, eps=1e-5) for n in (32, 256))
        assert rate(long) < rate(short)


def test_every_plan_names_its_system_and_estimates_the_second_target() -> None:
    plan = _plan(fc_mnist()).to_dict()
    assert plan["target"]["system"] == "CS-2 (WSE-2)"
    second = plan["second_target"]
    assert second["system"] == "CS-3 (WSE-3)" and second["samples_per_s"] > 0
    assert hardware.WSE3.cores == 900_000 and hardware.WSE3.memory_bytes == 44 * 10**9
    # More memory bandwidth in all, a little less per core: a small model's pipeline, paced by
    # its most parallel stage, is not faster on it; the wafer as a whole is.
    assert hardware.WSE3.peak_flops_s > hardware.WSE2.peak_flops_s
    assert hardware.WSE3.core_flops_s < hardware.WSE2.core_flops_s
    text = render_report(plan)
    assert "estimates for CS-2 (WSE-2)" in text and "CS-3 (WSE-3)" in text and "measured" in text


def test_hardware_constants_and_cost_model() -> None:
    assert hardware.CORES == 850_000 and hardware.ON_CHIP_MEMORY_BYTES == 40 * 10**9
    assert hardware.MEMORY_BANDWIDTH_BYTES_S == 20e15 and hardware.FABRIC_BANDWIDTH_BITS_S == 220e15
    assert hardware.DIE_AREA_MM2 == 46_225 and hardware.GRID_ROWS * hardware.GRID_COLS == hardware.CORES
    wafer = hardware.WSE2
    assert wafer.compute_time(wafer.core_flops_s * 10, 10) == pytest.approx(1.0)
    assert wafer.with_memory(1000).memory_bytes == 1000 and wafer.with_memory(None) is wafer
    assert wafer.pes_for_memory(wafer.core_memory_bytes * 2.5) == 3


def test_target_from_env() -> None:
    assert target_from_env({}) == Target(num_csx=1, compiled_on="cpu")
    assert target_from_env({"CS_TARGET": "cpu", "CS_NUM_CSX": "4"}).num_csx == 1  # the CPU ignores it
    assert target_from_env({"CS_TARGET": "wse", "CS_NUM_CSX": "4"}) == Target(num_csx=4, compiled_on="wse")
    with pytest.raises(CompileError, match="CS_TARGET"):
        target_from_env({"CS_TARGET": "gpu"})
    with pytest.raises(CompileError, match="CS_NUM_CSX"):
        target_from_env({"CS_TARGET": "wse", "CS_NUM_CSX": "0"})


# ---------------------------------------------------------------- the mode reported is the mode run

# (num_csx, --multireplica, runconfig.execution_strategy) -> what the CS system runs, as the
# run's Device line says it (None: refused before anything starts).
RUN_MODES = {
    (1, False, None): "pipelined", (1, True, None): "pipelined x2",
    (2, False, None): "weight_streaming", (2, True, None): "weight_streaming",
    (1, False, "weight_streaming"): "weight_streaming", (1, True, "weight_streaming"): "weight_streaming",
    (2, False, "weight_streaming"): "weight_streaming", (2, True, "weight_streaming"): "weight_streaming",
    (1, False, "pipelined"): "pipelined", (1, True, "pipelined"): "pipelined x2",
    (2, False, "pipelined"): None, (2, True, "pipelined"): None,
}


@pytest.mark.parametrize("num_csx, multireplica, forced", sorted(RUN_MODES, key=str))
@pytest.mark.parametrize("how", ["compile_only", "validate_only"])
def test_the_mode_reported_is_the_mode_the_wses_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture, num_csx: int,
                                                    multireplica: bool, forced: str | None, how: str) -> None:
    from chief.cluster_executor import choose_strategy as chief_choice
    monkeypatch.setenv("CS_TARGET", "wse")
    monkeypatch.setenv("CS_NUM_CSX", str(num_csx))
    args = args_for(tmp_path, {"runconfig": {"execution_strategy": forced}}, compile_only=how == "compile_only",
                    validate_only=how == "validate_only")
    args.multireplica = multireplica
    expected = RUN_MODES[num_csx, multireplica, forced]
    if expected is None:
        with pytest.raises(CompileError, match=f"--num_csx {num_csx}"):
            compile_model(fc_mnist(), args)
        return
    plan = compile_model(fc_mnist(), args)
    out = capsys.readouterr().out
    strategy, replicas = chief_choice(plan, args, num_csx)   # what the chief tells the WSEs to run
    assert (strategy + (f" x{replicas}" if replicas > 1 else "")) == expected
    assert (plan["execution_strategy"], plan.get("num_replicas", 1)) == (strategy, replicas)
    assert f"{expected} on {num_csx} CS system(s)" in out
    if how == "compile_only":
        report = (tmp_path / "model" / "compile_report.txt").read_text()
        assert f"Execution strategy: {expected} (" in report and f"x {num_csx} system(s)" in report
        assert (tmp_path / "model" / "compile" / "wafer.svg").exists() == strategy.startswith("pipelined")
        assert (tmp_path / "model" / "compile" / "streaming.svg").exists() == (strategy == "weight_streaming")


def test_a_plan_made_for_one_system_runs_weight_streaming_on_two() -> None:
    from chief.cluster_executor import choose_strategy as chief_choice
    from cs_runtime.run_args import RunArgs as Args
    args = Args("train", "p.yaml", params_from_dict({}), "m", None, False, False, multireplica=True)
    assert chief_choice({"execution_strategy": "pipelined"}, args, 2) == ("weight_streaming", 1)
    assert chief_choice({"execution_strategy": "pipelined"}, args, 1) == ("pipelined", 2)


# ---------------------------------------------------------------- report

def test_report_has_overall_block_and_a_row_per_kernel() -> None:
    plan = _plan(fc_mnist()).to_dict()
    text = render_report(plan)
    assert "Estimated Overall Performance" in text
    for label, key in OVERALL_FIELDS:
        line = next(l for l in text.splitlines() if l.startswith(label + ":"))
        assert float(line.split(":")[1].replace(",", "")) == pytest.approx(plan["estimate"][key], rel=1e-2)
    for k in plan["kernels"]:
        assert any(l.startswith(k["name"] + " ") for l in text.splitlines())
    json.dumps(plan, allow_nan=False)  # the plan is plain JSON


def test_svg_shows_every_kernel_of_a_pipelined_plan() -> None:
    plan = _plan(fc_mnist()).to_dict()
    root = ET.fromstring(render_wafer(plan))
    drawn = [r.get("data-kernel") for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.get("data-kernel")]
    assert drawn == [k["name"] for k in plan["kernels"]]
    ws = _plan(fc_mnist(), {"runconfig": {"execution_strategy": "weight_streaming"}}).to_dict()
    assert render_wafer(ws) is None


# ---------------------------------------------------------------- artifact

def test_compile_writes_report_plan_picture_and_artifact(tmp_path: Path) -> None:
    out = compile_model(fc_mnist(), args_for(tmp_path))
    model = tmp_path / "model"
    assert out["execution_strategy"] == "pipelined" and out["reused"] is False
    assert (model / "compile_report.txt").exists() and (model / "compile" / "wafer.svg").exists()
    assert json.loads((model / "compile" / "plan.json").read_text())["kernels"] == out["kernels"]
    assert "# unit fc0" in (model / "compile" / "program.txt").read_text()
    doc = json.loads((model / "compile" / "artifact.json").read_text())
    assert doc["format"] == artifact.FORMAT and len(doc["key"]) == 64 and doc["key"] == out["artifact_key"]


def test_same_inputs_reuse_the_artifact(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    first = compile_model(fc_mnist(), args_for(tmp_path))
    capsys.readouterr()
    again = compile_model(fc_mnist(), args_for(tmp_path, {"optimizer": {"learning_rate": 0.5}}))
    assert again["reused"] is True and "skipped compilation" in capsys.readouterr().out
    assert {k: v for k, v in again.items() if k != "reused"} == {k: v for k, v in first.items() if k != "reused"}


@pytest.mark.parametrize("change, named", [
    (dict(spec=fc_mnist(dropout=0.2)), "model.layers[0].dropout: 0.1 -> 0.2"),
    (dict(params={"train_input": {"batch_size": 64}}), "params.train_input.batch_size: 128 -> 64"),
    (dict(params={"csconfig": {"wafer_memory_bytes": 10**6}}), "params.csconfig.wafer_memory_bytes: None -> 1000000"),
    (dict(env={"CS_TARGET": "wse", "CS_NUM_CSX": "2"}), "target.num_csx: 1 -> 2"),
    (dict(mode="eval"), "mode: 'train' -> 'eval'"),
])
def test_changed_inputs_recompile_and_say_which(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch, change: dict, named: str) -> None:
    monkeypatch.delenv("CS_TARGET", raising=False)
    monkeypatch.delenv("CS_NUM_CSX", raising=False)
    compile_model(fc_mnist(), args_for(tmp_path))
    capsys.readouterr()
    for k, v in change.get("env", {}).items():
        monkeypatch.setenv(k, v)
    out = compile_model(change.get("spec", fc_mnist()),
                        args_for(tmp_path, change.get("params"), mode=change.get("mode", "train")))
    said = capsys.readouterr().out
    assert out["reused"] is False and named in said and "inputs changed" in said


def _spoil(path: Path, how: str) -> None:
    doc = json.loads(path.read_text())
    if how == "truncated":
        path.write_text(path.read_text()[:200])
    elif how == "foreign":
        path.write_text(json.dumps({"format": "someone-else", "plan": doc["plan"]}))
    elif how == "edited plan":
        doc["plan"]["execution_strategy"] = "weight_streaming"
        path.write_text(json.dumps(doc))
    elif how == "edited inputs":  # checksum recomputed, but the key no longer matches
        doc["inputs"]["mode"] = "eval"
        body = {k: doc[k] for k in ("inputs", "plan")}
        doc["checksum"] = artifact._sha256(body)
        path.write_text(json.dumps(doc))
    elif how == "bad plan":  # checksum and key sound, but the plan is not a plan
        doc["plan"]["kernels"] = "fc0"
        body = {k: doc[k] for k in ("inputs", "plan")}
        doc["checksum"] = artifact._sha256(body)
        path.write_text(json.dumps(doc))


@pytest.mark.parametrize("how, why", [
    ("truncated", "not readable JSON"), ("foreign", "not a compile artifact"),
    ("edited plan", "checksum does not match"), ("edited inputs", "key does not match"),
    ("bad plan", "stored plan is malformed"),
])
def test_bad_artifact_is_rejected_and_recompiled(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                 how: str, why: str) -> None:
    compile_model(fc_mnist(), args_for(tmp_path))
    path = tmp_path / "model" / "compile" / artifact.FILENAME
    _spoil(path, how)
    capsys.readouterr()
    out = compile_model(fc_mnist(), args_for(tmp_path))
    said = capsys.readouterr().out
    assert out["reused"] is False and "rejected" in said and why in said
    assert artifact.load(path.parent).key == out["artifact_key"]  # a sound artifact again


def test_no_pickle_in_the_compiler() -> None:
    for path in (ROOT / "cs_runtime/compiler").glob("*.py"):
        text = path.read_text()
        assert "import pickle" not in text and "pickle." not in text, path


# ---------------------------------------------------------------- end to end

def _csrun_cpu(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    exe = shutil.which("csrun_cpu")
    cmd = [exe] if exe else [sys.executable, "-m", "cs_runtime.cli.csrun_cpu"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([*cmd, sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.cluster
def test_csrun_cpu_compile_only_writes_the_report(tmp_path: Path) -> None:
    model_dir = tmp_path / "fc"
    common = ["examples/fc_mnist/run.py", "--params", str(FC_PARAMS), "--model_dir", str(model_dir)]
    done = _csrun_cpu(*common, "--mode", "train", "--compile_only")
    assert done.returncode == 0, done.stdout + done.stderr
    report = (model_dir / "compile_report.txt").read_text()
    for label, _ in OVERALL_FIELDS:
        assert f"\n{label}:" in report
    assert re.search(r"^fc0 +matmul +fc0 ", report, re.M) and not (model_dir / "train").exists()  # nothing ran
    again = _csrun_cpu(*common, "--mode", "compile_only")
    assert again.returncode == 0 and "skipped compilation" in again.stdout


BROKEN_RUN = '''
from cs_runtime.numerics.model import LayerSpec, ModelSpec
from cs_runtime.runner import run

def model_fn(params):
    return ModelSpec("broken", (LayerSpec("fc0", "dense", 784, 32, "relu"),
                                LayerSpec("volume", "conv3d", 32, 10)))

if __name__ == "__main__":
    run(model_fn, lambda params: None)
'''


@pytest.mark.cluster
def test_csrun_cpu_validate_only_fails_on_an_unsupported_layer(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(BROKEN_RUN)
    done = _csrun_cpu(str(script), "--mode", "train", "--params", str(FC_PARAMS),
                      "--model_dir", str(tmp_path / "m"), "--validate_only")
    assert done.returncode != 0
    assert "layer volume" in done.stderr and "conv3d" in done.stderr
    assert not (tmp_path / "m").exists()


@pytest.mark.cluster
def test_two_systems_report_and_run_weight_streaming(tmp_path: Path, oracle) -> None:
    """A model that fits one wafer, on two CS systems, the compiler left to choose: csrun_wse's
    check, the compile line, the report and the WSEs all say weight streaming; the numbers are
    the CPU run's."""
    from tests.cluster_utils import assert_matches_oracle, run_wse, write_params
    params = write_params(tmp_path, runconfig={"execution_strategy": None})
    model_dir = tmp_path / "m"
    checked = run_wse(params, model_dir, mode="compile_only", num_csx=2)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "weight_streaming on 2 CS system(s)" in checked.stdout, checked.stdout
    result = run_wse(params, model_dir, num_csx=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "weight_streaming on 2 CS system(s)" in result.stdout, result.stdout[-3000:]
    assert "| Train Device=WSE, Mode=weight_streaming, Step=100," in result.stdout
    report = (model_dir / "compile_report.txt").read_text()
    assert "Execution strategy: weight_streaming (2 CS systems train together only in weight streaming)" in report
    assert_matches_oracle(model_dir, oracle)
