"""The op set of a compiled program, in numpy: per op a forward, a
vector-Jacobian rule, a shape rule and a cost.

    out = OPS["linear"].forward([x, w, b], attrs)
    dx, dw, db = OPS["linear"].vjp(g, [x, w, b], out, attrs)
    shape = OPS["linear"].shape([x.shape, w.shape, b.shape], attrs)
    flops = OPS["linear"].flops([x.shape, w.shape, b.shape], shape, attrs)

Semantics are PyTorch's (the ops a captured torch model is made of, named
as ATen names them where that reads well): `linear` takes the weight as
[out, in], `embedding` takes (weight, ids), reductions take `dim` and
`keepdim`. Every op has one output. A binary op takes its second operand
either as a second input or as the attribute `scalar` (`reverse: True` puts
the scalar first: `2 - x`). A vjp returns one gradient per input, None for
inputs that have none (ids, masks, indices).

Ops run in the dtype they are given: float64 in the gradient tests,
float32 in training. Nothing here imports torch; tests/test_ops.py checks
every vjp against finite differences and against torch.autograd.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from cs_runtime.errors import UserInputError
from cs_runtime.numerics import compiled, kernels, parallel, windows
from cs_runtime.numerics.parallel import matmul as mm


class OpError(UserInputError):
    """An op got inputs or attributes it cannot take; the message says which."""


@dataclass(frozen=True)
class Op:
    name: str
    forward: Callable        # (inputs, attrs) -> array
    vjp: Callable            # (g, inputs, out, attrs) -> list of gradients (None: no gradient)
    shape: Callable          # (input shapes, attrs) -> output shape
    flops: Callable          # (input shapes, output shape, attrs) -> int
    saves_output: bool = False   # the vjp reads the forward output (so backward keeps it)
    saves_inputs: tuple[int, ...] = ()  # the inputs whose values the vjp reads
    # The vjp takes wanted= (per input, whether its gradient is asked for) and skips the
    # others (None): a first layer's matmul has no input gradient to compute, a dropout
    # mask never needs one.
    partial: bool = False
    # A training step's forward may also return a residual: arrays of the output's dtype (one,
    # or a tuple) made from the forward's own intermediates, from which residual_vjp computes the
    # gradients of vjp, the same bits, with less work (autodiff.backward_nodes keeps it and
    # the inputs in residual_reads, in place of what vjp reads). A matmul-like op (attention)
    # makes none in a 16-bit format: its rule there (mixed_ops.py) starts from the rounded inputs.
    residual: Callable | None = None          # (inputs, attrs) -> (output, residual)
    residual_vjp: Callable | None = None      # (g, inputs, residual, attrs) -> list of gradients
    residual_reads: tuple[int, ...] = ()      # the inputs residual_vjp reads (the rest: stand-ins)
    residual_shape: Callable | None = None    # its (largest) array's shape, from (input shapes, output
    #                                           shape, attrs); None: the output's
    # A collective op (SyncBatchNorm's) may sum per-shard values over every shard of the step:
    # its forward and vjp take reduce= (the shard's: float64 vector -> its sum over the shards,
    # in rank order; None where the shard is the whole batch).
    collective: bool = False

    def run(self, inputs, attrs, reduce=None):
        """The forward, handed the shard's reduce when it is a collective op."""
        if self.collective:
            return self.forward(inputs, attrs, reduce=reduce)
        return self.forward(inputs, attrs)

    def grads(self, g, inputs, out, attrs, wanted=None, reduce=None) -> list:
        """The vjp, told which gradients are wanted when it can use that (and a collective
        op the shard's reduce)."""
        extra = {"reduce": reduce} if self.collective else {}
        if self.partial and wanted is not None:
            extra["wanted"] = wanted
        return self.vjp(g, inputs, out, attrs, **extra)


OPS: dict[str, Op] = {}


def _register(name, forward, vjp, shape, flops, saves_output=False, saves_inputs=(), partial=False,
              residual=None, residual_vjp=None, residual_reads=(), residual_shape=None, collective=False):
    OPS[name] = Op(name, forward, vjp, shape, flops, saves_output, tuple(saves_inputs), partial,
                   residual, residual_vjp, tuple(residual_reads), residual_shape, collective)


def _numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) if len(shape) else 1


def _axis(dim: int, ndim: int) -> int:
    if not -ndim <= dim < max(ndim, 1):
        raise OpError(f"dim {dim} out of range for a tensor of {ndim} dims")
    return dim % max(ndim, 1)


def unbroadcast(g: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """Sum g over the axes broadcasting added or stretched, back to `shape`."""
    shape = tuple(shape)
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    if lead and g.shape[lead:] == shape and g.flags.c_contiguous:
        return g.reshape(-1, *shape).sum(axis=0)   # one pass over the rows, as a dense bias gradient
    g = g.sum(axis=tuple(range(lead))) if lead else g
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=stretched, keepdims=True) if stretched else g


def broadcast_shape(*shapes) -> tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(*[tuple(s) for s in shapes]))
    except ValueError as exc:
        raise OpError(f"shapes {[tuple(s) for s in shapes]} do not broadcast") from exc


def _same_shape(shapes, attrs):
    return tuple(shapes[0])


def _elementwise_cost(k: int):
    return lambda shapes, out, attrs: k * _numel(out)


_free = lambda shapes, out, attrs: 0   # noqa: E731  (views and copies: data movement, no arithmetic)


# ---------------------------------------------------------------- binary arithmetic

def _operands(inputs, attrs):
    """(a, b) of a binary op: the second from the inputs or the `scalar` attribute."""
    if "scalar" in attrs:
        s = np.asarray(attrs["scalar"], dtype=inputs[0].dtype if inputs[0].dtype.kind == "f" else None)
        return (s, inputs[0]) if attrs.get("reverse") else (inputs[0], s)
    return inputs[0], inputs[1]


def _binary_shape(shapes, attrs):
    return tuple(shapes[0]) if "scalar" in attrs else broadcast_shape(shapes[0], shapes[1])


def _binary_grads(ga, gb, inputs, attrs):
    """Map d/da, d/db back onto the op's inputs (scalars get none)."""
    if "scalar" in attrs:
        g = gb if attrs.get("reverse") else ga
        return [unbroadcast(g, inputs[0].shape)]
    return [unbroadcast(ga, inputs[0].shape), unbroadcast(gb, inputs[1].shape)]


def _add_vjp(g, inputs, out, attrs):
    alpha = attrs.get("alpha", 1)
    return _binary_grads(g, g * alpha if alpha != 1 else g, inputs, attrs)


def _sub_vjp(g, inputs, out, attrs):
    alpha = attrs.get("alpha", 1)
    return _binary_grads(g, -g * alpha if alpha != 1 else -g, inputs, attrs)


# mul and div make only the gradients asked for (wanted; a scalar operand asks for none): in
# GPT-2's gelu_new and mobilenet's hardswish most operands are constants, and each gradient
# not made is a pass over a whole activation.

def _mul_vjp(g, inputs, out, attrs, wanted=(True, True)):
    a, b = _operands(inputs, attrs)
    if "scalar" in attrs:
        return [unbroadcast(g * (a if attrs.get("reverse") else b), inputs[0].shape)]
    return [unbroadcast(g * b, inputs[0].shape) if wanted[0] else None,
            unbroadcast(g * a, inputs[1].shape) if wanted[1] else None]


def _div_vjp(g, inputs, out, attrs, wanted=(True, True)):
    a, b = _operands(inputs, attrs)
    ga = g / b
    if "scalar" in attrs:
        return [unbroadcast(-ga * a / b if attrs.get("reverse") else ga, inputs[0].shape)]
    return [unbroadcast(ga, inputs[0].shape) if wanted[0] else None,
            unbroadcast(-ga * a / b, inputs[1].shape) if wanted[1] else None]


def _alpha(b, attrs):
    alpha = attrs.get("alpha", 1)
    return b * alpha if alpha != 1 else b


def _add_forward(inputs, attrs):
    a, b = _operands(inputs, attrs)
    return parallel.binary(np.add, a, _alpha(b, attrs), commutative=True)


def _sub_forward(inputs, attrs):
    a, b = _operands(inputs, attrs)
    return np.subtract(a, _alpha(b, attrs))


_register("add", _add_forward, _add_vjp, _binary_shape, _elementwise_cost(1))
_register("sub", _sub_forward, _sub_vjp, _binary_shape, _elementwise_cost(1))
_register("mul", lambda i, a: parallel.binary(np.multiply, *_operands(i, a), commutative=True), _mul_vjp,
          _binary_shape, _elementwise_cost(1), saves_inputs=(0, 1), partial=True)
_register("div", lambda i, a: np.divide(*_operands(i, a)), _div_vjp, _binary_shape, _elementwise_cost(1),
          saves_inputs=(0, 1), partial=True)
_register("neg", lambda i, a: -i[0], lambda g, i, o, a: [-g], _same_shape, _elementwise_cost(1))


# ---------------------------------------------------------------- matmuls

def _matmul_shape(shapes, attrs):
    a, b = (tuple(s) for s in shapes[:2])
    if len(a) < 2 or len(b) < 2:
        raise OpError(f"matmul of shapes {a} and {b}: both operands need at least 2 dims")
    if a[-1] != b[-2]:
        raise OpError(f"matmul of shapes {a} and {b}: inner dims {a[-1]} and {b[-2]} differ")
    return (*broadcast_shape(a[:-2], b[:-2]), a[-2], b[-1])


def _matmul_cost(shapes, out, attrs):
    return 2 * _numel(out) * int(shapes[0][-1])


def _swap(t):
    return np.swapaxes(t, -1, -2)


def _matmul_vjp(g, inputs, out, attrs, wanted=(True, True)):
    a, b = inputs[:2]
    if b.ndim == 2 and a.ndim > 2:   # [..., k] @ [k, n]: one 2-d GEMM per gradient, not one per leading index
        g2, a2 = g.reshape(-1, g.shape[-1]), a.reshape(-1, a.shape[-1])
        return [mm(g2, b.T).reshape(a.shape) if wanted[0] else None, mm(a2.T, g2) if wanted[1] else None]
    return [unbroadcast(mm(g, _swap(b)), a.shape) if wanted[0] else None,
            unbroadcast(mm(_swap(a), g), b.shape) if wanted[1] else None]


def _flat_matmul(x, w):
    """x [..., k] @ w [k, n] as one 2-d GEMM (numpy runs a stacked one as many small ones)."""
    if w.ndim == 2 and x.ndim > 2:
        return mm(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1])
    return mm(x, w)


for _name in ("matmul", "mm", "bmm"):
    _register(_name, lambda i, a: _flat_matmul(i[0], i[1]), _matmul_vjp, _matmul_shape, _matmul_cost,
              saves_inputs=(0, 1), partial=True)


def _linear_forward(inputs, attrs):
    x, w = inputs[0], inputs[1]
    y = _flat_matmul(x, w.T)
    if len(inputs) > 2:
        y += inputs[2]
    return y


def _linear_vjp(g, inputs, out, attrs):
    x, w = inputs[0], inputs[1]
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    grads = [mm(g2, w).reshape(x.shape), mm(g2.T, x2)]
    if len(inputs) > 2:
        grads.append(g2.sum(axis=0))
    return grads


def _linear_shape(shapes, attrs):
    x, w = tuple(shapes[0]), tuple(shapes[1])
    if len(w) != 2 or not x or x[-1] != w[1]:
        raise OpError(f"linear of input {x} and weight {w}: expected weight [out, {x[-1] if x else '?'}]")
    if len(shapes) > 2 and tuple(shapes[2]) != (w[0],):
        raise OpError(f"linear bias {tuple(shapes[2])}: expected ({w[0]},)")
    return (*x[:-1], w[0])


_register("linear", _linear_forward, _linear_vjp, _linear_shape,
          lambda s, out, a: 2 * _numel(out) * int(s[0][-1]), saves_inputs=(0, 1))


def _addmm_shape(shapes, attrs):
    out = _matmul_shape(shapes[1:], attrs)
    broadcast_shape(shapes[0], out)
    return out


def _addmm_vjp(g, inputs, out, attrs):
    bias, a, b = inputs
    return [unbroadcast(g, bias.shape), mm(g, b.T), mm(a.T, g)]


_register("addmm", lambda i, a: i[0] + mm(i[1], i[2]), _addmm_vjp, _addmm_shape,
          lambda s, out, a: 2 * _numel(out) * int(s[1][-1]), saves_inputs=(1, 2))


# ---------------------------------------------------------------- activations

def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


_SQRT_HALF = 1.0 / math.sqrt(2.0)
_erf = np.vectorize(math.erf, otypes=[np.float64])


def _erf_array(x: np.ndarray) -> np.ndarray:
    """erf elementwise, to float64 accuracy (numpy has none; scipy is not a dependency).
    Abramowitz-Stegun 7.1.26 is only 1e-7 accurate, which float64 gradient checks see,
    so the exact values come from math.erf."""
    return _erf(x).astype(x.dtype, copy=False)


def gelu_exact(x):
    return 0.5 * x * (1.0 + _erf_array(x * x.dtype.type(_SQRT_HALF)))


def gelu_exact_grad(x):
    cdf = 0.5 * (1.0 + _erf_array(x * x.dtype.type(_SQRT_HALF)))
    pdf = np.exp(-0.5 * x * x) / x.dtype.type(math.sqrt(2.0 * math.pi))
    return cdf + x * pdf


_GELU_TANH_C = math.sqrt(2.0 / math.pi)   # the op set's own, at full precision


# The tanh GELU and its derivative work in place on one or two fresh arrays: each
# step is the same float operation, in the same order, as the plain expression
# 0.5 * x * (1 + tanh(c * (x + 0.044715 * x**3))) (so the numbers are the same
# bit for bit), without a new array per step.

def _gelu_tanh_inner(x):
    """tanh(c * (x + 0.044715 * (x * x * x))), in a new array."""
    t = x * x
    t *= x
    t *= 0.044715
    t += x
    t *= x.dtype.type(_GELU_TANH_C)
    return np.tanh(t, out=t)


# A chunk at a time (parallel.map_chunks): the same bits, but each pass reads and writes
# the cache, not memory (GPT-2's MLP activations are 4M floats a block, 16 MB a pass).

def gelu_tanh(x):
    return parallel.map_chunks(_gelu_tanh, x)


def gelu_tanh_grad(x):
    return parallel.map_chunks(_gelu_tanh_grad, x)


def gelu_tanh_and_grad(x):
    """(gelu_tanh(x), gelu_tanh_grad(x)), bit for bit, tanh evaluated once."""
    return parallel.map_chunks_pair(_gelu_tanh_and_grad, x)


def _gelu_tanh(x):
    return _gelu_tanh_from(_gelu_tanh_inner(x), x)


def _gelu_tanh_from(t, x):
    """The tanh GELU from t = _gelu_tanh_inner(x), into t."""
    t += 1.0
    t *= 0.5 * x
    return t


def _gelu_tanh_and_grad(x):
    t = _gelu_tanh_inner(x)
    value = _gelu_tanh_from(t.copy(), x)
    return value, _gelu_tanh_grad_from(t, x)


def _gelu_tanh_grad(x):
    return _gelu_tanh_grad_from(_gelu_tanh_inner(x), x)


def _gelu_tanh_grad_from(t, x):
    """0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x), into t."""
    b = t * t
    np.subtract(1.0, b, out=b)
    b *= 0.5 * x
    b *= x.dtype.type(_GELU_TANH_C)
    u = x * (3 * 0.044715)
    u *= x
    u += 1.0
    b *= u
    t += 1.0
    t *= 0.5
    t += b
    return t


def _exact(x, fn64, fn):
    """float32: the kernel (erf by a 1e-7 fit, in float64: 2 ulp, and fast); else math.erf's values."""
    return fn(x) if x.dtype == np.float32 else fn64(x)


def _gelu_forward(inputs, attrs):
    if attrs.get("approximate", "none") == "tanh":
        return gelu_tanh(inputs[0])
    return _exact(inputs[0], gelu_exact, kernels.gelu)


def _gelu_vjp(g, inputs, out, attrs):
    if attrs.get("approximate", "none") == "tanh":
        grad = gelu_tanh_grad(inputs[0])
    else:
        grad = _exact(inputs[0], gelu_exact_grad, kernels.gelu_grad)
    grad *= g    # a fresh array: g * grad in place
    return [grad]


# In a training step the forward makes GELU's derivative with its value (Phi(x), or the
# tanh, once for both) and keeps it in place of x, the same size: the backward multiplies.

def _gelu_and_slope(inputs, attrs):
    x = inputs[0]
    if attrs.get("approximate", "none") == "tanh":
        return gelu_tanh_and_grad(x)
    return kernels.gelu_and_grad(x) if x.dtype == np.float32 else (gelu_exact(x), gelu_exact_grad(x))


def _gelu_vjp_from_slope(g, inputs, slope, attrs):
    return [slope * g]    # the bits of _gelu_vjp's grad * g


_register("relu", lambda i, a: np.maximum(i[0], 0), lambda g, i, o, a: [g * (o > 0)], _same_shape,
          _elementwise_cost(1), saves_output=True)
_register("gelu", _gelu_forward, _gelu_vjp, _same_shape, _elementwise_cost(10), saves_inputs=(0,),
          residual=_gelu_and_slope, residual_vjp=_gelu_vjp_from_slope)
def _tanh_vjp(g, inputs, out, attrs):
    """g * (1 - out * out), in one new array where the dtypes allow (GPT-2's gelu_new: 1M floats a call)."""
    slope = out * out
    np.subtract(1, slope, out=slope)
    if np.result_type(g, slope) != slope.dtype or np.broadcast_shapes(g.shape, slope.shape) != slope.shape:
        return [g * slope]
    return [np.multiply(slope, g, out=slope)]


_register("tanh", lambda i, a: np.tanh(i[0]), _tanh_vjp, _same_shape, _elementwise_cost(4), saves_output=True)
_register("sigmoid", lambda i, a: _sigmoid(i[0]), lambda g, i, o, a: [g * (o * (1 - o))], _same_shape,
          _elementwise_cost(4), saves_output=True)


def _silu_slope(x, s):
    """d/dx x * sigmoid(x), s = sigmoid(x)."""
    return s * (1 + x * (1 - s))


def _silu_vjp(g, inputs, out, attrs):
    return [g * _silu_slope(inputs[0], _sigmoid(inputs[0]))]


# As GELU's: a training step's forward makes the slope with the value, sigmoid once (Llama's MLP).

def _silu_and_slope(inputs, attrs):
    s = _sigmoid(inputs[0])
    return inputs[0] * s, _silu_slope(inputs[0], s)


_register("silu", lambda i, a: i[0] * _sigmoid(i[0]), _silu_vjp, _same_shape, _elementwise_cost(5),
          saves_inputs=(0,), residual=_silu_and_slope, residual_vjp=lambda g, i, slope, a: [g * slope])


# optional: row passes as C loops (_norms.c), the same bits, for float32 rows along the last
# axis (numpy's reduction of such a row is the pairwise sum the loops make): layer norm's, and
# the softmax's backward (attention's among them)
_norm_loops = compiled.load("_norms", api=1)


def norms_path() -> str:
    """How this install runs layer norm's and softmax's backward row passes: "C loops" (_norms.c
    built) or "numpy"."""
    return "numpy" if _norm_loops is None else "C loops"


# ---------------------------------------------------------------- softmax family

def softmax(x, axis):
    """exp(x - max) / sum, in one new array (same operations as the plain expression)."""
    e = x - x.max(axis=axis, keepdims=True)
    np.exp(e, out=e)
    e /= e.sum(axis=axis, keepdims=True)
    return e


def log_softmax(x, axis):
    """shifted - log(sum(exp(shifted))), shifted = x - max: one new array besides the result."""
    shifted = x - x.max(axis=axis, keepdims=True)
    e = np.exp(shifted)
    total = np.log(e.sum(axis=axis, keepdims=True))
    return np.subtract(shifted, total, out=e)


def _softmax_grad_by_loops(g, p, into, scale=None) -> bool:
    """into <- (g - rowsum(g * p)) * p (then * scale), over the last axis, by the C loops
    (_norms.c: numpy's bits) when they take these arrays (float32, C-contiguous, one shape;
    `into` may be g); False: nothing done."""
    if _norm_loops is None or not all(a.dtype == np.float32 and a.flags.c_contiguous and a.shape == p.shape
                                      for a in (g, p, into)) or p.ndim == 0 or p.size == 0:
        return False
    _norm_loops.softmax_backward(g, p, into, (p.size // p.shape[-1], p.shape[-1]),
                                 1.0 if scale is None else float(scale), scale is not None)
    return True


def _softmax_vjp(g, inputs, out, attrs):
    axis = _axis(attrs["dim"], out.ndim)
    if axis == out.ndim - 1:
        d = np.empty_like(out)
        if _softmax_grad_by_loops(g, out, d):
            return [d]
    d = g * out
    np.subtract(g, d.sum(axis=axis, keepdims=True), out=d)
    d *= out
    return [d]


def _log_softmax_vjp(g, inputs, out, attrs):
    axis = _axis(attrs["dim"], out.ndim)
    return [g - np.exp(out) * g.sum(axis=axis, keepdims=True)]


_register("softmax", lambda i, a: softmax(i[0], _axis(a["dim"], i[0].ndim)), _softmax_vjp, _same_shape,
          _elementwise_cost(5), saves_output=True)
_register("log_softmax", lambda i, a: log_softmax(i[0], _axis(a["dim"], i[0].ndim)), _log_softmax_vjp,
          _same_shape, _elementwise_cost(5), saves_output=True)


# ---------------------------------------------------------------- layer norm

def _ln_axes(x, attrs):
    n = len(attrs["normalized_shape"])
    return tuple(range(x.ndim - n, x.ndim))


# Layer norm works in place on fresh arrays, in the operations and order of the plain
# expressions (y = (x - mean) * rstd * gain + bias; the vjp below), so the numbers are
# the same bit for bit with a third of the new arrays.

def _by_rows(x, axes, work) -> None:
    """work(lo, hi) over the first axis's rows of x in parallel.py's fixed cut, when the
    normalised axes leave one (every row is normalised on its own: the same bits)."""
    if len(axes) == x.ndim:
        work(None, None)
    else:
        parallel.in_pieces(x.shape[0], work, elements=x.size, align=1)


def _parameter(inputs, i):
    return inputs[i] if len(inputs) > i and inputs[i] is not None else None


def _loops_take(x, inputs, attrs) -> bool:
    if _norm_loops is None or len(attrs["normalized_shape"]) != 1 or x.dtype != np.float32:
        return False
    return x.flags.c_contiguous and x.size > 0 and all(
        p is None or (p.dtype == np.float32 and p.shape == x.shape[-1:] and p.flags.c_contiguous)
        for p in (_parameter(inputs, 1), _parameter(inputs, 2)))


def _dims(rows, width, gain, bias) -> tuple:
    return rows, width, gain is not None, bias is not None


def _layer_norm_by_loops(inputs, attrs, keep_xhat: bool):
    """(y, x-hat, rstd) by the C loops, a piece of rows at a time; x-hat is y's array unless
    `keep_xhat` (a training step's forward keeps it)."""
    x, gain, bias = inputs[0], _parameter(inputs, 1), _parameter(inputs, 2)
    width, eps = x.shape[-1], float(x.dtype.type(attrs.get("eps", 1e-5)))
    xhat, rstd = np.empty_like(x), np.empty(x.shape[:-1] + (1,), x.dtype)
    y = np.empty_like(x) if keep_xhat else xhat

    def rows(lo, hi):
        part = x[lo:hi]
        _norm_loops.forward(part, part if gain is None else gain, part if bias is None else bias, xhat[lo:hi],
                            rstd[lo:hi], y[lo:hi], _dims(part.size // width, width, gain, bias), eps)
    _by_rows(x, (x.ndim - 1,), rows)
    return y, xhat, rstd


def _layer_norm_stats(x, attrs):
    """(x-hat in a new array, rstd)."""
    axes = _ln_axes(x, attrs)
    eps = x.dtype.type(attrs.get("eps", 1e-5))
    xhat = np.empty(x.shape, x.dtype)
    rstd = np.empty(x.shape[:x.ndim - len(axes)] + (1,) * len(axes), x.dtype)

    def rows(lo, hi):
        part = x[lo:hi]
        centred = np.subtract(part, part.mean(axis=axes, keepdims=True), out=xhat[lo:hi])
        square = centred * centred
        var = square.mean(axis=axes, keepdims=True)
        np.divide(1.0, np.sqrt(var + eps), out=rstd[lo:hi])
        centred *= rstd[lo:hi]
    _by_rows(x, axes, rows)
    return xhat, rstd


def _layer_norm_forward(inputs, attrs):
    if _loops_take(inputs[0], inputs, attrs):
        return _layer_norm_by_loops(inputs, attrs, keep_xhat=False)[0]
    y, _ = _layer_norm_stats(inputs[0], attrs)
    return _scale_and_shift(y, inputs, out=y)


def _scale_and_shift(xhat, inputs, out=None):
    """xhat * gain + bias (either absent or None: left out), into `out` (xhat's dtype; xhat
    itself to work in place), else into a new array."""
    y = np.empty_like(xhat) if out is None else out
    if len(inputs) > 1 and inputs[1] is not None:
        np.multiply(xhat, inputs[1], out=y)
    elif y is not xhat:
        y[...] = xhat
    if len(inputs) > 2:
        y += inputs[2]
    return y


def _layer_norm_and_stats(inputs, attrs):
    """(the output, (x-hat, rstd)): a training step's forward keeps the statistics, so the
    backward need not compute them again from x (which it then does not keep)."""
    if _loops_take(inputs[0], inputs, attrs):
        y, xhat, rstd = _layer_norm_by_loops(inputs, attrs, keep_xhat=True)
        return y, (xhat, rstd)
    xhat, rstd = _layer_norm_stats(inputs[0], attrs)
    return _scale_and_shift(xhat, inputs), (xhat, rstd)


def _layer_norm_vjp(g, inputs, out, attrs):
    """Recomputes x-hat from x (one pass over the row): outside a training step's forward,
    which keeps it (_layer_norm_vjp_from_stats)."""
    return _layer_norm_vjp_from_stats(g, inputs, _layer_norm_stats(inputs[0], attrs), attrs)


def _layer_norm_vjp_from_stats(g, inputs, stats, attrs):
    """dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = g * gain."""
    x = inputs[0]
    xhat, rstd = stats
    axes = _ln_axes(x, attrs)
    lead = tuple(range(x.ndim - len(axes)))
    has_gain = len(inputs) > 1 and inputs[1] is not None
    dx = np.empty(np.broadcast_shapes(g.shape, x.shape), np.result_type(g, inputs[1]) if has_gain else g.dtype)
    gain, width = _parameter(inputs, 1), x.shape[-1]
    by_loops = (g.shape == x.shape and g.dtype == np.float32 and xhat.flags.c_contiguous
                and _loops_take(xhat, inputs[:2], attrs))
    g = np.ascontiguousarray(g) if by_loops else g

    def loop_rows(lo, hi):
        part = g[lo:hi]
        _norm_loops.backward(part, xhat[lo:hi], rstd[lo:hi], part if gain is None else gain, dx[lo:hi],
                             _dims(part.size // width, width, gain, None))

    def rows(lo, hi):
        d = dx[lo:hi]
        if has_gain:
            np.multiply(g[lo:hi], inputs[1], out=d)
        else:
            d[...] = g[lo:hi]
        scratch = d * xhat[lo:hi]
        projection = scratch.mean(axis=axes, keepdims=True)
        d -= d.mean(axis=axes, keepdims=True)
        np.multiply(xhat[lo:hi], projection, out=scratch)
        d -= scratch
        d *= rstd[lo:hi]
    _by_rows(x, axes, loop_rows if by_loops else rows)
    grads = [dx]
    if len(inputs) > 1:
        grads.append(np.multiply(g, xhat).sum(axis=lead) if has_gain else None)
    if len(inputs) > 2:
        grads.append(g.sum(axis=lead))
    return grads


def _layer_norm_shape(shapes, attrs):
    x, norm = tuple(shapes[0]), tuple(attrs["normalized_shape"])
    if x[len(x) - len(norm):] != norm:
        raise OpError(f"layer_norm over {norm} of an input {x}")
    for s in shapes[1:]:
        if tuple(s) != norm:
            raise OpError(f"layer_norm weight/bias {tuple(s)}: expected {norm}")
    return x


# A training step keeps x-hat (the size of x, which the backward then does not keep) and each
# row's rstd: the backward does not compute them again.
_register("layer_norm", _layer_norm_forward, _layer_norm_vjp, _layer_norm_shape, _elementwise_cost(8),
          saves_inputs=(0, 1), residual=_layer_norm_and_stats, residual_vjp=_layer_norm_vjp_from_stats,
          residual_reads=(1,))


# ---------------------------------------------------------------- embedding, gather

def _embedding_forward(inputs, attrs):
    weight, ids = inputs
    if ids.size and (ids.min() < 0 or ids.max() >= weight.shape[0]):
        raise OpError(f"embedding ids outside [0, {weight.shape[0]})")
    return weight[ids]


def _embedding_vjp(g, inputs, out, attrs):
    """Rows of g summed per id: sorted once, then one reduceat (np.add.at is a slow
    per-element loop); each id's rows are added in the order they come, as add.at adds them."""
    weight, ids = inputs
    dw = np.zeros_like(weight)
    flat = ids.reshape(-1)
    if flat.size:
        order = np.argsort(flat, kind="stable")
        ranked = flat[order]
        starts = np.flatnonzero(np.concatenate(([True], ranked[1:] != ranked[:-1])))
        dw[ranked[starts]] = np.add.reduceat(g.reshape(-1, weight.shape[1])[order], starts, axis=0)
    pad = attrs.get("padding_idx", -1)
    if pad is not None and pad >= 0:
        dw[pad] = 0   # torch: the padding row gets no gradient
    return [dw, None]


_register("embedding", _embedding_forward, _embedding_vjp,
          lambda s, a: (*tuple(s[1]), int(s[0][1])), _free, saves_inputs=(1,))


def _gather_vjp(g, inputs, out, attrs):
    x, index = inputs
    axis = _axis(attrs["dim"], x.ndim)
    dx = np.zeros_like(x)
    idx = list(np.indices(index.shape, sparse=True))
    idx[axis] = index
    np.add.at(dx, tuple(idx), g)
    return [dx, None]


_register("gather", lambda i, a: np.take_along_axis(i[0], i[1], axis=_axis(a["dim"], i[0].ndim)), _gather_vjp,
          lambda s, a: tuple(s[1]), _free, saves_inputs=(1,))


# ---------------------------------------------------------------- dropout

def _dropout_forward(inputs, attrs):
    """p = 0 (or eval): the identity. Otherwise the second input is the scaled
    keep-mask (0 or 1/(1-p)), drawn by whoever runs the program."""
    if len(inputs) > 1:
        return parallel.binary(np.multiply, inputs[0], inputs[1], commutative=True)
    if attrs.get("p", 0.0) and attrs.get("train", True):
        raise OpError(f"dropout with p={attrs['p']} needs its keep-mask as a second input")
    return inputs[0]


def _dropout_vjp(g, inputs, out, attrs, wanted=(True, True)):
    if len(inputs) == 1:
        return [g]
    return [parallel.binary(np.multiply, g, inputs[1], commutative=True) if wanted[0] else None,
            parallel.binary(np.multiply, g, inputs[0], commutative=True) if wanted[1] else None]


_register("dropout", _dropout_forward, _dropout_vjp, _same_shape, _elementwise_cost(1), saves_inputs=(0, 1),
          partial=True)


def _mask_shape(x_shape, attrs):
    """A dropout mask's shape: the value's, or with `heads` the attention probabilities' of a
    packed [B, T, 3D] projection: [B, heads, T, T]."""
    x = tuple(x_shape)
    if "heads" in attrs:
        return (x[0], int(attrs["heads"]), x[1], x[1])
    return x


def _dropout_mask_forward(inputs, attrs):
    """The scaled keep-mask of a built-in model's dropout site, from the run's context
    (inputs[1]: int64 [seed, step, row_start, row_stop, global_batch, train]): a function
    of (seed, step, layer, site, the sample's row in the global batch), so every shard,
    WSE and replica draws the same mask for a sample. `kind` "rows" is a dense layer's
    (a generator per (seed, step, layer) over the global batch), "hash" a transformer's
    (counter-based, per sample and position), "flat" a captured torch model's (as "hash",
    over each sample's elements in order, whatever the value's shape: its leading dim
    may hold several rows per sample, as a [B*T, D] view does)."""
    x, context = inputs
    seed, step, start, stop, global_batch, train = map(int, np.asarray(context).tolist())   # one call to list
    if not train:
        return np.ones((), dtype=x.dtype)
    shape, rows, p = _mask_shape(x.shape, attrs), slice(start, stop), float(attrs["p"])
    if attrs["kind"] == "flat":
        return kernels.sample_keep_mask(seed, step, int(attrs["layer"]), rows, shape, p, x.dtype.type)
    if shape[0] != stop - start:
        raise OpError(f"dropout mask for rows {start}:{stop} of a value of {shape[0]} rows")
    if attrs["kind"] == "rows":
        return kernels.rows_keep_mask(seed, step, int(attrs["layer"]), global_batch, shape[1], rows, p)
    key = kernels.hash_key(seed, step, int(attrs["layer"]), int(attrs["site"]))
    return kernels.keep_mask(key, rows, shape[1:], p, x.dtype.type)


_register("dropout_mask", _dropout_mask_forward, lambda g, i, o, a: [None, None],
          lambda s, a: _mask_shape(s[0], a), lambda s, out, a: 2 * _numel(out))


def _draw_shape(shapes, attrs):
    """attrs["shape"], its -1 (dim 0 only) the rows of input 0, a value of the batch's rows."""
    shape = [int(d) for d in attrs["shape"]]
    if -1 in shape[1:] or (shape and shape[0] == -1 and len(shapes) < 2):
        raise OpError(f"a draw of shape {shape}: only dim 0 follows the batch, read from a first input")
    return tuple(shapes[0][0] if d == -1 else d for d in shape)


def _draw_forward(inputs, attrs):
    """A captured model's random draw (torch.rand, randn, randperm and their _like forms),
    anew each step from the run's context (the last input, as dropout_mask's): with a first
    input the draw follows the batch, each sample's elements drawn by its row in the global
    batch; without, it is drawn as row 0, the same on every shard (kernels.sample_draws)."""
    seed, step, start, stop = map(int, np.asarray(inputs[-1]).tolist()[:4])
    rows = slice(start, stop) if len(inputs) > 1 else slice(0, 1)
    shape = _draw_shape([np.shape(i) for i in inputs], attrs)
    try:
        return kernels.sample_draws(seed, step, int(attrs["site"]), rows, shape, attrs["dist"],
                                    np.dtype(attrs["dtype"]))
    except ValueError as exc:
        raise OpError(str(exc)) from None


# No gradient flows into a draw: its first input gives only its rows.
_register("draw", _draw_forward, lambda g, inputs, out, attrs: [None] * len(inputs), _draw_shape,
          lambda s, out, a: 20 * _numel(out))


# ---------------------------------------------------------------- built-in transformer pieces

def _positions_forward(inputs, attrs):
    table, ids = inputs
    if ids.shape[-1] > table.shape[0]:
        raise OpError(f"sequence length {ids.shape[-1]} exceeds the {table.shape[0]} position embeddings")
    return table[:ids.shape[-1]]


def _positions_vjp(g, inputs, out, attrs):
    table = inputs[0]
    d = np.zeros(table.shape, dtype=g.dtype)
    d[:g.shape[0]] = g
    return [d, None]


# A learned position embedding: the first T rows of the table for ids of length T.
_register("position_embedding", _positions_forward, _positions_vjp,
          lambda s, a: (int(s[1][-1]), int(s[0][1])), _free)


def _attention_parts(inputs, attrs):
    """(qkv, key_keep or None, dropout mask or None) of self_attention."""
    rest = iter(inputs[1:])
    keep = next(rest) if attrs.get("key_keep") else None
    drop = next(rest) if attrs.get("drop") else None
    return inputs[0], keep, drop


def _attention_forward(inputs, attrs):
    qkv, keep, drop = _attention_parts(inputs, attrs)
    return kernels.attention_output(qkv, int(attrs["heads"]), bool(attrs.get("causal")), keep, drop)


def _attention_vjp(g, inputs, out, attrs):
    """Recomputes the probabilities from the packed projection (outside a training step's
    forward, which keeps them: the residual below)."""
    qkv, keep, drop = _attention_parts(inputs, attrs)
    grad = kernels.attention_grad(g, qkv, int(attrs["heads"]), bool(attrs.get("causal")), keep, drop)
    return [grad, *([None] * (len(inputs) - 1))]


def _attention_and_probs(inputs, attrs):
    qkv, keep, drop = _attention_parts(inputs, attrs)
    return kernels.attention_output_and_probs(qkv, int(attrs["heads"]), bool(attrs.get("causal")), keep, drop)


def _attention_vjp_from_probs(g, inputs, probs, attrs):
    qkv, _, drop = _attention_parts(inputs, attrs)
    grad = kernels.attention_grad_from_probs(g, qkv, probs, int(attrs["heads"]), drop)
    return [grad, *([None] * (len(inputs) - 1))]


def _attention_probs_shape(shapes, out, attrs):
    b, t, _ = out
    return (b, int(attrs["heads"]), t, t)


def _attention_shape(shapes, attrs):
    x = tuple(shapes[0])
    if len(x) != 3 or x[2] % (3 * int(attrs["heads"])):
        raise OpError(f"self_attention of {x}: expected a packed [B, T, 3 * heads * head_dim] projection")
    return (x[0], x[1], x[2] // 3)


def _attention_cost(shapes, out, attrs):
    b, t, d = out
    return 4 * b * t * t * d + 5 * b * int(attrs["heads"]) * t * t


# Multi-head self-attention of a packed [B, T, 3D] q/k/v projection (a built-in model's
# block): causal or not, keys masked by key_keep (bool [B, T]), probabilities dropped by
# a mask (dropout_mask with `heads`). Scores of masked keys are kernels.MASKED_SCORE.
# A training step keeps the probabilities (before dropout; [B, heads, T, T]) as well as the
# inputs: the backward does not compute them again (a third of its time). The key mask
# stays read: a 16-bit format's rule recomputes from the inputs.
_register("self_attention", _attention_forward, _attention_vjp, _attention_shape, _attention_cost,
          saves_inputs=(0, 1, 2), residual=_attention_and_probs, residual_vjp=_attention_vjp_from_probs,
          residual_reads=(0, 1, 2), residual_shape=_attention_probs_shape)


# ---------------------------------------------------------------- views and copies

def _reshape_shape(shapes, attrs):
    src, target = tuple(shapes[0]), list(attrs["shape"])
    if target.count(-1) > 1:
        raise OpError(f"reshape to {target}: more than one -1")
    known = _numel([d for d in target if d != -1])
    if -1 in target:
        if known == 0 or _numel(src) % known:
            raise OpError(f"reshape of {src} to {tuple(target)}")
        target[target.index(-1)] = _numel(src) // known
    if _numel(target) != _numel(src):
        raise OpError(f"reshape of {src} ({_numel(src)} elements) to {tuple(target)}")
    return tuple(target)


def _reshape_forward(inputs, attrs):
    x = inputs[0]
    return x.reshape(_reshape_shape([x.shape], attrs))


_register("reshape", _reshape_forward, lambda g, i, o, a: [g.reshape(i[0].shape)], _reshape_shape, _free)


def _flatten_shape(shapes, attrs):
    s = tuple(shapes[0])
    if not s:
        return (1,)
    start, end = _axis(attrs.get("start_dim", 0), len(s)), _axis(attrs.get("end_dim", -1), len(s))
    return (*s[:start], _numel(s[start:end + 1]), *s[end + 1:])


_register("flatten", lambda i, a: i[0].reshape(_flatten_shape([i[0].shape], a)),
          lambda g, i, o, a: [g.reshape(i[0].shape)], _flatten_shape, _free)


def _perm(attrs, ndim):
    dims = [_axis(d, ndim) for d in attrs["dims"]]
    if sorted(dims) != list(range(ndim)):
        raise OpError(f"permute dims {attrs['dims']} are not a permutation of {ndim} dims")
    return dims


_register("permute", lambda i, a: np.transpose(i[0], _perm(a, i[0].ndim)),   # a view, as torch's
          lambda g, i, o, a: [np.transpose(g, np.argsort(_perm(a, g.ndim)))],
          lambda s, a: tuple(s[0][d] for d in _perm(a, len(s[0]))), _free)


def _transpose_dims(attrs, ndim):
    return _axis(attrs.get("dim0", 0), ndim), _axis(attrs.get("dim1", 1), ndim)


def _transpose_shape(shapes, attrs):
    s = list(shapes[0])
    d0, d1 = _transpose_dims(attrs, len(s))
    s[d0], s[d1] = s[d1], s[d0]
    return tuple(s)


_register("transpose", lambda i, a: np.swapaxes(i[0], *_transpose_dims(a, i[0].ndim)),
          lambda g, i, o, a: [np.swapaxes(g, *_transpose_dims(a, g.ndim))], _transpose_shape, _free)


def _expand_shape(shapes, attrs):
    """attrs["shape"], -1 keeping the input's size; a dim in attrs["batch_dims"] takes the
    batch (dim 0) of inputs[1], so that a constant broadcast over the batch fits any shard."""
    src, target = tuple(shapes[0]), list(attrs["shape"])
    for i in attrs.get("batch_dims", ()):
        if len(shapes) < 2 or not shapes[1]:
            raise OpError("expand over the batch without an input to read the batch from")
        target[i] = shapes[1][0]
    lead = len(target) - len(src)
    if lead < 0:
        raise OpError(f"expand of {src} to fewer dims {tuple(target)}")
    for i, n in enumerate(target):
        if n == -1:
            target[i] = src[i - lead]
        elif i >= lead and src[i - lead] not in (1, n):
            raise OpError(f"expand of {src} to {tuple(attrs['shape'])}")
    return tuple(target)


def _expand_forward(inputs, attrs):
    return np.broadcast_to(inputs[0], _expand_shape([i.shape for i in inputs], attrs))


# The batch reference (inputs[1]) gives only its size: no gradient flows to it.
_register("expand", _expand_forward,
          lambda g, i, o, a: [unbroadcast(g, i[0].shape)] + [None] * (len(i) - 1), _expand_shape, _free)


def _slice_index(attrs, ndim):
    axis = _axis(attrs["dim"], ndim)
    return (slice(None),) * axis + (slice(attrs.get("start"), attrs.get("end"), attrs.get("step", 1)),)


def _slice_vjp(g, inputs, out, attrs):
    dx = np.zeros(inputs[0].shape, dtype=g.dtype)
    dx[_slice_index(attrs, g.ndim)] = g
    return [dx]


def _slice_shape(shapes, attrs):
    s = list(shapes[0])
    axis = _axis(attrs["dim"], len(s))
    s[axis] = len(range(*slice(attrs.get("start"), attrs.get("end"), attrs.get("step", 1)).indices(s[axis])))
    return tuple(s)


# split (torch's split and chunk) is captured as one slice per piece: every op has one output.
_register("slice", lambda i, a: i[0][_slice_index(a, i[0].ndim)], _slice_vjp, _slice_shape, _free)


def _unsqueeze_shape(shapes, attrs):
    s = list(shapes[0])
    s.insert(_axis(attrs["dim"], len(s) + 1), 1)
    return tuple(s)


def _squeeze_shape(shapes, attrs):
    s = tuple(shapes[0])
    dims = attrs.get("dims")
    dims = range(len(s)) if dims is None else [_axis(d, len(s)) for d in dims]
    return tuple(n for i, n in enumerate(s) if not (i in dims and n == 1))


_register("unsqueeze", lambda i, a: i[0].reshape(_unsqueeze_shape([i[0].shape], a)),
          lambda g, i, o, a: [g.reshape(i[0].shape)], _unsqueeze_shape, _free)
_register("squeeze", lambda i, a: i[0].reshape(_squeeze_shape([i[0].shape], a)),
          lambda g, i, o, a: [g.reshape(i[0].shape)], _squeeze_shape, _free)
_register("clone", lambda i, a: i[0].copy(), lambda g, i, o, a: [g], _same_shape, _free)
# torch's detach: the value passes, its gradient does not.
_register("detach", lambda i, a: i[0], lambda g, i, o, a: [None], _same_shape, _free)


def _cast_forward(inputs, attrs):
    return inputs[0].astype(attrs["dtype"])


def _cast_vjp(g, inputs, out, attrs):
    return [g.astype(inputs[0].dtype) if inputs[0].dtype.kind == "f" else None]


_register("cast", _cast_forward, _cast_vjp, _same_shape, _free)


# ---------------------------------------------------------------- masks and selection

_COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
            "gt": np.greater, "ge": np.greater_equal}


def _compare_forward(inputs, attrs):
    return _COMPARE[attrs["cmp"]](*_operands(inputs, attrs))


_register("compare", _compare_forward, lambda g, i, o, a: [None] * len(i), _binary_shape, _elementwise_cost(1))
_register("logical_not", lambda i, a: np.logical_not(i[0]), lambda g, i, o, a: [None], _same_shape,
          _elementwise_cost(1))


def _where_parts(inputs, attrs):
    """(cond, a, b): a and b from the inputs, or the `self_scalar` / `other_scalar` attributes."""
    it = iter(inputs[1:])
    dtype = next((t.dtype for t in inputs[1:]), np.float32)
    a = np.asarray(attrs["self_scalar"], dtype=dtype) if "self_scalar" in attrs else next(it)
    b = np.asarray(attrs["other_scalar"], dtype=dtype) if "other_scalar" in attrs else next(it)
    return inputs[0], a, b


def _where_vjp(g, inputs, out, attrs):
    cond = inputs[0]
    grads = [None]
    if "self_scalar" not in attrs:
        grads.append(unbroadcast(np.where(cond, g, 0).astype(g.dtype), inputs[len(grads)].shape))
    if "other_scalar" not in attrs:
        grads.append(unbroadcast(np.where(cond, 0, g).astype(g.dtype), inputs[len(grads)].shape))
    return grads


def _where_shape(shapes, attrs):
    return broadcast_shape(*shapes)


_register("where", lambda i, a: np.where(*_where_parts(i, a)), _where_vjp, _where_shape, _elementwise_cost(1),
          saves_inputs=(0,))


def _masked_fill_forward(inputs, attrs):
    x, mask = inputs[0], inputs[1]
    return np.where(mask, x.dtype.type(attrs["value"]), x)


def _masked_fill_vjp(g, inputs, out, attrs):
    return [unbroadcast(np.where(inputs[1], 0, g).astype(g.dtype), inputs[0].shape), None]


_register("masked_fill", _masked_fill_forward, _masked_fill_vjp, lambda s, a: broadcast_shape(s[0], s[1]),
          _elementwise_cost(1), saves_inputs=(1,))


# ---------------------------------------------------------------- reductions

def _reduce_axes(attrs, ndim):
    dims = attrs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(ndim))
    dims = [dims] if isinstance(dims, int) else dims
    return tuple(sorted(_axis(d, ndim) for d in dims))


def _reduce_shape(shapes, attrs):
    s = tuple(shapes[0])
    axes = _reduce_axes(attrs, len(s))
    if attrs.get("keepdim"):
        return tuple(1 if i in axes else n for i, n in enumerate(s))
    return tuple(n for i, n in enumerate(s) if i not in axes)


def _reduce_grad(g, x, attrs, scale):
    axes = _reduce_axes(attrs, x.ndim)
    if not attrs.get("keepdim"):
        g = np.expand_dims(g, axes)
    return np.broadcast_to(g * scale if scale != 1 else g, x.shape).astype(g.dtype)


def _mean_scale(x, attrs):
    return 1.0 / _numel([x.shape[a] for a in _reduce_axes(attrs, x.ndim)])


_register("sum", lambda i, a: np.asarray(i[0].sum(axis=_reduce_axes(a, i[0].ndim), keepdims=bool(a.get("keepdim")))),
          lambda g, i, o, a: [_reduce_grad(g, i[0], a, 1)], _reduce_shape,
          lambda s, out, a: _numel(s[0]))
_register("mean", lambda i, a: np.asarray(i[0].mean(axis=_reduce_axes(a, i[0].ndim),
                                                    keepdims=bool(a.get("keepdim")))),
          lambda g, i, o, a: [_reduce_grad(g, i[0], a, g.dtype.type(_mean_scale(i[0], a)))], _reduce_shape,
          lambda s, out, a: _numel(s[0]))


# ---------------------------------------------------------------- attention

@functools.lru_cache(maxsize=16)
def _causal_bias(lq: int, lk: int, dtype: np.dtype) -> np.ndarray:
    """[lq, lk]: 0 where query i may see key j (j <= i, torch's is_causal), -inf elsewhere.
    Added to the scores it gives what np.where(allowed, scores, -inf) gives (x + 0 = x,
    x + -inf = -inf for finite x) in one in-place pass, with no broadcast mask built per call."""
    bias = np.where(np.tril(np.ones((lq, lk), dtype=bool)), 0.0, -np.inf).astype(dtype)
    bias.flags.writeable = False
    return bias


def _sdpa_probs(inputs, attrs):
    """(softmax probabilities in a new array, scale). Heads as contiguous [..., T, d]
    blocks: numpy runs a stacked matmul as one BLAS call per head, and strided heads
    (a view of the packed projection) make each of them slower."""
    q, k = np.ascontiguousarray(inputs[0]), np.ascontiguousarray(inputs[1])
    scale = _sdpa_scale(q, attrs)
    scores = q @ _swap(k)
    scores *= scale
    mask = inputs[3] if len(inputs) > 3 else None
    if mask is not None and mask.dtype == bool:
        if not mask.all():    # an all-True mask (BERT's, of unpadded batches) changes nothing: no pass
            scores = np.where(mask, scores, -np.inf)
    elif mask is not None:
        scores = scores + mask
    if attrs.get("is_causal"):
        scores += _causal_bias(q.shape[-2], k.shape[-2], scores.dtype)
    return softmax(scores, -1).astype(q.dtype, copy=False), scale


def _sdpa_scale(q, attrs):
    return q.dtype.type(attrs.get("scale") or 1.0 / math.sqrt(q.shape[-1]))


def _sdpa_samples(inputs) -> int:
    """The batch size when every operand is per sample, so that attention cut by samples
    is the same computation (a float mask's gradient sums over samples: not then); else 0."""
    q, k, v = inputs[:3]
    mask = inputs[3] if len(inputs) > 3 else None
    if q.ndim < 3 or not q.ndim == k.ndim == v.ndim or not q.shape[0] == k.shape[0] == v.shape[0]:
        return 0
    if mask is not None and (mask.dtype != bool or mask.ndim != q.ndim):
        return 0
    return q.shape[0]


def _sdpa_by_samples(inputs, samples: int, rows) -> None:
    """rows(lo, hi) over the samples in parallel.py's fixed cut (attention never mixes them)."""
    q, k = inputs[:2]
    parallel.in_pieces(samples, rows, elements=samples * math.prod(q.shape[1:-1]) * k.shape[-2], align=1)


def _sdpa_rows(inputs, lo, hi):
    """The operands of samples lo:hi (a mask broadcast over the batch stays whole)."""
    return [t if i == 3 and t.shape[0] == 1 else t[lo:hi] for i, t in enumerate(inputs)]


def _sdpa_forward(inputs, attrs):
    return _sdpa_output(inputs, attrs, keep_probs=False)[0]


def _sdpa_and_probs(inputs, attrs):
    """(_sdpa_forward's output, the probabilities): a training step's forward, which keeps
    them for the backward (_sdpa_vjp_from_probs)."""
    return _sdpa_output(inputs, attrs, keep_probs=True)


def _sdpa_output(inputs, attrs, keep_probs: bool):
    """(the output, the probabilities when `keep_probs`, else None), a piece of the batch at
    a time where the operands allow (parallel.py)."""
    samples = _sdpa_samples(inputs)
    if not samples:
        probs, _ = _sdpa_probs(inputs, attrs)
        return probs @ np.ascontiguousarray(inputs[2]), probs if keep_probs else None
    q, v = inputs[0], inputs[2]
    out = np.empty((*q.shape[:-1], v.shape[-1]), np.result_type(q, inputs[1], v))
    kept = np.empty(_sdpa_probs_shape([t.shape for t in inputs], out.shape, attrs), q.dtype) if keep_probs else None

    def rows(lo, hi):
        part = _sdpa_rows(inputs, lo, hi)
        probs, _ = _sdpa_probs(part, attrs)
        if kept is not None:
            kept[lo:hi] = probs
        np.matmul(probs, np.ascontiguousarray(part[2]), out=out[lo:hi])
    _sdpa_by_samples(inputs, samples, rows)
    return out, kept


def _sdpa_probs_shape(shapes, out, attrs):
    batch = broadcast_shape(*(tuple(s)[:-2] for s in shapes[:2]), *(tuple(s)[:-2] for s in shapes[3:4]))
    return (*batch, int(shapes[0][-2]), int(shapes[1][-2]))


def _sdpa_vjp(g, inputs, out, attrs, probs=None):
    """_sdpa_vjp_whole, a piece of the batch at a time where the operands allow (parallel.py);
    from the probabilities the forward kept, when given."""
    samples = _sdpa_samples(inputs)
    if not samples:
        return _sdpa_vjp_whole(g, inputs, out, attrs, probs)
    grads = [np.empty(t.shape, np.result_type(g, t)) for t in inputs[:3]]

    def rows(lo, hi):
        kept = None if probs is None else probs[lo:hi]
        for whole, piece in zip(grads, _sdpa_vjp_whole(g[lo:hi], _sdpa_rows(inputs, lo, hi), None, attrs, kept)):
            whole[lo:hi] = piece
    _sdpa_by_samples(inputs, samples, rows)
    return grads + [None] * (len(inputs) > 3)


def _sdpa_vjp_from_probs(g, inputs, probs, attrs):
    return _sdpa_vjp(g, inputs, None, attrs, probs)


def _sdpa_vjp_whole(g, inputs, out, attrs, probs=None):
    """Recomputes the probabilities from q and k (flash-attention style) unless given.
    dscores = probs * (dprobs - rowsum(dprobs * probs)) * scale, in place on dprobs."""
    q, k, v = (np.ascontiguousarray(t) for t in inputs[:3])
    g = np.ascontiguousarray(g)
    if probs is None:
        probs, scale = _sdpa_probs([q, k, v, *inputs[3:]], attrs)
    else:
        scale = _sdpa_scale(q, attrs)
    dv = unbroadcast(_swap(probs) @ g, v.shape)
    dscores = g @ _swap(v)
    if not _softmax_grad_by_loops(dscores, probs, dscores, scale):
        dscores -= (dscores * probs).sum(axis=-1, keepdims=True)
        dscores *= probs
        dscores *= scale
    grads = [unbroadcast(dscores @ k, q.shape), unbroadcast(_swap(dscores) @ q, k.shape), dv]
    if len(inputs) > 3:
        mask = inputs[3]
        grads.append(None if mask.dtype == bool else unbroadcast(dscores / scale, mask.shape))
    return grads


def _sdpa_shape(shapes, attrs):
    q, k, v = (tuple(s) for s in shapes[:3])
    if q[-1] != k[-1] or k[-2] != v[-2]:
        raise OpError(f"scaled_dot_product_attention of q {q}, k {k}, v {v}")
    return (*broadcast_shape(q[:-2], k[:-2], v[:-2]), q[-2], v[-1])


def _sdpa_cost(shapes, out, attrs):
    q, k = shapes[0], shapes[1]
    return 2 * _numel(q) * int(k[-2]) + 2 * _numel(out) * int(k[-2]) + 5 * _numel((*q[:-1], k[-2]))


# As self_attention, a training step keeps the probabilities beside the inputs.
_register("scaled_dot_product_attention", _sdpa_forward, _sdpa_vjp, _sdpa_shape, _sdpa_cost,
          saves_inputs=(0, 1, 2, 3), residual=_sdpa_and_probs, residual_vjp=_sdpa_vjp_from_probs,
          residual_reads=(0, 1, 2, 3), residual_shape=_sdpa_probs_shape)


# ---------------------------------------------------------------- convolution and pooling

def _pair(v):
    return (int(v), int(v)) if isinstance(v, (int, np.integer)) else tuple(int(x) for x in (list(v) * 2)[:2]) \
        if len(v) == 1 else (int(v[0]), int(v[1]))


def _conv_geometry(attrs):
    return _pair(attrs.get("stride", 1)), _pair(attrs.get("padding", 0)), _pair(attrs.get("dilation", 1))


def _conv_groups(attrs, channels_in, channels_out) -> int:
    g = int(attrs.get("groups", 1))
    if g < 1 or channels_in % g or channels_out % g:
        raise OpError(f"conv2d with groups={g}: {channels_in} input and {channels_out} output channels "
                      "must both divide by it")
    return g


def _conv2d_forward(inputs, attrs):
    x, w = inputs[0], inputs[1]
    y = windows.conv2d(x, w, _conv_groups(attrs, x.shape[1], w.shape[0]), *_conv_geometry(attrs))
    if len(inputs) > 2 and inputs[2] is not None:
        y += inputs[2][None, :, None, None]
    return y


def _conv2d_vjp(g, inputs, out, attrs, wanted=(True, True, True)):
    """A first layer's input (the image) wants no gradient: its fold, the costliest part, is skipped."""
    x, w = inputs[0], inputs[1]
    dx, dw = windows.conv2d_vjp(g, x, w, _conv_groups(attrs, x.shape[1], w.shape[0]), *_conv_geometry(attrs),
                                input_grad=wanted[0])
    grads = [dx, dw if wanted[1] else None]
    if len(inputs) > 2:
        grads.append(g.sum(axis=(0, 2, 3)) if len(wanted) < 3 or wanted[2] else None)
    return grads


def _conv2d_shape(shapes, attrs):
    x, w = tuple(shapes[0]), tuple(shapes[1])
    if len(x) != 4 or len(w) != 4:
        raise OpError(f"conv2d of input {x} and weight {w}: expected [N, C, H, W] and [O, C/groups, kh, kw]")
    groups = _conv_groups(attrs, x[1], w[0])
    if x[1] != w[1] * groups:
        raise OpError(f"conv2d of input {x} and weight {w} with groups={groups}: expected [N, C, H, W] and "
                      "[O, C/groups, kh, kw]")
    stride, pad, dil = _conv_geometry(attrs)
    oh, ow = (windows.out_size(x[2 + d], w[2 + d], stride[d], pad[d], dil[d]) for d in (0, 1))
    if oh < 1 or ow < 1:
        raise OpError(f"conv2d of input {x} with kernel {w[2:]} leaves no output")
    return (x[0], w[0], oh, ow)


_register("conv2d", _conv2d_forward, _conv2d_vjp, _conv2d_shape,
          lambda s, out, a: 2 * _numel(out) * int(np.prod(s[1][1:])), saves_inputs=(0, 1), partial=True)


def _pool_geometry(attrs):
    k = _pair(attrs["kernel_size"])
    stride = _pair(attrs.get("stride") or k)
    if attrs.get("ceil_mode"):
        raise OpError("pooling with ceil_mode=True")
    return k, stride, _pair(attrs.get("padding", 0)), _pair(attrs.get("dilation", 1))


def _pool_shape(shapes, attrs):
    x = tuple(shapes[0])
    if len(x) != 4:
        raise OpError(f"pooling of an input {x}: expected [N, C, H, W]")
    k, stride, pad, dil = _pool_geometry(attrs)
    return (x[0], x[1], *(windows.out_size(x[2 + d], k[d], stride[d], pad[d], dil[d]) for d in (0, 1)))


def _max_pool_forward(inputs, attrs):
    k, stride, pad, dil = _pool_geometry(attrs)
    return windows.max_pool2d(inputs[0], k, stride, pad, dil)


def _max_pool_vjp(g, inputs, out, attrs):
    k, stride, pad, dil = _pool_geometry(attrs)
    return [windows.max_pool2d_vjp(g, inputs[0], out, k, stride, pad, dil)]


def _avg_pool_forward(inputs, attrs):
    k, stride, pad, dil = _pool_geometry(attrs)
    if not attrs.get("count_include_pad", True) and pad != (0, 0):
        raise OpError("avg_pool2d with count_include_pad=False and padding")
    return windows.avg_pool2d(inputs[0], k, stride, pad)


def _avg_pool_vjp(g, inputs, out, attrs):
    k, stride, pad, _ = _pool_geometry(attrs)
    return [windows.avg_pool2d_vjp(g, inputs[0].shape, k, stride, pad)]


_register("max_pool2d", _max_pool_forward, _max_pool_vjp, _pool_shape,
          lambda s, out, a: _numel(out) * int(np.prod(_pair(a["kernel_size"]))), saves_inputs=(0,),
          saves_output=True)
_register("avg_pool2d", _avg_pool_forward, _avg_pool_vjp, _pool_shape,
          lambda s, out, a: _numel(out) * int(np.prod(_pair(a["kernel_size"]))))


# ---------------------------------------------------------------- losses

def _counted(target, attrs):
    return target != attrs.get("ignore_index", kernels.IGNORE_INDEX)


def _class_axis_last(x):
    """[N, C, d1...] -> [N*d1*..., C] (torch puts classes on axis 1)."""
    return np.moveaxis(x, 1, -1).reshape(-1, x.shape[1]) if x.ndim > 2 else x


def _nll_forward(logp, target, attrs):
    flat, lab = _class_axis_last(logp), target.reshape(-1)
    counted = _counted(lab, attrs)
    safe = np.where(counted, lab, 0)
    if np.any(counted & ((lab < 0) | (lab >= flat.shape[1]))):
        raise OpError(f"targets outside [0, {flat.shape[1]}) (and not the ignore index)")
    picked = -flat[np.arange(len(lab)), safe] * counted
    if attrs.get("reduction", "mean") == "none":     # each target's loss, in the targets' shape
        return picked.reshape(target.shape).astype(logp.dtype, copy=False)
    if attrs.get("reduction", "mean") == "sum":
        return np.asarray(picked.sum(), dtype=logp.dtype)
    return np.asarray(picked.sum() / max(int(counted.sum()), 1), dtype=logp.dtype)


def _nll_dflat(g, logp, target, attrs):
    """d loss / d (flattened log-probabilities) for an upstream gradient g: a scalar, or with
    reduction "none" one per target."""
    flat, lab = _class_axis_last(logp), target.reshape(-1)
    counted = _counted(lab, attrs)
    reduction = attrs.get("reduction", "mean")
    if reduction == "none":
        upstream = np.asarray(g, dtype=logp.dtype).reshape(-1)
    else:
        scale = 1.0 if reduction == "sum" else 1.0 / max(int(counted.sum()), 1)
        upstream = g * logp.dtype.type(scale)
    d = np.zeros_like(flat)
    rows = np.arange(len(lab))
    d[rows, np.where(counted, lab, 0)] = np.where(counted, -upstream, 0)
    return d


def _unflatten_classes(d, like):
    if like.ndim <= 2:
        return d.reshape(like.shape)
    moved = (like.shape[0], *like.shape[2:], like.shape[1])
    return np.moveaxis(d.reshape(moved), -1, 1)


def _loss_shape(shapes, attrs):
    if attrs.get("reduction", "mean") not in ("mean", "sum", "none"):
        raise OpError(f"loss reduction {attrs['reduction']!r} (only mean, sum and none)")
    x, t = tuple(shapes[0]), tuple(shapes[1])
    if len(x) < 2 or (x[0],) + x[2:] != t:
        raise OpError(f"class scores {x} and targets {t}: expected [N, C, ...] and [N, ...]")
    return t if attrs.get("reduction", "mean") == "none" else ()


_register("nll_loss", lambda i, a: _nll_forward(i[0], i[1], a),
          lambda g, i, o, a: [_unflatten_classes(_nll_dflat(g, i[0], i[1], a), i[0]), None], _loss_shape,
          lambda s, out, a: _numel(s[1]), saves_inputs=(1,))


def _ce_logp(x):
    return _unflatten_classes(log_softmax(_class_axis_last(x), -1), x)


def _ce_vjp(g, inputs, out, attrs):
    return _ce_vjp_from_logp(g, inputs, _ce_logp(inputs[0]), attrs)


# In a training step the forward keeps its log-probabilities (the scores' size) as the residual,
# so the backward does not compute log_softmax again: a language model's scores are its
# largest activation (GPT-2's, vocabulary 1024: 1M floats a batch of 8).

def _ce_and_logp(inputs, attrs):
    logp = _ce_logp(inputs[0])
    return _nll_forward(logp, inputs[1], attrs), logp


def _ce_vjp_from_logp(g, inputs, logp, attrs):
    d = _nll_dflat(g, logp, inputs[1], attrs)
    dx = np.exp(_class_axis_last(logp))
    dx *= d.sum(axis=-1, keepdims=True)
    np.subtract(d, dx, out=dx)     # d - p * sum(d), in p's array
    return [_unflatten_classes(dx, logp), None]


_register("cross_entropy", lambda i, a: _nll_forward(_ce_logp(i[0]), i[1], a), _ce_vjp, _loss_shape,
          lambda s, out, a: 6 * _numel(s[0]), saves_inputs=(0, 1), residual=_ce_and_logp,
          residual_vjp=_ce_vjp_from_logp, residual_reads=(1,), residual_shape=lambda s, out, a: tuple(s[0]))


def _classifier_loss_shape(shapes, attrs):
    x, t, context = (tuple(s) for s in shapes)
    if len(x) != 2 or t != x[:1] or context != (6,):
        raise OpError(f"class scores {x}, labels {t} and context {context}: expected [N, C], [N] and [6]")
    return ()


def _classifier_loss_forward(inputs, attrs):
    """A built-in classifier's loss (kernels.softmax_cross_entropy): this shard's share of
    the global batch's mean, in float64 as the loss is reported. inputs[2] is the run's
    context (dropout_mask's); its global batch divides the summed loss and the gradient."""
    logits, labels, context = inputs
    return np.asarray(kernels.softmax_cross_entropy(logits, labels, int(context[4]))[0])


def _classifier_loss_vjp(g, inputs, out, attrs):
    logits, labels, context = inputs
    dlogits = kernels.softmax_cross_entropy(logits, labels, int(context[4]))[1]
    return [dlogits * logits.dtype.type(g), None, None]   # g: 1, or the loss scale (a power of 2)


def _classifier_loss_and_delta(inputs, attrs):
    """The loss and, as its residual, d loss / d logits: the kernel makes both at once, so
    the backward does not compute the softmax again. The residual is in the loss's float64
    (a residual has its output's dtype), which holds the scores' dtype exactly."""
    logits, labels, context = inputs
    loss, dlogits, _ = kernels.softmax_cross_entropy(logits, labels, int(context[4]))
    return np.asarray(loss), dlogits.astype(np.float64)


def _classifier_loss_vjp_from_delta(g, inputs, dlogits, attrs):
    dtype = inputs[0].dtype.type   # a stand-in of the scores: their shape and dtype
    return [dlogits.astype(dtype) * dtype(g), None, None]   # the bits of _classifier_loss_vjp's


_register("softmax_cross_entropy", _classifier_loss_forward, _classifier_loss_vjp, _classifier_loss_shape,
          lambda s, out, a: 6 * _numel(s[0]), saves_inputs=(0, 1, 2), residual=_classifier_loss_and_delta,
          residual_vjp=_classifier_loss_vjp_from_delta, residual_shape=lambda s, out, a: tuple(s[0]))


def _mse_forward(inputs, attrs):
    d = inputs[0] - inputs[1]
    total = (d * d).sum()
    return np.asarray(total if attrs.get("reduction", "mean") == "sum" else total / d.size, dtype=d.dtype)


def _mse_vjp(g, inputs, out, attrs):
    d = inputs[0] - inputs[1]
    scale = 2.0 if attrs.get("reduction", "mean") == "sum" else 2.0 / d.size
    gd = d * (g * d.dtype.type(scale))
    return [unbroadcast(gd, inputs[0].shape), unbroadcast(-gd, inputs[1].shape)]


def _mse_shape(shapes, attrs):
    broadcast_shape(shapes[0], shapes[1])
    return ()


_register("mse_loss", _mse_forward, _mse_vjp, _mse_shape, lambda s, out, a: 3 * _numel(s[0]),
          saves_inputs=(0, 1))


# ---------------------------------------------------------------- gradient accumulation

def _add_n_forward(inputs, attrs):
    """((x0 + x1) + x2) + ..., adding into one new array where the shapes and dtypes allow."""
    total = inputs[0] + inputs[1] if len(inputs) > 1 else inputs[0].copy()
    for x in inputs[2:]:
        if np.broadcast_shapes(total.shape, x.shape) == total.shape and np.result_type(total, x) == total.dtype:
            total += x
        else:
            total = total + x
    return total


_register("add_n", _add_n_forward, lambda g, i, o, a: [g] * len(i),
          lambda s, a: broadcast_shape(*s), _elementwise_cost(1))


# ================================================================ torch's Core ATen ops
# What torch.export(...).run_decompositions() leaves in a model written by others
# (transformers, torchvision, timm) beyond the ops above: elementwise maths, the
# comparisons' logical combinations, reductions, joins and picks, padding, batch
# norm. docs/torch.md counts them against torch's list; tests/test_ops.py checks
# each against torch.autograd and central differences.

# ---------------------------------------------------------------- unary maths

def _unary(name, fn, slope=None, reads="x", cost=2):
    """An elementwise op: forward fn(x); the vjp g * slope(x, out) (slope None: the op
    is flat almost everywhere, as floor or sign, and torch's gradient is zero).
    `reads`: what slope reads, "x" or "out" (what backward keeps)."""
    if slope is None:
        vjp = lambda g, i, o, a: [np.zeros_like(g)]   # noqa: E731
    else:
        vjp = lambda g, i, o, a: [g * slope(i[0], o)]   # noqa: E731
    _register(name, lambda i, a: np.asarray(fn(i[0])), vjp, _same_shape, _elementwise_cost(cost),
              saves_output=slope is not None and reads == "out",
              saves_inputs=(0,) if slope is not None and reads == "x" else ())


_LN2, _LN10 = math.log(2.0), math.log(10.0)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)

_unary("abs", np.abs, lambda x, o: np.sign(x), cost=1)
_unary("exp", np.exp, lambda x, o: o, reads="out")
_unary("expm1", np.expm1, lambda x, o: o + 1, reads="out")
_unary("log", np.log, lambda x, o: 1 / x)
_unary("log1p", np.log1p, lambda x, o: 1 / (1 + x))
_unary("log2", np.log2, lambda x, o: 1 / (x * x.dtype.type(_LN2)))
_unary("log10", np.log10, lambda x, o: 1 / (x * x.dtype.type(_LN10)))
_unary("sqrt", np.sqrt, lambda x, o: 0.5 / o, reads="out")
_unary("rsqrt", lambda x: 1 / np.sqrt(x), lambda x, o: -0.5 * o * o * o, reads="out")
_unary("reciprocal", lambda x: 1 / x, lambda x, o: -o * o, reads="out")
_unary("sin", np.sin, lambda x, o: np.cos(x))
_unary("cos", np.cos, lambda x, o: -np.sin(x))
_unary("tan", np.tan, lambda x, o: 1 + o * o, reads="out")
_unary("sinh", np.sinh, lambda x, o: np.cosh(x))
_unary("cosh", np.cosh, lambda x, o: np.sinh(x))
_unary("asin", np.arcsin, lambda x, o: 1 / np.sqrt(1 - x * x))
_unary("acos", np.arccos, lambda x, o: -1 / np.sqrt(1 - x * x))
_unary("atan", np.arctan, lambda x, o: 1 / (1 + x * x))
_unary("asinh", np.arcsinh, lambda x, o: 1 / np.sqrt(x * x + 1))
_unary("acosh", np.arccosh, lambda x, o: 1 / np.sqrt(x * x - 1))
_unary("atanh", np.arctanh, lambda x, o: 1 / (1 - x * x))
_unary("erf", lambda x: _erf_array(x) if x.dtype.kind == "f" else _erf_array(x.astype(np.float32)),
       lambda x, o: x.dtype.type(_TWO_OVER_SQRT_PI) * np.exp(-x * x), cost=10)
_unary("sign", np.sign, cost=1)
_unary("floor", np.floor, cost=1)
_unary("ceil", np.ceil, cost=1)
_unary("round", np.round, cost=1)       # half to even, as torch
_unary("trunc", np.trunc, cost=1)


def _no_grad(g, inputs, out, attrs):
    return [None] * len(inputs)


_register("isnan", lambda i, a: np.isnan(i[0]), _no_grad, _same_shape, _elementwise_cost(1))
_register("isinf", lambda i, a: np.isinf(i[0]), _no_grad, _same_shape, _elementwise_cost(1))


# ---------------------------------------------------------------- activations torch keeps whole

def _clamp_bounds(x, attrs):
    lo, hi = attrs.get("min"), attrs.get("max")
    return (None if lo is None else x.dtype.type(lo)), (None if hi is None else x.dtype.type(hi))


def _clamp_forward(inputs, attrs):
    lo, hi = _clamp_bounds(inputs[0], attrs)
    if lo is None and hi is None:
        raise OpError("clamp with neither min nor max")
    return np.clip(inputs[0], lo, hi)


def _clamp_vjp(g, inputs, out, attrs):
    """torch's: the gradient passes where min <= x <= max (both ends included)."""
    x = inputs[0]
    lo, hi = _clamp_bounds(x, attrs)
    keep = x >= lo if lo is not None else None
    if hi is not None:
        keep = x <= hi if keep is None else np.logical_and(keep, x <= hi, out=keep)
    return [np.where(keep, g, g.dtype.type(0)).astype(g.dtype, copy=False)]


_register("clamp", _clamp_forward, _clamp_vjp, _same_shape, _elementwise_cost(2), saves_inputs=(0,))


def _leaky_relu_vjp(g, inputs, out, attrs):
    slope = g.dtype.type(attrs.get("negative_slope", 0.01))
    return [np.where(inputs[0] > 0, g, g * slope)]


_register("leaky_relu",
          lambda i, a: np.where(i[0] > 0, i[0], i[0] * i[0].dtype.type(a.get("negative_slope", 0.01))),
          _leaky_relu_vjp, _same_shape, _elementwise_cost(2), saves_inputs=(0,))


def _elu_parts(x, attrs):
    return (x.dtype.type(attrs.get(k, 1.0)) for k in ("alpha", "scale", "input_scale"))


def _elu_forward(inputs, attrs):
    x = inputs[0]
    alpha, scale, input_scale = _elu_parts(x, attrs)
    return np.where(x > 0, x * scale, alpha * scale * np.expm1(x * input_scale))


def _elu_vjp(g, inputs, out, attrs):
    x = inputs[0]
    alpha, scale, input_scale = _elu_parts(x, attrs)
    return [np.where(x > 0, g * scale, g * alpha * scale * input_scale * np.exp(x * input_scale))]


_register("elu", _elu_forward, _elu_vjp, _same_shape, _elementwise_cost(4), saves_inputs=(0,))


# ---------------------------------------------------------------- binary maths

def _power(a, b):
    """a ** b; a small whole scalar exponent as products, as torch's kernel computes x ** 2 and x ** 3
    (the same bits, and a float32 powf an element costs far more: GPT-2's gelu_new cubes every activation).
    16-bit arrays keep np.power's one rounding."""
    if b.ndim == 0 and float(b) in (1.0, 2.0, 3.0) and a.dtype in (np.float32, np.float64):
        whole = int(b)
        return a.copy() if whole == 1 else a * a if whole == 2 else a * a * a
    return np.power(a, b)


def _pow_vjp(g, inputs, out, attrs):
    a, b = _operands(inputs, attrs)
    ga = g * b * _power(a, b - 1) if not ("scalar" in attrs and attrs.get("reverse")) else None
    gb = None
    if "scalar" not in attrs or attrs.get("reverse"):
        with np.errstate(divide="ignore", invalid="ignore"):
            gb = np.where((a == 0) & (b >= 0), 0, g * out * np.log(a)).astype(g.dtype)
    return _binary_grads(ga, gb, inputs, attrs)


_register("pow", lambda i, a: _power(*_operands(i, a)), _pow_vjp, _binary_shape, _elementwise_cost(10),
          saves_inputs=(0, 1), saves_output=True)


def _extremum(np_fn, chosen):
    """maximum / minimum: the gradient to the operand chosen, halved on a tie (torch's)."""
    def vjp(g, inputs, out, attrs):
        a, b = _operands(inputs, attrs)
        tie = a == b
        half = g * g.dtype.type(0.5)
        ga = np.where(tie, half, np.where(chosen(a, b), g, 0)).astype(g.dtype)
        gb = np.where(tie, half, np.where(chosen(a, b), 0, g)).astype(g.dtype)
        return _binary_grads(ga, gb, inputs, attrs)
    return lambda i, a: np_fn(*_operands(i, a)), vjp


for _name, _fn, _chosen in (("maximum", np.maximum, np.greater), ("minimum", np.minimum, np.less)):
    _register(_name, *_extremum(_fn, _chosen), _binary_shape, _elementwise_cost(1), saves_inputs=(0, 1))


def _atan2_vjp(g, inputs, out, attrs):
    a, b = _operands(inputs, attrs)
    d = g / (a * a + b * b)
    return _binary_grads(d * b, -d * a, inputs, attrs)


_register("atan2", lambda i, a: np.arctan2(*_operands(i, a)), _atan2_vjp, _binary_shape, _elementwise_cost(10),
          saves_inputs=(0, 1))


def _rounded_quotient_vjp(rounding):
    """fmod (the quotient truncated) and remainder (floored): d/da 1, d/db -round(a / b)."""
    def vjp(g, inputs, out, attrs):
        a, b = _operands(inputs, attrs)
        return _binary_grads(g, -g * rounding(a / b), inputs, attrs)
    return vjp


_register("fmod", lambda i, a: np.fmod(*_operands(i, a)), _rounded_quotient_vjp(np.trunc), _binary_shape,
          _elementwise_cost(2), saves_inputs=(0, 1))
_register("remainder", lambda i, a: np.remainder(*_operands(i, a)), _rounded_quotient_vjp(np.floor),
          _binary_shape, _elementwise_cost(2), saves_inputs=(0, 1))


def _logical_operands(inputs, attrs):
    a, b = _operands(inputs, attrs)
    return np.asarray(a), np.asarray(b)


# torch's bitwise ops on bool are the logical ones; on integers, bitwise.
for _name, _fn in (("logical_and", np.logical_and), ("logical_or", np.logical_or),
                   ("logical_xor", np.logical_xor), ("bitwise_and", np.bitwise_and),
                   ("bitwise_or", np.bitwise_or), ("bitwise_xor", np.bitwise_xor)):
    _register(_name, (lambda fn: lambda i, a: fn(*_logical_operands(i, a)))(_fn), _no_grad, _binary_shape,
              _elementwise_cost(1))


# ---------------------------------------------------------------- reductions torch keeps

def _extreme_reduce(np_fn):
    """amax / amin over dims (all with dim None or []); the gradient is shared evenly
    among the elements that reach the extreme (torch's amax rule)."""
    def forward(inputs, attrs):
        x = inputs[0]
        return np.asarray(np_fn(x, axis=_reduce_axes(attrs, x.ndim), keepdims=bool(attrs.get("keepdim"))))

    def vjp(g, inputs, out, attrs):
        x = inputs[0]
        axes = _reduce_axes(attrs, x.ndim)
        if not attrs.get("keepdim"):
            g, out = np.expand_dims(g, axes), np.expand_dims(out, axes)
        hit = x == out
        return [np.where(hit, g / hit.sum(axis=axes, keepdims=True), 0).astype(g.dtype)]
    return forward, vjp


_register("amax", *_extreme_reduce(np.max), _reduce_shape, lambda s, out, a: _numel(s[0]),
          saves_inputs=(0,), saves_output=True)
_register("amin", *_extreme_reduce(np.min), _reduce_shape, lambda s, out, a: _numel(s[0]),
          saves_inputs=(0,), saves_output=True)


def _arg_extreme(np_fn):
    def forward(inputs, attrs):
        x, dim = inputs[0], attrs.get("dim")
        if dim is None:
            return np.asarray(np_fn(x.reshape(-1)), dtype=np.int64)
        axis = _axis(dim, x.ndim)
        out = np_fn(x, axis=axis).astype(np.int64)
        return np.expand_dims(out, axis) if attrs.get("keepdim") else out
    return forward


def _arg_shape(shapes, attrs):
    return () if attrs.get("dim") is None else _reduce_shape(shapes, {**attrs, "dim": [attrs["dim"]]})


_register("argmax", _arg_extreme(np.argmax), _no_grad, _arg_shape, lambda s, out, a: _numel(s[0]))
_register("argmin", _arg_extreme(np.argmin), _no_grad, _arg_shape, lambda s, out, a: _numel(s[0]))


def _picked_extreme(np_arg):
    """max.dim / min.dim's values: the gradient goes to the element its index names (the first)."""
    def forward(inputs, attrs):
        x, axis = inputs[0], _axis(attrs["dim"], inputs[0].ndim)
        idx = np.expand_dims(np_arg(x, axis=axis), axis)
        out = np.take_along_axis(x, idx, axis=axis)
        return out if attrs.get("keepdim") else np.squeeze(out, axis)

    def vjp(g, inputs, out, attrs):
        x, axis = inputs[0], _axis(attrs["dim"], inputs[0].ndim)
        idx = np.expand_dims(np_arg(x, axis=axis), axis)
        dx = np.zeros(x.shape, dtype=g.dtype)
        np.put_along_axis(dx, idx, g if attrs.get("keepdim") else np.expand_dims(g, axis), axis=axis)
        return [dx]
    return forward, vjp


_register("max_dim", *_picked_extreme(np.argmax), lambda s, a: _reduce_shape(s, {**a, "dim": [a["dim"]]}),
          lambda s, out, a: _numel(s[0]), saves_inputs=(0,))
_register("min_dim", *_picked_extreme(np.argmin), lambda s, a: _reduce_shape(s, {**a, "dim": [a["dim"]]}),
          lambda s, out, a: _numel(s[0]), saves_inputs=(0,))
_register("any", lambda i, a: np.asarray(np.any(i[0], axis=_reduce_axes(a, i[0].ndim),
                                                keepdims=bool(a.get("keepdim")))),
          _no_grad, _reduce_shape, lambda s, out, a: _numel(s[0]))


def _var_count(x, attrs):
    return _numel([x.shape[a] for a in _reduce_axes(attrs, x.ndim)]) - float(attrs.get("correction", 1))


def _var_forward(inputs, attrs):
    x = inputs[0]
    axes = _reduce_axes(attrs, x.ndim)
    d = x - x.mean(axis=axes, keepdims=True)
    return np.asarray((d * d).sum(axis=axes, keepdims=bool(attrs.get("keepdim"))) / x.dtype.type(_var_count(x, attrs)))


def _var_vjp(g, inputs, out, attrs):
    x = inputs[0]
    axes = _reduce_axes(attrs, x.ndim)
    if not attrs.get("keepdim"):
        g = np.expand_dims(g, axes)
    d = x - x.mean(axis=axes, keepdims=True)
    return [g * d * x.dtype.type(2.0 / _var_count(x, attrs))]


_register("var", _var_forward, _var_vjp, _reduce_shape, lambda s, out, a: 3 * _numel(s[0]), saves_inputs=(0,))


def _prod_vjp(g, inputs, out, attrs):
    """The product of the others, per element (exact with zeros: no division)."""
    x = inputs[0]
    axes = _reduce_axes(attrs, x.ndim)
    if not attrs.get("keepdim"):
        g = np.expand_dims(g, axes)
    moved = np.moveaxis(x, axes, tuple(range(x.ndim - len(axes), x.ndim)))
    flat = moved.reshape(*moved.shape[:x.ndim - len(axes)], -1)
    ones = np.ones_like(flat[..., :1])
    before = np.cumprod(np.concatenate([ones, flat[..., :-1]], axis=-1), axis=-1)
    after = np.flip(np.cumprod(np.flip(np.concatenate([flat[..., 1:], ones], axis=-1), -1), axis=-1), -1)
    others = np.moveaxis((before * after).reshape(moved.shape), tuple(range(x.ndim - len(axes), x.ndim)), axes)
    return [g * others]


_register("prod", lambda i, a: np.asarray(np.prod(i[0], axis=_reduce_axes(a, i[0].ndim),
                                                  keepdims=bool(a.get("keepdim")))),
          _prod_vjp, _reduce_shape, lambda s, out, a: _numel(s[0]), saves_inputs=(0,))


def _cumsum_vjp(g, inputs, out, attrs):
    axis = _axis(attrs["dim"], g.ndim)
    return [np.flip(np.cumsum(np.flip(g, axis), axis=axis), axis)]


_register("cumsum", lambda i, a: np.cumsum(i[0], axis=_axis(a["dim"], i[0].ndim)), _cumsum_vjp, _same_shape,
          _elementwise_cost(1))


# ---------------------------------------------------------------- joins, picks and padding

def _cat_shape(shapes, attrs):
    shapes = [tuple(s) for s in shapes]
    first = shapes[0]
    axis = _axis(attrs.get("dim", 0), len(first))
    for s in shapes[1:]:
        if len(s) != len(first) or any(n != m for i, (n, m) in enumerate(zip(s, first)) if i != axis):
            raise OpError(f"cat of shapes {shapes} along dim {attrs.get('dim', 0)}")
    return (*first[:axis], sum(s[axis] for s in shapes), *first[axis + 1:])


def _cat_vjp(g, inputs, out, attrs):
    axis = _axis(attrs.get("dim", 0), g.ndim)
    cuts = np.cumsum([x.shape[axis] for x in inputs])[:-1]
    return [piece if x.dtype.kind == "f" else None for x, piece in zip(inputs, np.split(g, cuts, axis=axis))]


_register("cat", lambda i, a: np.concatenate(i, axis=_axis(a.get("dim", 0), i[0].ndim)), _cat_vjp, _cat_shape,
          _free)


def _select_index(attrs, ndim, size):
    axis = _axis(attrs["dim"], ndim)
    index = int(attrs["index"])
    if not -size <= index < size:
        raise OpError(f"select index {index} out of range for dim {attrs['dim']} of size {size}")
    return (slice(None),) * axis + (index % size,)


def _select_vjp(g, inputs, out, attrs):
    x = inputs[0]
    dx = np.zeros(x.shape, dtype=g.dtype)
    dx[_select_index(attrs, x.ndim, x.shape[_axis(attrs["dim"], x.ndim)])] = g
    return [dx]


def _select_shape(shapes, attrs):
    s = tuple(shapes[0])
    index = _select_index(attrs, len(s), s[_axis(attrs["dim"], len(s))])
    return s[:len(index) - 1] + s[len(index):]


_register("select", lambda i, a: i[0][_select_index(a, i[0].ndim, i[0].shape[_axis(a["dim"], i[0].ndim)])],
          _select_vjp, _select_shape, _free)


def _pad_widths(ndim, attrs):
    """torch's pad list (last dim first, (before, after) pairs) as numpy's per-dim widths."""
    pad = list(attrs["pad"])
    if len(pad) % 2 or len(pad) // 2 > ndim:
        raise OpError(f"pad {pad} for a tensor of {ndim} dims")
    if any(p < 0 for p in pad):
        raise OpError(f"pad {pad}: negative padding (cropping) is not supported")
    widths = [(0, 0)] * ndim
    for i in range(len(pad) // 2):
        widths[ndim - 1 - i] = (int(pad[2 * i]), int(pad[2 * i + 1]))
    return widths


def _pad_vjp(g, inputs, out, attrs):
    widths = _pad_widths(g.ndim, attrs)
    return [g[tuple(slice(lo, n - hi) for (lo, hi), n in zip(widths, g.shape))]]


_register("constant_pad_nd",
          lambda i, a: np.pad(i[0], _pad_widths(i[0].ndim, a), constant_values=a.get("value", 0)),
          _pad_vjp, lambda s, a: tuple(n + lo + hi for n, (lo, hi) in zip(s[0], _pad_widths(len(s[0]), a))),
          _free)


def _index_key(inputs, attrs):
    """torch's x[i0, i1, ...] with index tensors at `dims` (None elsewhere): numpy's
    advanced indexing has the same meaning (non-adjacent index dims go first)."""
    dims = attrs["dims"]
    key = [slice(None)] * (max(dims) + 1)
    for d, index in zip(dims, inputs[1:]):
        if index.dtype == bool:
            raise OpError("index with a boolean mask (a data-dependent shape)")
        key[d] = index
    return tuple(key)


def _index_vjp(g, inputs, out, attrs):
    dx = np.zeros(inputs[0].shape, dtype=g.dtype)
    np.add.at(dx, _index_key(inputs, attrs), g)
    return [dx] + [None] * (len(inputs) - 1)


def _index_shape(shapes, attrs):
    x, dims = tuple(shapes[0]), list(attrs["dims"])
    if len(shapes) - 1 != len(dims) or max(dims) >= len(x):
        raise OpError(f"index of a {x} tensor at dims {dims} with {len(shapes) - 1} index tensors")
    picked = broadcast_shape(*shapes[1:])
    adjacent = dims == list(range(dims[0], dims[0] + len(dims)))
    rest = [n for i, n in enumerate(x) if i not in dims]
    if adjacent:
        return (*x[:dims[0]], *picked, *x[dims[-1] + 1:])
    return (*picked, *rest)


_register("index", lambda i, a: i[0][_index_key(i, a)], _index_vjp, _index_shape, _free,
          saves_inputs=tuple(range(1, 9)))


def _index_select_vjp(g, inputs, out, attrs):
    x, index = inputs
    axis = _axis(attrs["dim"], x.ndim)
    dx = np.zeros(x.shape, dtype=g.dtype)
    np.add.at(dx, (slice(None),) * axis + (index,), g)
    return [dx, None]


def _index_select_shape(shapes, attrs):
    s = list(shapes[0])
    s[_axis(attrs["dim"], len(s))] = _numel(shapes[1])
    return tuple(s)


_register("index_select", lambda i, a: np.take(i[0], i[1], axis=_axis(a["dim"], i[0].ndim)), _index_select_vjp,
          _index_select_shape, _free, saves_inputs=(1,))


def _flip_axes(attrs, ndim):
    return tuple(_axis(d, ndim) for d in attrs["dims"])


_register("flip", lambda i, a: np.flip(i[0], _flip_axes(a, i[0].ndim)),
          lambda g, i, o, a: [np.flip(g, _flip_axes(a, g.ndim))], _same_shape, _free)


def _repeat_shape(shapes, attrs):
    s, reps = tuple(shapes[0]), list(attrs["repeats"])
    if len(reps) < len(s):
        raise OpError(f"repeat {reps} of a tensor of {len(s)} dims")
    s = (1,) * (len(reps) - len(s)) + s
    return tuple(n * r for n, r in zip(s, reps))


def _repeat_vjp(g, inputs, out, attrs):
    x, reps = inputs[0], list(attrs["repeats"])
    shape = (1,) * (len(reps) - x.ndim) + x.shape
    tiled = g.reshape([v for n, r in zip(shape, reps) for v in (r, n)])
    return [tiled.sum(axis=tuple(range(0, 2 * len(reps), 2))).reshape(x.shape)]


_register("repeat", lambda i, a: np.tile(i[0], a["repeats"]), _repeat_vjp, _repeat_shape, _free)


# ---------------------------------------------------------------- batch norm

def _bn_axes(x):
    if x.ndim < 2:
        raise OpError(f"batch_norm of a {x.ndim}-d input: expected [N, C, ...]")
    return (0, *range(2, x.ndim))


def _bn_channel(v, ndim):
    """A per-channel [C] vector shaped to broadcast against [N, C, ...]."""
    return v.reshape(-1, *([1] * (ndim - 2)))


def _bn_training(inputs, attrs) -> bool:
    """Whether the batch's statistics normalize: attrs["training"], or for a layer that
    keeps running statistics (attrs["running"]) the train flag of the run's context
    (input 5, [seed, step, row_start, row_stop, global_batch, train]): an eval step
    normalizes by the running statistics, as torch's module in eval mode."""
    if attrs.get("running"):
        return bool(inputs[5][5])
    return bool(attrs.get("training"))


def _bn_batch_moments(x, reduce=None):
    """The batch's mean and biased variance per channel (keepdims), and the values per channel
    they are over, in float64: torch's kernel accumulates them in double, and where a channel's
    values sit close together (a small variance beside a large mean: a deep network's last,
    smallest feature maps) float32 sums would lose the digits its gradient divides by the
    standard deviation. With `reduce` (a synchronized batch norm on one of several shards) the
    sums are the whole batch's: the count and the sums, then the squared deviations from the
    whole batch's mean, each summed over the shards (two passes, as on one)."""
    axes = _bn_axes(x)
    wide = x.astype(np.float64)
    n = x.size // x.shape[1]
    total = wide.sum(axis=axes, keepdims=True)
    if reduce is not None:
        summed = reduce(np.concatenate([[float(n)], total.reshape(-1)]))
        n, total = summed[0], summed[1:].reshape(total.shape)
    mean = total / n
    d = wide - mean
    squares = (d * d).sum(axis=axes, keepdims=True)
    if reduce is not None:
        squares = reduce(squares.reshape(-1)).reshape(squares.shape)
    return mean, squares / n, n


def _bn_sync(attrs, reduce):
    """The reduce a batch norm's statistics are summed with: the shard's for a synchronized one
    (SyncBatchNorm, attrs["sync"]), None (this shard's own rows) for the others."""
    return reduce if attrs.get("sync") else None


def _bn_stats(inputs, attrs, reduce=None):
    """(mean, rstd, x - mean, n): per channel [C], the batch's (training: the biased variance torch
    normalizes by, in float64 as _bn_batch_moments, and x centred in float64; synchronized
    over the shards with `reduce`) or the running statistics (inputs 3 and 4, eval; in x's
    dtype), x centred on the mean (a new array, which the caller may overwrite), and the values
    per channel the statistics are over."""
    x = inputs[0]
    if _bn_training(inputs, attrs):
        mean, var, n = _bn_batch_moments(x, reduce)
        centred = x.astype(np.float64) - mean
        return mean.reshape(-1), 1 / np.sqrt(var.reshape(-1) + attrs.get("eps", 1e-5)), centred, n
    eps = x.dtype.type(attrs.get("eps", 1e-5))
    mean, var = inputs[3], inputs[4]
    return mean, (1 / np.sqrt(var + eps)).astype(x.dtype), x - _bn_channel(mean, x.ndim), x.size // x.shape[1]


def _bn_forward(inputs, attrs, reduce=None):
    """y = (x - mean) * (rstd * weight) + bias: the per-channel factors first, then two passes over x."""
    x, w, b = inputs[:3]
    _, rstd, y, _ = _bn_stats(inputs, attrs, _bn_sync(attrs, reduce))
    y *= _bn_channel(rstd * w, x.ndim)
    y += _bn_channel(b, x.ndim)
    return y.astype(x.dtype, copy=False)


def _bn_vjp(g, inputs, out, attrs, reduce=None):
    """With A = rstd * weight per channel, n values a channel, d = x - mean:
    training (through the batch statistics) dx = A * (g - sum(g) / n - d * rstd^2 * sum(g * d) / n),
    eval (the statistics are constants) dx = A * g; dweight = rstd * sum(g * d), dbias = sum(g).
    Per-channel factors first, then whole-array passes (no x-hat is made). Running statistics get none.
    Synchronized (`reduce`): dx's two sums and n are the whole batch's, as its statistics are;
    dweight and dbias stay this shard's (SwarmX sums them with every other gradient)."""
    x, w = inputs[0], inputs[1]
    sync = _bn_sync(attrs, reduce)
    _, rstd, centred, n = _bn_stats(inputs, attrs, sync)   # float64 in training (_bn_batch_moments)
    axes, ndim = _bn_axes(x), x.ndim
    per_channel = rstd * w
    dx = np.multiply(g, _bn_channel(per_channel, ndim), dtype=centred.dtype)
    g_sum = g.sum(axis=axes)
    g_dot = (g * centred).sum(axis=axes)
    if _bn_training(inputs, attrs):
        whole_sum, whole_dot = g_sum, g_dot
        if sync is not None:
            summed = sync(np.concatenate([g_sum, g_dot]).astype(np.float64))
            whole_sum, whole_dot = summed[:len(g_sum)], summed[len(g_sum):]
        n = centred.dtype.type(n)
        centred *= _bn_channel(-per_channel * rstd * rstd * whole_dot / n, ndim)
        dx += centred
        dx -= _bn_channel(per_channel * whole_sum / n, ndim)
    return [dx.astype(x.dtype, copy=False), (rstd * g_dot).astype(w.dtype, copy=False),
            g_sum] + [None] * (len(inputs) - 3)


def _bn_shape(shapes, attrs):
    x = tuple(shapes[0])
    wanted = 6 if attrs.get("running") else 3 if attrs.get("training") else 5
    if len(shapes) != wanted:
        stats = ", running mean and variance" + (", the run's context" if wanted == 6 else "") if wanted > 3 else ""
        raise OpError(f"batch_norm takes {wanted} inputs (x, weight, bias{stats}), not {len(shapes)}")
    if len(x) < 2:
        raise OpError(f"batch_norm of input {x}: expected [N, C, ...]")
    _check_sync(attrs, "batch_norm")
    if wanted == 6 and tuple(shapes[5]) != (6,):
        raise OpError(f"batch_norm's context of shape {tuple(shapes[5])}: expected (6,)")
    for i, s in enumerate(shapes[1:5 if wanted == 6 else None], 1):
        if tuple(s) != (x[1],):
            raise OpError(f"batch_norm input {i} of shape {tuple(s)}: expected ({x[1]},) for {x[1]} channels")
    return x


# inputs: x, weight, bias (ones and zeros where the module has no affine part), and in eval
# (training False) the running mean and variance it normalizes by; a layer that keeps running
# statistics in training (running True) takes the run's context too: the batch's statistics
# in a train step, the running ones in an eval step.
# attrs["sync"]: the statistics are the whole batch's over every shard (SyncBatchNorm).
_register("batch_norm", _bn_forward, _bn_vjp, _bn_shape, _elementwise_cost(8), saves_inputs=(0, 1, 2, 3, 4, 5),
          collective=True)


def _check_sync(attrs, op: str) -> None:
    if not isinstance(attrs.get("sync", False), bool):
        raise OpError(f"{op}'s sync {attrs.get('sync')!r}: expected true or false")


def _bn_running_forward(inputs, attrs, reduce=None):
    """A running statistic after a train step, as torch's BatchNorm updates it:
    (1 - momentum) * old + momentum * the batch's mean (stat "mean") or its unbiased
    variance (stat "var"; the biased one times n / (n - 1), n the values per channel),
    synchronized as the batch norm it belongs to (attrs["sync"])."""
    x, old = inputs
    mean, var, n = _bn_batch_moments(x, _bn_sync(attrs, reduce))
    stat = mean if attrs["stat"] == "mean" else var * (n / max(n - 1, 1))
    m = attrs["momentum"]
    return ((1 - m) * old + m * stat.reshape(old.shape)).astype(old.dtype)


def _bn_running_shape(shapes, attrs):
    x, old = tuple(shapes[0]), tuple(shapes[1])
    if len(x) < 2 or old != (x[1],):
        raise OpError(f"batch_norm_running of input {x} and statistic {old}: expected [N, C, ...] and (C,)")
    if attrs.get("stat") not in ("mean", "var"):
        raise OpError(f"batch_norm_running of statistic {attrs.get('stat')!r}: expected mean or var")
    _check_sync(attrs, "batch_norm_running")
    return old


def _no_vjp(name):
    def vjp(g, inputs, out, attrs):
        raise OpError(f"{name} has no gradient (a buffer's new value)")
    return vjp


# inputs: the batch norm's input, a running statistic (a buffer); its new value, which the run
# carries to the next step (Program.buffers): no gradient flows through it.
_register("batch_norm_running", _bn_running_forward, _no_vjp("batch_norm_running"), _bn_running_shape,
          _elementwise_cost(3), collective=True)


# ---------------------------------------------------------------- values made from a shape

# torch's full_like / zeros_like / ones_like: `value` in `dtype`, of the input's shape (so
# the running batch's, not the capture's); nothing flows back to the input.
def _full_like_vjp(g, inputs, out, attrs):
    x = inputs[0]
    return [np.zeros(x.shape, dtype=x.dtype) if x.dtype.kind == "f" else None]


_register("full_like", lambda i, a: np.full(i[0].shape, a["value"], dtype=a["dtype"]), _full_like_vjp, _same_shape,
          _free)


# ---------------------------------------------------------------- writes into a copy
# What torch's functionalization makes of an assignment into part of a tensor
# (x[:, 0] = v, x[..., :k] = v, x.scatter_(...), x[idx] += v): a new tensor, x
# with the part replaced (or added to).

def _part_replaced(key_of):
    """forward and vjp of an op that writes its second input over the part of its first that
    key_of(attrs, shape) names: the gradient of the part goes to the second input, the rest to the first."""
    def forward(inputs, attrs):
        out = inputs[0].copy()
        out[key_of(attrs, out.shape)] = inputs[1]
        return out

    def vjp(g, inputs, out, attrs):
        key = key_of(attrs, g.shape)
        dx = g.copy()
        dx[key] = 0
        return [dx, g[key]]
    return forward, vjp


def _select_key(attrs, shape):
    return _select_index(attrs, len(shape), shape[_axis(attrs["dim"], len(shape))])


_register("slice_scatter", *_part_replaced(lambda attrs, shape: _slice_index(attrs, len(shape))), _same_shape, _free)
_register("select_scatter", *_part_replaced(_select_key), _same_shape, _free)


def _scatter_key(index, axis):
    key = list(np.indices(index.shape, sparse=True))
    key[axis] = index
    return tuple(key)


def _scatter_forward(inputs, attrs):
    """torch's scatter (`reduce` None: src's values put at index along dim) and scatter_add
    (`reduce` "sum": added there), src as a tensor or the attribute `value`."""
    x, index = inputs[0], inputs[1]
    axis = _axis(attrs["dim"], x.ndim)
    src = inputs[2] if len(inputs) > 2 else np.full(index.shape, attrs["value"], dtype=x.dtype)
    src = src[tuple(slice(0, n) for n in index.shape)]
    out = x.copy()
    if attrs.get("reduce") == "sum":
        np.add.at(out, _scatter_key(index, axis), src)
    else:
        out[_scatter_key(index, axis)] = src
    return out


def _scatter_vjp(g, inputs, out, attrs):
    x, index = inputs[0], inputs[1]
    axis = _axis(attrs["dim"], x.ndim)
    key = _scatter_key(index, axis)
    dx = g.copy()
    if attrs.get("reduce") != "sum":
        dx[key] = 0
    grads = [dx, None]
    if len(inputs) > 2:
        dsrc = np.zeros(inputs[2].shape, dtype=g.dtype)
        dsrc[tuple(slice(0, n) for n in index.shape)] = g[key]
        grads.append(dsrc)
    return grads


_register("scatter", _scatter_forward, _scatter_vjp, _same_shape, _free, saves_inputs=(1,))


def _index_put_forward(inputs, attrs):
    """x with x[indices] = values (accumulate: += values), indices at `dims` as `index` takes them."""
    x, values = inputs[0], inputs[-1]
    key = _index_key([x, *inputs[1:-1]], attrs)
    out = x.copy()
    if attrs.get("accumulate"):
        np.add.at(out, key, values)
    else:
        out[key] = values
    return out


def _index_put_vjp(g, inputs, out, attrs):
    x, values = inputs[0], inputs[-1]
    key = _index_key([x, *inputs[1:-1]], attrs)
    dx = g.copy()
    if not attrs.get("accumulate"):
        dx[key] = 0
    dvalues = unbroadcast(g[key], values.shape) if values.dtype.kind == "f" else None
    return [dx] + [None] * (len(inputs) - 2) + [dvalues]


_register("index_put", _index_put_forward, _index_put_vjp, _same_shape, _free, saves_inputs=tuple(range(1, 9)))


def _copy_vjp(g, inputs, out, attrs):
    """x's values are overwritten: its gradient is zero; src's, g summed back to its shape."""
    src = inputs[1]
    return [np.zeros_like(g), unbroadcast(g, src.shape).astype(src.dtype) if src.dtype.kind == "f" else None]


# torch's copy(x, src): src's values, in x's shape and dtype (x's own values are not read).
_register("copy", lambda i, a: np.broadcast_to(i[1], i[0].shape).astype(i[0].dtype), _copy_vjp, _same_shape, _free)


# ---------------------------------------------------------------- group norm and upsampling

def _group_stats(x, groups, eps):
    """(x-hat [N, G, rest], rstd [N, G, 1]) over each sample's channel groups."""
    n = x.shape[0]
    xg = x.reshape(n, groups, -1)
    mean = xg.mean(axis=-1, keepdims=True)
    d = xg - mean
    rstd = 1 / np.sqrt((d * d).mean(axis=-1, keepdims=True) + x.dtype.type(eps))
    return d * rstd, rstd


def _group_norm_forward(inputs, attrs):
    x, w, b = inputs
    xhat, _ = _group_stats(x, int(attrs["groups"]), attrs.get("eps", 1e-5))
    return xhat.reshape(x.shape) * _bn_channel(w, x.ndim) + _bn_channel(b, x.ndim)


def _group_norm_vjp(g, inputs, out, attrs):
    x, w, b = inputs
    groups = int(attrs["groups"])
    xhat, rstd = _group_stats(x, groups, attrs.get("eps", 1e-5))
    axes = (0, *range(2, x.ndim))
    gw = (g * _bn_channel(w, x.ndim)).reshape(xhat.shape)
    dx = rstd * (gw - gw.mean(axis=-1, keepdims=True) - xhat * (gw * xhat).mean(axis=-1, keepdims=True))
    return [dx.reshape(x.shape), (g * xhat.reshape(x.shape)).sum(axis=axes), g.sum(axis=axes)]


def _group_norm_shape(shapes, attrs):
    x = tuple(shapes[0])
    groups = int(attrs["groups"])
    if len(x) < 2 or x[1] % groups:
        raise OpError(f"group_norm of input {x} in {groups} groups: the channels must divide into them")
    for s in shapes[1:]:
        if tuple(s) != (x[1],):
            raise OpError(f"group_norm weight or bias of shape {tuple(s)}: expected ({x[1]},)")
    return x


# inputs: x [N, C, ...], weight and bias [C] (ones and zeros where the module has none)
_register("group_norm", _group_norm_forward, _group_norm_vjp, _group_norm_shape, _elementwise_cost(8),
          saves_inputs=(0, 1))


def _upsample_scale(shapes, attrs):
    x = tuple(shapes[0])
    size = [int(s) for s in attrs["size"]]
    if len(x) != 4 or any(o % i for o, i in zip(size, x[2:])):
        raise OpError(f"upsample_nearest2d of {x} to {tuple(size)}: only whole multiples of [N, C, H, W]'s H and W")
    return size[0] // x[2], size[1] // x[3]


def _upsample_forward(inputs, attrs):
    sh, sw = _upsample_scale([inputs[0].shape], attrs)
    return inputs[0].repeat(sh, axis=2).repeat(sw, axis=3)


def _upsample_vjp(g, inputs, out, attrs):
    n, c, h, w = inputs[0].shape
    sh, sw = _upsample_scale([inputs[0].shape], attrs)
    return [g.reshape(n, c, h, sh, w, sw).sum(axis=(3, 5))]


_register("upsample_nearest2d", _upsample_forward, _upsample_vjp,
          lambda s, a: (*tuple(s[0])[:2], *(int(v) for v in a["size"])) if _upsample_scale(s, a) else (),
          _free)


# ---------------------------------------------------------------- order: topk and sort

def _order(x, attrs):
    """The indices of torch's topk (`k` of them along `dim`, the largest first unless
    `largest` is False; sort is topk of them all). Ties keep their order (a stable sort):
    torch leaves which of two equal values comes first unspecified."""
    axis = _axis(attrs.get("dim", -1), x.ndim)
    keys = -x if attrs.get("largest", True) else x
    order = np.argsort(keys, axis=axis, kind="stable")
    k = int(attrs.get("k", x.shape[axis]))
    return np.take(order, np.arange(k), axis=axis), axis


def _topk_forward(inputs, attrs):
    idx, axis = _order(inputs[0], attrs)
    return np.take_along_axis(inputs[0], idx, axis=axis)


def _topk_vjp(g, inputs, out, attrs):
    idx, axis = _order(inputs[0], attrs)
    dx = np.zeros(inputs[0].shape, dtype=g.dtype)
    np.put_along_axis(dx, idx, g, axis=axis)
    return [dx]


def _topk_shape(shapes, attrs):
    s = list(shapes[0])
    axis = _axis(attrs.get("dim", -1), len(s))
    k = int(attrs.get("k", s[axis]))
    if not 0 <= k <= s[axis]:
        raise OpError(f"topk of {k} along a dim of {s[axis]}")
    s[axis] = k
    return tuple(s)


def _sort_cost(shapes, out, attrs):
    n = _numel(shapes[0])
    return n * max(1, int(math.log2(max(2, n))))


# The values (the gradient goes back to where each came from) and, as their own op, the indices.
_register("topk", _topk_forward, _topk_vjp, _topk_shape, _sort_cost, saves_inputs=(0,))
_register("topk_indices", lambda i, a: _order(i[0], a)[0].astype(np.int64), _no_grad, _topk_shape, _sort_cost)


# ---------------------------------------------------------------- diagonal

def _diagonal_geometry(shape, attrs):
    """(dim1, dim2, offset, length) of torch's diagonal(x, offset, dim1, dim2)."""
    ndim = len(shape)
    d1, d2 = _axis(attrs.get("dim1", 0), ndim), _axis(attrs.get("dim2", 1), ndim)
    if d1 == d2:
        raise OpError(f"diagonal of dims {d1} and {d2}: they must differ")
    offset = int(attrs.get("offset", 0))
    length = max(0, min(shape[d1] - max(-offset, 0), shape[d2] - max(offset, 0)))
    return d1, d2, offset, length


def _diagonal_forward(inputs, attrs):
    x = inputs[0]
    d1, d2, offset, _ = _diagonal_geometry(x.shape, attrs)
    return np.ascontiguousarray(np.diagonal(x, offset, d1, d2))


def _diagonal_vjp(g, inputs, out, attrs):
    x = inputs[0]
    d1, d2, offset, length = _diagonal_geometry(x.shape, attrs)
    dx = np.zeros(x.shape, dtype=g.dtype)
    i = np.arange(length)
    np.moveaxis(dx, (d1, d2), (-2, -1))[..., i + max(-offset, 0), i + max(offset, 0)] = g
    return [dx]


def _diagonal_shape(shapes, attrs):
    s = tuple(shapes[0])
    d1, d2, _, length = _diagonal_geometry(s, attrs)
    return tuple(n for d, n in enumerate(s) if d not in (d1, d2)) + (length,)


# torch's layout: the two dims go, the diagonal becomes the last dim
_register("diagonal", _diagonal_forward, _diagonal_vjp, _diagonal_shape, _free)


# ---------------------------------------------------------------- padding by the edges

def _edge_indices(n, lo, hi, mode):
    """The source index of each padded position along a dim of n: reflect (about the edge,
    which is not repeated), replicate (the edge repeated) or circular (wrapping around)."""
    i = np.arange(-lo, n + hi)
    if mode == "reflect":
        period = 2 * (n - 1)
        i = np.abs(i) % period if period else np.zeros_like(i)
        return np.where(i >= n, period - i, i)
    if mode == "replicate":
        return np.clip(i, 0, n - 1)
    if mode == "circular":
        return i % n
    raise OpError(f"pad mode {mode!r} (reflect, replicate or circular)")


def _edge_widths(shape, attrs):
    widths = _pad_widths(len(shape), attrs)
    mode = attrs["mode"]
    for n, (lo, hi) in zip(shape, widths):
        if (lo or hi) and (mode == "reflect" and max(lo, hi) >= n or mode == "circular" and max(lo, hi) > n):
            raise OpError(f"{mode} padding of {lo} and {hi} for a dim of size {n}: too wide")
    return widths


def _pad_edges_forward(inputs, attrs):
    x = inputs[0]
    for axis, (lo, hi) in enumerate(_edge_widths(x.shape, attrs)):
        if lo or hi:
            x = np.take(x, _edge_indices(x.shape[axis], lo, hi, attrs["mode"]), axis=axis)
    return x


def _pad_edges_vjp(g, inputs, out, attrs):
    shape = inputs[0].shape
    for axis, (lo, hi) in enumerate(_edge_widths(shape, attrs)):
        if lo or hi:
            moved = np.moveaxis(g, axis, 0)
            back = np.zeros((shape[axis],) + moved.shape[1:], dtype=g.dtype)
            np.add.at(back, _edge_indices(shape[axis], lo, hi, attrs["mode"]), moved)
            g = np.moveaxis(back, 0, axis)
    return [np.ascontiguousarray(g)]


# torch's pad list (last dim first) and mode: reflection_pad1d/2d/3d, replication_pad*, F.pad's modes
_register("pad_edges", _pad_edges_forward, _pad_edges_vjp,
          lambda s, a: tuple(n + lo + hi for n, (lo, hi) in zip(s[0], _edge_widths(tuple(s[0]), a))), _free)


# ---------------------------------------------------------------- bilinear upsampling

def _linear_weights(n_in, n_out, align_corners, scale):
    """[n_out, n_in]: each output pixel as torch's upsample_bilinear2d weighs the two input
    pixels about its source coordinate (`scale`: the caller's scale factor, or None)."""
    if align_corners:
        step = (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
        src = step * np.arange(n_out)
    else:
        step = 1.0 / scale if scale else n_in / n_out
        src = np.maximum(step * (np.arange(n_out) + 0.5) - 0.5, 0.0)
    lo = np.minimum(src.astype(np.int64), n_in - 1)
    hi = np.minimum(lo + 1, n_in - 1)
    frac = src - lo
    w = np.zeros((n_out, n_in))
    np.add.at(w, (np.arange(n_out), lo), 1.0 - frac)
    np.add.at(w, (np.arange(n_out), hi), frac)
    return w


def _bilinear_matrices(x_shape, attrs, dtype):
    scales = list(attrs.get("scales") or [None, None])
    return [_linear_weights(x_shape[2 + d], int(attrs["size"][d]), bool(attrs.get("align_corners")),
                            scales[d]).astype(dtype) for d in (0, 1)]


def _bilinear_forward(inputs, attrs):
    x = inputs[0]
    wh, ww = _bilinear_matrices(x.shape, attrs, x.dtype)
    return np.ascontiguousarray(np.einsum("hH,ncHW,wW->nchw", wh, x, ww, optimize=True))


def _bilinear_vjp(g, inputs, out, attrs):
    wh, ww = _bilinear_matrices(inputs[0].shape, attrs, g.dtype)
    return [np.ascontiguousarray(np.einsum("hH,nchw,wW->ncHW", wh, g, ww, optimize=True))]


def _bilinear_shape(shapes, attrs):
    x = tuple(shapes[0])
    if len(x) != 4:
        raise OpError(f"upsample_bilinear2d of {x}: expected [N, C, H, W]")
    return (*x[:2], *(int(v) for v in attrs["size"]))


# size [H, W] of the output; align_corners; scales [h, w] (the caller's factors, or None)
_register("upsample_bilinear2d", _bilinear_forward, _bilinear_vjp, _bilinear_shape,
          lambda s, out, a: 8 * _numel(out))


# ---------------------------------------------------------------- distances

def _pnorm(diff, p):
    """torch's p-norm of each last-dim vector (p 0 counts the nonzeros; inf: the largest)."""
    a = np.abs(diff)
    if p == 0:
        return (a != 0).sum(axis=-1).astype(diff.dtype)
    if np.isinf(p):
        return a.max(axis=-1, initial=0)
    if p == 1:
        return a.sum(axis=-1)
    if p == 2:
        return np.sqrt((diff * diff).sum(axis=-1))
    return (a ** p).sum(axis=-1) ** (1.0 / p)


def _cdist_parts(x1, x2, p):
    """(x1 - x2 per pair, [..., P, R, M]; the distances, [..., P, R]) of torch's cdist."""
    diff = x1[..., :, None, :] - x2[..., None, :, :]
    return diff, _pnorm(diff, p)


def _cdist_pair_grad(g, diff, dist, p):
    """d(sum g * dist) / d(x1 - x2), per pair and feature; zero where a distance is 0, as torch."""
    if p == 0:
        return np.zeros_like(diff)
    a, sign = np.abs(diff), np.sign(diff)
    if np.isinf(p):
        return sign * (a == dist[..., None]) * g[..., None]
    if p == 1:
        return sign * g[..., None]
    safe = np.where(dist == 0, 1, dist)[..., None]
    if p == 2:
        return np.where(dist[..., None] == 0, 0, diff / safe * g[..., None])
    scaled = sign * a ** (p - 1) / safe ** (p - 1)
    return np.where(dist[..., None] == 0, 0, scaled * g[..., None])


def _cdist_forward(inputs, attrs):
    return _cdist_parts(inputs[0], inputs[1], float(attrs.get("p", 2.0)))[1]


def _cdist_vjp(g, inputs, out, attrs):
    x1, x2 = inputs
    p = float(attrs.get("p", 2.0))
    diff, dist = _cdist_parts(x1, x2, p)
    pair = _cdist_pair_grad(g, diff, dist, p)
    return [unbroadcast(pair.sum(axis=-2), x1.shape), unbroadcast(-pair.sum(axis=-3), x2.shape)]


def _cdist_shape(shapes, attrs):
    a, b = tuple(shapes[0]), tuple(shapes[1])
    if len(a) < 2 or len(b) < 2 or a[-1] != b[-1]:
        raise OpError(f"cdist of {a} and {b}: expected [..., P, M] and [..., R, M]")
    if float(attrs.get("p", 2.0)) < 0:
        raise OpError(f"cdist with p={attrs['p']}: p must be >= 0")
    return broadcast_shape(a[:-2], b[:-2]) + (a[-2], b[-2])


# torch's cdist(x1, x2, p) (computed pair by pair, not by matrix products)
_register("cdist", _cdist_forward, _cdist_vjp, _cdist_shape,
          lambda s, out, a: 3 * _numel(out) * s[0][-1], saves_inputs=(0, 1))


def _pdist_pairs(n):
    return np.triu_indices(n, 1)


def _pdist_forward(inputs, attrs):
    x = inputs[0]
    i, j = _pdist_pairs(x.shape[0])
    return _pnorm(x[i] - x[j], float(attrs.get("p", 2.0)))


def _pdist_vjp(g, inputs, out, attrs):
    x = inputs[0]
    i, j = _pdist_pairs(x.shape[0])
    diff = x[i] - x[j]
    p = float(attrs.get("p", 2.0))
    pair = _cdist_pair_grad(g, diff, _pnorm(diff, p), p)
    dx = np.zeros(x.shape, dtype=g.dtype)
    np.add.at(dx, i, pair)
    np.add.at(dx, j, -pair)
    return [dx]


def _pdist_shape(shapes, attrs):
    x = tuple(shapes[0])
    if len(x) != 2:
        raise OpError(f"pdist of {x}: expected [N, M]")
    return (x[0] * (x[0] - 1) // 2,)


# torch's pdist(x, p): the upper triangle of cdist(x, x), row by row
_register("pdist", _pdist_forward, _pdist_vjp, _pdist_shape, lambda s, out, a: 3 * _numel(out) * s[0][-1],
          saves_inputs=(0,))


# ---------------------------------------------------------------- scatter with a reduction

_SCATTER_REDUCE = {"sum": np.add, "mean": np.add, "amax": np.maximum, "amin": np.minimum}


def _scatter_reduce_parts(inputs, attrs):
    """(the result; the positions some src element went to; how many values each position
    averages) of torch's scatter_reduce(x, dim, index, src, reduce, include_self)."""
    x, index, src = inputs
    reduce = attrs["reduce"]
    if reduce not in _SCATTER_REDUCE:
        raise OpError(f"scatter_reduce with reduce={reduce!r} (sum, mean, amax or amin)")
    key = _scatter_key(index, _axis(attrs["dim"], x.ndim))
    hit = np.zeros(x.shape, dtype=bool)
    hit[key] = True
    count = np.zeros(x.shape, dtype=x.dtype)
    np.add.at(count, key, 1)
    include_self = attrs.get("include_self", True)
    out = x.copy()
    if not include_self:
        identity = {"sum": 0, "mean": 0, "amax": -np.inf, "amin": np.inf}[reduce]
        out[hit] = identity
    _SCATTER_REDUCE[reduce].at(out, key, src[tuple(slice(0, n) for n in index.shape)])
    if reduce == "mean":
        count = count + (1 if include_self else 0)
        count[count == 0] = 1
        out = out / count
    return out, hit, count, key


def _scatter_reduce_vjp(g, inputs, out, attrs):
    """torch's rule: sum and mean pass the gradient back (over the count, for mean); amax and
    amin share it evenly among the values equal to the result."""
    x, index, src = inputs
    result, hit, count, key = _scatter_reduce_parts(inputs, attrs)
    part = src[tuple(slice(0, n) for n in index.shape)]
    if attrs["reduce"] in ("sum", "mean"):
        dx = g / count if attrs["reduce"] == "mean" else g.copy()
        dpart = dx[key]
    else:
        value = result[key]
        x_is, part_is = (x == result), (part == value)
        share = x_is.astype(g.dtype)
        np.add.at(share, key, part_is.astype(g.dtype))
        distributed = g / np.where(share == 0, 1, share)
        dx, dpart = x_is * distributed, part_is * distributed[key]
    if not attrs.get("include_self", True):
        dx = np.where(hit, 0, dx)
    dsrc = np.zeros(src.shape, dtype=g.dtype)
    dsrc[tuple(slice(0, n) for n in index.shape)] = dpart
    return [dx.astype(g.dtype), None, dsrc]


_register("scatter_reduce", lambda i, a: _scatter_reduce_parts(i, a)[0], _scatter_reduce_vjp, _same_shape,
          lambda s, out, a: _numel(s[1]), saves_inputs=(0, 1, 2))


# ---------------------------------------------------------------- col2im (fold)

def _col2im_geometry(x_shape, attrs):
    """(N, C, (H, W), kernel, stride, pad, dilation, (OH, OW)) of torch's col2im / F.fold."""
    k, (h, w) = _pair(attrs["kernel_size"]), _pair(attrs["output_size"])
    stride, pad, dil = _conv_geometry(attrs)
    oh, ow = windows.out_size(h, k[0], stride[0], pad[0], dil[0]), windows.out_size(w, k[1], stride[1], pad[1], dil[1])
    if len(x_shape) != 3 or x_shape[1] % (k[0] * k[1]) or x_shape[2] != oh * ow or oh < 1 or ow < 1:
        raise OpError(f"col2im of {tuple(x_shape)} to {h}x{w} with kernel {k}: expected [N, C*{k[0]}*{k[1]}, "
                      f"{max(oh, 0) * max(ow, 0)}]")
    return x_shape[0], x_shape[1] // (k[0] * k[1]), (h, w), k, stride, pad, dil, (oh, ow)


def _col2im_forward(inputs, attrs):
    x = inputs[0]
    _, _, size, k, stride, pad, dil, _ = _col2im_geometry(x.shape, attrs)
    return windows.col2im(x, size, k, stride, pad, dil)


def _col2im_vjp(g, inputs, out, attrs):
    _, _, _, k, stride, pad, dil, _ = _col2im_geometry(inputs[0].shape, attrs)
    return [windows.im2col(g, k, stride, pad, dil)]


_register("col2im", _col2im_forward, _col2im_vjp,
          lambda s, a: (lambda geo: (geo[0], geo[1], *geo[2]))(_col2im_geometry(tuple(s[0]), a)),
          lambda s, out, a: _numel(s[0]))


# ---------------------------------------------------------------- 3-d pools

def _triple(v):
    v = [int(v)] if isinstance(v, (int, np.integer)) else [int(x) for x in v]
    return tuple(v * 3) if len(v) == 1 else tuple(v)


def _pool3d_geometry(attrs):
    k = _triple(attrs["kernel_size"])
    if attrs.get("ceil_mode"):
        raise OpError("pooling with ceil_mode=True")
    return k, _triple(attrs.get("stride") or k), _triple(attrs.get("padding", 0)), _triple(attrs.get("dilation", 1))


def _windows3d(x, k, stride, dil):
    """[N, C, D, H, W] (already padded) -> view [N, C, OD, OH, OW, kd, kh, kw] of every window."""
    out = [windows.out_size(n, kk, s, 0, d) for n, kk, s, d in zip(x.shape[2:], k, stride, dil)]
    st = x.strides
    return np.lib.stride_tricks.as_strided(
        x, (*x.shape[:2], *out, *k), (*st[:2], *(a * s for a, s in zip(st[2:], stride)),
                                      *(a * d for a, d in zip(st[2:], dil))), writeable=False)


def _pad3d(x, pad, value=0.0):
    return np.pad(x, ((0, 0), (0, 0), *((p, p) for p in pad)), constant_values=value) if any(pad) else x


def _fold3d(cols, shape, k, stride, pad, dil):
    """The adjoint of _windows3d on a padded input."""
    out = np.zeros((*shape[:2], *(n + 2 * p for n, p in zip(shape[2:], pad))), dtype=cols.dtype)
    o = cols.shape[2:5]
    for offset in np.ndindex(*k):
        at = tuple(slice(i * d, i * d + s * m, s) for i, d, s, m in zip(offset, dil, stride, o))
        out[(slice(None), slice(None), *at)] += cols[(Ellipsis, *offset)]
    return out[(slice(None), slice(None), *(slice(p, p + n) for p, n in zip(pad, shape[2:])))]


def _pool3d_shape(shapes, attrs):
    x = tuple(shapes[0])
    if len(x) != 5:
        raise OpError(f"3-d pooling of an input {x}: expected [N, C, D, H, W]")
    k, stride, pad, dil = _pool3d_geometry(attrs)
    out = tuple(windows.out_size(n, kk, s, p, d) for n, kk, s, p, d in zip(x[2:], k, stride, pad, dil))
    if min(out) < 1:
        raise OpError(f"3-d pooling of {x} with kernel {k} leaves no output")
    return (*x[:2], *out)


def _max_pool3d_forward(inputs, attrs):
    k, stride, pad, dil = _pool3d_geometry(attrs)
    return _windows3d(_pad3d(inputs[0], pad, -np.inf), k, stride, dil).max(axis=(5, 6, 7))


def _max_pool3d_vjp(g, inputs, out, attrs):
    """The gradient goes to the first maximum of each window, as torch's kernel picks it."""
    k, stride, pad, dil = _pool3d_geometry(attrs)
    cols = _windows3d(_pad3d(inputs[0], pad, -np.inf), k, stride, dil)
    flat = cols.reshape(*cols.shape[:5], -1)
    onehot = np.zeros(flat.shape, dtype=g.dtype)
    np.put_along_axis(onehot, flat.argmax(axis=-1)[..., None], g[..., None], axis=-1)
    return [_fold3d(onehot.reshape(cols.shape), inputs[0].shape, k, stride, pad, dil)]


def _avg_pool3d_forward(inputs, attrs):
    k, stride, pad, _ = _pool3d_geometry(attrs)
    if not attrs.get("count_include_pad", True) and any(pad):
        raise OpError("avg_pool3d with count_include_pad=False and padding")
    return _windows3d(_pad3d(inputs[0], pad), k, stride, (1, 1, 1)).mean(axis=(5, 6, 7))


def _avg_pool3d_vjp(g, inputs, out, attrs):
    k, stride, pad, _ = _pool3d_geometry(attrs)
    cols = np.broadcast_to((g / g.dtype.type(np.prod(k)))[..., None, None, None], (*g.shape, *k))
    return [_fold3d(cols, inputs[0].shape, k, stride, pad, (1, 1, 1))]


_register("max_pool3d", _max_pool3d_forward, _max_pool3d_vjp, _pool3d_shape,
          lambda s, out, a: _numel(out) * int(np.prod(_triple(a["kernel_size"]))), saves_inputs=(0,))
_register("avg_pool3d", _avg_pool3d_forward, _avg_pool3d_vjp, _pool3d_shape,
          lambda s, out, a: _numel(out) * int(np.prod(_triple(a["kernel_size"]))))


# ---------------------------------------------------------------- grid sampling

_GRID_INTERPOLATION = {0: "bilinear", 1: "nearest"}
_GRID_PADDING = {0: "zeros", 1: "border"}


def _grid_source(coord, size, attrs):
    """A grid's [-1, 1] coordinates as pixel positions along a dim of `size`, and the
    derivative of that map (0 where border padding clips)."""
    if attrs.get("align_corners"):
        scale = (size - 1) / 2.0
        pos = (coord + 1) * scale
    else:
        scale = size / 2.0
        pos = ((coord + 1) * size - 1) / 2.0
    slope = np.full(coord.shape, scale, dtype=coord.dtype)
    if _GRID_PADDING[int(attrs.get("padding_mode", 0))] == "border":
        inside = (pos >= 0) & (pos <= size - 1)
        pos, slope = np.clip(pos, 0, size - 1), np.where(inside, slope, 0)
    return pos, slope


def _grid_corners(x, grid, attrs):
    """Per corner of each sample point's pixel square: (values [N, C, Ho, Wo], weight, its
    derivatives by the x and y position, the pixel indices and whether they lie inside)."""
    n, c, h, w = x.shape
    px, sx = _grid_source(grid[..., 0], w, attrs)
    py, sy = _grid_source(grid[..., 1], h, attrs)
    x0, y0 = np.floor(px), np.floor(py)
    fx, fy = px - x0, py - y0
    rows = np.arange(n)[:, None, None]
    corners = []
    for dy, dx in ((0, 0), (0, 1), (1, 0), (1, 1)):
        xi, yi = (x0 + dx).astype(np.int64), (y0 + dy).astype(np.int64)
        inside = (xi >= 0) & (xi < w) & (yi >= 0) & (yi < h)
        wx, wy = (fx if dx else 1 - fx), (fy if dy else 1 - fy)
        values = x[rows, :, np.clip(yi, 0, h - 1), np.clip(xi, 0, w - 1)].transpose(0, 3, 1, 2) * inside[:, None]
        corners.append((values, wx * wy, (1 if dx else -1) * wy, (1 if dy else -1) * wx, yi, xi, inside))
    return corners, sx, sy


def _grid_nearest(x, grid, attrs):
    n, c, h, w = x.shape
    px = np.rint(_grid_source(grid[..., 0], w, attrs)[0]).astype(np.int64)
    py = np.rint(_grid_source(grid[..., 1], h, attrs)[0]).astype(np.int64)
    inside = (px >= 0) & (px < w) & (py >= 0) & (py < h)
    return np.clip(py, 0, h - 1), np.clip(px, 0, w - 1), inside


def _grid_sample_forward(inputs, attrs):
    x, grid = inputs
    if _GRID_INTERPOLATION[int(attrs.get("interpolation_mode", 0))] == "nearest":
        yi, xi, inside = _grid_nearest(x, grid, attrs)
        return np.ascontiguousarray(x[np.arange(x.shape[0])[:, None, None], :, yi, xi].transpose(0, 3, 1, 2)
                                    * inside[:, None])
    corners, _, _ = _grid_corners(x, grid, attrs)
    return sum(values * weight[:, None] for values, weight, *_ in corners).astype(x.dtype)


def _grid_sample_vjp(g, inputs, out, attrs):
    """The input's gradient goes back to the pixels each point read, by the same weights;
    the grid's (bilinear only) is the change of the weights with the position."""
    x, grid = inputs
    rows = np.arange(x.shape[0])[:, None, None]
    dx = np.zeros(x.shape, dtype=g.dtype)
    to_pixels = g.transpose(0, 2, 3, 1)                       # [N, Ho, Wo, C]
    if _GRID_INTERPOLATION[int(attrs.get("interpolation_mode", 0))] == "nearest":
        yi, xi, inside = _grid_nearest(x, grid, attrs)
        np.add.at(dx, (rows, slice(None), yi, xi), to_pixels * inside[..., None])
        return [dx, np.zeros(grid.shape, dtype=g.dtype)]
    corners, sx, sy = _grid_corners(x, grid, attrs)
    dpx, dpy = np.zeros(grid.shape[:-1], g.dtype), np.zeros(grid.shape[:-1], g.dtype)
    for values, weight, by_x, by_y, yi, xi, inside in corners:
        np.add.at(dx, (rows, slice(None), np.clip(yi, 0, x.shape[2] - 1), np.clip(xi, 0, x.shape[3] - 1)),
                  to_pixels * (weight * inside)[..., None])
        read = (g * values).sum(axis=1)
        dpx += read * by_x
        dpy += read * by_y
    return [dx, np.stack([dpx * sx, dpy * sy], axis=-1).astype(g.dtype)]


def _grid_sample_shape(shapes, attrs):
    x, grid = tuple(shapes[0]), tuple(shapes[1])
    if len(x) != 4 or len(grid) != 4 or grid[-1] != 2 or grid[0] != x[0]:
        raise OpError(f"grid_sampler_2d of {x} at grid {grid}: expected [N, C, H, W] and [N, Ho, Wo, 2]")
    if int(attrs.get("interpolation_mode", 0)) not in _GRID_INTERPOLATION or \
            int(attrs.get("padding_mode", 0)) not in _GRID_PADDING:
        raise OpError("grid_sampler_2d: bilinear or nearest, with zeros or border padding")
    return (x[0], x[1], grid[1], grid[2])


# torch's grid_sampler_2d (F.grid_sample): interpolation_mode 0 bilinear, 1 nearest; padding_mode
# 0 zeros, 1 border; align_corners
_register("grid_sampler_2d", _grid_sample_forward, _grid_sample_vjp, _grid_sample_shape,
          lambda s, out, a: 12 * _numel(out), saves_inputs=(0, 1))
