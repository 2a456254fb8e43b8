"""Transformer layers (the units weight streaming moves, one at a time): their parameters.

A GPT-2 or BERT model is three kinds of layer (cs_runtime/numerics/model.py's
`LayerSpec` with these ops), each holding several named weight tensors:

- "embedding": token + learned position embedding [+ layer norm (BERT)],
  dropout. It sees the token ids, so it tells every block after it which
  keys are padding.
- "transformer_block": self-attention and a GELU MLP (the layer's `activation`:
  gelu exact, gelu_new / gelu_tanh the tanh form) with residuals; "pre"
  norm (GPT-2: x + f(LN(x))) or "post" norm (BERT: LN(x + f(x))); causal or
  bidirectional attention.
- "lm_head": [dense + GELU (BERT's transform)] + layer norm + decoder to the
  vocabulary [+ bias]. Tied (`layer.tied`, the model zoo's
  share_embedding_weights), the decoder is the embedding's token table,
  transposed: the head holds a copy of it ("tokens"), which the executor keeps
  equal to the embedding's (one gradient, their sum; program_layer.tie_grads)
  and checkpoints store once.
- "nsp_head" (BERT unless disable_nsp): the pooler (dense + its nonlinearity on
  the first token's final hidden state) and the next-sentence classifier
  (dense to 2); the embedding then also adds a segment table ("segments").

Here: each op's parameter shapes and initialisation. Their maths is a program
over the op set (cs_runtime/compiler/families.py lowers each layer to one unit;
numerics/executor.py runs it). Dropout sites are numbered per layer, so every
mask is a function of (seed, step, layer, site, sample, position).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

# BERT with its next-sentence head: a batch's features by name (the data sets make them,
# the lowered program reads them, the batch check checks them).
NSP_FEATURES = ("input_ids", "segment_ids", "next_sentence_label")

# ---------------------------------------------------------------- parameters


def embedding_shapes(layer) -> dict[str, tuple[int, ...]]:
    d = layer.out_features
    shapes = {"tokens": (layer.in_features, d), "positions": (layer.max_len, d)}
    if layer.segments:   # BERT with its next-sentence head: a segment (token type) table
        shapes["segments"] = (layer.segments, d)
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
    shapes.update(ln_gain=(d,), ln_bias=(d,))
    if layer.tied:
        shapes["tokens"] = (v, d)        # the tied embedding's table, in its layout
    else:
        shapes["decoder_weight"] = (d, v)
    if layer.out_bias:
        shapes["decoder_bias"] = (v,)
    return shapes


def nsp_head_shapes(layer) -> dict[str, tuple[int, ...]]:
    """BERT's next-sentence head: the pooler (width -> width) and the classifier (width -> 2)."""
    d, c = layer.in_features, layer.out_features
    return {"pooler_weight": (d, d), "pooler_bias": (d,), "classifier_weight": (d, c), "classifier_bias": (c,)}


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


# The parameter shapes of each transformer layer op.
LAYER_SHAPES: dict[str, Callable[[Any], dict[str, tuple[int, ...]]]] = {
    "embedding": embedding_shapes, "transformer_block": block_shapes, "lm_head": head_shapes,
    "nsp_head": nsp_head_shapes}
