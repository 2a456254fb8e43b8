"""The hand-written dense layer: an independent reference for the lowered program.

Every run lowers its model to a compiled program (cs_runtime/compiler/families.py)
and the runtime runs nothing else. This module keeps the dense layer as it
was written before that, by hand in numpy: y = act(x @ W + b), then dropout,
its backward, and the loss of an unlowered spec. The tests train a spec both
ways and ask for the same bits (test_lowered_dense.py, test_program_precision.py,
test_families.py), and check the layer itself against finite differences
(test_model.py) and the 16-bit rule (test_mixed_precision.py).

The functions take the runtime's arguments (model.model_forward and friends),
so a test runs `dense_reference` where it would run `model` on a lowered spec:

    run = model if spec.program is not None else dense_reference
    logits, caches = run.model_forward(spec, x, weights, ctx)

Mixed precision (a format other than float32): the matmul inputs (activations
or deltas, and weights) and the bias are rounded to the format, the products
accumulate in float32, and the weight gradients come out rounded; the
activation and the loss stay float32 (cs_runtime/numerics/mixed_ops.py, the
program's side of the same rule).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cs_runtime.numerics import kernels
from cs_runtime.numerics.model import GELU_KINDS, LayerSpec, LossResult, ModelSpec, ShardContext, blas_threads
from cs_runtime.numerics.precision import quantize

activate = kernels.activate


def activation_grad(kind: str, z: np.ndarray | None, a: np.ndarray | None) -> np.ndarray:
    """d act / d z of tanh and sigmoid (from the activation a) and the GELUs (from
    the pre-activation z). relu's is read off the layer's output in dense_backward,
    and "none" has no factor to apply."""
    if kind == "tanh":
        return 1.0 - a * a
    if kind == "sigmoid":
        return a * (1.0 - a)
    if kind in kernels.GELUS:
        return kernels.GELUS[kind][1](z).astype(z.dtype, copy=False)
    raise ValueError(f"activation_grad: no derivative table entry for {kind!r}")


def _rounded(x: np.ndarray, fmt: str) -> np.ndarray:
    """x as a matmul input of `fmt` (untouched in float32, so float64 gradient checks stay exact)."""
    return x if fmt == "float32" else quantize(x, fmt)


@dataclass
class DenseCache:
    x: np.ndarray              # the matmul input (rounded, in mixed precision)
    out: np.ndarray            # the layer's output, after activation and dropout
    z: np.ndarray | None       # pre-activation, kept where the derivative needs it (the GELUs)
    a: np.ndarray | None       # activation before dropout (tanh, sigmoid: the derivative is a function of it)
    mask: np.ndarray | None


def dense_forward(layer: LayerSpec, x: np.ndarray, weight: np.ndarray, bias: np.ndarray,
                  mask: np.ndarray | None, fmt: str = "float32") -> tuple[np.ndarray, DenseCache]:
    x = _rounded(x, fmt)   # kept rounded: the weight gradient's matmul takes the same input
    z = x @ _rounded(weight, fmt)
    z += _rounded(bias, fmt)
    if layer.activation == "relu":
        # In place: relu's derivative is read off the output (out > 0 exactly where
        # z > 0 and dropout kept the unit; where it did not, the delta is 0 anyway).
        out = np.maximum(z, 0, out=z)
        if mask is not None:
            out *= mask
        return out, DenseCache(x, out, None, None, mask)
    a = activate(layer.activation, z)
    out = a * mask if mask is not None else a
    return out, DenseCache(x, out, z if layer.activation in GELU_KINDS else None, a, mask)


def dense_backward(layer: LayerSpec, dout: np.ndarray, cache: DenseCache, weight: np.ndarray,
                   need_dx: bool = True, fmt: str = "float32"):
    """(dx or None, {"weight": dW, "bias": db}), the gradients in `fmt`'s values. `dout` is left as it is."""
    dz = dout if cache.mask is None else dout * cache.mask
    if layer.activation == "relu":
        dz = dz * (cache.out > 0) if dz is dout else np.multiply(dz, cache.out > 0, out=dz)
    elif layer.activation != "none":
        dz = dz * activation_grad(layer.activation, cache.z, cache.a)
    dz_in = _rounded(dz, fmt)
    grads = {"weight": _rounded(cache.x.T @ dz_in, fmt), "bias": _rounded(dz.sum(axis=0), fmt)}
    dx = dz_in @ _rounded(weight, fmt).T if need_dx else None
    return dx, grads


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray, global_batch: int):
    """(sum of per-sample losses / global_batch, dlogits in float32, number correct)."""
    loss, dlogits, correct = kernels.softmax_cross_entropy(logits, labels, global_batch)
    return loss, dlogits.astype(np.float32, copy=False), correct


# ---------------------------------------------------------------- the runtime's calls, unlowered

def _dense(spec: ModelSpec, index: int) -> LayerSpec:
    layer = spec.layers[index]
    if layer.op != "dense":
        raise ValueError(f"dense_reference: layer {layer.name} is {layer.op!r}, not dense")
    return layer


def layer_forward(spec: ModelSpec, index: int, x: np.ndarray, weights: dict, ctx: ShardContext):
    """(output, cache), the dropout mask the program's (kernels.rows_keep_mask, per global row)."""
    layer = _dense(spec, index)
    mask = None
    if ctx.train and layer.dropout > 0:
        mask = kernels.rows_keep_mask(ctx.seed, ctx.step, index, ctx.global_batch, layer.out_features,
                                      ctx.rows, layer.dropout)
    with blas_threads(spec, layer, x):   # the runtime's thread count, so its BLAS kernels
        return dense_forward(layer, x, weights["weight"], weights["bias"], mask, spec.precision)


def layer_backward(spec: ModelSpec, index: int, delta: np.ndarray, cache: DenseCache, weights: dict):
    layer = _dense(spec, index)
    with blas_threads(spec, layer, cache.x):
        return dense_backward(layer, delta, cache, weights["weight"], need_dx=index > 0, fmt=spec.precision)


def model_forward(spec: ModelSpec, x: np.ndarray, weights: dict, ctx: ShardContext):
    caches = []
    for index, layer in enumerate(spec.layers):
        x, cache = layer_forward(spec, index, x, weights[layer.name], ctx)
        caches.append(cache)
    return x, caches


def model_backward(spec: ModelSpec, delta: np.ndarray, caches: list, weights: dict, step: int = -1) -> list[dict]:
    grads: list = [None] * len(spec.layers)
    for index in reversed(range(len(spec.layers))):
        delta, grads[index] = layer_backward(spec, index, delta, caches[index], weights[spec.layers[index].name])
    return grads


def model_loss(spec: ModelSpec, logits: np.ndarray, labels: np.ndarray, global_batch: int,
               label_count: int | None = None) -> LossResult:
    """A classifier's mean over the global batch; [B, T, V] logits: the labelled tokens'
    summed loss normalised as `spec.loss_scaling` says (kernels.token_loss_weight)."""
    if logits.ndim == 2:
        loss, delta, correct = softmax_cross_entropy(logits, labels, global_batch)
        return LossResult(loss, delta, correct, loss * global_batch, len(labels))
    weight = kernels.token_loss_weight(spec.loss_scaling, spec.loss_weight, global_batch, label_count)
    return LossResult(*kernels.token_cross_entropy(logits, labels, weight))
