"""The 16-bit rule of a compiled program's matmul-like ops: the dense layer's rule.

With mixed precision (a format other than float32), a dense layer
(a built-in one lowered to these ops; its hand-written reference is
tests/dense_reference.py) computes

    forward    z = q(x) @ q(W) + q(b)             (float32 accumulation)
    backward   dW = q(x).T @ q(dz)   db = sum(dz)   dx = q(dz) @ q(W).T

where q rounds to the format (precision.quantize) and dz, the gradient of
z, is a float32 value. The ops here do the same, operand for operand:

- linear, addmm, mm, matmul, bmm, conv2d: every float input rounded in the
  forward (the bias too: it streams in 16 bits like the weight); in the
  backward the upstream gradient and the forward operands are rounded
  before each product, and a bias gradient is the sum of the *unrounded*
  upstream gradient, as db is;
- scaled_dot_product_attention, two matmuls around a float32 softmax:
  scores = q(Q) @ q(K).T * scale, out = q(P) @ q(V); its backward rounds the
  matmul operands (q(g), q(P), q(dscores)) and keeps the softmax's
  derivative in float32, as a dense layer keeps its activation's;
- self_attention (a built-in GPT-2 / BERT block's attention on the packed
  q/k/v projection) the same way: scores = q(Q) @ q(K).T * scale, a float32
  softmax (the model zoo's attention_softmax_fp32), its dropout in float32,
  out = q(P) @ q(V); backward as scaled_dot_product_attention's.

Every other op (activations, norms, softmax, the loss, reshapes) computes in
float32 on what it is given. The parameter gradients leave the unit in the
format, and the parameters arrive in it (executor.py rounds both), as a WSE
sends and receives them. In float32 nothing here runs: ops.py's own rules do,
so float32 numbers are unchanged to the bit.
"""
from __future__ import annotations

import numpy as np

from cs_runtime.numerics import kernels, ops
from cs_runtime.numerics.ops import OPS, unbroadcast
from cs_runtime.numerics.precision import quantize

# op -> the input that is a bias (added, not multiplied), if it has one
BIAS_INPUT = {"linear": 2, "addmm": 0, "conv2d": 2}
SDPA = "scaled_dot_product_attention"
SELF_ATTENTION = "self_attention"
MATMUL_LIKE = frozenset({"linear", "addmm", "mm", "matmul", "bmm", "conv2d", SDPA, SELF_ATTENTION})


def _q(x, fmt: str):
    """x rounded to fmt where it is a float tensor (masks, ids and absent inputs as they are)."""
    if x is None or not isinstance(x, np.ndarray) or x.dtype.kind != "f":
        return x
    return quantize(x, fmt)


def forward(op: str, inputs: list, attrs: dict, fmt: str, exact=()) -> np.ndarray:
    """The forward of a matmul-like op in `fmt`. `exact`: positions of inputs that hold
    fmt's values already (a unit's parameters): rounding them again would change nothing."""
    if op == SDPA:
        return _sdpa_forward(inputs, attrs, fmt)
    if op == SELF_ATTENTION:
        return _attention_forward(inputs, attrs, fmt)
    return OPS[op].forward([x if i in exact else _q(x, fmt) for i, x in enumerate(inputs)], attrs)


def vjp(op: str, g: np.ndarray, inputs: list, out, attrs: dict, fmt: str, exact=(), wanted=None) -> list:
    """The gradients of a matmul-like op in `fmt` (None where an input has none, or
    where `wanted` says it is not asked for and the op's rule can skip it)."""
    if op == SDPA:
        return _sdpa_vjp(g, inputs, attrs, fmt)
    if op == SELF_ATTENTION:
        return [_attention_vjp(g, inputs, attrs, fmt), *([None] * (len(inputs) - 1))]
    bias = BIAS_INPUT.get(op)
    read = OPS[op].saves_inputs   # the rest are shape-only stand-ins: nothing to round
    rounded = [_q(x, fmt) if i in read and i not in exact else x for i, x in enumerate(inputs)]
    grads = list(OPS[op].grads(_q(g, fmt), rounded, out, attrs, wanted))
    if bias is not None and bias < len(inputs) and inputs[bias] is not None:
        grads[bias] = _bias_grad(op, g, inputs[bias].shape)
    return grads


def _bias_grad(op: str, g: np.ndarray, shape) -> np.ndarray:
    """The bias gradient from the unrounded upstream gradient, summed as ops.py sums it."""
    if op == "linear":
        return g.reshape(-1, g.shape[-1]).sum(axis=0)
    if op == "conv2d":
        return g.sum(axis=(0, 2, 3))
    return unbroadcast(g, shape)


def _probs(inputs: list, attrs: dict, fmt: str):
    """(softmax probabilities in float32, scale, rounded q, k, v) of attention in `fmt`."""
    q, k, v = (_q(x, fmt) for x in inputs[:3])
    probs, scale = ops._sdpa_probs([q, k, *inputs[3:]], attrs)
    return probs, scale, q, k, v


def _sdpa_forward(inputs, attrs, fmt):
    probs, _, _, _, v = _probs(inputs, attrs, fmt)
    return quantize(probs, fmt) @ v


def _sdpa_vjp(g, inputs, attrs, fmt):
    """As ops.py's rule (probabilities recomputed), with the matmul operands rounded."""
    probs, scale, q, k, v = _probs(inputs, attrs, fmt)
    gq = quantize(g, fmt)
    dv = unbroadcast(ops._swap(quantize(probs, fmt)) @ gq, v.shape)
    dprobs = gq @ ops._swap(v)
    dscores = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True)) * scale
    ds = quantize(dscores, fmt)
    grads = [unbroadcast(ds @ k, q.shape), unbroadcast(ops._swap(ds) @ q, k.shape), dv]
    if len(inputs) > 3:
        mask = inputs[3]
        grads.append(None if mask.dtype == bool else unbroadcast(dscores / scale, mask.shape))
    return grads



def _attention_cache(inputs, attrs, fmt) -> kernels.AttentionCache:
    """self_attention's heads (from the rounded projection) and float32 probabilities,
    the dropped probabilities rounded: they are the second matmul's operand."""
    qkv, keep, drop = ops._attention_parts(inputs, attrs)
    cache = kernels.attention_probs(quantize(qkv, fmt), int(attrs["heads"]), bool(attrs.get("causal")), keep, drop)
    cache.dropped = quantize(cache.dropped, fmt)
    return cache


def _attention_forward(inputs, attrs, fmt):
    """_attention_forward_rows a piece of the batch at a time (kernels.by_samples)."""
    qkv = inputs[0]
    out = np.empty((*qkv.shape[:2], qkv.shape[2] // 3), qkv.dtype)

    def piece(lo, hi):
        out[lo:hi] = _attention_forward_rows([kernels.sample_rows(x, lo, hi) for x in inputs], attrs, fmt)
    kernels.by_samples(qkv, int(attrs["heads"]), piece)
    return out


def _attention_forward_rows(inputs, attrs, fmt):
    cache = _attention_cache(inputs, attrs, fmt)
    b, heads, t, hd = cache.q.shape
    return (cache.dropped @ cache.v).transpose(0, 2, 1, 3).reshape(b, t, heads * hd)


def _attention_vjp(g, inputs, attrs, fmt):
    """_attention_vjp_rows a piece of the batch at a time (kernels.by_samples)."""
    qkv = inputs[0]
    grad = np.empty(qkv.shape, np.result_type(g, qkv))

    def piece(lo, hi):
        grad[lo:hi] = _attention_vjp_rows(g[lo:hi], [kernels.sample_rows(x, lo, hi) for x in inputs], attrs, fmt)
    kernels.by_samples(qkv, int(attrs["heads"]), piece)
    return grad


def _attention_vjp_rows(g, inputs, attrs, fmt):
    """d qkv, as kernels.attention_backward, with the matmul operands rounded
    (the upstream gradient and the score gradient; the heads and probabilities are)."""
    cache = _attention_cache(inputs, attrs, fmt)
    q, k, v = cache.q, cache.k, cache.v
    b, heads, t, hd = q.shape
    do = quantize(g, fmt).reshape(b, t, heads, hd).transpose(0, 2, 1, 3)
    dv = ops._swap(cache.dropped) @ do
    dprobs = do @ ops._swap(v)
    if cache.drop is not None:
        dprobs *= cache.drop
    p = cache.probs
    dscores = p * (dprobs - (dprobs * p).sum(axis=-1, keepdims=True))
    dscores *= q.dtype.type(1.0 / np.sqrt(hd))
    ds = quantize(dscores, fmt)
    merged = [x.transpose(0, 2, 1, 3).reshape(b, t, heads * hd) for x in (ds @ k, ops._swap(ds) @ q, dv)]
    return np.concatenate(merged, axis=-1)
