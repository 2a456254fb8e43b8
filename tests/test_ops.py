"""Every op of cs_runtime/numerics/ops.py: the vjp against central differences
(float64), and forward plus vjp against torch.autograd (when torch is there),
on random shapes; and the shape rule against the forward's actual shape."""
import zlib

import numpy as np
import pytest

from cs_runtime.numerics import parallel
from cs_runtime.numerics.ops import OPS, OpError


def _f(rng, *shape):
    return rng.standard_normal(shape)


def _ids(rng, high, *shape):
    return rng.integers(0, high, size=shape)


def _torch_attention(F, qkv, heads, **kw):
    """self_attention's meaning in torch: split the packed projection, attend, merge the heads."""
    b, t, three_d = qkv.shape
    q, k, v = (p.reshape(b, t, heads, three_d // 3 // heads).transpose(1, 2) for p in qkv.split(three_d // 3, -1))
    return F.scaled_dot_product_attention(q, k, v, **kw).transpose(1, 2).reshape(b, t, three_d // 3)


def _cases():
    """(id, op, inputs(rng), attrs, torch function of (F, torch, tensors) or None)."""
    return [
        ("linear", "linear", lambda g: [_f(g, 2, 3, 4), _f(g, 5, 4), _f(g, 5)], {},
         lambda F, t, x: F.linear(*x)),
        ("linear_nobias", "linear", lambda g: [_f(g, 3, 4), _f(g, 5, 4)], {}, lambda F, t, x: F.linear(*x)),
        ("addmm", "addmm", lambda g: [_f(g, 5), _f(g, 3, 4), _f(g, 4, 5)], {}, lambda F, t, x: t.addmm(*x)),
        ("mm", "mm", lambda g: [_f(g, 3, 4), _f(g, 4, 2)], {}, lambda F, t, x: t.mm(*x)),
        ("bmm", "bmm", lambda g: [_f(g, 2, 3, 4), _f(g, 2, 4, 2)], {}, lambda F, t, x: t.bmm(*x)),
        ("matmul_bcast", "matmul", lambda g: [_f(g, 2, 3, 3, 4), _f(g, 3, 4, 2)], {},
         lambda F, t, x: t.matmul(*x)),
        ("matmul_w", "matmul", lambda g: [_f(g, 2, 3, 4), _f(g, 4, 5)], {}, lambda F, t, x: t.matmul(*x)),
        ("add_bcast", "add", lambda g: [_f(g, 2, 3, 4), _f(g, 3, 1)], {}, lambda F, t, x: x[0] + x[1]),
        ("add_alpha", "add", lambda g: [_f(g, 2, 3), _f(g, 2, 3)], {"alpha": 2.5},
         lambda F, t, x: t.add(x[0], x[1], alpha=2.5)),
        ("add_scalar", "add", lambda g: [_f(g, 2, 3)], {"scalar": 1.5}, lambda F, t, x: x[0] + 1.5),
        ("sub_bcast", "sub", lambda g: [_f(g, 4), _f(g, 2, 4)], {}, lambda F, t, x: x[0] - x[1]),
        ("rsub_scalar", "sub", lambda g: [_f(g, 2, 3)], {"scalar": 1.0, "reverse": True},
         lambda F, t, x: 1.0 - x[0]),
        ("mul_bcast", "mul", lambda g: [_f(g, 2, 1, 4), _f(g, 3, 1)], {}, lambda F, t, x: x[0] * x[1]),
        ("mul_scalar", "mul", lambda g: [_f(g, 2, 3)], {"scalar": -0.5}, lambda F, t, x: x[0] * -0.5),
        ("div_bcast", "div", lambda g: [_f(g, 2, 3), 2.0 + np.abs(_f(g, 3))], {}, lambda F, t, x: x[0] / x[1]),
        ("div_scalar", "div", lambda g: [_f(g, 2, 3)], {"scalar": 4.0}, lambda F, t, x: x[0] / 4.0),
        ("rdiv_scalar", "div", lambda g: [2.0 + np.abs(_f(g, 2, 3))], {"scalar": 3.0, "reverse": True},
         lambda F, t, x: 3.0 / x[0]),
        ("neg", "neg", lambda g: [_f(g, 2, 3)], {}, lambda F, t, x: -x[0]),
        ("relu", "relu", lambda g: [_f(g, 3, 4)], {}, lambda F, t, x: F.relu(x[0])),
        ("gelu_exact", "gelu", lambda g: [_f(g, 3, 4)], {"approximate": "none"}, lambda F, t, x: F.gelu(x[0])),
        ("gelu_tanh", "gelu", lambda g: [_f(g, 3, 4)], {"approximate": "tanh"},
         lambda F, t, x: F.gelu(x[0], approximate="tanh")),
        ("tanh", "tanh", lambda g: [_f(g, 3, 4)], {}, lambda F, t, x: t.tanh(x[0])),
        ("sigmoid", "sigmoid", lambda g: [_f(g, 3, 4)], {}, lambda F, t, x: t.sigmoid(x[0])),
        ("silu", "silu", lambda g: [_f(g, 3, 4)], {}, lambda F, t, x: F.silu(x[0])),
        ("softmax", "softmax", lambda g: [_f(g, 2, 3, 5)], {"dim": 1}, lambda F, t, x: t.softmax(x[0], 1)),
        ("log_softmax", "log_softmax", lambda g: [_f(g, 2, 5)], {"dim": -1},
         lambda F, t, x: t.log_softmax(x[0], -1)),
        ("layer_norm", "layer_norm", lambda g: [_f(g, 2, 3, 6), _f(g, 6), _f(g, 6)],
         {"normalized_shape": [6], "eps": 1e-5}, lambda F, t, x: F.layer_norm(x[0], [6], x[1], x[2], 1e-5)),
        ("layer_norm_nobias", "layer_norm", lambda g: [_f(g, 4, 6), _f(g, 6)],
         {"normalized_shape": [6], "eps": 1e-5}, lambda F, t, x: F.layer_norm(x[0], [6], x[1], None, 1e-5)),
        ("embedding", "embedding", lambda g: [_f(g, 7, 4), _ids(g, 7, 2, 5)], {},
         lambda F, t, x: F.embedding(x[1], x[0])),
        ("embedding_pad", "embedding", lambda g: [_f(g, 7, 4), np.array([[0, 1, 0, 3]])], {"padding_idx": 0},
         lambda F, t, x: F.embedding(x[1], x[0], padding_idx=0)),
        ("gather", "gather", lambda g: [_f(g, 3, 5), _ids(g, 5, 3, 2)], {"dim": 1},
         lambda F, t, x: t.gather(x[0], 1, x[1])),
        ("dropout_p0", "dropout", lambda g: [_f(g, 3, 4)], {"p": 0.0}, lambda F, t, x: F.dropout(x[0], 0.0)),
        ("dropout_mask", "dropout", lambda g: [_f(g, 3, 4), (g.random((3, 4)) > 0.5) * 2.0], {"p": 0.5},
         lambda F, t, x: x[0] * x[1]),
        ("position_embedding", "position_embedding", lambda g: [_f(g, 6, 4), _ids(g, 9, 2, 3)], {},
         lambda F, t, x: x[0][:x[1].shape[-1]]),
        ("self_attention_causal", "self_attention", lambda g: [_f(g, 2, 3, 12)], {"heads": 2, "causal": True},
         lambda F, t, x: _torch_attention(F, x[0], 2, is_causal=True)),
        ("self_attention_keys", "self_attention", lambda g: [_f(g, 2, 4, 6), np.array([[1, 1, 0, 1], [1, 0, 0, 0]], bool)],
         {"heads": 1, "key_keep": True},
         lambda F, t, x: _torch_attention(F, x[0], 1, attn_mask=x[1][:, None, None, :])),
        ("reshape", "reshape", lambda g: [_f(g, 2, 3, 4)], {"shape": [6, -1]},
         lambda F, t, x: x[0].reshape(6, -1)),
        ("permute", "permute", lambda g: [_f(g, 2, 3, 4)], {"dims": [2, 0, 1]},
         lambda F, t, x: x[0].permute(2, 0, 1)),
        ("transpose", "transpose", lambda g: [_f(g, 2, 3, 4)], {"dim0": -2, "dim1": -1},
         lambda F, t, x: x[0].transpose(-2, -1)),
        ("expand", "expand", lambda g: [_f(g, 3, 1)], {"shape": [2, 3, 4]}, lambda F, t, x: x[0].expand(2, 3, 4)),
        ("slice", "slice", lambda g: [_f(g, 3, 8)], {"dim": 1, "start": 2, "end": 7, "step": 2},
         lambda F, t, x: x[0][:, 2:7:2]),
        ("unsqueeze", "unsqueeze", lambda g: [_f(g, 3, 4)], {"dim": 1}, lambda F, t, x: x[0].unsqueeze(1)),
        ("squeeze", "squeeze", lambda g: [_f(g, 3, 1, 4)], {"dims": [1]}, lambda F, t, x: x[0].squeeze(1)),
        ("clone", "clone", lambda g: [_f(g, 3, 4)], {}, lambda F, t, x: x[0].clone()),
        ("flatten", "flatten", lambda g: [_f(g, 2, 3, 4)], {"start_dim": 1}, lambda F, t, x: x[0].flatten(1)),
        ("where", "where", lambda g: [g.random((3, 4)) > 0.5, _f(g, 3, 4), _f(g, 4)], {},
         lambda F, t, x: t.where(*x)),
        ("where_scalar", "where", lambda g: [g.random((3, 4)) > 0.5, _f(g, 3, 4)], {"other_scalar": -100.0},
         lambda F, t, x: t.where(x[0], x[1], -100.0)),
        ("masked_fill_causal", "masked_fill", lambda g: [_f(g, 2, 4, 4), ~np.tril(np.ones((4, 4), bool))],
         {"value": -1e4}, lambda F, t, x: x[0].masked_fill(x[1], -1e4)),
        ("masked_fill_padding", "masked_fill", lambda g: [_f(g, 2, 2, 3, 3), np.array([[0, 0, 1], [0, 1, 1]],
                                                                                    bool)[:, None, None, :]],
         {"value": -100.0}, lambda F, t, x: x[0].masked_fill(x[1], -100.0)),
        ("sum_all", "sum", lambda g: [_f(g, 2, 3)], {}, lambda F, t, x: x[0].sum()),
        ("sum_dim", "sum", lambda g: [_f(g, 2, 3, 4)], {"dim": [1], "keepdim": True},
         lambda F, t, x: x[0].sum(1, keepdim=True)),
        ("mean_dims", "mean", lambda g: [_f(g, 2, 3, 4)], {"dim": [0, 2]}, lambda F, t, x: x[0].mean((0, 2))),
        ("sdpa", "scaled_dot_product_attention", lambda g: [_f(g, 2, 2, 4, 3), _f(g, 2, 2, 5, 3),
                                                            _f(g, 2, 2, 5, 3)], {},
         lambda F, t, x: F.scaled_dot_product_attention(*x)),
        ("sdpa_causal", "scaled_dot_product_attention", lambda g: [_f(g, 2, 2, 4, 3) for _ in range(3)],
         {"is_causal": True}, lambda F, t, x: F.scaled_dot_product_attention(*x, is_causal=True)),
        ("sdpa_boolmask", "scaled_dot_product_attention",
         lambda g: [_f(g, 2, 2, 3, 3) for _ in range(3)] + [np.array([[1, 1, 0], [1, 0, 0]], bool)[:, None, None]],
         {}, lambda F, t, x: F.scaled_dot_product_attention(*x[:3], attn_mask=x[3])),
        ("sdpa_floatmask", "scaled_dot_product_attention", lambda g: [_f(g, 1, 2, 3, 4) for _ in range(4)][:3]
         + [_f(g, 3, 3)], {}, lambda F, t, x: F.scaled_dot_product_attention(*x[:3], attn_mask=x[3])),
        ("conv2d", "conv2d", lambda g: [_f(g, 2, 3, 7, 6), _f(g, 4, 3, 3, 2), _f(g, 4)],
         {"stride": [2, 1], "padding": [1, 1]}, lambda F, t, x: F.conv2d(*x, stride=(2, 1), padding=1)),
        ("conv2d_dil", "conv2d", lambda g: [_f(g, 1, 2, 7, 7), _f(g, 3, 2, 3, 3)],
         {"dilation": [2, 2]}, lambda F, t, x: F.conv2d(*x, dilation=2)),
        ("max_pool2d", "max_pool2d", lambda g: [_f(g, 2, 3, 6, 7)], {"kernel_size": [2, 2]},
         lambda F, t, x: F.max_pool2d(x[0], 2)),
        ("max_pool2d_pad", "max_pool2d", lambda g: [_f(g, 1, 2, 5, 5)],
         {"kernel_size": [3, 3], "stride": [2, 2], "padding": [1, 1]},
         lambda F, t, x: F.max_pool2d(x[0], 3, 2, 1)),
        ("avg_pool2d", "avg_pool2d", lambda g: [_f(g, 2, 3, 6, 6)], {"kernel_size": [3, 3], "stride": [2, 2],
                                                                   "padding": [1, 1]},
         lambda F, t, x: F.avg_pool2d(x[0], 3, 2, 1)),
        ("cross_entropy", "cross_entropy", lambda g: [_f(g, 5, 4), np.array([0, 3, -100, 1, 2])],
         {"ignore_index": -100}, lambda F, t, x: F.cross_entropy(x[0], x[1], ignore_index=-100)),
        ("cross_entropy_3d", "cross_entropy", lambda g: [_f(g, 2, 4, 3), np.array([[0, 3, -1], [1, -1, 2]])],
         {"ignore_index": -1}, lambda F, t, x: F.cross_entropy(x[0], x[1], ignore_index=-1)),
        ("softmax_cross_entropy", "softmax_cross_entropy",   # a shard of 5 rows of a global batch of 10
         lambda g: [_f(g, 5, 4), np.array([0, 3, 2, 1, 2]), np.array([0, 0, 0, 5, 10, 1])], {},
         lambda F, t, x: F.cross_entropy(x[0], x[1], reduction="sum") / 10),
        ("nll_loss", "nll_loss", lambda g: [_f(g, 5, 4), np.array([0, 3, 2, 1, 2])], {},
         lambda F, t, x: F.nll_loss(x[0], x[1])),
        ("mse", "mse_loss", lambda g: [_f(g, 3, 4), _f(g, 3, 4)], {}, lambda F, t, x: F.mse_loss(x[0], x[1])),
        ("mse_sum", "mse_loss", lambda g: [_f(g, 3, 4), _f(g, 3, 4)], {"reduction": "sum"},
         lambda F, t, x: F.mse_loss(x[0], x[1], reduction="sum")),
    ]


def _pos(rng, *shape):
    return 0.5 + rng.random(shape)


def _unit(rng, *shape):
    return rng.uniform(-0.8, 0.8, shape)


def _distinct(rng, *shape):
    """Values with no ties (an extremum's gradient is then one element's)."""
    return rng.permutation(_numel(shape)).reshape(shape) * 0.1 + rng.random(shape) * 0.01


def _numel(shape):
    return int(np.prod(shape)) if shape else 1


def _bools(rng, *shape):
    return rng.random(shape) > 0.5


def _core_aten_cases():
    """The Core ATen ops a model written by others is made of after run_decompositions."""
    unary = [("abs", _f, "abs"), ("exp", _f, "exp"), ("expm1", _f, "expm1"), ("log", _pos, "log"),
             ("log1p", _pos, "log1p"), ("log2", _pos, "log2"), ("log10", _pos, "log10"), ("sqrt", _pos, "sqrt"),
             ("rsqrt", _pos, "rsqrt"), ("reciprocal", _pos, "reciprocal"), ("sin", _f, "sin"), ("cos", _f, "cos"),
             ("tan", _unit, "tan"), ("sinh", _f, "sinh"), ("cosh", _f, "cosh"), ("asin", _unit, "asin"),
             ("acos", _unit, "acos"), ("atan", _f, "atan"), ("asinh", _f, "asinh"),
             ("acosh", lambda g, *s: 1.5 + g.random(s), "acosh"), ("atanh", _unit, "atanh"), ("erf", _f, "erf"),
             ("sign", _f, "sign"), ("floor", _f, "floor"), ("ceil", _f, "ceil"), ("round", _f, "round"),
             ("trunc", _f, "trunc")]
    cases = [(name, name, (lambda make: lambda g: [make(g, 3, 4)])(make), {},
              (lambda fn: lambda F, t, x: getattr(t, fn)(x[0]))(fn)) for name, make, fn in unary]
    return cases + [
        ("pow_scalar", "pow", lambda g: [_f(g, 3, 4)], {"scalar": 3.0}, lambda F, t, x: x[0] ** 3),
        ("pow_half", "pow", lambda g: [_pos(g, 3, 4)], {"scalar": 0.5}, lambda F, t, x: x[0] ** 0.5),
        ("pow_tensor", "pow", lambda g: [_pos(g, 2, 3), _f(g, 3)], {}, lambda F, t, x: x[0] ** x[1]),
        ("pow_base", "pow", lambda g: [_f(g, 2, 3)], {"scalar": 2.0, "reverse": True},
         lambda F, t, x: 2.0 ** x[0]),
        ("maximum", "maximum", lambda g: [_f(g, 2, 3), _f(g, 3)], {}, lambda F, t, x: t.maximum(*x)),
        ("minimum", "minimum", lambda g: [_f(g, 2, 3), _f(g, 2, 1)], {}, lambda F, t, x: t.minimum(*x)),
        ("atan2", "atan2", lambda g: [_f(g, 2, 3), _pos(g, 2, 3)], {}, lambda F, t, x: t.atan2(*x)),
        ("fmod", "fmod", lambda g: [_f(g, 2, 3) * 3, _pos(g, 3)], {}, lambda F, t, x: t.fmod(*x)),
        ("remainder", "remainder", lambda g: [_f(g, 2, 3) * 3, _pos(g, 3)], {},
         lambda F, t, x: t.remainder(*x)),
        ("logical_and", "logical_and", lambda g: [_bools(g, 2, 3), _bools(g, 3)], {},
         lambda F, t, x: t.logical_and(*x)),
        ("bitwise_and", "bitwise_and", lambda g: [_bools(g, 2, 3), _bools(g, 2, 3)], {},
         lambda F, t, x: x[0] & x[1]),
        ("bitwise_or_int", "bitwise_or", lambda g: [_ids(g, 9, 2, 3), _ids(g, 9, 3)], {},
         lambda F, t, x: x[0] | x[1]),
        ("logical_xor", "logical_xor", lambda g: [_bools(g, 2, 3), _bools(g, 2, 3)], {},
         lambda F, t, x: t.logical_xor(*x)),
        ("isnan", "isnan", lambda g: [np.where(_bools(g, 3, 2), np.nan, _f(g, 3, 2))], {},
         lambda F, t, x: t.isnan(x[0])),
        ("clamp", "clamp", lambda g: [_f(g, 3, 4)], {"min": -0.5, "max": 0.7},
         lambda F, t, x: t.clamp(x[0], -0.5, 0.7)),
        ("clamp_min", "clamp", lambda g: [_f(g, 3, 4)], {"min": 0.1}, lambda F, t, x: t.clamp(x[0], min=0.1)),
        ("leaky_relu", "leaky_relu", lambda g: [_f(g, 3, 4)], {"negative_slope": 0.2},
         lambda F, t, x: F.leaky_relu(x[0], 0.2)),
        ("elu", "elu", lambda g: [_f(g, 3, 4)], {"alpha": 1.5}, lambda F, t, x: F.elu(x[0], 1.5)),
        ("amax", "amax", lambda g: [_distinct(g, 2, 3, 4)], {"dim": [1], "keepdim": False},
         lambda F, t, x: t.amax(x[0], 1)),
        ("amin_ties", "amin", lambda g: [np.array([[1.0, 0.5, 0.5], [2.0, 3.0, 2.0]])], {"dim": [-1],
                                                                                         "keepdim": True},
         lambda F, t, x: t.amin(x[0], -1, keepdim=True)),
        ("max_dim", "max_dim", lambda g: [_distinct(g, 3, 4)], {"dim": 1, "keepdim": False},
         lambda F, t, x: t.max(x[0], 1).values),
        ("min_dim", "min_dim", lambda g: [_distinct(g, 3, 4)], {"dim": 0, "keepdim": True},
         lambda F, t, x: t.min(x[0], 0, keepdim=True).values),
        ("argmax", "argmax", lambda g: [_distinct(g, 3, 4)], {"dim": 1}, lambda F, t, x: t.argmax(x[0], 1)),
        ("argmin_all", "argmin", lambda g: [_distinct(g, 3, 4)], {}, lambda F, t, x: t.argmin(x[0])),
        ("any", "any", lambda g: [_bools(g, 3, 4)], {"dim": [1], "keepdim": False},
         lambda F, t, x: t.any(x[0], 1)),
        ("var", "var", lambda g: [_f(g, 3, 4, 2)], {"dim": [1, 2], "correction": 1, "keepdim": True},
         lambda F, t, x: t.var(x[0], (1, 2), keepdim=True)),
        ("var_biased", "var", lambda g: [_f(g, 3, 4)], {"dim": None, "correction": 0},
         lambda F, t, x: t.var(x[0], correction=0)),
        ("prod", "prod", lambda g: [_f(g, 3, 4)], {"dim": [1], "keepdim": False},
         lambda F, t, x: t.prod(x[0], 1)),
        ("prod_zero", "prod", lambda g: [np.array([[0.0, 2.0, 3.0], [1.0, -1.0, 0.5]])], {"dim": [1]},
         lambda F, t, x: t.prod(x[0], 1)),
        ("topk", "topk", lambda g: [_distinct(g, 3, 6)], {"k": 2, "dim": 1, "largest": True},
         lambda F, t, x: t.topk(x[0], 2, 1).values),
        ("topk_smallest", "topk", lambda g: [_distinct(g, 4, 3)], {"k": 3, "dim": 0, "largest": False},
         lambda F, t, x: t.topk(x[0], 3, 0, largest=False).values),
        ("topk_indices", "topk_indices", lambda g: [_distinct(g, 3, 6)], {"k": 4, "dim": -1, "largest": True},
         lambda F, t, x: t.topk(x[0], 4, -1).indices),
        ("sort_descending", "topk", lambda g: [_distinct(g, 3, 5)], {"dim": 1, "largest": True},
         lambda F, t, x: t.sort(x[0], 1, descending=True).values),
        ("cumsum", "cumsum", lambda g: [_f(g, 3, 4)], {"dim": 1}, lambda F, t, x: t.cumsum(x[0], 1)),
        ("cat", "cat", lambda g: [_f(g, 2, 3), _f(g, 2, 1), _f(g, 2, 2)], {"dim": -1},
         lambda F, t, x: t.cat(x, -1)),
        ("select", "select", lambda g: [_f(g, 2, 3, 4)], {"dim": 1, "index": -1}, lambda F, t, x: x[0][:, -1]),
        ("constant_pad_nd", "constant_pad_nd", lambda g: [_f(g, 2, 3, 4)], {"pad": [1, 2, 0, 1], "value": 0.5},
         lambda F, t, x: F.pad(x[0], (1, 2, 0, 1), value=0.5)),
        ("index_rows", "index", lambda g: [_f(g, 5, 3), _ids(g, 5, 2, 4)], {"dims": [0]},
         lambda F, t, x: x[0][x[1]]),
        ("index_split_dims", "index", lambda g: [_f(g, 4, 3, 5), _ids(g, 4, 2), _ids(g, 5, 2)], {"dims": [0, 2]},
         lambda F, t, x: x[0][x[1], :, x[2]]),
        ("index_select", "index_select", lambda g: [_f(g, 3, 5), np.array([4, 0, 4])], {"dim": 1},
         lambda F, t, x: t.index_select(x[0], 1, x[1])),
        ("flip", "flip", lambda g: [_f(g, 2, 3, 4)], {"dims": [0, 2]}, lambda F, t, x: t.flip(x[0], (0, 2))),
        ("repeat", "repeat", lambda g: [_f(g, 2, 3)], {"repeats": [2, 1, 3]}, lambda F, t, x: x[0].repeat(2, 1, 3)),
        ("conv2d_depthwise", "conv2d", lambda g: [_f(g, 2, 4, 5, 5), _f(g, 4, 1, 3, 3), _f(g, 4)],
         {"stride": [2, 2], "padding": [1, 1], "groups": 4},
         lambda F, t, x: F.conv2d(x[0], x[1], x[2], stride=2, padding=1, groups=4)),
        ("conv2d_groups", "conv2d", lambda g: [_f(g, 1, 4, 4, 4), _f(g, 6, 2, 3, 3)], {"groups": 2},
         lambda F, t, x: F.conv2d(x[0], x[1], groups=2)),
        ("batch_norm_train", "batch_norm", lambda g: [_f(g, 4, 3, 2, 2), _f(g, 3), _f(g, 3)],
         {"training": True, "eps": 1e-5},
         lambda F, t, x: F.batch_norm(x[0], None, None, x[1], x[2], training=True, eps=1e-5)),
        ("batch_norm_1d", "batch_norm", lambda g: [_f(g, 5, 3), _f(g, 3), _f(g, 3)],
         {"training": True, "eps": 1e-3},
         lambda F, t, x: F.batch_norm(x[0], None, None, x[1], x[2], training=True, eps=1e-3)),
        ("slice_scatter", "slice_scatter", lambda g: [_f(g, 3, 5), _f(g, 3, 2)], {"dim": 1, "start": 1, "end": 5,
                                                                                   "step": 2},
         lambda F, t, x: t.slice_scatter(x[0], x[1], 1, 1, 5, 2)),
        ("select_scatter", "select_scatter", lambda g: [_f(g, 3, 4), _f(g, 4)], {"dim": 0, "index": 1},
         lambda F, t, x: t.select_scatter(x[0], x[1], 0, 1)),
        ("scatter", "scatter", lambda g: [_f(g, 3, 5), np.array([[0, 4], [2, 1], [3, 1]]), _f(g, 3, 2)], {"dim": 1},
         lambda F, t, x: t.scatter(x[0], 1, x[1], x[2])),
        ("scatter_add", "scatter", lambda g: [_f(g, 3, 5), np.array([[0, 4], [2, 2], [3, 3]]), _f(g, 3, 2)],
         {"dim": 1, "reduce": "sum"}, lambda F, t, x: t.scatter_add(x[0], 1, x[1], x[2])),
        ("scatter_value", "scatter", lambda g: [_f(g, 3, 5), np.array([[0], [2], [4]])], {"dim": 1, "value": 1.5},
         lambda F, t, x: t.scatter(x[0], 1, x[1], 1.5)),
        ("index_put", "index_put", lambda g: [_f(g, 5, 3), np.array([4, 0]), _f(g, 2, 3)], {"dims": [0]},
         lambda F, t, x: t.index_put(x[0], (x[1],), x[2])),
        ("index_put_acc", "index_put", lambda g: [_f(g, 5, 3), np.array([4, 0, 4]), _f(g, 3)],
         {"dims": [0], "accumulate": True}, lambda F, t, x: t.index_put(x[0], (x[1],), x[2], accumulate=True)),
        ("copy", "copy", lambda g: [_f(g, 2, 3), _f(g, 3)], {}, lambda F, t, x: x[0] * 0 + x[1]),
        ("full_like", "full_like", lambda g: [_f(g, 2, 3)], {"value": 2.5, "dtype": "float64"},
         lambda F, t, x: t.full_like(x[0], 2.5) + x[0] * 0),
        ("group_norm", "group_norm", lambda g: [_f(g, 2, 6, 2, 2), _f(g, 6), _f(g, 6)], {"groups": 3, "eps": 1e-5},
         lambda F, t, x: F.group_norm(x[0], 3, x[1], x[2], 1e-5)),
        ("upsample_nearest2d", "upsample_nearest2d", lambda g: [_f(g, 1, 2, 2, 3)], {"size": [4, 9]},
         lambda F, t, x: F.interpolate(x[0], size=(4, 9), mode="nearest")),
        *_rest_of_core_aten_cases(),
        ("batch_norm_eval", "batch_norm", lambda g: [_f(g, 4, 3, 2, 2), _f(g, 3), _f(g, 3), _f(g, 3), _pos(g, 3)],
         {"training": False, "eps": 1e-5},
         lambda F, t, x: F.batch_norm(x[0], x[3].detach(), x[4].detach(), x[1], x[2], training=False, eps=1e-5)),
    ]


def _rest_of_core_aten_cases():
    """The last Core ATen ops with a meaning for dense tensors: diagonal, padding by the
    edges, bilinear upsampling, distances, scatter with a reduction, col2im, 3-d pools."""
    return [
        ("diagonal", "diagonal", lambda g: [_f(g, 3, 4, 2)], {"offset": 1, "dim1": 0, "dim2": 1},
         lambda F, t, x: t.diagonal(x[0], 1, 0, 1)),
        ("diagonal_below", "diagonal", lambda g: [_f(g, 2, 4, 3)], {"offset": -1, "dim1": -1, "dim2": 1},
         lambda F, t, x: t.diagonal(x[0], -1, -1, 1)),
        ("reflect_pad1d", "pad_edges", lambda g: [_f(g, 2, 2, 5)], {"pad": [3, 1], "mode": "reflect"},
         lambda F, t, x: F.pad(x[0], (3, 1), mode="reflect")),
        ("reflect_pad2d", "pad_edges", lambda g: [_f(g, 1, 2, 3, 4)], {"pad": [1, 2, 2, 0], "mode": "reflect"},
         lambda F, t, x: F.pad(x[0], (1, 2, 2, 0), mode="reflect")),
        ("replicate_pad3d", "pad_edges", lambda g: [_f(g, 1, 1, 2, 3, 2)], {"pad": [1, 0, 2, 1, 0, 2],
                                                                             "mode": "replicate"},
         lambda F, t, x: F.pad(x[0], (1, 0, 2, 1, 0, 2), mode="replicate")),
        ("circular_pad2d", "pad_edges", lambda g: [_f(g, 1, 2, 3, 3)], {"pad": [2, 1, 0, 3], "mode": "circular"},
         lambda F, t, x: F.pad(x[0], (2, 1, 0, 3), mode="circular")),
        ("bilinear", "upsample_bilinear2d", lambda g: [_f(g, 2, 2, 3, 4)], {"size": [5, 7]},
         lambda F, t, x: F.interpolate(x[0], size=(5, 7), mode="bilinear")),
        ("bilinear_corners", "upsample_bilinear2d", lambda g: [_f(g, 1, 2, 4, 3)],
         {"size": [7, 6], "align_corners": True},
         lambda F, t, x: F.interpolate(x[0], size=(7, 6), mode="bilinear", align_corners=True)),
        ("bilinear_scale", "upsample_bilinear2d", lambda g: [_f(g, 1, 1, 3, 5)], {"size": [4, 7],
                                                                                  "scales": [1.5, 1.5]},
         lambda F, t, x: F.interpolate(x[0], scale_factor=1.5, mode="bilinear")),
        ("bilinear_down", "upsample_bilinear2d", lambda g: [_f(g, 1, 1, 6, 5)], {"size": [4, 2]},
         lambda F, t, x: F.interpolate(x[0], size=(4, 2), mode="bilinear")),
        ("cdist", "cdist", lambda g: [_f(g, 2, 3, 4), _f(g, 2, 5, 4)], {"p": 2.0},
         lambda F, t, x: t.cdist(x[0], x[1])),
        ("cdist_bcast_p1", "cdist", lambda g: [_f(g, 3, 4), _f(g, 2, 2, 4)], {"p": 1.0},
         lambda F, t, x: t.cdist(x[0], x[1], p=1.0)),
        ("cdist_p3", "cdist", lambda g: [_f(g, 3, 2), _f(g, 4, 2)], {"p": 3.0},
         lambda F, t, x: t.cdist(x[0], x[1], p=3.0)),
        ("cdist_inf", "cdist", lambda g: [_distinct(g, 3, 2), _distinct(g, 2, 2) + 5], {"p": float("inf")},
         lambda F, t, x: t.cdist(x[0], x[1], p=float("inf"))),
        ("pdist", "pdist", lambda g: [_f(g, 4, 3)], {"p": 2.0}, lambda F, t, x: F.pdist(x[0])),
        ("pdist_p1", "pdist", lambda g: [_f(g, 3, 2)], {"p": 1.0}, lambda F, t, x: F.pdist(x[0], p=1.0)),
        ("scatter_reduce_sum", "scatter_reduce", lambda g: [_f(g, 3, 4), np.array([[0, 2], [3, 3], [1, 0]]),
                                                            _f(g, 3, 2)], {"dim": 1, "reduce": "sum"},
         lambda F, t, x: t.scatter_reduce(x[0], 1, x[1], x[2], "sum")),
        ("scatter_reduce_mean", "scatter_reduce", lambda g: [_f(g, 4, 2), np.array([[0, 1], [0, 1], [3, 1]]),
                                                             _f(g, 3, 2)], {"dim": 0, "reduce": "mean",
                                                                            "include_self": False},
         lambda F, t, x: t.scatter_reduce(x[0], 0, x[1], x[2], "mean", include_self=False)),
        ("scatter_reduce_amax", "scatter_reduce", lambda g: [_distinct(g, 2, 4), np.array([[1, 1, 3], [0, 2, 2]]),
                                                             _distinct(g, 2, 3)], {"dim": 1, "reduce": "amax"},
         lambda F, t, x: t.scatter_reduce(x[0], 1, x[1], x[2], "amax")),
        ("scatter_reduce_amin", "scatter_reduce", lambda g: [_distinct(g, 2, 4), np.array([[1, 1], [0, 3]]),
                                                             _distinct(g, 2, 2)], {"dim": 1, "reduce": "amin",
                                                                                   "include_self": False},
         lambda F, t, x: t.scatter_reduce(x[0], 1, x[1], x[2], "amin", include_self=False)),
        ("col2im", "col2im", lambda g: [_f(g, 2, 2 * 2 * 3, 6)], {"output_size": [4, 5], "kernel_size": [2, 3],
                                                                   "stride": [2, 1], "padding": [0, 0],
                                                                   "dilation": [1, 1]},
         lambda F, t, x: F.fold(x[0], (4, 5), (2, 3), stride=(2, 1))),
        ("col2im_pad", "col2im", lambda g: [_f(g, 1, 3 * 4, 9)], {"output_size": [3, 3], "kernel_size": [2, 2],
                                                                   "stride": [1, 1], "padding": [1, 1],
                                                                   "dilation": [2, 2]},
         lambda F, t, x: F.fold(x[0], (3, 3), 2, dilation=2, padding=1)),
        ("max_pool3d", "max_pool3d", lambda g: [_distinct(g, 1, 2, 4, 3, 4)],
         {"kernel_size": [2, 2, 2], "stride": [2, 1, 2], "padding": [1, 0, 1]},
         lambda F, t, x: F.max_pool3d(x[0], 2, (2, 1, 2), (1, 0, 1))),
        ("max_pool3d_dil", "max_pool3d", lambda g: [_distinct(g, 1, 1, 5, 4, 4)],
         {"kernel_size": [2, 2, 2], "dilation": [2, 1, 1]},
         lambda F, t, x: F.max_pool3d(x[0], 2, dilation=(2, 1, 1))),
        ("grid_sample", "grid_sampler_2d", lambda g: [_f(g, 2, 2, 3, 4), g.uniform(-1.2, 1.2, (2, 2, 3, 2))], {},
         lambda F, t, x: F.grid_sample(x[0], x[1], align_corners=False)),
        ("grid_sample_border", "grid_sampler_2d", lambda g: [_f(g, 1, 2, 4, 3), g.uniform(-1.3, 1.3, (1, 3, 2, 2))],
         {"padding_mode": 1, "align_corners": True},
         lambda F, t, x: F.grid_sample(x[0], x[1], padding_mode="border", align_corners=True)),
        ("grid_sample_nearest", "grid_sampler_2d", lambda g: [_f(g, 1, 2, 3, 3), g.uniform(-1, 1, (1, 2, 2, 2))],
         {"interpolation_mode": 1}, lambda F, t, x: F.grid_sample(x[0], x[1], mode="nearest", align_corners=False)),
        ("avg_pool3d", "avg_pool3d", lambda g: [_f(g, 2, 1, 4, 4, 3)],
         {"kernel_size": [2, 3, 2], "stride": [2, 1, 1], "padding": [1, 1, 0]},
         lambda F, t, x: F.avg_pool3d(x[0], (2, 3, 2), (2, 1, 1), (1, 1, 0))),
    ]


CASES = _cases() + _core_aten_cases()
IDS = [c[0] for c in CASES]


def _differentiable(x):
    return isinstance(x, np.ndarray) and x.dtype.kind == "f"


# Inputs that are a module's buffers (batch norm's running statistics): never trained, no gradient.
BUFFER_INPUTS = {"batch_norm": (3, 4)}


def _only_saved(op, inputs, out):
    """The inputs and output with what the rule says it does not read replaced by NaN:
    a rule reading more than it declares (so backward would not have kept it) fails."""
    def blank(x):
        return np.full(x.shape, np.nan) if x.dtype.kind == "f" else x
    ins = [x if i in op.saves_inputs else blank(x) for i, x in enumerate(inputs)]
    return ins, (out if op.saves_output else blank(out))


def _numeric_grads(op, inputs, attrs, g, eps=1e-6):
    grads = []
    for i, x in enumerate(inputs):
        if not _differentiable(x):
            grads.append(None)
            continue
        grad = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            shifted = [y.copy() if j == i else y for j, y in enumerate(inputs)]
            shifted[i][idx] = x[idx] + eps
            up = float((op.forward(shifted, attrs) * g).sum())
            shifted[i][idx] = x[idx] - eps
            down = float((op.forward(shifted, attrs) * g).sum())
            grad[idx] = (up - down) / (2 * eps)
        grads.append(grad)
    return grads


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_vjp_matches_finite_differences(case):
    _, name, make, attrs, _ = case
    rng = np.random.default_rng(zlib.crc32(case[0].encode()))
    inputs = make(rng)
    op = OPS[name]
    out = op.forward(inputs, attrs)
    assert out.shape == op.shape([x.shape for x in inputs], attrs)
    g = rng.standard_normal(out.shape)
    analytic = op.vjp(g, *_only_saved(op, inputs, out), attrs)
    assert len(analytic) == len(inputs)
    if out.dtype.kind != "f":   # a mask, an index: nothing flows back through it
        assert all(a is None for a in analytic)
        return
    for i, (x, a, n) in enumerate(zip(inputs, analytic, _numeric_grads(op, inputs, attrs, g))):
        if n is None or i in BUFFER_INPUTS.get(name, ()):
            assert a is None
            continue
        assert a.shape == x.shape
        if name == "embedding" and "padding_idx" in attrs:
            n[attrs["padding_idx"]] = 0   # by definition (torch's), not by calculus
        np.testing.assert_allclose(a, n, rtol=1e-5, atol=1e-6)
    assert op.flops([x.shape for x in inputs], out.shape, attrs) >= 0


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_and_vjp_match_torch_autograd(case):
    torch = pytest.importorskip("torch", reason="torch is the oracle of the op set; it is an optional extra")
    F = torch.nn.functional
    _, name, make, attrs, torch_fn = case
    rng = np.random.default_rng(7 + len(case[0]))
    inputs = make(rng)
    tensors = [torch.tensor(x, requires_grad=_differentiable(x) and i not in BUFFER_INPUTS.get(name, ()))
               for i, x in enumerate(inputs)]
    expected = torch_fn(F, torch, tensors)
    op = OPS[name]
    out = op.forward(inputs, attrs)
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-10, atol=1e-12)
    assert out.dtype == expected.detach().numpy().dtype
    if out.dtype.kind != "f":
        return
    g = rng.standard_normal(out.shape)
    expected.backward(torch.tensor(g))
    for t, a in zip(tensors, op.vjp(g, inputs, out, attrs)):
        if t.requires_grad:
            np.testing.assert_allclose(a, t.grad.numpy(), rtol=1e-9, atol=1e-11)


def test_float32_stays_float32():
    x = np.ones((2, 3), np.float32)
    for name, attrs in [("gelu", {}), ("gelu", {"approximate": "tanh"}), ("softmax", {"dim": -1}),
                        ("mul", {"scalar": 0.5}), ("layer_norm", {"normalized_shape": [3]}),
                        ("rsqrt", {}), ("erf", {}), ("pow", {"scalar": 2.0}), ("pow", {"scalar": 0.5}),
                        ("clamp", {"min": 0.0}), ("var", {"dim": [1]}), ("elu", {})]:
        assert OPS[name].forward([x], attrs).dtype == np.float32, name
    c = np.ones(3, np.float32)
    assert OPS["batch_norm"].forward([x, c, c], {"training": True}).dtype == np.float32
    assert OPS["batch_norm"].forward([x, c, c, c, c], {"training": False}).dtype == np.float32


REST_OF_CORE_ATEN = _rest_of_core_aten_cases()


@pytest.mark.parametrize("case", REST_OF_CORE_ATEN, ids=[c[0] for c in REST_OF_CORE_ATEN])
def test_the_last_core_aten_ops_keep_float32_and_their_shape_rule(case):
    """Training runs in float32: forward and gradients stay in it, each the shape the shape
    rule gives."""
    _, name, make, attrs, _ = case
    inputs = [x.astype(np.float32) if x.dtype.kind == "f" else x for x in make(np.random.default_rng(11))]
    op = OPS[name]
    out = op.forward(inputs, attrs)
    assert out.dtype == np.float32 and out.shape == op.shape([x.shape for x in inputs], attrs)
    grads = op.vjp(np.ones(out.shape, np.float32), inputs, out, attrs)
    assert all(g is None or (g.dtype == np.float32 and g.shape == x.shape) for g, x in zip(grads, inputs))


@pytest.mark.parametrize("name,shapes,attrs,words", [
    ("linear", [(2, 3), (4, 5)], {}, "linear of input (2, 3)"),
    ("matmul", [(2, 3), (4, 5)], {}, "inner dims"),
    ("add", [(2, 3), (4,)], {}, "do not broadcast"),
    ("reshape", [(2, 3)], {"shape": [4, -1]}, "reshape of (2, 3)"),
    ("conv2d", [(1, 3, 5, 5), (2, 3, 3, 3)], {"groups": 3}, "groups=3"),
    ("cross_entropy", [(4, 3), (5,)], {}, "targets (5,)"),
    ("pad_edges", [(2, 3)], {"pad": [3, 0], "mode": "reflect"}, "reflect padding of 3 and 0 for a dim of size 3"),
    ("cdist", [(2, 3), (4, 2)], {}, "cdist of (2, 3) and (4, 2)"),
    ("col2im", [(1, 12, 5)], {"output_size": [3, 3], "kernel_size": [2, 2]}, "col2im of (1, 12, 5)"),
    ("max_pool3d", [(1, 2, 3, 3)], {"kernel_size": [2, 2, 2]}, "3-d pooling of an input (1, 2, 3, 3)"),
])
def test_shape_rules_reject_with_a_message(name, shapes, attrs, words):
    with pytest.raises(OpError, match=words.replace("(", r"\(").replace(")", r"\)")):
        OPS[name].shape(shapes, attrs)


def test_dropout_mask_is_the_built_in_layers_mask_of_the_shards_rows():
    """dropout_mask draws from the run's context [seed, step, rows, global batch, train]:
    the same mask a sample gets whichever shard holds it; ones in eval."""
    from cs_runtime.numerics import kernels
    x = np.ones((3, 5), np.float32)
    ctx = np.array([7, 2, 4, 7, 10, 1])   # rows 4:7 of a global batch of 10, training
    rows = OPS["dropout_mask"].forward([x, ctx], {"p": 0.25, "kind": "rows", "layer": 1, "site": 0})
    np.testing.assert_array_equal(rows, kernels.rows_keep_mask(7, 2, 1, 10, 5, slice(0, 10), 0.25)[4:7])
    x3 = np.ones((3, 4, 6), np.float32)
    hashed = OPS["dropout_mask"].forward([x3, ctx], {"p": 0.5, "kind": "hash", "layer": 2, "site": 1})
    full = kernels.keep_mask(kernels.hash_key(7, 2, 2, 1), slice(0, 10), (4, 6), 0.5, np.float32)
    np.testing.assert_array_equal(hashed, full[4:7])
    heads = OPS["dropout_mask"].forward([x3, ctx], {"p": 0.5, "kind": "hash", "layer": 2, "site": 0, "heads": 2})
    assert heads.shape == OPS["dropout_mask"].shape([x3.shape, ctx.shape], {"heads": 2}) == (3, 2, 4, 4)
    assert set(np.unique(heads)) == {0.0, 2.0}
    ctx[5] = 0   # eval: nothing dropped
    assert OPS["dropout_mask"].forward([x, ctx], {"p": 0.25, "kind": "rows", "layer": 1, "site": 0}) == 1.0
    with pytest.raises(OpError, match="rows 4:7 of a value of 2 rows"):
        OPS["dropout_mask"].forward([x[:2], np.array([7, 2, 4, 7, 10, 1])], {"p": 0.25, "kind": "rows",
                                                                             "layer": 1, "site": 0})


def test_self_attention_with_a_dropout_mask_matches_the_kernel():
    from cs_runtime.numerics import kernels
    rng = np.random.default_rng(3)
    qkv, drop = rng.standard_normal((2, 3, 12)), (rng.random((2, 2, 3, 3)) > 0.3) * 1.5
    attrs = {"heads": 2, "causal": True, "drop": True}
    out = OPS["self_attention"].forward([qkv, drop], attrs)
    expected, cache = kernels.attention_forward(qkv, 2, True, None, drop)
    np.testing.assert_array_equal(out, expected)
    g = rng.standard_normal(out.shape)
    dqkv, ddrop = OPS["self_attention"].vjp(g, [qkv, drop], out, attrs)
    np.testing.assert_array_equal(dqkv, kernels.attention_backward(g, cache))
    assert ddrop is None


def test_tanh_gelu_by_pieces_has_the_bits_of_one_pass():
    """The tanh GELU and its derivative, run a cache-sized piece at a time, equal the whole-array pass."""
    from cs_runtime.numerics import ops, parallel
    rng = np.random.default_rng(4)
    for dtype in (np.float32, np.float64):
        for shape in ((3, 7), (parallel.CHUNK + 5,), (4, 128, 300)):
            x = (rng.standard_normal(shape) * 3).astype(dtype)
            for pieces, whole in ((ops.gelu_tanh, ops._gelu_tanh), (ops.gelu_tanh_grad, ops._gelu_tanh_grad)):
                got, want = pieces(x), whole(x)
                assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


def _pieced_attention(rng):
    """Attention large enough to run a piece of the batch at a time (parallel.py)."""
    qkv = rng.standard_normal((16, 64, 3 * 128)).astype(np.float32)
    drop = (rng.random((16, 4, 64, 64)) > 0.1).astype(np.float32) / np.float32(0.9)
    keep = rng.random((16, 64)) > 0.2
    q, k, v = (rng.standard_normal((16, 4, 64, 32)).astype(np.float32) for _ in range(3))
    return [("self_attention_pieces", "self_attention", [qkv, keep, drop],
             {"heads": 4, "causal": False, "key_keep": True, "drop": True}),
            ("self_attention_causal", "self_attention", [qkv[:2]], {"heads": 4, "causal": True}),
            ("sdpa_pieces", "scaled_dot_product_attention", [q, k, v, keep[:, None, None, :]], {}),
            ("sdpa_pieces_causal", "scaled_dot_product_attention", [q, k, v], {"is_causal": True}),
            ("layer_norm_pieces", "layer_norm", [qkv, qkv[0, 0], qkv[1, 1]],
             {"normalized_shape": [3 * 128], "eps": 1e-5}),
            ("layer_norm_no_gain", "layer_norm", [qkv, None, qkv[1, 1]], {"normalized_shape": [3 * 128]}),
            ("layer_norm_bare", "layer_norm", [qkv], {"normalized_shape": [3 * 128]})]


def _residual_cases():
    rng = np.random.default_rng(8)
    small = [(c[0], c[1], c[2](rng), c[3]) for c in CASES if OPS[c[1]].residual is not None]
    exact = [("gelu_specials", "gelu", [np.array([0.0, -0.0, 12.0, -12.0, 1e-30, -40.0, 3.0])], {})]
    chunks = [(f"gelu_chunks_{a}", "gelu", [(rng.standard_normal(parallel.CHUNK + 5) * 4).astype(np.float32)],
               {"approximate": a}) for a in ("none", "tanh")]
    return small + exact + chunks + _pieced_attention(rng)


RESIDUAL_CASES = _residual_cases()


@pytest.mark.parametrize("case", RESIDUAL_CASES, ids=[c[0] for c in RESIDUAL_CASES])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_residual_gives_the_forward_and_the_vjp_their_bits(case, dtype):
    """An op's training forward (output, residual) has the output's bits, and its vjp from
    the residual, reading only the inputs it declares (the rest NaN), the bits of the vjp
    from the inputs: GELU's derivative and attention's probabilities, made once."""
    _, name, inputs, attrs = case
    op = OPS[name]
    inputs = [x.astype(dtype) if x is not None and x.dtype.kind == "f" else x for x in inputs]
    out = op.forward(inputs, attrs)
    value, residual = op.residual(inputs, attrs)
    assert value.dtype == out.dtype and value.tobytes() == out.tobytes()
    shape = op.residual_shape([x.shape for x in inputs], out.shape, attrs) if op.residual_shape else out.shape
    largest = max(residual, key=np.size) if isinstance(residual, tuple) else residual
    assert largest.shape == tuple(shape) and largest.dtype == out.dtype
    g = np.random.default_rng(9).standard_normal(out.shape).astype(out.dtype)
    want = op.vjp(g, inputs, out, attrs)
    blank = [x if i in op.residual_reads or x is None or x.dtype.kind != "f" else np.full(x.shape, np.nan, x.dtype)
             for i, x in enumerate(inputs)]
    got = op.residual_vjp(g, blank, residual, attrs)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a is None and b is None) or (a.dtype == b.dtype and a.tobytes() == b.tobytes())


def test_expand_over_the_batch_reads_the_batch_of_its_second_input_and_reshape_guesses_nothing():
    """A constant row broadcast over the batch (a captured token_type_ids buffer) takes the
    shard's rows from inputs[1]; its gradient is the constant's, none to the reference.
    A reshape takes its shape as written: the captured -1 is where the batch is."""
    row, ids = np.arange(4, dtype=np.float32)[None, :], np.zeros((3, 4), np.int64)
    attrs = {"shape": [8, 4], "batch_dims": [0]}   # 8: the capture's batch, replaced
    out = OPS["expand"].forward([row, ids], attrs)
    assert out.shape == OPS["expand"].shape([row.shape, ids.shape], attrs) == (3, 4)
    np.testing.assert_array_equal(out, np.repeat(row, 3, axis=0))
    grads = OPS["expand"].vjp(np.ones((3, 4), np.float32), [row, ids], out, attrs)
    np.testing.assert_array_equal(grads[0], np.full((1, 4), 3.0))
    assert grads[1] is None
    with pytest.raises(OpError, match="without an input to read the batch from"):
        OPS["expand"].shape([row.shape], attrs)
    x = np.zeros((4, 16, 32), np.float32)   # a shard of 4 rows of a view captured as (8, 16, 4, 8)
    with pytest.raises(OpError, match="reshape of"):
        OPS["reshape"].forward([x], {"shape": [8, 16, 4, 8]})
