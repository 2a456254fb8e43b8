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

`reduce` is the shard's collective (model.ShardContext.reduce): a function that sums a
float64 vector over every shard of the step, handed to the collective ops (ops.Op.collective:
a synchronized batch norm's statistics); None where this shard is the whole batch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from cs_runtime import spans
from cs_runtime.numerics import mixed_ops
from cs_runtime.numerics.ops import OPS, OpError
from cs_runtime.numerics.precision import quantize, to_bits
from cs_runtime.numerics.program import Node


def run_node(node: Node, env: dict, fmt: str = "float32", exact: frozenset = frozenset(),
             residuals: bool = True, reduce=None) -> None:
    """`exact`: names of values that hold fmt's values already (a unit's parameters).
    `residuals`: False where no backward follows (eval), so none is made."""
    try:
        if node.op == "vjp":
            _run_vjp(node, env, fmt, exact, reduce)
            return
        inputs = [env[name] for name in node.inputs]
        residual = None   # a second output: the op's residual, for its vjp (autodiff.py)
        if fmt != "float32" and node.op in mixed_ops.MATMUL_LIKE:
            out = mixed_ops.forward(node.op, inputs, node.attrs, fmt, _positions(node.inputs, exact))
        elif len(node.outputs) == 2 and residuals:
            out, residual = OPS[node.op].residual(inputs, node.attrs)
        else:
            out = OPS[node.op].run(inputs, node.attrs, reduce)
        env[node.outputs[0]] = out
        if len(node.outputs) == 2:
            env[node.outputs[1]] = residual   # None in eval, and where the 16-bit rule starts from the inputs
    except (OpError, ValueError, IndexError) as exc:
        raise OpError(f"{node.where()}: {exc}") from exc


def _positions(names, exact: frozenset) -> frozenset:
    return frozenset(i for i, name in enumerate(names) if name in exact) if exact else frozenset()


_NO_ATTRS: dict = {}


def _run_vjp(node: Node, env: dict, fmt: str = "float32", exact: frozenset = frozenset(), reduce=None) -> None:
    """inputs: (upstream gradient, forward inputs..., forward output or its residual)."""
    attrs, names = node.attrs, node.inputs
    of, op_attrs = attrs["of"], attrs.get("attrs", _NO_ATTRS)
    g, out = env[names[0]], (env[names[-1]] if names[-1] else None)
    fwd = [env[name] if name else None for name in names[1:-1]]
    if fmt != "float32" and of in mixed_ops.MATMUL_LIKE:
        grads = mixed_ops.vjp(of, g, fwd, out, op_attrs, fmt, _positions(names[1:-1], exact),
                              tuple(map(bool, node.outputs)))
    elif attrs.get("residual"):
        grads = OPS[of].residual_vjp(g, fwd, out, op_attrs)
    else:   # wanted: the outputs named (the rest: no gradient asked for)
        grads = OPS[of].grads(g, fwd, out, op_attrs, tuple(map(bool, node.outputs)), reduce)
    for name, grad, x in zip(node.outputs, grads, fwd):
        if name:
            # Gradients take the dtype and shape of what they are the gradient of (most have them).
            if not (isinstance(grad, np.ndarray) and grad.dtype == x.dtype and grad.shape == x.shape):
                grad = np.asarray(grad, dtype=x.dtype).reshape(x.shape)
            env[name] = grad


# Ops run into their first input's buffer when nothing else can see it (run_nodes):
# op -> (the ops whose fresh output it may overwrite, the in-place forward)
IN_PLACE = {"add": (mixed_ops.MATMUL_LIKE, lambda a, b: np.add(a, b, out=a)),
            "relu": (frozenset({"add"}), lambda a: np.maximum(a, 0, out=a))}


def _may_run_in_place(node: Node, producer: dict, last_use: dict, i: int, keep) -> bool:
    """Whether `node` may run into its first input's buffer: a dense layer's bias add into its
    matmul's output and relu into that, as the hand-written layer did, saving an allocation and
    a pass over memory each. Only for a value this run made with an op that returns a fresh
    array (never a view), read by nothing after this node and kept for nobody. What the arrays
    themselves must be is checked as they come (_run_in_place)."""
    rule = IN_PLACE.get(node.op)
    if rule is None or node.attrs or keep is None:
        return False
    name = node.inputs[0]
    return (producer.get(name) in rule[0] and last_use.get(name) == i and name not in keep
            and name not in node.inputs[1:])


def _fits(shape: tuple, other: tuple) -> bool:
    """Whether `other` broadcasts onto `shape` leaving it as it is (np.broadcast_shapes(shape,
    other) == shape, without the cost of building the broadcast)."""
    lead = len(shape) - len(other)
    return lead >= 0 and all(o == 1 or o == d for d, o in zip(shape[lead:], other))


def _run_in_place(node: Node, env: dict) -> bool:
    """Run `node` into its first input's buffer when the arrays allow: a writeable float array,
    the others of its dtype and broadcasting onto it. False: nothing done."""
    a, rest = env[node.inputs[0]], [env[n] for n in node.inputs[1:]]
    if not (isinstance(a, np.ndarray) and a.flags.writeable and a.dtype.kind == "f"):
        return False
    for b in rest:
        if not (isinstance(b, np.ndarray) and b.dtype == a.dtype and _fits(a.shape, b.shape)):
            return False
    env[node.outputs[0]] = IN_PLACE[node.op][1](a, *rest)
    return True


@functools.lru_cache(maxsize=256)
def _stand_in(shape, dtype) -> np.ndarray:
    """A zero-cost read-only array of this shape: one per shape, shared by every step."""
    return np.broadcast_to(np.zeros((), dtype=dtype), tuple(shape))


@dataclass(frozen=True)
class NodePlan:
    """What run_nodes works out from a node list, its `keep` and its `shapes_of` alone, per
    node: whether it may run in place, the outputs whose shape is noted, the values dropped
    after it (last read there and not kept). The same every step: a unit's plans are made
    once (unit_plan), not in every call."""
    in_place: tuple[bool, ...]
    noted: tuple[tuple[str, ...], ...]
    drops: tuple[tuple[str, ...], ...]


def plan_nodes(nodes: list[Node], keep: set[str] | None = None, shapes_of=frozenset()) -> NodePlan:
    """run_nodes' plan of `nodes` with this `keep` and `shapes_of` (see run_nodes)."""
    last_use = {}
    if keep is not None:
        for i, node in enumerate(nodes):
            for name in node.inputs:
                last_use[name] = i
    producer: dict[str, str] = {}
    in_place, noted, drops = [], [], []
    for i, node in enumerate(nodes):
        in_place.append(_may_run_in_place(node, producer, last_use, i, keep))
        producer[node.outputs[0]] = node.op
        noted.append(tuple(name for name in node.outputs if name in shapes_of))
        dropped = () if keep is None else (name for name in node.inputs if last_use.get(name) == i and name not in keep)
        drops.append(tuple(dict.fromkeys(dropped)))
    return NodePlan(tuple(in_place), tuple(noted), tuple(drops))


def run_nodes(nodes: Iterable[Node], env: dict, keep: set[str] | None = None,
              shapes_of: set[str] = frozenset(), shapes: dict | None = None, fmt: str = "float32",
              exact: frozenset = frozenset(), plan: NodePlan | None = None, residuals: bool = True,
              reduce=None) -> dict:
    """Run the nodes in order, adding their outputs to env (returned). With
    `keep`, values last read by a node and not in `keep` are dropped as the
    run goes (what a unit's forward need not hold for its backward); the
    (shape, dtype) of each value in `shapes_of` is noted in `shapes`. `plan`:
    plan_nodes of these nodes, keep and shapes_of, made earlier (else made here); `residuals`:
    see run_node."""
    if not isinstance(nodes, (list, tuple)):
        nodes = list(nodes)
    plan = plan or plan_nodes(nodes, keep, shapes_of)
    for name in shapes_of:
        if name in env:
            shapes[name] = (env[name].shape, env[name].dtype)
    for node, in_place, noted, drops in zip(nodes, plan.in_place, plan.noted, plan.drops):
        if not (in_place and _run_in_place(node, env)):
            run_node(node, env, fmt, exact, residuals, reduce)
        if noted:
            for name in noted:
                shapes[name] = (env[name].shape, env[name].dtype)
        if drops:
            for name in drops:
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
    they hold fmt's values already (they arrived in it). Its buffers (parameters without a
    gradient: running statistics) stay float32 in every format, as torch's autocast keeps them."""
    own = {p: weights[p] for p in unit.params}
    if weights_rounded or fmt == "float32":
        return own
    return {**rounded({p: w for p, w in own.items() if p in unit.param_grads}, fmt),
            **{p: w for p, w in own.items() if p not in unit.param_grads}}


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
    dense layer rounds its input once; rounding again would change nothing but the time.
    Worked out once per unit, in its plan (unit_plan)."""
    readers: dict[str, list[Node]] = {}
    for node in (*unit.forward, *unit.backward):
        for name in set(node.inputs):
            readers.setdefault(name, []).append(node)
    return frozenset(r for r in unit.reads if r not in unit.params and r not in unit.writes and readers.get(r)
                     and all(_rounds(node, r) for node in readers[r]))


@dataclass(frozen=True)
class UnitPlan:
    """A unit's sets and node plans, as unit_forward and unit_backward use them every step."""
    keep: frozenset        # what its forward holds on to: its writes and what its backward reads
    shape_only: frozenset
    params: frozenset          # the parameters used in the format (those with a gradient; not buffers)
    rounded_reads: frozenset   # in a 16-bit format, rounded once as they come in (rounded_reads)
    forward: NodePlan
    backward: NodePlan

    def once(self, fmt: str) -> frozenset:
        """The reads rounded as they come in, in `fmt` (none in float32)."""
        return self.rounded_reads if fmt != "float32" else frozenset()

    def exact(self, fmt: str) -> frozenset:
        """The values that hold fmt's values already: the parameters, and the reads rounded once."""
        return self.params | self.rounded_reads if fmt != "float32" else self.params


_UNIT_PLANS: dict[int, tuple[object, UnitPlan]] = {}


def unit_plan(unit) -> UnitPlan:
    """The unit's plan, made once per unit object (a unit is not changed once built)."""
    cached = _UNIT_PLANS.get(id(unit))
    if cached is None or cached[0] is not unit:
        keep, shape_only = frozenset(unit.writes) | frozenset(unit.kept), frozenset(unit.shape_only)
        plan = UnitPlan(keep, shape_only, frozenset(unit.param_grads), rounded_reads(unit),
                        plan_nodes(unit.forward, keep, shape_only), plan_nodes(unit.backward))
        cached = _UNIT_PLANS[id(unit)] = (unit, plan)
    return cached[1]


def _read(value, fmt: str, rounded_here: bool):
    if rounded_here and isinstance(value, np.ndarray) and value.dtype.kind == "f":
        return quantize(value, fmt)
    return value


def unit_forward(unit, weights: dict, live: dict, fmt: str = "float32", weights_rounded: bool = False,
                 train: bool = True, reduce=None) -> dict:
    """Run a unit's forward on its parameters and the live values it reads;
    add what it writes to `live` and return what its backward keeps (the values
    its rules read, and zero-cost stand-ins of those whose shape is all they need;
    in 16 bits, the parameters it rounded itself, so the backward does not round them again).
    Not `train` (eval): the ops' residuals are not made (run_node)."""
    env = unit_params(unit, weights, fmt, weights_rounded)
    params = dict(env) if fmt != "float32" and not weights_rounded else {}   # rounded here
    plan = unit_plan(unit)
    once = plan.once(fmt)
    if once:
        env.update((r, _read(live[r], fmt, r in once)) for r in unit.reads)
    else:
        env.update((r, live[r]) for r in unit.reads)
    shapes = {}
    run_nodes(unit.forward, env, keep=plan.keep, shapes_of=plan.shape_only, shapes=shapes, fmt=fmt,
              exact=plan.exact(fmt), plan=plan.forward, residuals=train, reduce=reduce)
    live.update((w, env[w]) for w in unit.writes)
    cache = {k: env[k] for k in unit.kept}
    cache.update((k, _stand_in(*shapes[k])) for k in unit.shape_only)
    cache.update(params)   # the backward uses them as they are
    return cache


def unit_backward(unit, weights: dict, cache: dict, live: dict, dlive: dict, fmt: str = "float32",
                  weights_rounded: bool = False, grads_on_wire: bool = False, reduce=None) -> dict:
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
    plan = unit_plan(unit)   # the cache holds the reads rounded once (plan.exact)
    run_nodes(unit.backward, env, fmt=fmt, exact=plan.exact(fmt), plan=plan.backward, reduce=reduce)
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
    caches = []
    for index, unit in enumerate(units):   # each unit timed when spans are on (cstorch.profiler)
        with spans.span(unit.name, layer=index):
            caches.append(unit_forward(unit, weights, live, fmt))
    if live_out is not None:
        live_out.update(live)
    value = live[loss]
    dlive = {loss: np.asarray(seed, dtype=value.dtype)}
    grads: dict = {}
    for index in reversed(range(len(units))):
        with spans.span(f"{units[index].name} (backward)", layer=index):
            unit_grads = unit_backward(units[index], weights, caches[index], live, dlive, fmt)
        for p, g in unit_grads.items():
            grads[p] = grads[p] + g if p in grads else g
    return float(value), grads
