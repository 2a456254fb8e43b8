"""The one executor of compiled programs: runs a node list over an
environment of named arrays, in numpy.

    env = run_nodes(program.nodes, {**params, **inputs, **program.consts})
    loss = env[program.outputs["loss"]]

A forward node calls its op's forward; a backward `vjp` node (built by
cs_runtime/compiler/autodiff.py) calls the vjp rule of the forward op named
in attrs["of"] with (upstream gradient, the forward inputs, the forward
output) and writes one gradient per output name ("" for none). The CPU
path, the WSE in both modes and the compiler's checks all run programs
through this one function.

`fmt` is the job's precision format: in a 16-bit one the matmul-like ops
round as a dense layer does (mixed_ops.py), a unit's parameters are used
in the format (they stream in it) and its parameter gradients leave in it.
In float32 (the default) nothing is rounded.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from cs_runtime.numerics import mixed_ops
from cs_runtime.numerics.ops import OPS, OpError
from cs_runtime.numerics.precision import quantize, to_bits
from cs_runtime.numerics.program import Node


def run_node(node: Node, env: dict, fmt: str = "float32", exact: frozenset = frozenset()) -> None:
    """`exact`: names of values that hold fmt's values already (a unit's parameters)."""
    try:
        if node.op == "vjp":
            _run_vjp(node, env, fmt, exact)
            return
        inputs = [env[name] for name in node.inputs]
        if fmt != "float32" and node.op in mixed_ops.MATMUL_LIKE:
            out = mixed_ops.forward(node.op, inputs, node.attrs, fmt, _positions(node.inputs, exact))
        else:
            out = OPS[node.op].forward(inputs, node.attrs)
        env[node.outputs[0]] = out
    except (OpError, ValueError, IndexError) as exc:
        raise OpError(f"{node.where()}: {exc}") from exc


def _positions(names, exact: frozenset) -> frozenset:
    return frozenset(i for i, name in enumerate(names) if name in exact) if exact else frozenset()


def _run_vjp(node: Node, env: dict, fmt: str = "float32", exact: frozenset = frozenset()) -> None:
    """inputs: (upstream gradient, forward inputs..., forward output)."""
    of = node.attrs["of"]
    g, *fwd, out = (env[name] if name else None for name in node.inputs)
    wanted = tuple(bool(name) for name in node.outputs)   # the rest: no gradient asked for
    if fmt != "float32" and of in mixed_ops.MATMUL_LIKE:
        grads = mixed_ops.vjp(of, g, fwd, out, node.attrs.get("attrs", {}), fmt,
                              _positions(node.inputs[1:-1], exact), wanted)
    else:
        grads = OPS[of].grads(g, fwd, out, node.attrs.get("attrs", {}), wanted)
    for name, grad, x in zip(node.outputs, grads, fwd):
        if name:
            # Gradients take the dtype and shape of what they are the gradient of.
            env[name] = np.asarray(grad, dtype=x.dtype).reshape(x.shape)


# Ops run into their first input's buffer when nothing else can see it (run_nodes):
# op -> (the ops whose fresh output it may overwrite, the in-place forward)
IN_PLACE = {"add": (mixed_ops.MATMUL_LIKE, lambda a, b: np.add(a, b, out=a)),
            "relu": (frozenset({"add"}), lambda a: np.maximum(a, 0, out=a))}


def _in_place(node: Node, env: dict, producer: dict, last_use: dict, i: int, keep) -> bool:
    """Run `node` into its first input's buffer: a dense layer's bias add into its matmul's
    output and relu into that, as the hand-written layer did, saving an allocation and a
    pass over memory each. Only for a value this run made with an op that returns a fresh
    array (never a view), read by nothing after this node and kept for nobody."""
    rule = IN_PLACE.get(node.op)
    if rule is None or node.attrs or keep is None:
        return False
    name = node.inputs[0]
    if producer.get(name) not in rule[0] or last_use.get(name) != i or name in keep or name in node.inputs[1:]:
        return False
    a, rest = env[name], [env[n] for n in node.inputs[1:]]
    if not (isinstance(a, np.ndarray) and a.flags.writeable and a.dtype.kind == "f"
            and all(isinstance(b, np.ndarray) and b.dtype == a.dtype for b in rest)
            and np.broadcast_shapes(a.shape, *(b.shape for b in rest)) == a.shape):
        return False
    env[node.outputs[0]] = rule[1](a, *rest)
    return True


def _stand_in(shape, dtype) -> np.ndarray:
    return np.broadcast_to(np.zeros((), dtype=dtype), tuple(shape))


def run_nodes(nodes: Iterable[Node], env: dict, keep: set[str] | None = None,
              shapes_of: set[str] = frozenset(), shapes: dict | None = None, fmt: str = "float32",
              exact: frozenset = frozenset()) -> dict:
    """Run the nodes in order, adding their outputs to env (returned). With
    `keep`, values last read by a node and not in `keep` are dropped as the
    run goes (what a unit's forward need not hold for its backward); the
    (shape, dtype) of each value in `shapes_of` is noted in `shapes`."""
    nodes = list(nodes)
    last_use = {}
    if keep is not None:
        for i, node in enumerate(nodes):
            for name in node.inputs:
                last_use[name] = i
    for name in shapes_of:
        if name in env:
            shapes[name] = (env[name].shape, env[name].dtype)
    producer: dict[str, str] = {}
    for i, node in enumerate(nodes):
        if not _in_place(node, env, producer, last_use, i, keep):
            run_node(node, env, fmt, exact)
        producer[node.outputs[0]] = node.op
        for name in node.outputs:
            if name in shapes_of:
                shapes[name] = (env[name].shape, env[name].dtype)
        if keep is not None:
            for name in node.inputs:
                if last_use.get(name) == i and name not in keep:
                    env.pop(name, None)
    return env


# ---------------------------------------------------------------- units (weight streaming)

def rounded(arrays: dict, fmt: str) -> dict:
    """Float arrays as `fmt` holds them (what a 16-bit tensor on the wire carries); others as they are."""
    if fmt == "float32":
        return arrays
    return {k: quantize(a, fmt) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a
            for k, a in arrays.items()}


def unit_params(unit, weights: dict, fmt: str = "float32", weights_rounded: bool = False) -> dict:
    """The unit's parameters as it uses them: in `fmt` (they stream in it). `weights_rounded`:
    they hold fmt's values already (they arrived in it)."""
    own = {p: weights[p] for p in unit.params}
    return own if weights_rounded else rounded(own, fmt)


_ROUNDED_READS: dict[int, tuple[object, frozenset]] = {}


def _rounds(node: Node, name: str) -> bool:
    """Whether every input position of `node` holding `name` is one its 16-bit rule rounds."""
    op = node.attrs["of"] if node.op == "vjp" else node.op
    if op not in mixed_ops.MATMUL_LIKE:
        return False
    inputs = node.inputs[1:-1] if node.op == "vjp" else node.inputs
    return all(i < 3 for i, n in enumerate(inputs) if n == name) if op == mixed_ops.SDPA else True


def rounded_reads(unit) -> frozenset:
    """The values a unit takes from before it (a dense layer's input, the activation of the
    layer below) that only the rounded operands of its matmul-like ops read, forward and
    backward. In a 16-bit format they are rounded once as they come in and used as they
    are in both passes (the weight gradient's matmul takes the same rounded input), as a
    dense layer rounds its input once; rounding again would change nothing but the time."""
    cached = _ROUNDED_READS.get(id(unit))
    if cached is None or cached[0] is not unit:
        readers: dict[str, list[Node]] = {}
        for node in (*unit.forward, *unit.backward):
            for name in set(node.inputs):
                readers.setdefault(name, []).append(node)
        found = frozenset(r for r in unit.reads if r not in unit.params and r not in unit.writes and readers.get(r)
                          and all(_rounds(node, r) for node in readers[r]))
        cached = _ROUNDED_READS[id(unit)] = (unit, found)
    return cached[1]


def _read(value, fmt: str, rounded_here: bool):
    if rounded_here and isinstance(value, np.ndarray) and value.dtype.kind == "f":
        return quantize(value, fmt)
    return value


def unit_forward(unit, weights: dict, live: dict, fmt: str = "float32", weights_rounded: bool = False) -> dict:
    """Run a unit's forward on its parameters and the live values it reads;
    add what it writes to `live` and return what its backward keeps (the values
    its rules read, and zero-cost stand-ins of those whose shape is all they need;
    in 16 bits, the parameters it rounded itself, so the backward does not round them again)."""
    env = unit_params(unit, weights, fmt, weights_rounded)
    params = dict(env) if fmt != "float32" and not weights_rounded else {}   # rounded here
    once = rounded_reads(unit) if fmt != "float32" else frozenset()
    env.update((r, _read(live[r], fmt, r in once)) for r in unit.reads)
    shapes = {}
    run_nodes(unit.forward, env, keep=set(unit.writes) | set(unit.kept), shapes_of=set(unit.shape_only),
              shapes=shapes, fmt=fmt, exact=frozenset(unit.params) | once)
    live.update((w, env[w]) for w in unit.writes)
    cache = {k: env[k] for k in unit.kept}
    cache.update((k, _stand_in(*shapes[k])) for k in unit.shape_only)
    cache.update(params)   # the backward uses them as they are
    return cache


def unit_backward(unit, weights: dict, cache: dict, live: dict, dlive: dict, fmt: str = "float32",
                  weights_rounded: bool = False, grads_on_wire: bool = False) -> dict:
    """Run a unit's backward: reads the gradients of what it wrote from `dlive`
    (zero where none arrived), adds its contributions to the gradients of what
    it read into `dlive`, and returns its parameter gradients: in a 16-bit `fmt`
    rounded to it (with `grads_on_wire`, in its storage, as a WSE sends them).
    The gradients passed between units stay float32, on the WSE."""
    held = all(p in cache for p in unit.params)   # the forward's rounded parameters
    env = {} if held else unit_params(unit, weights, fmt, weights_rounded)
    env.update(cache)
    for w in unit.grad_writes:
        g = dlive.pop(w, None)
        env[f"d:{w}"] = g if g is not None else np.zeros_like(live[w])
    once = rounded_reads(unit) if fmt != "float32" else frozenset()   # the cache holds them rounded
    run_nodes(unit.backward, env, fmt=fmt, exact=frozenset(unit.params) | once)
    for value, name in unit.input_grads.items():
        dlive[value] = dlive[value] + env[name] if value in dlive else env[name]
    grads = {p: env[name] for p, name in unit.param_grads.items()}
    if fmt == "float32":
        return grads
    finish = to_bits if grads_on_wire else quantize
    return {p: finish(g, fmt) for p, g in grads.items()}


def forward_backward(units, weights: dict, inputs: dict, consts: dict, loss: str, seed: float = 1.0,
                     fmt: str = "float32", round_inputs: bool = True, live_out: dict | None = None):
    """One training step's maths over every unit, weight-streaming order:
    (loss value, {param: gradient}), a parameter read by several units getting
    the sum of their gradients (in float32, of each unit's gradient in `fmt`).
    In a 16-bit `fmt` the float inputs are rounded to it, as an input worker sends
    them (unless `round_inputs` is False: the caller rounded those it sends).
    `live_out` (a dict) receives the values live after the forward pass (the
    program's outputs among them)."""
    live = {**consts, **(rounded(inputs, fmt) if round_inputs else inputs)}
    caches = [unit_forward(u, weights, live, fmt) for u in units]
    if live_out is not None:
        live_out.update(live)
    value = live[loss]
    dlive = {loss: np.asarray(seed, dtype=value.dtype)}
    grads: dict = {}
    for unit, cache in zip(reversed(units), reversed(caches)):
        for p, g in unit_backward(unit, weights, cache, live, dlive, fmt).items():
            grads[p] = grads[p] + g if p in grads else g
    return float(value), grads
