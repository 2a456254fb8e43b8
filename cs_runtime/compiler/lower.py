"""Graph extraction: a ModelSpec becomes a kernel graph of primitive ops.

Each layer is lowered on its own by the function registered for its op in
`LOWERINGS`; a layer whose op has none is unsupported, and the error names
the layer and the op. A "dense" layer becomes

    matmul -> bias_add -> activation -> dropout(keep-scale = 1 / (1 - p))

node for node, even where a node does nothing (activation "none",
dropout 0): the rewrites, not the lowering, decide what to drop or fuse, so
each rewrite can be tested on its own. The model's loss closes the graph.

Transformer layers lower to embedding, layer_norm, matmul/bias_add,
attention, activation, dropout and add (the residuals); a model that starts
with an embedding takes int32 token ids [B, T] and int32 labels [B, T].

To support a new layer op, write a `lower_<op>(graph, layer, x) -> output
name` and register it.
"""
from __future__ import annotations

from typing import Callable

from cs_runtime.numerics.model import LayerSpec, ModelSpec
from cs_runtime.numerics.transformer_params import NSP_FEATURES

from .ir import BATCH, CompileError, Graph, validate

INPUT = "x"
LABELS = "labels"
_, SEGMENTS, NSP_LABELS = NSP_FEATURES


def lower_dense(g: Graph, layer: LayerSpec, x: str) -> str:
    n, op = layer.name, layer.op
    at = {"layer": n, "layer_op": op}
    if not isinstance(layer.dropout, (int, float)) or not 0.0 <= layer.dropout < 1.0:
        raise CompileError(f"layer {n} (op {op}): dropout {layer.dropout!r} outside [0, 1)")
    w = g.add("param", name=f"{n}.weight", shape=(layer.in_features, layer.out_features), **at)
    b = g.add("param", name=f"{n}.bias", shape=(layer.out_features,), **at)
    h = g.add("matmul", (x, w), name=f"{n}.matmul", **at)
    h = g.add("bias_add", (h, b), name=f"{n}.bias_add", **at)
    h = g.add("activation", (h,), name=f"{n}.act", kind=layer.activation, **at)
    return _dropout(g, layer, h, layer.dropout, "")


def _dropout(g: Graph, layer: LayerSpec, h: str, p: float, site: str) -> str:
    n, at = layer.name, {"layer": layer.name, "layer_op": layer.op}
    # The keep-scale is written as the expression it is; constant folding
    # turns it into one number at compile time.
    one = g.add("const", name=f"{n}{site}.one", value=1.0, **at)
    pn = g.add("const", name=f"{n}{site}.p", value=float(p), **at)
    keep = g.add("sub", (one, pn), name=f"{n}{site}.keep", **at)
    scale = g.add("div", (one, keep), name=f"{n}{site}.keep_scale", **at)
    return g.add("dropout", (h, scale), name=f"{n}{site}.dropout", p=float(p), **at)


def _params(g: Graph, layer: LayerSpec) -> dict[str, str]:
    at = {"layer": layer.name, "layer_op": layer.op}
    return {k: g.add("param", name=f"{layer.name}.{k}", shape=s, **at) for k, s in layer.param_shapes().items()}


def _dense(g: Graph, layer: LayerSpec, x: str, p: dict, what: str) -> str:
    at = {"layer": layer.name, "layer_op": layer.op}
    h = g.add("matmul", (x, p[f"{what}_weight"]), name=f"{layer.name}.{what}.matmul", **at)
    return g.add("bias_add", (h, p[f"{what}_bias"]), name=f"{layer.name}.{what}.bias_add", **at)


def _norm(g: Graph, layer: LayerSpec, x: str, p: dict, what: str) -> str:
    return g.add("layer_norm", (x, p[f"{what}_gain"], p[f"{what}_bias"]), name=f"{layer.name}.{what}",
                 layer=layer.name, layer_op=layer.op, eps=float(layer.eps))


def _check_dropouts(layer: LayerSpec) -> None:
    for what in ("dropout", "attn_dropout"):
        p = getattr(layer, what)
        if not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise CompileError(f"layer {layer.name} (op {layer.op}): {what} {p!r} outside [0, 1)")


def lower_embedding(g: Graph, layer: LayerSpec, x: str) -> str:
    _check_dropouts(layer)
    if layer.max_len <= 0:
        raise CompileError(f"layer {layer.name} (op embedding): max_len {layer.max_len!r} is not a positive int")
    p = _params(g, layer)
    segments = (g.add("input", name=SEGMENTS, shape=g.node(x).shape, dtype="int32"), p["segments"]) \
        if layer.segments else ()
    h = g.add("embedding", (x, p["tokens"], p["positions"], *segments), name=f"{layer.name}.embedding",
              layer=layer.name, layer_op=layer.op, pad_id=int(layer.pad_id))
    if layer.norm == "post":
        h = _norm(g, layer, h, p, "ln")
    return _dropout(g, layer, h, layer.dropout, "")


def _padding(g: Graph) -> tuple[tuple[str, ...], int]:
    """((token-id input,), pad id) when the model's embedding marks padding (BERT), else ((), -1)."""
    marks = [n for n in g.nodes if n.op == "embedding" and n.attrs.get("pad_id", -1) >= 0]
    return ((marks[0].inputs[0],), int(marks[0].attrs["pad_id"])) if marks else ((), -1)


def _attention(g: Graph, layer: LayerSpec, x: str, p: dict) -> str:
    n, at = layer.name, {"layer": layer.name, "layer_op": layer.op}
    ids, pad_id = _padding(g)
    qkv = _dense(g, layer, x, p, "qkv")
    att = g.add("attention", (qkv, *ids), name=f"{n}.attention", heads=int(layer.num_heads),
                causal=bool(layer.causal), dropout=float(layer.attn_dropout), pad_id=pad_id, **at)
    return _dropout(g, layer, _dense(g, layer, att, p, "proj"), layer.dropout, ".attn")


def _mlp(g: Graph, layer: LayerSpec, x: str, p: dict) -> str:
    h = _dense(g, layer, x, p, "fc")
    h = g.add("activation", (h,), name=f"{layer.name}.fc.act", kind=layer.activation, layer=layer.name,
              layer_op=layer.op)
    return _dropout(g, layer, _dense(g, layer, h, p, "out"), layer.dropout, ".mlp")


def lower_block(g: Graph, layer: LayerSpec, x: str) -> str:
    _check_dropouts(layer)
    if layer.num_heads <= 0 or layer.in_features % layer.num_heads or layer.ffn_features <= 0:
        raise CompileError(f"layer {layer.name} (op {layer.op}): width {layer.in_features} needs num_heads > 0 "
                           f"dividing it (got {layer.num_heads}) and ffn_features > 0 (got {layer.ffn_features})")
    p, n, at = _params(g, layer), layer.name, {"layer": layer.name, "layer_op": layer.op}
    if layer.norm == "pre":     # GPT-2: x + f(LN(x))
        h = g.add("add", (x, _attention(g, layer, _norm(g, layer, x, p, "ln1"), p)), name=f"{n}.residual1", **at)
        return g.add("add", (h, _mlp(g, layer, _norm(g, layer, h, p, "ln2"), p)), name=f"{n}.residual2", **at)
    h = g.add("add", (x, _attention(g, layer, x, p)), name=f"{n}.residual1", **at)     # BERT: LN(x + f(x))
    h = _norm(g, layer, h, p, "ln1")
    h = g.add("add", (h, _mlp(g, layer, h, p)), name=f"{n}.residual2", **at)
    return _norm(g, layer, h, p, "ln2")


def lower_lm_head(g: Graph, layer: LayerSpec, x: str) -> str:
    p = _params(g, layer)
    if layer.activation != "none":
        x = _dense(g, layer, x, p, "transform")
        x = g.add("activation", (x,), name=f"{layer.name}.transform.act", kind=layer.activation, layer=layer.name,
                  layer_op=layer.op)
    x = _norm(g, layer, x, p, "ln")
    if not layer.tied and layer.out_bias:
        return _dense(g, layer, x, p, "decoder")
    at = {"layer": layer.name, "layer_op": layer.op}
    # tied: the token table (vocab, width), transposed (the model zoo's share_embedding_weights)
    weight, attrs = (p["tokens"], {"transpose_b": True}) if layer.tied else (p["decoder_weight"], {})
    h = g.add("matmul", (x, weight), name=f"{layer.name}.decoder.matmul", **attrs, **at)
    if layer.out_bias:
        h = g.add("bias_add", (h, p["decoder_bias"]), name=f"{layer.name}.decoder.bias_add", **at)
    return h


def lower_nsp_head(g: Graph, layer: LayerSpec, encoded: str) -> str:
    """BERT's pooler (dense + its nonlinearity on the first token) and next-sentence classifier,
    on the encoder's output: the [B, 2] scores."""
    p, at = _params(g, layer), {"layer": layer.name, "layer_op": layer.op}
    h = g.add("first_token", (encoded,), name=f"{layer.name}.first_token", **at)
    h = g.add("activation", (_dense(g, layer, h, p, "pooler"),), name=f"{layer.name}.pooler.act",
              kind=layer.activation, **at)
    return _dense(g, layer, h, p, "classifier")


LOWERINGS: dict[str, Callable[[Graph, LayerSpec, str], str]] = {
    "dense": lower_dense,
    "embedding": lower_embedding,
    "transformer_block": lower_block,
    "lm_head": lower_lm_head,
    "nsp_head": lower_nsp_head,
}
LOSSES = ("softmax_cross_entropy",)


def _check_widths(layer: LayerSpec) -> None:
    for what in ("in_features", "out_features"):
        value = getattr(layer, what)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CompileError(f"layer {layer.name} (op {layer.op}): {what} {value!r} is not a positive int")


def lower(spec: ModelSpec) -> Graph:
    """The kernel graph of `spec`, validated (ops, shapes, dtypes)."""
    if not spec.layers:
        raise CompileError(f"model {spec.name}: has no layers")
    g = Graph(spec.name)
    first = spec.layers[0]
    if first.op == "embedding":  # token ids [B, T]
        x = g.add("input", name=INPUT, shape=(BATCH, first.max_len), dtype="int32")
    else:
        x = g.add("input", name=INPUT, shape=(BATCH, first.in_features))
    encoded = nsp = None
    for layer in spec.layers:
        if layer.op == "nsp_head":   # reads the encoder's output, not the masked-LM logits
            _check_widths(layer)
            nsp = lower_nsp_head(g, layer, encoded)
            continue
        if layer.op == "lm_head":
            encoded = x
        if layer.op not in LOWERINGS:
            raise CompileError(f"layer {layer.name} (op {layer.op}): unsupported op {layer.op!r}; "
                               f"supported: {', '.join(LOWERINGS)}")
        _check_widths(layer)
        x = LOWERINGS[layer.op](g, layer, x)
    if spec.loss not in LOSSES:
        raise CompileError(f"model {spec.name}: unsupported loss {spec.loss!r}; supported: {', '.join(LOSSES)}")
    labels = g.add("input", name=LABELS, shape=g.node(x).shape[:-1], dtype="int32")
    g.output = g.add(spec.loss, (x, labels), name="loss", layer="loss", layer_op=spec.loss,
                     loss_scaling=spec.loss_scaling, loss_weight=float(spec.loss_weight))
    if nsp is not None:   # the model zoo's total: masked-LM loss + the next-sentence mean
        nsp_labels = g.add("input", name=NSP_LABELS, shape=g.node(nsp).shape[:-1], dtype="int32")
        nsp_loss = g.add(spec.loss, (nsp, nsp_labels), name="nsp_loss", layer="loss", layer_op=spec.loss)
        g.output = g.add("add", (g.output, nsp_loss), name="total_loss", layer="loss", layer_op="add")
    validate(g)
    return g
