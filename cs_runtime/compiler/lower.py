"""Graph extraction: a ModelSpec becomes a kernel graph of primitive ops.

Each layer is lowered on its own by the function registered for its op in
`LOWERINGS`; a layer whose op has none is unsupported, and the error names
the layer and the op. A "dense" layer becomes

    matmul -> bias_add -> activation -> dropout(keep-scale = 1 / (1 - p))

node for node, even where a node does nothing (activation "none",
dropout 0): the rewrites, not the lowering, decide what to drop or fuse, so
each rewrite can be tested on its own. The model's loss closes the graph.

To support a new layer op (layer_norm, attention, embedding...), write a
`lower_<op>(graph, layer, x) -> output name` and register it.
"""
from __future__ import annotations

from typing import Callable

from cs_runtime.model import LayerSpec, ModelSpec

from .ir import BATCH, CompileError, Graph, validate

INPUT = "x"
LABELS = "labels"


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
    # The keep-scale is written as the expression it is; constant folding
    # turns it into one number at compile time.
    one = g.add("const", name=f"{n}.one", value=1.0, **at)
    p = g.add("const", name=f"{n}.p", value=float(layer.dropout), **at)
    keep = g.add("sub", (one, p), name=f"{n}.keep", **at)
    scale = g.add("div", (one, keep), name=f"{n}.keep_scale", **at)
    return g.add("dropout", (h, scale), name=f"{n}.dropout", p=float(layer.dropout), **at)


LOWERINGS: dict[str, Callable[[Graph, LayerSpec, str], str]] = {
    "dense": lower_dense,
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
    x = g.add("input", name=INPUT, shape=(BATCH, spec.layers[0].in_features))
    for layer in spec.layers:
        if layer.op not in LOWERINGS:
            raise CompileError(f"layer {layer.name} (op {layer.op}): unsupported op {layer.op!r}; "
                               f"supported: {', '.join(LOWERINGS)}")
        _check_widths(layer)
        x = LOWERINGS[layer.op](g, layer, x)
    if spec.loss not in LOSSES:
        raise CompileError(f"model {spec.name}: unsupported loss {spec.loss!r}; supported: {', '.join(LOSSES)}")
    labels = g.add("input", name=LABELS, shape=(BATCH,), dtype="int32")
    g.output = g.add(spec.loss, (x, labels), name="loss", layer="loss", layer_op=spec.loss)
    validate(g)
    return g
