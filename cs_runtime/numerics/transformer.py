"""Transformer layers: the units weight streaming moves, one at a time.

A GPT-2 or BERT model is three kinds of layer (cs_runtime/numerics/model.py's
`LayerSpec` with these ops), each holding several named weight tensors:

- "embedding": token + learned position embedding [+ layer norm (BERT)],
  dropout. It sees the token ids, so it records in the ShardContext which
  keys are padding, for the attention of every block after it.
- "transformer_block": self-attention and a GELU MLP (the layer's `activation`:
  gelu exact, gelu_new / gelu_tanh the tanh form) with residuals; "pre"
  norm (GPT-2: x + f(LN(x))) or "post" norm (BERT: LN(x + f(x))); causal or
  bidirectional attention.
- "lm_head": [dense + GELU (BERT's transform)] + layer norm + decoder to the
  vocabulary. Not tied to the token embedding: tying would make two streamed
  layers share one tensor.

Each op gives its parameter shapes, its initialisation, and forward/backward
built from cs_runtime/numerics/kernels.py. Dropout sites are numbered per layer, so
every mask is a function of (seed, step, layer, site, sample, position).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from cs_runtime.numerics import kernels as K

# ---------------------------------------------------------------- parameters


def embedding_shapes(layer) -> dict[str, tuple[int, ...]]:
    d = layer.out_features
    shapes = {"tokens": (layer.in_features, d), "positions": (layer.max_len, d)}
    if layer.norm == "post":
        shapes.update(ln_gain=(d,), ln_bias=(d,))
    return shapes


def block_shapes(layer) -> dict[str, tuple[int, ...]]:
    d, f = layer.in_features, layer.ffn_features
    return {"ln1_gain": (d,), "ln1_bias": (d,), "qkv_weight": (d, 3 * d), "qkv_bias": (3 * d,),
            "proj_weight": (d, d), "proj_bias": (d,), "ln2_gain": (d,), "ln2_bias": (d,),
            "fc_weight": (d, f), "fc_bias": (f,), "out_weight": (f, d), "out_bias": (d,)}


def head_shapes(layer) -> dict[str, tuple[int, ...]]:
    d, v = layer.in_features, layer.out_features
    shapes = {}
    if layer.activation != "none":
        shapes.update(transform_weight=(d, d), transform_bias=(d,))
    shapes.update(ln_gain=(d,), ln_bias=(d,), decoder_weight=(d, v), decoder_bias=(v,))
    return shapes


INIT_STD = 0.02                                  # initializer_range of GPT-2 and BERT
RESIDUAL_PROJECTIONS = ("proj_weight", "out_weight")  # the matrices whose output joins a residual sum


def init_param(name: str, shape: tuple[int, ...], rng: np.random.Generator, std: float = INIT_STD) -> np.ndarray:
    """GPT-2 / BERT init: N(0, std) matrices and embeddings, zero biases, unit gains."""
    if name.endswith("gain"):
        return np.ones(shape, np.float32)
    if name.endswith("bias"):
        return np.zeros(shape, np.float32)
    return (rng.standard_normal(shape) * std).astype(np.float32)


def init_std(layer, name: str, num_blocks: int) -> float:
    """GPT-2 (pre-norm blocks) scales the residual projections by 1/sqrt(2 n_layer),
    two residual sums per block adding up along the depth (HF's c_proj, the model
    zoo's output_layer_initializer); BERT keeps 0.02 everywhere."""
    if layer.op == "transformer_block" and layer.norm == "pre" and name in RESIDUAL_PROJECTIONS:
        return INIT_STD / np.sqrt(2.0 * num_blocks)
    return INIT_STD


# ---------------------------------------------------------------- dropout


def dropout(layer, index: int, site: int, x: np.ndarray, ctx, p: float):
    """(x * mask, mask or None): the mask of this site for the shard's rows."""
    if not ctx.train or p == 0:
        return x, None
    key = K.hash_key(ctx.seed, ctx.step, index, site)
    mask = K.keep_mask(key, ctx.rows, x.shape[1:], p, x.dtype.type)
    return x * mask, mask


def undrop(dy: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    return dy * mask if mask is not None else dy


# ---------------------------------------------------------------- embedding


def embedding_forward(layer, index: int, tokens: np.ndarray, w: dict, ctx):
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"layer {layer.name}: expects integer token ids, got {tokens.dtype}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= layer.in_features):
        raise ValueError(f"layer {layer.name}: token ids outside [0, {layer.in_features})")
    ctx.key_keep = tokens != layer.pad_id if layer.pad_id >= 0 else None
    h = K.embedding_forward(tokens, w["tokens"], w["positions"])
    ln = None
    if layer.norm == "post":
        h, ln = K.layer_norm_forward(h, w["ln_gain"], w["ln_bias"], layer.eps)
    out, mask = dropout(layer, index, 0, h, ctx, layer.dropout)
    return out, {"tokens": tokens, "ln": ln, "mask": mask}


def embedding_backward(layer, dout: np.ndarray, cache: dict, w: dict, need_dx: bool):
    dh = undrop(dout, cache["mask"])
    grads = {}
    if cache["ln"] is not None:
        dh, grads["ln_gain"], grads["ln_bias"] = K.layer_norm_backward(dh, cache["ln"], w["ln_gain"])
    grads["tokens"], grads["positions"] = K.embedding_backward(dh, cache["tokens"], layer.in_features,
                                                                layer.max_len)
    return None, grads  # token ids have no gradient


# ---------------------------------------------------------------- transformer block


def _attention(layer, index: int, x: np.ndarray, w: dict, ctx, c: dict) -> np.ndarray:
    """Attention sub-block on its (already normalised, for pre-norm) input; fills cache c."""
    c["att_in"] = x
    qkv = K.dense_forward(x, w["qkv_weight"], w["qkv_bias"])
    drop = None
    if ctx.train and layer.attn_dropout > 0:
        key = K.hash_key(ctx.seed, ctx.step, index, 0)
        drop = K.keep_mask(key, ctx.rows, (layer.num_heads, x.shape[1], x.shape[1]), layer.attn_dropout,
                           x.dtype.type)
    att, c["att"] = K.attention_forward(qkv, layer.num_heads, layer.causal, ctx.key_keep, drop)
    c["att_out"] = att
    proj = K.dense_forward(att, w["proj_weight"], w["proj_bias"])
    out, c["mask1"] = dropout(layer, index, 1, proj, ctx, layer.dropout)
    return out


def _attention_back(dy: np.ndarray, w: dict, c: dict, g: dict) -> np.ndarray:
    dproj = undrop(dy, c["mask1"])
    datt, g["proj_weight"], g["proj_bias"] = K.dense_backward(dproj, c["att_out"], w["proj_weight"])
    dqkv = K.attention_backward(datt, c["att"])
    dx, g["qkv_weight"], g["qkv_bias"] = K.dense_backward(dqkv, c["att_in"], w["qkv_weight"])
    return dx


def gelu_of(layer) -> tuple[Callable, Callable]:
    """(forward, derivative) of the layer's GELU."""
    if layer.activation not in K.GELUS:
        raise ValueError(f"layer {layer.name} ({layer.op}): activation {layer.activation!r} is not one of "
                         f"{', '.join(K.GELUS)}")
    return K.GELUS[layer.activation]


def _mlp(layer, index: int, x: np.ndarray, w: dict, ctx, c: dict) -> np.ndarray:
    c["mlp_in"] = x
    c["fc"] = K.dense_forward(x, w["fc_weight"], w["fc_bias"])
    c["act"] = gelu_of(layer)[0](c["fc"])
    out = K.dense_forward(c["act"], w["out_weight"], w["out_bias"])
    out, c["mask2"] = dropout(layer, index, 2, out, ctx, layer.dropout)
    return out


def _mlp_back(layer, dy: np.ndarray, w: dict, c: dict, g: dict) -> np.ndarray:
    do = undrop(dy, c["mask2"])
    dact, g["out_weight"], g["out_bias"] = K.dense_backward(do, c["act"], w["out_weight"])
    dfc = dact * gelu_of(layer)[1](c["fc"])
    dx, g["fc_weight"], g["fc_bias"] = K.dense_backward(dfc, c["mlp_in"], w["fc_weight"])
    return dx


def block_forward(layer, index: int, x: np.ndarray, w: dict, ctx):
    c: dict[str, Any] = {}
    if layer.norm == "pre":   # GPT-2: x + f(LN(x))
        a, c["ln1"] = K.layer_norm_forward(x, w["ln1_gain"], w["ln1_bias"], layer.eps)
        h = K.residual_forward(x, _attention(layer, index, a, w, ctx, c))
        m, c["ln2"] = K.layer_norm_forward(h, w["ln2_gain"], w["ln2_bias"], layer.eps)
        return K.residual_forward(h, _mlp(layer, index, m, w, ctx, c)), c
    # BERT: LN(x + f(x))
    h, c["ln1"] = K.layer_norm_forward(K.residual_forward(x, _attention(layer, index, x, w, ctx, c)),
                                       w["ln1_gain"], w["ln1_bias"], layer.eps)
    out, c["ln2"] = K.layer_norm_forward(K.residual_forward(h, _mlp(layer, index, h, w, ctx, c)),
                                         w["ln2_gain"], w["ln2_bias"], layer.eps)
    return out, c


def block_backward(layer, dout: np.ndarray, c: dict, w: dict, need_dx: bool):
    g: dict[str, np.ndarray] = {}
    if layer.norm == "pre":
        dh, dbranch = K.residual_backward(dout)
        dm, g["ln2_gain"], g["ln2_bias"] = K.layer_norm_backward(_mlp_back(layer, dbranch, w, c, g), c["ln2"],
                                                                 w["ln2_gain"])
        dh = dh + dm
        dx, dbranch = K.residual_backward(dh)
        da, g["ln1_gain"], g["ln1_bias"] = K.layer_norm_backward(_attention_back(dbranch, w, c, g), c["ln1"],
                                                                 w["ln1_gain"])
        return dx + da, g
    ds2, g["ln2_gain"], g["ln2_bias"] = K.layer_norm_backward(dout, c["ln2"], w["ln2_gain"])
    dh, dbranch = K.residual_backward(ds2)
    dh = dh + _mlp_back(layer, dbranch, w, c, g)
    ds1, g["ln1_gain"], g["ln1_bias"] = K.layer_norm_backward(dh, c["ln1"], w["ln1_gain"])
    dx, dbranch = K.residual_backward(ds1)
    return dx + _attention_back(dbranch, w, c, g), g


# ---------------------------------------------------------------- language-model head


def head_forward(layer, index: int, x: np.ndarray, w: dict, ctx):
    c: dict[str, Any] = {"x": x}
    h = x
    if layer.activation != "none":   # BERT's MLM transform
        c["t"] = K.dense_forward(x, w["transform_weight"], w["transform_bias"])
        h = gelu_of(layer)[0](c["t"])
    c["h"] = h
    c["normed"], c["ln"] = K.layer_norm_forward(h, w["ln_gain"], w["ln_bias"], layer.eps)
    return K.dense_forward(c["normed"], w["decoder_weight"], w["decoder_bias"]), c


def head_backward(layer, dlogits: np.ndarray, c: dict, w: dict, need_dx: bool):
    g: dict[str, np.ndarray] = {}
    dn, g["decoder_weight"], g["decoder_bias"] = K.dense_backward(dlogits, c["normed"], w["decoder_weight"])
    dh, g["ln_gain"], g["ln_bias"] = K.layer_norm_backward(dn, c["ln"], w["ln_gain"])
    if layer.activation != "none":
        dt = dh * gelu_of(layer)[1](c["t"])
        dh, g["transform_weight"], g["transform_bias"] = K.dense_backward(dt, c["x"], w["transform_weight"],
                                                                          need_dx)
    return (dh if need_dx else None), g


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class LayerOp:
    shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    forward: Callable
    backward: Callable


LAYER_OPS: dict[str, LayerOp] = {
    "embedding": LayerOp(embedding_shapes, embedding_forward, embedding_backward),
    "transformer_block": LayerOp(block_shapes, block_forward, block_backward),
    "lm_head": LayerOp(head_shapes, head_forward, head_backward),
}
