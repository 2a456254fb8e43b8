"""Convolution and pooling over [N, C, H, W] maps: the kernels behind ops.py's conv2d,
max_pool2d, avg_pool2d and col2im (im2col and col2im: torch's unfold and fold).

Every kernel loops over the kh x kw offsets of a window, never over pixels or windows:
each offset is one strided slice of the padded input, a whole-map numpy operation.
A dense convolution copies those slices once into columns laid out [C, kh, kw, N, OH, OW]
and makes one matmul of the whole batch (im2col: small late-stage maps still give BLAS a
wide product); a depthwise one (groups == channels) multiplies and adds the slices, as
a matmul of one input channel would waste the columns' copy (as C loops where setup.py built
_windows.c: the same bits); other groups run the dense kernel a group at a time. The adjoints
add the same slices back; the depthwise weight gradient sums each offset's products in a
fixed order (batch, row, column), so that its C loop gives numpy's bits.
"""
from __future__ import annotations

import numpy as np

from cs_runtime.numerics import compiled

_depthwise_loops = compiled.load("_windows", api=3)


def depthwise_path() -> str:
    """Which path the depthwise convolution takes: "C loops" (setup.py built _windows.c) or "numpy"."""
    return "C loops" if _depthwise_loops is not None else "numpy"


def out_size(n: int, k: int, stride: int, pad: int, dil: int) -> int:
    return (n + 2 * pad - dil * (k - 1) - 1) // stride + 1


def pad_map(x: np.ndarray, pad: tuple, value: float = 0.0) -> np.ndarray:
    """x with `pad` rows and columns of `value` on each side (np.pad's result, at a fraction of its cost)."""
    if pad == (0, 0):
        return x
    n, c, h, w = x.shape
    out = np.full((n, c, h + 2 * pad[0], w + 2 * pad[1]), value, dtype=x.dtype)
    out[:, :, pad[0]:pad[0] + h, pad[1]:pad[1] + w] = x
    return out


def _offsets(kh: int, kw: int, out_hw: tuple, stride: tuple, dil: tuple):
    """(i, j, the slices of a padded map that window offset (i, j) reads for every output pixel)."""
    oh, ow = out_hw
    for i in range(kh):
        for j in range(kw):
            r, s = i * dil[0], j * dil[1]
            yield i, j, (slice(r, r + stride[0] * (oh - 1) + 1, stride[0]),
                         slice(s, s + stride[1] * (ow - 1) + 1, stride[1]))


def _out_hw(shape, kh, kw, stride, pad, dil) -> tuple:
    return tuple(out_size(shape[2 + d], (kh, kw)[d], stride[d], pad[d], dil[d]) for d in (0, 1))


def _unpad(xp: np.ndarray, shape, pad) -> np.ndarray:
    return xp[:, :, pad[0]:pad[0] + shape[2], pad[1]:pad[1] + shape[3]]


def _columns(x, kh, kw, stride, pad, dil, out_hw) -> np.ndarray:
    """[C * kh * kw, N * OH * OW]: each window offset's slice of the padded input, channels first."""
    n, c = x.shape[:2]
    if (kh, kw) == (1, 1) and stride == (1, 1) and pad == (0, 0):
        return np.ascontiguousarray(x.transpose(1, 0, 2, 3)).reshape(c, -1)
    xp = pad_map(x, pad).transpose(1, 0, 2, 3)                       # C N H W, a view
    cols = np.empty((c, kh, kw, n, *out_hw), dtype=x.dtype)
    for i, j, (rows, columns) in _offsets(kh, kw, out_hw, stride, dil):
        cols[:, i, j] = xp[:, :, rows, columns]
    return cols.reshape(c * kh * kw, -1)


def _fold_columns(dcols, shape, kh, kw, stride, pad, dil, out_hw) -> np.ndarray:
    """The adjoint of _columns: add each offset's values back to the pixels it read."""
    n, c, h, w = shape
    dcols = dcols.reshape(c, kh, kw, n, *out_hw)
    if (kh, kw) == (1, 1) and stride == (1, 1) and pad == (0, 0):
        return np.ascontiguousarray(dcols[:, 0, 0].transpose(1, 0, 2, 3))
    dxp = np.zeros((c, n, h + 2 * pad[0], w + 2 * pad[1]), dtype=dcols.dtype)
    for i, j, (rows, columns) in _offsets(kh, kw, out_hw, stride, dil):
        dxp[:, :, rows, columns] += dcols[:, i, j]
    return np.ascontiguousarray(_unpad(dxp, (c, n, h, w), pad).transpose(1, 0, 2, 3))


def im2col(x, k, stride, pad, dil) -> np.ndarray:
    """torch's im2col (F.unfold): [N, C, H, W] -> [N, C * kh * kw, OH * OW]."""
    n, c = x.shape[:2]
    out_hw = _out_hw(x.shape, *k, stride, pad, dil)
    cols = _columns(x, *k, stride, pad, dil, out_hw).reshape(c * k[0] * k[1], n, -1)
    return np.ascontiguousarray(cols.transpose(1, 0, 2))


def col2im(x, size, k, stride, pad, dil) -> np.ndarray:
    """torch's col2im (F.fold), im2col's adjoint: [N, C * kh * kw, OH * OW] -> [N, C, *size],
    each window's values added back to the pixels it covers."""
    n, c = x.shape[0], x.shape[1] // (k[0] * k[1])
    out_hw = _out_hw((n, c, *size), *k, stride, pad, dil)
    dcols = x.reshape(n, c * k[0] * k[1], -1).transpose(1, 0, 2)
    return _fold_columns(dcols, (n, c, *size), *k, stride, pad, dil, out_hw)


def _is_depthwise(x_shape, w_shape, groups: int) -> bool:
    return groups == x_shape[1] == w_shape[0] and w_shape[1] == 1 and groups > 1


def conv2d(x, w, groups, stride, pad, dil) -> np.ndarray:
    """y [N, O, OH, OW] of x [N, C, H, W] and w [O, C / groups, kh, kw], no bias."""
    kh, kw = w.shape[2:]
    out_hw = _out_hw(x.shape, kh, kw, stride, pad, dil)
    if _is_depthwise(x.shape, w.shape, groups):
        return _depthwise(x, w, stride, pad, dil, out_hw)
    if groups == 1:
        return _dense(x, w, stride, pad, dil, out_hw)
    xs, ws = np.split(x, groups, axis=1), np.split(w, groups, axis=0)
    return np.concatenate([_dense(xg, wg, stride, pad, dil, out_hw) for xg, wg in zip(xs, ws)], axis=1)


def conv2d_vjp(g, x, w, groups, stride, pad, dil, input_grad: bool = True) -> tuple:
    """(dx, dw) of conv2d given dy = g; dx is None unless input_grad."""
    if _is_depthwise(x.shape, w.shape, groups):
        return _depthwise_vjp(g, x, w, stride, pad, dil, input_grad)
    if groups == 1:
        return _dense_vjp(g, x, w, stride, pad, dil, input_grad)
    parts = [_dense_vjp(gg, xg, wg, stride, pad, dil, input_grad)
             for gg, xg, wg in zip(np.split(g, groups, axis=1), np.split(x, groups, axis=1),
                                   np.split(w, groups, axis=0))]
    dx = np.concatenate([p[0] for p in parts], axis=1) if input_grad else None
    return dx, np.concatenate([p[1] for p in parts], axis=0)


def _dense(x, w, stride, pad, dil, out_hw):
    o, n = w.shape[0], x.shape[0]
    y = w.reshape(o, -1) @ _columns(x, *w.shape[2:], stride, pad, dil, out_hw)     # O, N * OH * OW
    return np.ascontiguousarray(y.reshape(o, n, *out_hw).transpose(1, 0, 2, 3))


def _dense_vjp(g, x, w, stride, pad, dil, input_grad):
    o, kh, kw = w.shape[0], *w.shape[2:]
    out_hw = g.shape[2:]
    g2 = np.ascontiguousarray(g.transpose(1, 0, 2, 3)).reshape(o, -1)               # O, N * OH * OW
    cols = _columns(x, kh, kw, stride, pad, dil, out_hw)
    dw = (g2 @ cols.T).reshape(w.shape)
    if not input_grad:
        return None, dw
    return _fold_columns(w.reshape(o, -1).T @ g2, x.shape, kh, kw, stride, pad, dil, out_hw), dw


def _loops_take(*arrays) -> bool:
    return _depthwise_loops is not None and all(a.dtype == np.float32 for a in arrays)


# The C loops turn a sample's planes channels last where a layer has at least this many
# channels per pixel of an output row (their vector loop then runs over the channels, not
# along a short row). Measured on mobilenet_v3_small's depthwise layers (batch 16), forward /
# vjp CPU ms, planes first against channels last: 576 maps of 3 x 3, 5 x 5 kernel, 2.18 / 4.79
# against 0.79 / 2.14; 88 of 12 x 12, 0.91 / 3.21 against 0.80 / 1.70; 72 of 24 x 24 with
# stride 2, 1.24 / 3.72 against 1.50 / 3.63; 16 of 48 x 48 with stride 2, 0.83 / 3.36 against
# 1.83 / 4.08.
CHANNELS_LAST_RATIO = 4


def _loop_dims(xp, w, out_hw, stride, dil) -> tuple:
    return (*xp.shape, *w.shape[2:], *out_hw, *stride, *dil, xp.shape[1] >= CHANNELS_LAST_RATIO * out_hw[1])


def _depthwise(x, w, stride, pad, dil, out_hw):
    kh, kw = w.shape[2:]
    xp = pad_map(x, pad)
    if _loops_take(x, w):
        xp, w = np.ascontiguousarray(xp), np.ascontiguousarray(w)
        y = np.empty((*x.shape[:2], *out_hw), dtype=np.float32)
        _depthwise_loops.forward(xp, w, y, _loop_dims(xp, w, out_hw, stride, dil))
        return y
    y = np.zeros((*x.shape[:2], *out_hw), dtype=np.result_type(x, w))
    term = np.empty_like(y)
    for i, j, (rows, columns) in _offsets(kh, kw, out_hw, stride, dil):
        np.multiply(xp[:, :, rows, columns], w[:, 0, i, j][None, :, None, None], out=term)
        y += term
    return y


def _depthwise_weight_grad(g, xp, w_shape, stride, dil):
    """dw[c, 0, i, j]: the sum over (n, p, q) of g times window offset (i, j)'s slice of xp,
    added in that order from 0 (the C loop's order, which makes the same bits): the products
    laid out [(n, p, q), c] and reduced over the first axis, which numpy adds row by row."""
    c, kh, kw = w_shape[0], *w_shape[2:]
    out_hw = g.shape[2:]
    dw = np.empty(w_shape, dtype=g.dtype)
    if _loops_take(g, xp):
        _depthwise_loops.weight_grad(np.ascontiguousarray(g), np.ascontiguousarray(xp), dw,
                                     _loop_dims(xp, dw, out_hw, stride, dil))
        return dw
    by_channel = g.transpose(0, 2, 3, 1)
    products = np.empty(by_channel.shape, dtype=g.dtype)
    for i, j, (rows, columns) in _offsets(kh, kw, out_hw, stride, dil):
        np.multiply(by_channel, xp[:, :, rows, columns].transpose(0, 2, 3, 1), out=products)
        dw[:, 0, i, j] = np.add.reduce(products.reshape(-1, c), axis=0)
    return dw


def _depthwise_vjp(g, x, w, stride, pad, dil, input_grad):
    kh, kw = w.shape[2:]
    out_hw = g.shape[2:]
    xp = pad_map(x, pad)
    dw = _depthwise_weight_grad(g, xp, w.shape, stride, dil)
    if not input_grad:
        return None, dw
    dxp = np.zeros(xp.shape, dtype=g.dtype)
    if _loops_take(g, w):
        _depthwise_loops.input_grad(np.ascontiguousarray(g), np.ascontiguousarray(w), dxp,
                                    _loop_dims(dxp, w, out_hw, stride, dil))
        return np.ascontiguousarray(_unpad(dxp, x.shape, pad)), dw
    term = np.empty_like(g)
    for i, j, (rows, columns) in _offsets(kh, kw, out_hw, stride, dil):
        np.multiply(g, w[:, 0, i, j][None, :, None, None], out=term)
        dxp[:, :, rows, columns] += term
    return np.ascontiguousarray(_unpad(dxp, x.shape, pad)), dw


def max_pool2d(x, k, stride, pad, dil) -> np.ndarray:
    out_hw = _out_hw(x.shape, *k, stride, pad, dil)
    xp = pad_map(x, pad, -np.inf)
    out = None
    for _, _, (rows, columns) in _offsets(*k, out_hw, stride, dil):
        out = xp[:, :, rows, columns].copy() if out is None else np.maximum(out, xp[:, :, rows, columns], out=out)
    return out


def max_pool2d_vjp(g, x, out, k, stride, pad, dil) -> np.ndarray:
    """The gradient goes to the first maximum of each window in row-major order (as torch's kernel picks it)."""
    xp = pad_map(x, pad, -np.inf)
    dxp = np.zeros(xp.shape, dtype=g.dtype)
    taken = np.zeros(out.shape, dtype=bool)
    for _, _, (rows, columns) in _offsets(*k, out.shape[2:], stride, dil):
        hit = xp[:, :, rows, columns] == out
        hit &= ~taken
        taken |= hit
        dxp[:, :, rows, columns] += np.where(hit, g, g.dtype.type(0))
    return np.ascontiguousarray(_unpad(dxp, x.shape, pad))


def avg_pool2d(x, k, stride, pad) -> np.ndarray:
    out_hw = _out_hw(x.shape, *k, stride, pad, (1, 1))
    xp = pad_map(x, pad)
    total = np.zeros((*x.shape[:2], *out_hw), dtype=x.dtype)
    for _, _, (rows, columns) in _offsets(*k, out_hw, stride, (1, 1)):
        total += xp[:, :, rows, columns]
    total /= x.dtype.type(k[0] * k[1])
    return total


def avg_pool2d_vjp(g, x_shape, k, stride, pad) -> np.ndarray:
    share = g / g.dtype.type(k[0] * k[1])
    dxp = np.zeros((*x_shape[:2], x_shape[2] + 2 * pad[0], x_shape[3] + 2 * pad[1]), dtype=g.dtype)
    for _, _, (rows, columns) in _offsets(*k, g.shape[2:], stride, (1, 1)):
        dxp[:, :, rows, columns] += share
    return np.ascontiguousarray(_unpad(dxp, x_shape, pad))
