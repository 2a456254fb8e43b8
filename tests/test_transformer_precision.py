"""GPT-2 and BERT from params.yaml in mixed precision (float16, bfloat16, cbfloat16).

    python -m pytest tests/test_transformer_precision.py -q

Their matmuls and attention round as a dense layer does (mixed_ops.py); layer
norm, softmax, GELU, the embedding lookup and the loss compute in float32.
One WSE runs the CPU path's maths in the same order, so it equals it to the
bit, in weight streaming and pipelined; two WSEs each round their own partial
gradient to 16 bits before SwarmX sums the partials in float32, so there the
oracle is that sum, computed here shard by shard (docs/design.md).
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from cs_runtime.numerics import mixed_ops
from cs_runtime.numerics import precision as P
from cs_runtime.numerics.ops import OPS
from tests.cluster_utils import final_weights, tool, train_losses
from tests.test_transformer import eval_loss, example, write_lm_params

FORMATS16 = ("float16", "bfloat16", "cbfloat16")
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "cbfloat16": 2.0 ** -10}
STEPS = 10


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _attention_inputs(rng):
    """A packed [B, T, 3D] projection (2 heads of 4), padding keys, a dropout mask."""
    qkv = _rand(rng, 2, 5, 24)
    keep = np.ones((2, 5), bool)
    keep[1, 3:] = False
    drop = (rng.random((2, 2, 5, 5)) > 0.2).astype(np.float32) / np.float32(0.8)
    return [qkv, keep, drop], {"heads": 2, "causal": True, "key_keep": True, "drop": True}


def test_self_attention_is_the_float32_rule_with_its_matmul_operands_rounded():
    """In float32 the 16-bit rule is the op itself, to the bit: only the rounding differs."""
    inputs, attrs = _attention_inputs(np.random.default_rng(0))
    op = OPS["self_attention"]
    out = mixed_ops.forward("self_attention", inputs, attrs, "float32")
    np.testing.assert_array_equal(out, op.forward(inputs, attrs))
    g = _rand(np.random.default_rng(1), *out.shape)
    got = mixed_ops.vjp("self_attention", g, inputs, out, attrs, "float32")
    np.testing.assert_array_equal(got[0], op.vjp(g, inputs, out, attrs)[0])
    assert got[1:] == [None, None]


@pytest.mark.parametrize("fmt", FORMATS16)
def test_self_attention_rounds_its_two_matmuls_and_keeps_softmax_and_dropout_float32(fmt):
    rng = np.random.default_rng(2)
    (qkv, keep, drop), attrs = _attention_inputs(rng)
    out = mixed_ops.forward("self_attention", [qkv, keep, drop], attrs, fmt)
    # by hand: heads of the rounded projection, a float32 softmax, the dropped probabilities rounded
    q, k, v = (P.quantize(t, fmt).reshape(2, 5, 2, 4).transpose(0, 2, 1, 3) for t in np.split(qkv, 3, axis=-1))
    scores = (q @ k.transpose(0, 1, 3, 2)) * np.float32(0.5)
    allowed = np.tril(np.ones((5, 5), bool))[None, None] & keep[:, None, None, :]
    scores = np.where(allowed, scores, np.float32(-1e9))
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = (P.quantize(probs * drop, fmt) @ v).transpose(0, 2, 1, 3).reshape(2, 5, 8)
    np.testing.assert_array_equal(out, want)
    # the backward: within the format's rounding of float32's, not equal to it
    g = _rand(rng, *out.shape)
    got = mixed_ops.vjp("self_attention", g, [qkv, keep, drop], out, attrs, fmt)[0]
    ref = OPS["self_attention"].vjp(g, [qkv, keep, drop], out, attrs)[0]
    assert not np.array_equal(got, ref)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 40 * UNIT_ROUNDOFF[fmt]


def _lm_spec(style: str, model_keys: dict, **sections):
    """The example's model at the precision its params say, as the compile stage builds it."""
    from cs_runtime.compiler.stage import build_spec
    from cs_runtime.config import params_from_dict
    from cs_runtime.run_args import RunArgs, UserFunctions
    import examples.bert.run as bert
    import examples.gpt2.run as gpt2
    model = {"model_type": style, "hidden_size": 16, "num_hidden_layers": 1, "num_heads": 2, "filter_size": 32,
             "max_position_embeddings": 8, "mixed_precision": True, **model_keys}
    if style == "bert":
        model["disable_nsp"] = True
    train_input = {"batch_size": 2, "max_sequence_length": 8, **sections.pop("train_input", {})}
    params = params_from_dict({"model": model, "train_input": train_input, **sections}, style)
    fns = UserFunctions((gpt2 if style == "gpt2" else bert).model_fn, None, None)
    return build_spec(RunArgs("train", "p.yaml", params, "m", None, False, False), fns)


@pytest.mark.parametrize("style,model_keys,sections,fmt", [
    ("gpt2", {"use_bfloat16": True}, {}, "bfloat16"),
    ("bert", {}, {"csconfig": {"use_cbfloat16": True}}, "cbfloat16"),
    ("gpt2", {"to_float16": True}, {"train_input": {"to_float16": True}}, "float16"),
    ("bert", {"mixed_precision": False, "fp16_type": "bfloat16"}, {}, "float32")])
def test_the_model_zoo_precision_keys_give_gpt2_and_bert_their_format(style, model_keys, sections, fmt):
    spec = _lm_spec(style, model_keys, **sections)
    assert spec.precision == fmt and spec.program is not None   # accepted, and lowered to its program


@pytest.mark.parametrize("style,fmt", [("gpt2", "float16"), ("bert", "bfloat16"), ("gpt2", "cbfloat16")])
def test_only_matmuls_and_attention_round_layer_norm_gelu_embedding_stay_float32(style, fmt):
    """The whole forward of a 16-bit GPT-2 / BERT: every op outside mixed_ops.MATMUL_LIKE
    computes in float32 on the values it is given (its output equals float32's op, and holds
    values no 16-bit tensor could); the matmul-like ones take rounded operands."""
    from cs_runtime.numerics.executor import run_node, unit_params
    from cs_runtime.numerics.model import init_weights
    from cs_runtime.numerics.program_layer import _program_weights, shared_values, unit_of
    spec = _lm_spec(style, {"fp16_type": fmt})
    assert spec.precision == fmt
    weights = init_weights(spec, 0)
    rng = np.random.default_rng(3)
    env = {**shared_values(spec), "x": rng.integers(1, 200, (2, 8)), "labels": rng.integers(0, 200, (2, 8)),
           "dropout_context": np.array([0, 0, 0, 2, 2, 1], np.int64)}
    seen = set()
    for layer in spec.layers:
        unit = unit_of(layer)
        env.update(unit_params(unit, _program_weights(layer, weights[layer.name]), fmt))
        for node in unit.forward:
            inputs = [env[name] for name in node.inputs]
            run_node(node, env, fmt, frozenset(unit.params))
            out = env[node.outputs[0]]
            if node.op == "self_attention":
                continue   # its rule: the tests above
            if node.op in mixed_ops.MATMUL_LIKE:   # on rounded operands (matmul; linear: a tied head's decoder)
                inputs = [P.quantize(x, fmt) for x in inputs]
            np.testing.assert_array_equal(out, OPS[node.op].forward(inputs, node.attrs),
                                          err_msg=f"{layer.name} {node.op}")
            if node.op in ("layer_norm", "gelu", "embedding", "add") and out.dtype.kind == "f":
                seen.add(node.op)
                if node.op != "embedding":   # a lookup of a streamed (16-bit) table: its rows
                    assert not np.array_equal(out, P.quantize(out, fmt)), f"{layer.name} {node.op} was rounded"
    rounding = {n.op for layer in spec.layers for n in unit_of(layer).forward} & mixed_ops.MATMUL_LIKE
    assert rounding == {"matmul", "linear", "self_attention"}   # linear: the tied head's decoder
    assert {"layer_norm", "gelu", "embedding", "add"} <= seen


# ---------------------------------------------------------------- whole jobs

def _params(tmp_path, style: str, fmt: str, name: str, steps: int = STEPS, **sections) -> str:
    """The tiny GPT-2 / BERT of test_transformer.py at `fmt` (float32: mixed_precision false)."""
    model = {"mixed_precision": fmt != "float32", **({"fp16_type": fmt} if fmt != "float32" else {})}
    runconfig = {"max_steps": steps, "log_steps": 1, "checkpoint_steps": steps}
    for key, value in (("model", model), ("runconfig", runconfig)):
        sections[key] = {**value, **sections.get(key, {})}
    return write_lm_params(tmp_path / name, style, **sections)


def _train(launcher: list[str], style: str, params: str, model_dir, *extra: str, mode: str = "train") -> str:
    """Train (no eval unless `mode` says); the run's stdout and stderr."""
    cmd = [*launcher, sys.executable, example(style), "--mode", mode, "--params", params,
           "--model_dir", str(model_dir), *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


ONE_WSE = [tool("csrun_wse"), "--num_csx", "1", "--num_workers_per_csx", "1"]


def _assert_bit_equal(model_dir, oracle_dir) -> np.ndarray:
    want, got = train_losses(oracle_dir), train_losses(model_dir)
    assert len(got) == len(want) > 0
    np.testing.assert_array_equal(got, want)
    w_want, w_got = final_weights(oracle_dir), final_weights(model_dir)
    assert w_got.keys() == w_want.keys() and len(w_want) > 20
    for name in w_want:
        np.testing.assert_array_equal(w_got[name], w_want[name], err_msg=name)
    return want


def _assert_near_float32(losses: np.ndarray, float32: np.ndarray, fmt: str, stdout: str) -> None:
    """Within one unit roundoff of the format, relative, at every step, and not float32's numbers.

    Each step's loss is float32 arithmetic on 16-bit operands: every matmul input
    carries a relative error up to u (2**-11 float16, 2**-10 cbfloat16, 2**-8
    bfloat16), and the errors of a sum of products largely cancel. Measured over 10
    steps of these models, the loss stays within 0.25 u of float32's (GPT-2 and BERT,
    each format); u itself is the bound: below the format's own resolution. A skipped
    step (dynamic loss scaling) would move the run off float32's path by design, so
    none may happen here."""
    assert "gradients overflowed" not in stdout
    assert len(losses) == len(float32) == STEPS
    assert not np.array_equal(losses, float32)
    worst = np.max(np.abs(losses - float32) / float32)
    assert worst < UNIT_ROUNDOFF[fmt], f"{fmt}: {worst:.2e} relative"


@pytest.mark.cluster
def test_gpt2_in_every_16bit_format_on_one_wse_equals_the_cpu_path_and_stays_near_float32(tmp_path):
    """Weight streaming on 1 WSE, dynamic loss scaling: the CPU path's bits, every step
    and every weight; the 16-bit formats stream 2 bytes per parameter and the compile
    report says which kernels compute in the format."""
    float32_dir = tmp_path / "float32"
    _train([tool("csrun_cpu")], "gpt2", _params(tmp_path, "gpt2", "float32", "f32.yaml"), float32_dir)
    float32 = train_losses(float32_dir)
    weights = final_weights(float32_dir)
    # the tied token table is stored once and streamed to both units that read it
    table = next(w.size for name, w in weights.items() if name.endswith("tokens"))
    num_params = sum(w.size for w in weights.values()) + table
    for fmt in FORMATS16:
        params = _params(tmp_path, "gpt2", fmt, f"{fmt}.yaml", optimizer={"loss_scaling_factor": "dynamic"},
                         runconfig={"execution_strategy": "weight_streaming"})
        cpu = _train([tool("csrun_cpu")], "gpt2", params, tmp_path / f"cpu_{fmt}")
        wse = _train(ONE_WSE, "gpt2", params, tmp_path / f"wse_{fmt}")
        assert f"Mode=weight_streaming, Step={STEPS}," in wse
        # 2 bytes a parameter, once a step: the model is one group of small layers
        # (protocol.layer_groups), sent forward and at once backward (fwd_bwd)
        assert f"WeightBytes/step={2 * num_params} " in wse
        losses = _assert_bit_equal(tmp_path / f"wse_{fmt}", tmp_path / f"cpu_{fmt}")
        _assert_near_float32(losses, float32, fmt, cpu + wse)
        report = (tmp_path / f"wse_{fmt}" / "compile_report.txt").read_text()
        assert f"precision {fmt}" in report
        rows = {line.split()[0]: line.split()[3] for line in report.splitlines() if line.startswith("block0.")}
        assert rows["block0.qkv"] == rows["block0.self_attention"] == fmt   # matmul-like: 16-bit operands
        assert rows["block0.layer_norm"] == "float32"


@pytest.mark.cluster
def test_bert_pipelined_in_bfloat16_with_a_static_loss_scale_equals_the_cpu_path(tmp_path):
    """Layer pipelined on 1 WSE (padding mask, post-norm, the MLM transform's GELU)."""
    float32_dir = tmp_path / "float32"
    _train([tool("csrun_cpu")], "bert", _params(tmp_path, "bert", "float32", "f32.yaml"), float32_dir)
    params = _params(tmp_path, "bert", "bfloat16", "bf16.yaml", optimizer={"loss_scaling_factor": 128.0},
                     runconfig={"execution_strategy": "pipelined"})
    cpu = _train([tool("csrun_cpu")], "bert", params, tmp_path / "cpu", mode="train_and_eval")
    wse = _train(ONE_WSE, "bert", params, tmp_path / "wse", mode="train_and_eval")
    assert f"Mode=pipelined, Step={STEPS}," in wse and "WeightBytes/step=0" in wse
    assert eval_loss(wse) == eval_loss(cpu)   # eval in 16 bits too, to the printed digit
    losses = _assert_bit_equal(tmp_path / "wse", tmp_path / "cpu")
    _assert_near_float32(losses, train_losses(float32_dir), "bfloat16", cpu + wse)


def _shard_grads(style: str, params_path: str, num_csx: int, loss_scale: float):
    """(initial weights, each WSE's 16-bit gradients of step 1 at `loss_scale`), computed
    here with the CPU path's functions on the rows each WSE holds."""
    import importlib
    from cs_runtime.compiler.stage import runnable
    from cs_runtime.config import load_params
    from cs_runtime.data.inputs import InputStream
    from cs_runtime.numerics.model import ShardContext, init_weights, model_backward, model_forward, model_loss
    example_module = importlib.import_module(f"examples.{style}.run")
    p = load_params(params_path)
    spec = runnable(replace(example_module.model_fn(p), precision=p.precision))
    weights = init_weights(spec, p.runconfig.seed)
    stream = InputStream.build("train", example_module.train_input_fn(p), p.train_input, p.runconfig.seed)
    per_wse = []
    for shard in stream.shards(0, num_csx):
        ctx = ShardContext(p.runconfig.seed, 0, shard.global_batch, shard.rows, True, labels=shard.y)
        live, caches = model_forward(spec, shard.x, weights, ctx)
        delta = model_loss(spec, live, shard.y, shard.global_batch, shard.label_count).delta
        per_wse.append(model_backward(spec, P.scaled(delta, loss_scale), caches, weights))
    return weights, per_wse


# Two ways to split a batch in two: weight streaming on 2 WSEs (SwarmX sums their
# gradients), and layer pipelined with two replicas on one WSE (summed on the wafer;
# layer pipelined runs on one system).
TWO_WAY = {"weight_streaming": ("2", (), "weight_streaming"), "pipelined": ("1", ("--multireplica",), "pipelined x2")}


@pytest.mark.cluster
@pytest.mark.parametrize("style,fmt,strategy", [("gpt2", "float16", "weight_streaming"),
                                                ("bert", "cbfloat16", "pipelined")])
def test_two_replicas_apply_the_float32_sum_of_each_ones_16bit_gradients(tmp_path, style, fmt, strategy):
    """Two WSEs (or replicas) cannot equal the CPU path to the bit: each rounds its own
    partial gradient to 16 bits before the partials are summed in float32 (docs/design.md).
    Their oracle is that sum, computed here shard by shard with the CPU path's code:
    after one SGD step (no momentum, no clipping, a static loss scale of 2**10)
    every weight is w0 - lr * (r(S G_0) + r(S G_1)) / S to the bit."""
    lr, scale = 0.5, 1024.0
    # Untied: the oracle below rounds each parameter's gradient once per shard.
    params = _params(tmp_path, style, fmt, "p.yaml", steps=1, model={"share_embedding_weights": False},
                     optimizer={"learning_rate": lr, "momentum": 0.0, "max_gradient_norm": None,
                                "loss_scaling_factor": scale},
                     runconfig={"execution_strategy": strategy})
    num_csx, extra, mode = TWO_WAY[strategy]
    out = _train([tool("csrun_wse"), "--num_csx", num_csx, "--num_workers_per_csx", "1"], style, params,
                 tmp_path / "m", *extra)
    assert f"Mode={mode}, Step=1," in out
    got = final_weights(tmp_path / "m")
    w0, per_wse = _shard_grads(style, params, 2, scale)
    checked = 0
    for index, (layer, start) in enumerate(w0.items()):
        for pname, w in start.items():
            parts = [grads[index][pname] for grads in per_wse]
            assert all(np.array_equal(g, P.quantize(g, fmt)) for g in parts)   # each partial is 16-bit
            total = (parts[0] + parts[1]) / np.float32(scale)
            key = f"model/{layer}/{pname}"
            np.testing.assert_array_equal(got[key], w - total * np.float32(lr), err_msg=key)
            checked += bool(np.any(total))
    assert checked > 20   # every tensor of every block moved
