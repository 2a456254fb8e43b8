"""Graph rewrites: each takes a graph and returns a new one plus what it did.

    graph, notes = optimize(graph)

- fold_constants: a kernel whose inputs are all constants is computed now,
  once, and becomes a constant (e.g. dropout's keep-scale 1 / (1 - p));
- drop_noops: nodes that return their input unchanged (dropout with p = 0,
  activation "none", x * 1, x + 0) are bypassed;
- drop_dead: nodes nothing reads any more are removed (inputs and params are
  the model's interface and stay);
- fuse_dense: matmul -> bias_add [-> activation] [-> dropout] becomes one
  fused_dense kernel, so the activations never leave a PE between the steps.

Every rewrite keeps the numbers: tests/test_compiler.py runs both graphs in
the interpreter on random inputs and compares.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from .interp import eval_node
from .ir import SOURCES, Graph, Node, validate

Rewrite = Callable[[Graph], tuple[Graph, list[str]]]


def _rename_uses(nodes: list[Node], old: str, new: str) -> list[Node]:
    """Every node reading `old` reads `new` instead."""
    return [replace(n, inputs=tuple(new if i == old else i for i in n.inputs)) for n in nodes]


def _bypass(graph: Graph, node: Node, to: str) -> Graph:
    """Remove `node`, its readers reading `to` instead."""
    nodes = _rename_uses([n for n in graph.nodes if n.name != node.name], node.name, to)
    output = to if graph.output == node.name else graph.output
    return Graph(graph.name, nodes, output)


# ---------------------------------------------------------------- folding

def fold_constants(graph: Graph) -> tuple[Graph, list[str]]:
    nodes: list[Node] = []
    consts: dict[str, Node] = {}
    notes = []
    for node in graph.nodes:
        if node.op not in SOURCES and node.inputs and all(i in consts for i in node.inputs):
            value = eval_node(node, [eval_node(consts[i], []) for i in node.inputs])
            node = Node(node.name, "const", (), node.shape, node.dtype, {"value": value.tolist()},
                        node.layer, node.layer_op)
            notes.append(f"folded %{node.name} to the constant {value.tolist()!r}")
        if node.op == "const":
            consts[node.name] = node
        nodes.append(node)
    return Graph(graph.name, nodes, graph.output), notes


# ---------------------------------------------------------------- no-ops

def _const_value(graph: Graph, name: str) -> float | None:
    node = graph.node(name)
    value = node.attrs.get("value") if node.op == "const" else None
    return value if isinstance(value, (int, float)) else None


def _identity_input(graph: Graph, node: Node) -> str | None:
    """The input `node` passes through unchanged, or None if it computes something."""
    if node.op == "dropout" and node.attrs.get("p") == 0:
        return node.inputs[0]
    if node.op == "activation" and node.attrs.get("kind") == "none":
        return node.inputs[0]
    neutral = {"mul": 1.0, "div": 1.0, "add": 0.0, "sub": 0.0}.get(node.op)
    if neutral is not None:
        a, b = node.inputs
        same_shape = graph.node(a).shape == node.shape
        if same_shape and _const_value(graph, b) == neutral:
            return a
    return None


def drop_noops(graph: Graph) -> tuple[Graph, list[str]]:
    notes = []
    for name in [n.name for n in graph.nodes]:
        node = graph.node(name)  # fresh: earlier bypasses may have renamed its inputs
        to = _identity_input(graph, node)
        if to is not None:
            graph = _bypass(graph, node, to)
            attrs = ", ".join(f"{k}={v}" for k, v in node.attrs.items())
            notes.append(f"dropped no-op %{node.name} ({node.op} {attrs})".replace(" )", ")"))
    return graph, notes


def drop_dead(graph: Graph) -> tuple[Graph, list[str]]:
    live = {graph.output}
    for node in reversed(graph.nodes):
        if node.name in live:
            live.update(node.inputs)
    keep = [n for n in graph.nodes if n.name in live or n.op in ("input", "param")]
    dead = [n.name for n in graph.nodes if n not in keep]
    notes = [f"removed dead %{', %'.join(dead)}"] if dead else []
    return Graph(graph.name, keep, graph.output), notes


# ---------------------------------------------------------------- fusion

def _only_reader(graph: Graph, node: Node, op: str) -> Node | None:
    """The single node reading `node` if it has op `op` and reads it first."""
    readers = graph.consumers(node.name)
    if len(readers) != 1 or graph.output == node.name:
        return None
    reader = readers[0]
    return reader if reader.op == op and reader.inputs[0] == node.name else None


def _dense_chain(graph: Graph, matmul: Node) -> list[Node]:
    """matmul, bias_add [, activation] [, dropout]: the longest fusable chain."""
    bias = _only_reader(graph, matmul, "bias_add")
    if bias is None or graph.node(bias.inputs[1]).op != "param":
        return []
    chain = [matmul, bias]
    for op in ("activation", "dropout"):
        nxt = _only_reader(graph, chain[-1], op)
        if nxt is not None:
            chain.append(nxt)
    return chain


def _fused(chain: list[Node]) -> Node:
    matmul, bias, rest = chain[0], chain[1], {n.op: n for n in chain[2:]}
    inputs = (*matmul.inputs, bias.inputs[1])
    attrs = {"activation": rest["activation"].attrs["kind"] if "activation" in rest else "none",
             "dropout": rest["dropout"].attrs["p"] if "dropout" in rest else 0.0}
    if matmul.attrs.get("transpose_b"):
        attrs["transpose_b"] = True
    if "dropout" in rest:
        inputs += (rest["dropout"].inputs[1],)
    # "fc0.matmul" -> "fc0.fused_dense"; a layer with several (a transformer
    # block's "block0.qkv.matmul") keeps each one's own prefix.
    name = f"{matmul.name.removesuffix('.matmul')}.fused_dense" if matmul.layer else f"{matmul.name}.fused"
    last = chain[-1]
    return Node(name, "fused_dense", inputs, last.shape, last.dtype, attrs, matmul.layer, matmul.layer_op)


def fuse_dense(graph: Graph) -> tuple[Graph, list[str]]:
    notes = []
    for name in [n.name for n in graph.nodes if n.op == "matmul"]:
        matmul = graph.node(name)
        chain = _dense_chain(graph, matmul)
        if not chain:
            continue
        fused, gone = _fused(chain), {n.name for n in chain}
        # The fused node takes the place of the chain's last node, where all
        # its inputs are already defined.
        last = chain[-1].name
        nodes = [fused if n.name == last else n for n in graph.nodes if n.name == last or n.name not in gone]
        nodes = _rename_uses(nodes, last, fused.name)
        output = fused.name if graph.output == last else graph.output
        graph = Graph(graph.name, nodes, output)
        notes.append(f"fused {' + '.join(n.op for n in chain)} of layer {matmul.layer} into %{fused.name}")
    return graph, notes


# ---------------------------------------------------------------- all of them

PASSES: tuple[Rewrite, ...] = (fold_constants, drop_noops, drop_dead, fuse_dense)


def optimize(graph: Graph, passes: tuple[Rewrite, ...] = PASSES) -> tuple[Graph, list[str]]:
    """Run `passes` in order; the result is validated again (a rewrite bug is a compile error)."""
    notes: list[str] = []
    for rewrite in passes:
        graph, done = rewrite(graph)
        notes += done
    validate(graph)
    return graph, notes
