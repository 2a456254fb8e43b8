"""Mixed precision for compiled programs (no torch needed): the matmul-like ops
round as a dense layer does (cs_runtime/numerics/mixed_ops.py), so an MLP
written as a program trains to the same bits as the hand-written dense layers
of tests/dense_reference.py, loss scaling and skipped steps included."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cs_runtime.compiler.units import program_spec, split_units
from cs_runtime.numerics import mixed_ops
from cs_runtime.numerics import precision as P
from cs_runtime.numerics.executor import unit_backward, unit_forward
from cs_runtime.numerics import model
from cs_runtime.numerics.model import ShardContext, init_weights, mlp_spec
from cs_runtime.numerics.ops import OPS
from cs_runtime.numerics.optim import Optimizer, OptimizerSpec
from cs_runtime.numerics.program import Node, Program, Value, infer_values
from cs_runtime.numerics.program_layer import unit_of
from tests import dense_reference

FORMATS16 = ("float16", "bfloat16", "cbfloat16")
SIZES, BATCH = [20, 16, 12, 5], 8


def mlp_program(sizes: list[int], batch: int, seed_grad: np.ndarray):
    """The dense MLP of mlp_spec(sizes, relu) as a program: addmm(b, x, W) per layer
    (W as the dense layer holds it, [in, out]), relu between. Its loss is
    sum(logits * seed_grad), so d loss / d logits is `seed_grad` exactly and the
    dense layers can be given the same delta: the comparison isolates the layers."""
    params, nodes, h = {}, [], "x"
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"fc{i}.weight"], params[f"fc{i}.bias"] = Value((n_in, n_out)), Value((n_out,))
        nodes.append(Node("addmm", (f"fc{i}.bias", h, f"fc{i}.weight"), (f"z{i}",), {}, module=f"fc{i}"))
        h = f"z{i}"
        if i < len(sizes) - 2:
            nodes.append(Node("relu", (h,), (f"a{i}",)))
            h = f"a{i}"
    nodes += [Node("mul", (h, "seed_grad"), ("weighted",)), Node("sum", ("weighted",), ("loss",), {"dim": None})]
    program = Program(params, {"x": Value((batch, sizes[0])), "y": Value((batch,), "int64")},
                      {"seed_grad": seed_grad}, nodes, {"loss": "loss"}).validate()
    shapes, dtypes = infer_values(program)
    return program, split_units(program, shapes, dtypes), shapes, dtypes


def _both_specs(fmt: str, seed_grad: np.ndarray):
    dense = dataclasses.replace(mlp_spec("mlp", SIZES, "relu", 0.0), precision=fmt)
    start = init_weights(dense, 0)
    program, units, shapes, dtypes = mlp_program(SIZES, BATCH, seed_grad)
    flat = {f"{layer}.{p}": w for layer, ws in start.items() for p, w in ws.items()}
    spec = program_spec("mlp", program, units, shapes, dtypes, flat)
    return dense, dataclasses.replace(spec, precision=fmt)


def _train(spec, batches, seed_grad, scaler: P.LossScaler):
    """The CPU path's step (chief/cpu_executor.py): forward, loss, scaled backward, update."""
    weights = init_weights(spec, 0)
    optimizer = Optimizer(OptimizerSpec("sgd", momentum=0.9))
    state = {name: optimizer.init_state(w) for name, w in weights.items()}
    losses, applied = [], []
    run = model if spec.program is not None else dense_reference
    for step, x in enumerate(batches):
        y = np.zeros(BATCH, np.int64)
        ctx = ShardContext(0, step, BATCH, slice(0, BATCH), True, labels=y)
        out, caches = run.model_forward(spec, x, weights, ctx)
        if spec.program is None:       # the dense layers: the program's loss, by hand
            loss, delta = float((out * seed_grad).sum()), seed_grad
        else:
            result = run.model_loss(spec, out, y, BATCH)
            loss, delta = result.loss, result.delta
        grads = run.model_backward(spec, P.scaled(delta, scaler.scale), caches, weights, step)
        _, ok, _ = optimizer.update_model([layer.name for layer in spec.layers], weights, grads, state, 0.05,
                                          step, None, scaler.scale, scaler.skips_nonfinite)
        scaler.update(ok)
        losses.append(loss)
        applied.append(ok)
    # a program's parameters are named by their module already; a dense layer's by the layer
    return losses, applied, {p if spec.program is not None else f"{layer}.{p}": w
                             for layer, ws in weights.items() for p, w in ws.items()}


@pytest.mark.parametrize("fmt", ("float32", *FORMATS16))
def test_a_program_mlp_trains_to_the_same_bits_as_dense_layers(fmt):
    """Twelve steps with dynamic loss scaling from a scale past the format's range
    (2**20 for float16's 2**16, 2**36 for cbfloat16's 2**32): the first steps
    overflow and are skipped (the scale halves), then training goes on; every
    loss, every skipped step and every weight equal the dense layers' to the bit."""
    rng = np.random.default_rng(3)
    seed_grad = (rng.standard_normal((BATCH, SIZES[-1])) / BATCH).astype(np.float32)
    batches = [rng.standard_normal((BATCH, SIZES[0])).astype(np.float32) for _ in range(12)]
    dense, program = _both_specs(fmt, seed_grad)
    start = 2.0 ** (36 if fmt == "cbfloat16" else 20)
    new_scaler = lambda: P.LossScaler("dynamic", initial_scale=start, steps_per_increase=3,  # noqa: E731
                                      max_scale=start)
    want_losses, want_applied, want = _train(dense, batches, seed_grad, new_scaler())
    got_losses, got_applied, got = _train(program, batches, seed_grad, new_scaler())
    assert got_applied == want_applied
    if fmt in ("float16", "cbfloat16"):
        assert not all(got_applied), "the first scale should overflow the format's gradients"
    assert sum(got_applied) >= 5
    assert got_losses == want_losses
    assert got.keys() == want.keys()
    for name, w in want.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)
    if fmt != "float32":   # the rounding is really there: float32 ends elsewhere
        _, _, float32 = _train(_both_specs("float32", seed_grad)[1], batches, seed_grad, new_scaler())
        assert any(not np.array_equal(float32[n], got[n]) for n in got)


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


CASES = {   # op: (inputs, attrs)
    "linear": (lambda r: [_rand(r, 2, 3, 6), _rand(r, 4, 6), _rand(r, 4)], {}),
    "addmm": (lambda r: [_rand(r, 4), _rand(r, 5, 6), _rand(r, 6, 4)], {}),
    "mm": (lambda r: [_rand(r, 5, 6), _rand(r, 6, 4)], {}),
    "matmul": (lambda r: [_rand(r, 2, 5, 6), _rand(r, 6, 4)], {}),
    "bmm": (lambda r: [_rand(r, 2, 5, 6), _rand(r, 2, 6, 4)], {}),
    "conv2d": (lambda r: [_rand(r, 2, 3, 6, 6), _rand(r, 4, 3, 3, 3), _rand(r, 4)], {"padding": 1}),
}


@pytest.mark.parametrize("fmt", FORMATS16)
@pytest.mark.parametrize("op", sorted(CASES))
def test_matmul_like_ops_round_operands_and_sum_the_bias_gradient_unrounded(op, fmt):
    rng = np.random.default_rng(0)
    make, attrs = CASES[op]
    inputs = make(rng)
    rounded = [P.quantize(x, fmt) for x in inputs]
    out = mixed_ops.forward(op, inputs, attrs, fmt)
    np.testing.assert_array_equal(out, OPS[op].forward(rounded, attrs))
    assert not np.array_equal(out, OPS[op].forward(inputs, attrs))
    g = _rand(rng, *out.shape)
    got = mixed_ops.vjp(op, g, inputs, out, attrs, fmt)
    want = OPS[op].vjp(P.quantize(g, fmt), rounded, out, attrs)
    bias = mixed_ops.BIAS_INPUT.get(op)
    for i, (a, b) in enumerate(zip(got, want)):
        if i == bias:   # the dense layer's db: the sum of the unrounded gradient
            np.testing.assert_array_equal(a, OPS[op].vjp(g, inputs, out, attrs)[i])
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fmt", FORMATS16)
def test_attention_rounds_its_two_matmuls_and_keeps_the_softmax_float32(fmt):
    rng = np.random.default_rng(1)
    q, k, v = (_rand(rng, 2, 2, 5, 4) for _ in range(3))
    attrs = {"is_causal": True}
    out = mixed_ops.forward(mixed_ops.SDPA, [q, k, v], attrs, fmt)
    qq, kq, vq = (P.quantize(x, fmt) for x in (q, k, v))
    scores = np.where(np.tril(np.ones((5, 5), bool)), (qq @ kq.swapaxes(-1, -2)) * np.float32(0.5), -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_array_equal(out, P.quantize(probs, fmt) @ vq)
    g = _rand(rng, *out.shape)
    dq, dk, dv = mixed_ops.vjp(mixed_ops.SDPA, g, [q, k, v], out, attrs, fmt)
    np.testing.assert_array_equal(dv, P.quantize(probs, fmt).swapaxes(-1, -2) @ P.quantize(g, fmt))
    # against float32 attention: within the format's rounding, not equal
    ref = OPS[mixed_ops.SDPA].vjp(g, [q, k, v], out, attrs)
    for got, want in zip((dq, dk, dv), ref):
        assert not np.array_equal(got, want)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 40 * 2.0 ** -P._SPECS[fmt].man_bits


def test_a_unit_sends_its_gradients_in_the_formats_storage():
    rng = np.random.default_rng(2)
    seed_grad = _rand(rng, BATCH, SIZES[-1])
    _, spec = _both_specs("bfloat16", seed_grad)
    weights = init_weights(spec, 0)
    units = [unit_of(layer) for layer in spec.layers]
    live = {"x": _rand(rng, BATCH, SIZES[0]), "y": np.zeros(BATCH, np.int64), "seed_grad": seed_grad}
    caches = [unit_forward(u, w, live, "bfloat16") for u, w in zip(units, weights.values())]
    dlive = {"loss": np.float32(1.0)}
    last = units[-1]
    values = unit_backward(last, weights["fc2"], caches[-1], live, dict(dlive), "bfloat16")
    stored = unit_backward(last, weights["fc2"], caches[-1], live, dict(dlive), "bfloat16", grads_on_wire=True)
    for name, g in values.items():
        assert stored[name].dtype == np.uint16
        np.testing.assert_array_equal(P.from_bits(stored[name], "bfloat16"), g)
        np.testing.assert_array_equal(P.quantize(g, "bfloat16"), g)


@pytest.mark.parametrize("model, fmt", [({"mixed_precision": True, "fp16_type": "bfloat16"}, "bfloat16"),
                                        ({"mixed_precision": True, "use_bfloat16": True}, "bfloat16"),
                                        ({"mixed_precision": True}, "float16"),
                                        ({"mixed_precision": False, "fp16_type": "bfloat16"}, "float32")])
def test_the_params_precision_keys_apply_to_a_program_model(model, fmt):
    from cs_runtime.compiler.stage import build_spec
    from cs_runtime.config import params_from_dict
    from cs_runtime.run_args import RunArgs, UserFunctions
    _, spec = _both_specs("float32", np.ones((BATCH, SIZES[-1]), np.float32))
    params = params_from_dict({"model": model}, "fc_mnist")
    built = build_spec(RunArgs("train", "p.yaml", params, "m", None, False, False),
                       UserFunctions(lambda p: spec, None, None))
    assert built.precision == fmt and built.program is spec.program
    assert built.initial_weights is spec.initial_weights      # the starting weights come along

