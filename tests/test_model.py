"""Tests for cs_runtime.numerics.model (specs, initialisation) and the dense-layer
reference (tests/dense_reference.py): the layer against finite differences, the
loss against numpy, and the data-parallel property the whole cluster relies on.
The runtime runs only lowered programs; test_lowered_dense.py checks that the
program trains to the reference's bits.

    python -m pytest tests/test_model.py -q

Gradient checks run in float64 (the kernels work in the dtype they are given),
so central differences are accurate to ~1e-9 and a 1e-6 tolerance is strict.
"""
from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from cs_runtime.data.batches import shard_rows
from cs_runtime.numerics import model
from cs_runtime.numerics.kernels import rows_keep_mask as dropout_mask
from cs_runtime.numerics.model import ACTIVATIONS, LayerSpec, ModelSpec, ShardContext, init_weights, mlp_spec
from tests.dense_reference import (activate, dense_backward, dense_forward, layer_forward,
                                   softmax_cross_entropy)

H = 1e-6  # central-difference step


def numeric_grad(f, arr: np.ndarray) -> np.ndarray:
    """d f / d arr by central differences, perturbing arr in place."""
    grad = np.zeros_like(arr, dtype=np.float64)
    flat, gflat = arr.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + H
        up = f()
        flat[i] = old - H
        down = f()
        flat[i] = old
        gflat[i] = (up - down) / (2 * H)
    return grad


def assert_close(actual, expected, rtol: float, what: str = "") -> None:
    """Relative to the array's scale, so entries near zero do not dominate."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, what
    scale = max(np.abs(expected).max(initial=0.0), 1e-12)
    err = np.abs(actual - expected).max(initial=0.0) / scale
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


def dense_problem(activation: str, seed: int = 0, batch: int = 5, n_in: int = 4, n_out: int = 3):
    rng = np.random.default_rng(seed)
    layer = LayerSpec("fc", "dense", n_in, n_out, activation=activation)
    x = rng.standard_normal((batch, n_in))
    w = rng.standard_normal((n_in, n_out)) * 0.7
    b = rng.standard_normal(n_out) * 0.3
    if activation == "relu":
        # keep pre-activations away from the kink so differences are well defined
        z = x @ w + b
        x[np.abs(z).min(axis=1) < 1e-3] += 0.1
    dout = rng.standard_normal((batch, n_out))
    return layer, x, w, b, dout


# --------------------------------------------------------------------------
# dense layer
# --------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activations_listed_are_the_five_supported(activation):
    assert set(ACTIVATIONS) == {"relu", "tanh", "sigmoid", "gelu", "gelu_new", "gelu_tanh", "none"}
    z = np.linspace(-3, 3, 13)
    a = activate(activation, z)
    assert a.shape == z.shape and np.isfinite(a).all()


def test_activation_values():
    z = np.array([-2.0, -0.5, 0.0, 0.5, 2.0])
    np.testing.assert_allclose(activate("relu", z), [0, 0, 0, 0.5, 2])
    np.testing.assert_allclose(activate("tanh", z), np.tanh(z))
    np.testing.assert_allclose(activate("sigmoid", z), 1 / (1 + np.exp(-z)))
    np.testing.assert_allclose(activate("none", z), z)
    # gelu is the exact x * Phi(x); gelu_new / gelu_tanh the tanh form, within 1e-3 of it
    from math import erf, sqrt
    exact = np.array([0.5 * v * (1 + erf(v / sqrt(2))) for v in z])
    np.testing.assert_allclose(activate("gelu", z), exact, rtol=2e-7, atol=1e-15)
    for approx in ("gelu_new", "gelu_tanh"):
        np.testing.assert_allclose(activate(approx, z), exact, atol=1e-3)
        assert np.abs(activate(approx, z) - exact).max() > 1e-5   # and not the same function


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("with_mask", [False, True])
def test_dense_backward_matches_finite_differences(activation, with_mask):
    layer, x, w, b, dout = dense_problem(activation, seed=1 + with_mask)
    mask = None
    if with_mask:
        mask = dropout_mask(3, 1, 0, x.shape[0], w.shape[1], slice(None), 0.4).astype(np.float64)

    def loss():
        out, _ = dense_forward(layer, x, w, b, mask)
        return float((out * dout).sum())

    out, cache = dense_forward(layer, x, w, b, mask)
    assert out.dtype == np.float64
    dx, grads = dense_backward(layer, dout, cache, w)
    assert dx.dtype == grads["weight"].dtype == grads["bias"].dtype == np.float64
    assert_close(dx, numeric_grad(loss, x), 1e-6, f"{activation} dx")
    assert_close(grads["weight"], numeric_grad(loss, w), 1e-6, f"{activation} dW")
    assert_close(grads["bias"], numeric_grad(loss, b), 1e-6, f"{activation} db")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_dense_forward_formula_and_no_dx_on_request(activation):
    layer, x, w, b, dout = dense_problem(activation, seed=5)
    out, cache = dense_forward(layer, x, w, b, None)
    np.testing.assert_allclose(out, activate(activation, x @ w + b), rtol=1e-12)
    x_before = x.copy()
    dx, grads = dense_backward(layer, dout, cache, w, need_dx=False)
    assert dx is None and set(grads) == {"weight", "bias"}
    assert grads["weight"].shape == w.shape and grads["bias"].shape == b.shape
    np.testing.assert_array_equal(x, x_before)  # inputs are not modified


def test_dense_kernels_keep_float32():
    layer, x, w, b, dout = dense_problem("gelu", seed=2)
    x, w, b, dout = (a.astype(np.float32) for a in (x, w, b, dout))
    out, cache = dense_forward(layer, x, w, b, None)
    dx, grads = dense_backward(layer, dout, cache, w)
    assert out.dtype == dx.dtype == grads["weight"].dtype == grads["bias"].dtype == np.float32


# --------------------------------------------------------------------------
# loss
# --------------------------------------------------------------------------

def reference_ce(logits: np.ndarray, labels: np.ndarray, global_batch: int) -> float:
    logits = logits.astype(np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(labels)), labels].sum() / global_batch)


@pytest.mark.parametrize("global_batch", [6, 10])  # a shard is scaled by the global batch
def test_softmax_cross_entropy_against_numpy_and_finite_differences(global_batch):
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((6, 5)) * 2
    labels = rng.integers(0, 5, 6)
    loss, dlogits, correct = softmax_cross_entropy(logits, labels, global_batch)
    assert isinstance(loss, float) and isinstance(correct, int)
    assert loss == pytest.approx(reference_ce(logits, labels, global_batch), rel=1e-12)
    numeric = numeric_grad(lambda: softmax_cross_entropy(logits, labels, global_batch)[0], logits)
    assert_close(dlogits, numeric, 1e-6, "dlogits")
    # closed form: (softmax - onehot) / global_batch
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    onehot = np.eye(5)[labels]
    assert_close(dlogits, (p - onehot) / global_batch, 1e-6, "dlogits closed form")
    assert correct == int((logits.argmax(axis=1) == labels).sum())


def test_softmax_cross_entropy_is_stable_for_large_logits():
    logits = np.array([[1000.0, 0.0, -1000.0], [0.0, 800.0, 800.0]], dtype=np.float32)
    labels = np.array([0, 2])
    loss, dlogits, correct = softmax_cross_entropy(logits, labels, 2)
    assert np.isfinite(loss) and np.isfinite(dlogits).all()
    assert loss == pytest.approx(np.log(2) / 2, rel=1e-6)
    assert correct == 1
    np.testing.assert_allclose(dlogits.sum(axis=1), 0, atol=1e-7)


def test_softmax_cross_entropy_float32_matches_float64():
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((16, 10)).astype(np.float32)
    labels = rng.integers(0, 10, 16)
    l32, d32, c32 = softmax_cross_entropy(logits, labels, 16)
    l64, d64, c64 = softmax_cross_entropy(logits.astype(np.float64), labels, 16)
    assert l32 == pytest.approx(l64, rel=1e-6) and c32 == c64
    assert_close(d32, d64, 1e-6, "float32 dlogits")


# --------------------------------------------------------------------------
# dropout and the data-parallel property
# --------------------------------------------------------------------------

def test_dropout_mask_values_rows_and_determinism():
    full = dropout_mask(7, 3, 1, 50, 40, slice(None), 0.25)
    assert full.shape == (50, 40) and full.dtype == np.float32
    assert set(np.unique(full)) <= {0.0, np.float32(1 / 0.75)}
    assert 0.65 < (full > 0).mean() < 0.85
    np.testing.assert_array_equal(full, dropout_mask(7, 3, 1, 50, 40, slice(None), 0.25))
    for k in (2, 3, 7):
        parts = [dropout_mask(7, 3, 1, 50, 40, shard_rows(50, r, k), 0.25) for r in range(k)]
        np.testing.assert_array_equal(np.concatenate(parts), full)
    for other in [(8, 3, 1), (7, 4, 1), (7, 3, 2)]:  # seed, step, layer each matter
        assert not np.array_equal(dropout_mask(*other, 50, 40, slice(None), 0.25), full)


def model_and_batch(activation: str, dropout: float, batch: int, dtype=np.float64, seed: int = 0):
    spec = mlp_spec("dp", [6, 8, 7, 4], activation, dropout)
    weights = {name: {k: v.astype(dtype) for k, v in params.items()}
               for name, params in init_weights(spec, seed).items()}
    rng = np.random.default_rng(seed + 100)
    x = rng.standard_normal((batch, 6)).astype(dtype)
    y = rng.integers(0, 4, batch)
    return spec, weights, x, y


def run_shard(spec, weights, x, y, ctx: ShardContext):
    """Forward + backward over the model for the rows of one shard (the CPU path's loop)."""
    h, caches = x[ctx.rows], []
    for index in range(len(spec.layers)):
        h, cache = layer_forward(spec, index, h, weights[spec.layers[index].name], ctx)
        caches.append(cache)
    loss, delta, correct = softmax_cross_entropy(h, y[ctx.rows], ctx.global_batch)
    grads = {}
    for index in reversed(range(len(spec.layers))):
        layer = spec.layers[index]
        delta, grads[layer.name] = dense_backward(layer, delta, caches[index],
                                                  weights[layer.name]["weight"], need_dx=index > 0)
    return loss, grads, correct


def test_the_runtime_runs_only_lowered_layers():
    """An unlowered spec is an error naming the fix, at a layer and at the loss."""
    spec, weights, x, y = model_and_batch("relu", dropout=0.0, batch=4)
    ctx = ShardContext(0, 0, 4, slice(0, 4), train=True, labels=y)
    with pytest.raises(ValueError, match="fc0.*lower_spec"):
        model.model_forward(spec, x, weights, ctx)
    with pytest.raises(ValueError, match="fc1.*lower_spec"):
        model.layer_backward(spec, 1, np.zeros((4, 7)), None, weights["fc1"])
    with pytest.raises(ValueError, match="loss.*lower_spec"):
        model.model_loss(spec, np.zeros((4, 4)), y, 4)


@pytest.mark.parametrize("num_shards", [2, 3])
@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh"])
@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-6), (np.float32, 1e-5)])
def test_sum_over_shards_equals_full_batch(num_shards, activation, dtype, rtol):
    batch, seed, step = 11, 5, 3
    spec, weights, x, y = model_and_batch(activation, dropout=0.3, batch=batch, dtype=dtype)
    full_loss, full_grads, full_correct = run_shard(
        spec, weights, x, y, ShardContext(seed, step, batch, slice(0, batch), train=True))
    loss, correct = 0.0, 0
    grads = {name: {k: np.zeros_like(v) for k, v in g.items()} for name, g in full_grads.items()}
    for rank in range(num_shards):
        rows = shard_rows(batch, rank, num_shards)
        part_loss, part_grads, part_correct = run_shard(
            spec, weights, x, y, ShardContext(seed, step, batch, rows, train=True))
        loss += part_loss
        correct += part_correct
        for name, g in part_grads.items():
            for k, v in g.items():
                grads[name][k] += v
    assert loss == pytest.approx(full_loss, rel=rtol)
    assert correct == full_correct
    for name in full_grads:
        for k in ("weight", "bias"):
            assert_close(grads[name][k], full_grads[name][k], rtol, f"{name}/{k}")


def test_dropout_changes_training_but_not_eval():
    spec, weights, x, y = model_and_batch("relu", dropout=0.5, batch=8)
    ctx = ShardContext(1, 0, 8, slice(0, 8), train=True)
    train_loss, _, _ = run_shard(spec, weights, x, y, ctx)
    eval_ctx = ShardContext(1, 0, 8, slice(0, 8), train=False)
    eval_loss, _, _ = run_shard(spec, weights, x, y, eval_ctx)
    spec0, _, _, _ = model_and_batch("relu", dropout=0.0, batch=8)
    plain_loss, _, _ = run_shard(spec0, weights, x, y, ctx)
    assert eval_loss == pytest.approx(plain_loss, rel=1e-12)
    assert train_loss != pytest.approx(eval_loss, rel=1e-6)


@pytest.mark.parametrize("activation", ["sigmoid", "gelu"])
def test_whole_model_gradient_matches_finite_differences(activation):
    spec, weights, x, y = model_and_batch(activation, dropout=0.3, batch=5)
    ctx = ShardContext(2, 1, 5, slice(0, 5), train=True)  # masks are fixed by (seed, step)
    _, grads, _ = run_shard(spec, weights, x, y, ctx)
    for layer in spec.layers:
        for k in ("weight", "bias"):
            arr = weights[layer.name][k]
            numeric = numeric_grad(lambda: run_shard(spec, weights, x, y, ctx)[0], arr)
            assert_close(grads[layer.name][k], numeric, 1e-5, f"{layer.name}/{k}")


# --------------------------------------------------------------------------
# specs and initialisation
# --------------------------------------------------------------------------

def test_mlp_spec_layer_shapes():
    spec = mlp_spec("fc_mnist", [784, 256, 128, 10], "relu", 0.2)
    assert [l.name for l in spec.layers] == ["fc0", "fc1", "fc2"]
    assert [(l.in_features, l.out_features) for l in spec.layers] == [(784, 256), (256, 128), (128, 10)]
    assert [l.activation for l in spec.layers] == ["relu", "relu", "none"]
    assert [l.dropout for l in spec.layers] == [0.2, 0.2, 0.0]
    assert all(l.op == "dense" for l in spec.layers)
    assert spec.layers[0].param_shapes() == {"weight": (784, 256), "bias": (256,)}
    assert spec.num_params() == 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10
    single = mlp_spec("linear", [4, 3], "tanh", 0.5)
    assert len(single.layers) == 1 and single.layers[0].activation == "none"
    assert single.layers[0].dropout == 0.0


def test_init_weights_deterministic_in_seed():
    spec = mlp_spec("m", [20, 16, 3], "relu", 0.0)
    a, b, c = init_weights(spec, 42), init_weights(spec, 42), init_weights(spec, 43)
    for layer in spec.layers:
        for k, shape in layer.param_shapes().items():
            assert a[layer.name][k].shape == shape and a[layer.name][k].dtype == np.float32
            np.testing.assert_array_equal(a[layer.name][k], b[layer.name][k])
            assert not np.array_equal(a[layer.name][k], c[layer.name][k])
            bound = 1 / np.sqrt(layer.in_features)
            assert np.abs(a[layer.name][k]).max() <= bound
    # a layer's init does not depend on the layers after it
    longer = init_weights(mlp_spec("m", [20, 16, 3, 5], "relu", 0.0), 42)
    np.testing.assert_array_equal(longer["fc0"]["weight"], a["fc0"]["weight"])


def test_model_spec_dict_round_trip():
    spec = ModelSpec("m", (LayerSpec("fc0", "dense", 3, 4, "gelu", 0.1),
                           LayerSpec("fc1", "dense", 4, 2)))
    d = spec.to_dict()
    assert d["name"] == "m" and d["loss"] == "softmax_cross_entropy"
    assert d["layers"][0] == {"name": "fc0", "op": "dense", "in_features": 3, "out_features": 4,
                              "activation": "gelu", "dropout": 0.1}
    assert ModelSpec.from_dict(d) == spec
    assert ModelSpec.from_dict(json.loads(json.dumps(d))) == spec
    # as it travels in a LOAD_MODEL header
    assert ModelSpec.from_dict(msgpack.unpackb(msgpack.packb(d))) == spec
    no_loss = {k: v for k, v in d.items() if k != "loss"}
    assert ModelSpec.from_dict(no_loss) == spec
    mlp = mlp_spec("x", [5, 4, 3], "sigmoid", 0.3)
    assert ModelSpec.from_dict(mlp.to_dict()) == mlp
