"""The kernel graph: the compiler's IR.

A `Graph` is a list of `Node`s in topological order. Every value is a node:
graph inputs (`input`), trainable weights (`param`), literals (`const`) and
the kernels that compute on them. Shapes use "B" for the batch dimension, so
one graph serves every batch size. `print(graph)` shows it to a user:

    %x              = input                          [B, 784]    float32
    %fc0.matmul     = matmul(%x, %fc0.weight)        [B, 256]    float32  # fc0

The op set is the table `OPS` (one entry per primitive, tinygrad style): to
add an op, give it a shape rule here, a numpy rule in interp.py and a cost in
planner.py. Shape and dtype rules raise `CompileError` naming the layer, the
op and what is wrong, which is what validate_only reports.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

from cs_runtime.errors import UserInputError

Dim = Union[int, str]            # an int, or "B" for the batch
Shape = tuple[Dim, ...]
BATCH = "B"
FLOAT_DTYPES = ("float32",)
DTYPES = (*FLOAT_DTYPES, "int32")  # int32: labels and token ids
ACTIVATIONS = ("relu", "tanh", "sigmoid", "gelu", "gelu_new", "gelu_tanh", "none")
SOURCES = ("input", "param", "const")  # nodes that hold a value, compute nothing


class CompileError(UserInputError):
    """The model cannot be compiled; the message names the layer and the op."""


@dataclass(frozen=True)
class Node:
    name: str
    op: str
    inputs: tuple[str, ...] = ()
    shape: Shape = ()
    dtype: str = "float32"
    attrs: dict[str, Any] = field(default_factory=dict, hash=False)
    layer: str = ""              # the model layer it came from (errors, report)
    layer_op: str = ""           # that layer's op, e.g. "dense"

    def where(self) -> str:
        """'layer fc0 (op dense): matmul fc0.matmul' — the prefix of every error."""
        head = f"layer {self.layer} (op {self.layer_op}): " if self.layer else ""
        return f"{head}{self.op} {self.name}"


@dataclass
class Graph:
    name: str
    nodes: list[Node] = field(default_factory=list)
    output: str = ""

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def by_name(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def consumers(self, name: str) -> list[Node]:
        return [n for n in self.nodes if name in n.inputs]

    def kernels(self) -> list[Node]:
        """The nodes that compute (everything but inputs, params, consts)."""
        return [n for n in self.nodes if n.op not in SOURCES]

    def add(self, op: str, inputs: tuple[str, ...] = (), *, name: str, layer: str = "",
            layer_op: str = "", shape: Shape = (), dtype: str = "float32", **attrs: Any) -> str:
        """Append a node, inferring its shape and dtype (sources give theirs)."""
        node = Node(name, op, tuple(inputs), tuple(shape), dtype, attrs, layer, layer_op)
        if op not in SOURCES:
            node = infer(node, self.by_name())
        self.nodes.append(node)
        return name

    # --- printing and JSON
    def __str__(self) -> str:
        rows = [(f"%{n.name}", _call(n), _fmt_shape(n.shape), n.dtype, n.layer) for n in self.nodes]
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        w2 = max(len(r[2]) for r in rows)
        lines = [f"graph {self.name}: {len(self.kernels())} kernels, output %{self.output}"]
        for name, call, shape, dtype, layer in rows:
            note = f"  # {layer}" if layer else ""
            lines.append(f"  {name:<{w0}} = {call:<{w1}}  {shape:<{w2}}  {dtype}{note}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        nodes = [{"name": n.name, "op": n.op, "inputs": list(n.inputs), "shape": list(n.shape),
                  "dtype": n.dtype, "attrs": n.attrs, "layer": n.layer, "layer_op": n.layer_op}
                 for n in self.nodes]
        return {"name": self.name, "output": self.output, "nodes": nodes}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Graph":
        """Rebuild and re-validate a graph read from disk (never trusted as is)."""
        nodes = [Node(str(n["name"]), str(n["op"]), tuple(n["inputs"]), tuple(n["shape"]),
                      str(n["dtype"]), dict(n["attrs"]), str(n["layer"]), str(n["layer_op"]))
                 for n in d["nodes"]]
        graph = cls(str(d["name"]), nodes, str(d["output"]))
        validate(graph)
        return graph


def _fmt_shape(shape: Shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _call(n: Node) -> str:
    args = ", ".join(f"%{i}" for i in n.inputs)
    attrs = ", ".join(f"{k}={v}" for k, v in n.attrs.items())
    inner = ", ".join(x for x in (args, attrs) if x)
    return f"{n.op}({inner})" if inner or n.op not in SOURCES else n.op


# ---------------------------------------------------------------- shape rules
# Each rule takes the node and its input nodes and returns (shape, dtype), or
# raises CompileError with a message that makes sense after node.where().

def _need(cond: bool, node: Node, why: str) -> None:
    if not cond:
        raise CompileError(f"{node.where()}: {why}")


def _float_inputs(node: Node, ins: list[Node]) -> None:
    for i in ins:
        _need(i.dtype in FLOAT_DTYPES, node, f"input %{i.name} is {i.dtype}; "
              f"supported: {', '.join(FLOAT_DTYPES)}")


def _matmul(node: Node, ins: list[Node]) -> tuple[Shape, str]:
    x, w = ins[0], ins[1]
    # [B, ..., k] @ [k, n]: a token model's [B, T, D] activations included
    _need(len(x.shape) >= 2 and len(w.shape) == 2, node,
          f"needs [B, ..., k] @ [k, n] operands, got {_fmt_shape(x.shape)} @ {_fmt_shape(w.shape)}")
    k, n = w.shape[::-1] if node.attrs.get("transpose_b") else w.shape   # transpose_b: a tied [n, k] table
    _need(x.shape[-1] == k, node, f"%{x.name} has {x.shape[-1]} features but "
          f"%{w.name} is {_fmt_shape(w.shape)} (expects {k})")
    return (*x.shape[:-1], n), x.dtype


def _bias_add(node: Node, ins: list[Node]) -> tuple[Shape, str]:
    x, b = ins[0], ins[1]
    _need(b.shape == x.shape[-1:], node,
          f"bias %{b.name} is {_fmt_shape(b.shape)} but %{x.name} is {_fmt_shape(x.shape)}")
    return x.shape, x.dtype


def _check_activation(node: Node, kind: Any) -> None:
    _need(kind in ACTIVATIONS, node, f"unsupported activation {kind!r}; supported: {', '.join(ACTIVATIONS)}")


def _activation(node: Node, ins: list[Node]) -> tuple[Shape, str]:
    _check_activation(node, node.attrs.get("kind"))
    return ins[0].shape, ins[0].dtype


def _check_dropout(node: Node, ins: list[Node], key: str) -> None:
    p = node.attrs.get(key)
    _need(isinstance(p, (int, float)) and 0.0 <= p < 1.0, node, f"dropout {p!r} outside [0, 1)")
    _need(ins[-1].shape == (), node, f"keep-scale %{ins[-1].name} must be a scalar")


def _dropout(node: Node, ins: list[Node]) -> tuple[Shape, str]:
    _check_dropout(node, ins, "p")
    return ins[0].shape, ins[0].dtype


def _elementwise(node: Node, ins: list[Node]) -> tuple[Shape, str]:
    a, b = ins[0], ins[1]
    # Same shape, or one side a scalar: enough for constants and residuals.
    _need(a.shape == b.shape or () in (a.shape, b.shape), node,
          f"shapes {_fmt_shape(a.shape)} and {_fmt_shape(b.shape)} do not match")
    return (a.shape if a.shape else b.shape), a.dtype


def _softmax_ce(node: Node, ins: list[Node]) -> tuple[Shape, str]:
    logits, labels = ins[0], ins[1]
    _need(len(logits.shape) in (2, 3), node,
          f"logits must be [B, classes] or [B, T, vocab], got {_fmt_shape(logits.shape)}")
    _need(labels.dtype == "int32", node, f"labels %{labels.name} must be int32, got {labels.dtype}")
    _need(labels.shape == logits.shape[:-1], node, f"labels {_fmt_shape(labels.shape)} do not match "
          f"logits {_fmt_shape(logits.shape)}")
    return (), logits.dtype


def _embedding(node: Node, ins: list[Node]) -> tuple[Shape, str]:
    tokens, table, positions = ins[:3]
    if len(ins) == 5:   # BERT with its next-sentence head: segment ids and their table
        segments, seg_table = ins[3:]
        _need(segments.dtype == "int32" and segments.shape == tokens.shape, node,
              f"segment ids %{segments.name} must be int32 {_fmt_shape(tokens.shape)}")
        _need(len(seg_table.shape) == 2 and seg_table.shape[1:] == table.shape[1:], node,
              f"segment table {_fmt_shape(seg_table.shape)} and token table {_fmt_shape(table.shape)} differ")
    _need(tokens.dtype == "int32" and len(tokens.shape) == 2, node,
          f"token ids %{tokens.name} must be int32 [B, T], got {_fmt_shape(tokens.shape)} {tokens.dtype}")
    _need(table.dtype in FLOAT_DTYPES and positions.dtype in FLOAT_DTYPES, node, "tables must be float")
    _need(len(table.shape) == 2 and len(positions.shape) == 2 and table.shape[1] == positions.shape[1], node,
          f"token table {_fmt_shape(table.shape)} and positions {_fmt_shape(positions.shape)} differ in width")
    seq = tokens.shape[1]
    _need(seq == BATCH or seq <= positions.shape[0], node,
          f"sequence length {seq} exceeds the {positions.shape[0]} position embeddings")
    return (tokens.shape[0], seq, table.shape[1]), table.dtype


def _first_token(node: Node, ins: list[Node]) -> tuple[Shape, str]:
    x = ins[0]
    _need(len(x.shape) == 3, node, f"needs [B, T, D], got {_fmt_shape(x.shape)}")
    return (x.shape[0], x.shape[2]), x.dtype


def _layer_norm(node: Node, ins: list[Node]) -> tuple[Shape, str]:
    x, gain, bias = ins
    _need(gain.shape == x.shape[-1:] and bias.shape == x.shape[-1:], node,
          f"gain {_fmt_shape(gain.shape)} / bias {_fmt_shape(bias.shape)} do not match {_fmt_shape(x.shape)}")
    _need(isinstance(node.attrs.get("eps"), float) and node.attrs["eps"] > 0, node, "eps must be a float > 0")
    return x.shape, x.dtype


def _attention(node: Node, ins: list[Node]) -> tuple[Shape, str]:
    qkv = ins[0]
    _need(qkv.dtype in FLOAT_DTYPES, node, f"input %{qkv.name} is {qkv.dtype}; supported: float32")
    _need(len(qkv.shape) == 3 and isinstance(qkv.shape[2], int) and qkv.shape[2] % 3 == 0, node,
          f"needs packed [B, T, 3*D] projections, got {_fmt_shape(qkv.shape)}")
    heads, width = node.attrs.get("heads"), qkv.shape[2] // 3
    _need(isinstance(heads, int) and heads > 0 and width % heads == 0, node,
          f"width {width} is not a multiple of heads {heads!r}")
    p = node.attrs.get("dropout")
    _need(isinstance(p, (int, float)) and 0.0 <= p < 1.0, node, f"dropout {p!r} outside [0, 1)")
    if len(ins) == 2:  # token ids: padding keys are masked
        _need(ins[1].dtype == "int32" and ins[1].shape == qkv.shape[:2], node,
              f"padding ids %{ins[1].name} must be int32 {_fmt_shape(qkv.shape[:2])}")
    return (*qkv.shape[:2], width), qkv.dtype


def _fused_dense(node: Node, ins: list[Node]) -> tuple[Shape, str]:
    shape, dtype = _matmul(node, ins[:2])
    b = ins[2]
    _need(b.shape == shape[-1:], node, f"bias %{b.name} is {_fmt_shape(b.shape)} but the "
          f"product is {_fmt_shape(shape)}")
    _check_activation(node, node.attrs.get("activation"))
    if len(ins) == 4:
        _check_dropout(node, ins, "dropout")
    return shape, dtype


@dataclass(frozen=True)
class OpDef:
    arity: tuple[int, ...]        # allowed numbers of inputs
    rule: Callable[[Node, list[Node]], tuple[Shape, str]]
    float_only: bool = True       # every input must be a float (labels excepted)


OPS: dict[str, OpDef] = {
    "matmul": OpDef((2,), _matmul),
    "bias_add": OpDef((2,), _bias_add),
    "activation": OpDef((1,), _activation),
    "dropout": OpDef((2,), _dropout),           # (x, keep-scale 1/(1-p))
    "add": OpDef((2,), _elementwise),
    "sub": OpDef((2,), _elementwise),
    "mul": OpDef((2,), _elementwise),
    "div": OpDef((2,), _elementwise),
    "softmax_cross_entropy": OpDef((2,), _softmax_ce, float_only=False),
    "fused_dense": OpDef((3, 4), _fused_dense),  # act(x @ w + b) [* dropout]
    "embedding": OpDef((3, 5), _embedding, float_only=False),   # (ids, token table, positions[, segments, table])
    "first_token": OpDef((1,), _first_token),                 # [B, T, D] -> [B, D]: BERT's pooler input
    "layer_norm": OpDef((3,), _layer_norm),                   # (x, gain, bias)
    "attention": OpDef((1, 2), _attention, float_only=False),  # (qkv [, ids for the padding mask])
}


def infer(node: Node, known: dict[str, Node]) -> Node:
    """`node` with its shape and dtype inferred from its inputs in `known`."""
    if node.op not in OPS:
        raise CompileError(f"{node.where()}: unsupported op; supported: {', '.join(OPS)}")
    spec = OPS[node.op]
    _need(len(node.inputs) in spec.arity, node, f"takes {spec.arity} inputs, got {len(node.inputs)}")
    missing = [i for i in node.inputs if i not in known]
    _need(not missing, node, f"input {', '.join('%' + m for m in missing)} is not defined before it")
    ins = [known[i] for i in node.inputs]
    if spec.float_only:
        _float_inputs(node, ins)
    shape, dtype = spec.rule(node, ins)
    return Node(node.name, node.op, node.inputs, tuple(shape), dtype, node.attrs, node.layer, node.layer_op)


def validate(graph: Graph) -> None:
    """Check every op, shape and dtype of `graph`; raise CompileError at the first problem."""
    known: dict[str, Node] = {}
    for node in graph.nodes:
        _need(node.name not in known, node, "name used twice")
        _need(node.dtype in DTYPES, node, f"unsupported dtype {node.dtype}; supported: {', '.join(DTYPES)}")
        _need(all(d == BATCH or (isinstance(d, int) and d > 0) for d in node.shape), node,
              f"bad shape {_fmt_shape(node.shape)}: dimensions are positive ints or {BATCH}")
        if node.op in SOURCES:
            _need(not node.inputs, node, "a source takes no inputs")
        else:
            inferred = infer(node, known)
            _need((inferred.shape, inferred.dtype) == (node.shape, node.dtype), node,
                  f"declared {_fmt_shape(node.shape)} {node.dtype} but computes "
                  f"{_fmt_shape(inferred.shape)} {inferred.dtype}")
        known[node.name] = node
    if graph.output not in known:
        raise CompileError(f"graph {graph.name}: output %{graph.output} is not a node")


def elements(shape: Shape) -> int:
    """Elements per sample: the product of every dimension but the batch."""
    n = 1
    for d in shape:
        if d != BATCH:
            n *= int(d)
    return n
