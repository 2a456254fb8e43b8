"""A tiny numpy interpreter for the kernel graph.

It gives every op its meaning with the kernels of cs_runtime/numerics/kernels.py,
the numpy behind the op set the executor runs. Constant folding calls it at
compile time, and the tests use it as the oracle of every rewrite: a rewritten
graph must compute the same numbers as the original.

    values = run(graph, {"x": x, "labels": y}, weights, train=True, seed=0)
    values[graph.output]
"""
from __future__ import annotations

import zlib
from typing import Callable

import numpy as np

from cs_runtime.numerics import kernels

from .ir import Graph, Node

Array = np.ndarray


class Context:
    """What an op may need beyond its inputs: train or eval, and the dropout seed."""

    def __init__(self, train: bool = False, seed: int = 0):
        self.train, self.seed = train, seed

    def keep_mask(self, node: Node, shape: tuple[int, ...], p: float) -> Array:
        # Keyed by layer, not node name, so a fused kernel draws the same mask
        # as the dropout node it replaced.
        rng = np.random.default_rng([self.seed, zlib.crc32(node.layer.encode())])
        return rng.random(shape, dtype=np.float32) >= p


def _dropout(x: Array, scale: Array, p: float, node: Node, ctx: Context) -> Array:
    if not ctx.train or p == 0:
        return x
    return x * ctx.keep_mask(node, x.shape, p) * scale


def _matmul(node: Node, args: list[Array]) -> Array:
    return args[0] @ (args[1].T if node.attrs.get("transpose_b") else args[1])


def _fused_dense(node: Node, args: list[Array], ctx: Context) -> Array:
    a = kernels.activate(node.attrs["activation"], _matmul(node, args) + args[2])
    return _dropout(a, args[3], node.attrs["dropout"], node, ctx) if len(args) == 4 else a


def _loss(node: Node, args: list[Array], ctx: Context) -> Array:
    logits, labels = args
    if logits.ndim == 3:
        count = int(np.count_nonzero(labels != kernels.IGNORE_INDEX))   # the graph sees the whole batch
        weight = kernels.token_loss_weight(node.attrs.get("loss_scaling", "num_tokens"),
                                           node.attrs.get("loss_weight", 1.0), len(labels), count)
        return np.float32(kernels.token_cross_entropy(logits, labels, weight)[0])
    loss, _, _ = kernels.softmax_cross_entropy(logits, labels, len(labels))
    return np.float32(loss)


def _attention(node: Node, args: list[Array], ctx: Context) -> Array:
    qkv = args[0]
    keep = args[1] != node.attrs["pad_id"] if len(args) == 2 else None
    p = node.attrs["dropout"]
    drop = None
    if ctx.train and p > 0:
        heads, seq = node.attrs["heads"], qkv.shape[1]
        drop = ctx.keep_mask(node, (len(qkv), heads, seq, seq), p) / np.float32(1 - p)
    return kernels.attention_forward(qkv, node.attrs["heads"], node.attrs["causal"], keep, drop)[0]


RULES: dict[str, Callable[[Node, list[Array], Context], Array]] = {
    "const": lambda n, a, c: np.asarray(n.attrs["value"], dtype=n.dtype),
    "matmul": lambda n, a, c: _matmul(n, a),
    "bias_add": lambda n, a, c: a[0] + a[1],
    "activation": lambda n, a, c: kernels.activate(n.attrs["kind"], a[0]),
    "dropout": lambda n, a, c: _dropout(a[0], a[1], n.attrs["p"], n, c),
    "add": lambda n, a, c: a[0] + a[1],
    "sub": lambda n, a, c: a[0] - a[1],
    "mul": lambda n, a, c: a[0] * a[1],
    "div": lambda n, a, c: a[0] / a[1],
    "softmax_cross_entropy": _loss,
    "fused_dense": _fused_dense,
    "embedding": lambda n, a, c: kernels.embedding_forward(a[0], a[1], a[2]) + (a[4][a[3]] if len(a) == 5 else 0),
    "first_token": lambda n, a, c: a[0][:, 0],
    "layer_norm": lambda n, a, c: kernels.layer_norm_forward(a[0], a[1], a[2], n.attrs["eps"])[0],
    "attention": _attention,
}


def eval_node(node: Node, args: list[Array], ctx: Context | None = None) -> Array:
    """The value of one node given its inputs' values."""
    out = RULES[node.op](node, args, ctx or Context())
    return np.asarray(out, dtype=node.dtype)


def run(graph: Graph, feeds: dict[str, Array], weights: dict[str, Array],
        train: bool = False, seed: int = 0) -> dict[str, Array]:
    """Every node's value. `feeds` holds the inputs, `weights` the params, by node name."""
    ctx = Context(train, seed)
    values: dict[str, Array] = {}
    for node in graph.nodes:
        if node.op == "input":
            values[node.name] = np.asarray(feeds[node.name], dtype=node.dtype)
        elif node.op == "param":
            values[node.name] = np.asarray(weights[node.name], dtype=node.dtype)
        else:
            values[node.name] = eval_node(node, [values[i] for i in node.inputs], ctx)
    return values
