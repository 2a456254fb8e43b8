"""Tests of the compiler (cs_runtime/compiler, cs_runtime/compiler/hardware.py, cs_runtime/compiler/stage.py).

    python -m pytest tests/test_compiler.py -q

Unit tests use the numpy interpreter as the oracle of every rewrite; two
end-to-end tests run csrun_cpu on a real script.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cs_runtime.compiler.stage import compile_model
from cs_runtime.compiler import hardware
from cs_runtime.compiler import artifact
from cs_runtime.compiler.interp import run as interpret
from cs_runtime.compiler.ir import BATCH, CompileError, Graph, validate
from cs_runtime.compiler.lower import lower
from cs_runtime.compiler.planner import Target, choose_strategy, make_plan, target_from_env
from cs_runtime.compiler.report import OVERALL_FIELDS, render_report, render_svg
from cs_runtime.compiler.rewrites import drop_dead, drop_noops, fold_constants, fuse_dense, optimize
from cs_runtime.config import params_from_dict
from cs_runtime.numerics.model import LayerSpec, ModelSpec, mlp_spec
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


# ---------------------------------------------------------------- graph extraction

def test_lowering_gives_primitive_nodes_with_shapes_and_sizes() -> None:
    g = lower(fc_mnist())
    ops = [n.op for n in g.kernels() if n.layer == "fc0"]
    assert ops == ["matmul", "bias_add", "activation", "sub", "div", "dropout"]
    assert g.node("fc0.matmul").shape == (BATCH, 256) and g.node("fc0.matmul").dtype == "float32"
    assert g.node("labels").dtype == "int32" and g.node("loss").shape == ()
    params = [n for n in g.nodes if n.op == "param"]
    assert sum(int(np.prod(n.shape)) for n in params) == fc_mnist().num_params()


def test_graph_prints_for_a_user() -> None:
    text = str(lower(fc_mnist()))
    assert "%fc0.matmul" in text and "matmul(%x, %fc0.weight)" in text
    assert "[B, 784]" in text and "float32" in text and "# fc0" in text


def test_graph_round_trips_through_json() -> None:
    g, _ = optimize(lower(small()))
    again = Graph.from_dict(json.loads(json.dumps(g.to_dict())))
    assert again.to_dict() == g.to_dict()


# ---------------------------------------------------------------- validation

def _error(spec: ModelSpec) -> str:
    with pytest.raises(CompileError) as info:
        lower(spec)
    return str(info.value)


def test_unsupported_op_names_layer_and_op() -> None:
    spec = ModelSpec("m", (LayerSpec("fc0", "dense", 8, 4), LayerSpec("vol", "conv3d", 4, 2)))
    msg = _error(spec)
    assert "layer vol" in msg and "conv3d" in msg and "unsupported op" in msg


def test_width_mismatch_names_layer_and_op() -> None:
    spec = ModelSpec("m", (LayerSpec("fc0", "dense", 8, 4), LayerSpec("fc1", "dense", 5, 2)))
    msg = _error(spec)
    assert msg.startswith("layer fc1 (op dense): matmul fc1.matmul:") and "4 features" in msg


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


def test_dtype_checks() -> None:
    g = lower(small())
    g.nodes = [n if n.name != "labels" else type(n)(n.name, n.op, n.inputs, n.shape, "float32")
               for n in g.nodes]
    with pytest.raises(CompileError, match="labels %labels must be int32"):
        validate(g)
    g.nodes[0] = type(g.nodes[0])("x", "input", (), (BATCH, 12), "float64")
    with pytest.raises(CompileError, match="unsupported dtype float64"):
        validate(g)


def test_validate_only_is_fast_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    start = time.perf_counter()
    out = compile_model(fc_mnist(), args_for(tmp_path, validate_only=True, compile_only=False))
    assert time.perf_counter() - start < 0.5
    assert out["execution_strategy"] == "pipelined"
    assert not (tmp_path / "model").exists()
    assert "nothing was compiled" in capsys.readouterr().out


# ---------------------------------------------------------------- rewrites

def _random_run(g: Graph, spec: ModelSpec, train: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((6, spec.layers[0].in_features)).astype(np.float32),
             "labels": rng.integers(0, spec.layers[-1].out_features, 6).astype(np.int32)}
    weights = {n.name: rng.standard_normal(n.shape).astype(np.float32) for n in g.nodes if n.op == "param"}
    return interpret(g, feeds, weights, train=train, seed=seed)


def _same_numbers(before: Graph, after: Graph, spec: ModelSpec) -> None:
    for train in (False, True):
        for seed in range(3):
            a, b = _random_run(before, spec, train, seed), _random_run(after, spec, train, seed)
            np.testing.assert_allclose(b[after.output], a[before.output], rtol=1e-6)
            # The logits too, not only the loss that sums them up.
            np.testing.assert_allclose(b[after.node(after.output).inputs[0]],
                                       a[before.node(before.output).inputs[0]], rtol=1e-6)


MODELS = [small(0.25, "gelu"), small(0.0, "tanh"), small(0.5, "sigmoid"), fc_mnist(0.1, "relu")]


@pytest.mark.parametrize("spec", MODELS, ids=lambda s: f"{s.name}-{s.layers[0].activation}-{s.layers[0].dropout}")
@pytest.mark.parametrize("rewrite", [fold_constants, drop_noops, drop_dead, fuse_dense, optimize],
                         ids=lambda r: r.__name__)
def test_each_rewrite_keeps_the_numbers(spec: ModelSpec, rewrite: Any) -> None:
    before = lower(spec)
    after, _ = rewrite(before)
    validate(after)
    _same_numbers(before, after, spec)


def test_fold_constants_computes_the_keep_scale() -> None:
    g, notes = fold_constants(lower(small(0.2)))
    assert not [n for n in g.nodes if n.op in ("sub", "div")]
    assert g.node("fc0.keep_scale").op == "const"
    assert g.node("fc0.keep_scale").attrs["value"] == pytest.approx(1 / 0.8)
    assert any("folded %fc0.keep_scale" in n for n in notes)


def test_drop_noops_removes_p0_dropout_and_identity_activation() -> None:
    g, notes = drop_noops(fold_constants(lower(small(0.0, "relu")))[0])
    ops = [n.op for n in g.nodes]
    assert "dropout" not in ops  # every layer had p = 0
    assert not [n for n in g.nodes if n.op == "activation" and n.attrs["kind"] == "none"]  # the last layer
    assert len([n for n in g.nodes if n.op == "activation"]) == 2 and len(notes) == 3 + 1


def test_drop_noops_removes_arithmetic_identities() -> None:
    g = Graph("m")
    x = g.add("input", name="x", shape=(BATCH, 3))
    one = g.add("const", name="one", value=1.0)
    zero = g.add("const", name="zero", value=0.0)
    y = g.add("mul", (x, one), name="y")
    z = g.add("add", (y, zero), name="z")
    g.output = g.add("activation", (z,), name="out", kind="tanh")
    out, _ = drop_dead(drop_noops(g)[0])
    assert [n.op for n in out.kernels()] == ["activation"] and out.node("out").inputs == ("x",)
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    np.testing.assert_array_equal(interpret(out, feeds, {})["out"], interpret(g, feeds, {})["out"])


def test_drop_dead_keeps_inputs_and_params() -> None:
    g, notes = drop_dead(drop_noops(fold_constants(lower(small(0.0)))[0])[0])
    assert not [n for n in g.nodes if n.op == "const"]
    assert {n.name for n in g.nodes if n.op == "param"} == {f"fc{i}.{p}" for i in range(3) for p in ("weight", "bias")}
    assert notes and notes[0].startswith("removed dead")


def test_fusion_makes_one_kernel_per_layer() -> None:
    g, notes = optimize(lower(fc_mnist()))
    assert [n.op for n in g.kernels()] == ["fused_dense"] * 3 + ["softmax_cross_entropy"]
    assert g.node("fc0.fused_dense").attrs == {"activation": "relu", "dropout": 0.1}
    assert g.node("fc2.fused_dense").attrs == {"activation": "none", "dropout": 0.0}
    assert sum("fused" in n for n in notes) == 3


def test_fusion_stops_at_a_shared_intermediate() -> None:
    # bias_add's result is read twice: fusing the activation too would lose it.
    g = Graph("m")
    x = g.add("input", name="x", shape=(BATCH, 4))
    w = g.add("param", name="w", shape=(4, 3))
    b = g.add("param", name="b", shape=(3,))
    h = g.add("bias_add", (g.add("matmul", (x, w), name="mm"), b), name="h")
    a = g.add("activation", (h,), name="a", kind="relu")
    g.output = g.add("add", (a, h), name="out")
    fused, _ = fuse_dense(g)
    assert [n.op for n in fused.kernels()] == ["fused_dense", "activation", "add"]
    assert fused.kernels()[0].attrs["activation"] == "none"
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((5, 4)).astype(np.float32)}
    weights = {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    np.testing.assert_allclose(interpret(fused, feeds, weights)["out"], interpret(g, feeds, weights)["out"], rtol=1e-6)
    g2 = Graph("m2", list(g.nodes[:-1]), "a")  # with a single reader the activation fuses too
    assert [n.op for n in fuse_dense(g2)[0].kernels()] == ["fused_dense"]


# ---------------------------------------------------------------- plan and mode

def _plan(spec: ModelSpec, params: dict | None = None, target: Target = Target(), mode: str = "train"):
    g, notes = optimize(lower(spec))
    return make_plan(g, params_from_dict(params or {}), mode, target, notes)


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
        one = _plan(fc_mnist(), params).estimate
        assert one.samples_per_s == pytest.approx(min(one.compute_samples_per_s, one.transmission_samples_per_s))
        assert 0 < one.active_pes_pct <= 100 and 0 < one.compute_utilization_pct <= 100
        two = _plan(fc_mnist(), params, Target(num_csx=2)).estimate
        assert two.samples_per_s >= one.samples_per_s


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
    root = ET.fromstring(render_svg(plan))
    texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    assert all(k["name"] in texts for k in plan["kernels"])
    assert len(list(root.iter("{http://www.w3.org/2000/svg}rect"))) >= 1 + 2 * len(plan["kernels"])
    ws = _plan(fc_mnist(), {"runconfig": {"execution_strategy": "weight_streaming"}}).to_dict()
    assert render_svg(ws) is None


# ---------------------------------------------------------------- artifact

def test_compile_writes_report_plan_picture_and_artifact(tmp_path: Path) -> None:
    out = compile_model(fc_mnist(), args_for(tmp_path))
    model = tmp_path / "model"
    assert out["execution_strategy"] == "pipelined" and out["reused"] is False
    assert (model / "compile_report.txt").exists() and (model / "compile" / "wafer.svg").exists()
    assert json.loads((model / "compile" / "plan.json").read_text())["kernels"] == out["kernels"]
    assert "# as compiled" in (model / "compile" / "graph.txt").read_text()
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
        body = {k: doc[k] for k in ("inputs", "graph", "plan")}
        doc["checksum"] = artifact._sha256(body)
        path.write_text(json.dumps(doc))
    elif how == "bad graph":  # a well-formed artifact whose graph has an unknown op
        doc["graph"]["nodes"][-1]["op"] = "conv3d"
        body = {k: doc[k] for k in ("inputs", "graph", "plan")}
        doc["checksum"] = artifact._sha256(body)
        path.write_text(json.dumps(doc))


@pytest.mark.parametrize("how, why", [
    ("truncated", "not readable JSON"), ("foreign", "not a compile artifact"),
    ("edited plan", "checksum does not match"), ("edited inputs", "key does not match"),
    ("bad graph", "stored graph is invalid"),
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
    cmd = [exe] if exe else [sys.executable, "-m", "scripts.csrun_cpu"]
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
    assert "fc0.fused_dense" in report and not (model_dir / "train").exists()  # nothing ran
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
