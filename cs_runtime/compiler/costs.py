"""The kernels the planner places: the program's own ops, costed by the op set's rules.

    kernels = program_kernels(spec, train=True, copies=2)
    kernels[0].name, kernels[0].layer, kernels[0].cost.flops

The program every path runs (numerics/executor.py: a captured model's, or a
built-in model lowered by families.py) is the one representation. A kernel is
a run of its units' forward nodes: a node that reads a weight matrix (a
parameter of two or more dimensions) or is matmul-like (numerics/mixed_ops.py)
starts one, with the first node of each unit; every other node (a bias, an
activation, dropout, a norm, a residual add, a reshape, the loss) joins the
kernel before it, as a fused kernel would on the wafer: it costs its FLOPs
there, and its values never cross the fabric. FLOPs are each op's own rule
(numerics/ops.py: `Op.flops` from its input and output shapes); weights are the
unit's parameters the kernel reads.

Shapes are the program's (a captured model's from its capture, a built-in
model's by the ops' shape rules at batch 2); costs are per sample.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cs_runtime.compiler.families import build_program
from cs_runtime.numerics.mixed_ops import MATMUL_LIKE
from cs_runtime.numerics.model import ModelSpec
from cs_runtime.numerics.ops import OPS
from cs_runtime.numerics.program import Node, infer_values
from cs_runtime.numerics.program_layer import unit_of

DTYPE_BYTES = 4           # weights and activations as the plan counts them: float32
SHAPE_BATCH = 2           # the batch a built-in model's program is shaped at


@dataclass(frozen=True)
class Cost:
    """What one kernel needs, per sample unless said otherwise."""

    flops: float            # forward, plus backward when training
    weight_bytes: int       # its params (per model, not per sample)
    resident_bytes: int     # params + gradients + optimizer state on the wafer
    act_bytes: int          # activations in + out (and their gradients back)
    host_bytes: int         # program inputs read from outside the wafer
    max_pes: int            # parallelism per sample: more cores do not help


@dataclass(frozen=True)
class Kernel:
    name: str               # "<unit>.<op>", numbered within the unit when an op repeats
    op: str                 # its first node's op
    layer: str              # its unit (a built-in model's layer)
    nodes: tuple[str, ...]  # the ops it holds, in order
    cost: Cost


def program_shapes(spec: ModelSpec) -> tuple[dict[str, tuple], dict[str, str], int]:
    """Every value's shape and dtype, and the batch they are shaped at."""
    values = (spec.program or {}).get("values")
    if values:   # a captured model: its capture's shapes
        shapes = {k: tuple(v[0]) for k, v in values.items()}
        first = shapes[spec.program["inputs"][0]]
        return shapes, {k: v[1] for k, v in values.items()}, int(first[0]) if first else 1
    return (*infer_values(build_program(spec.plain())[0]), SHAPE_BATCH)


def elements(shape: tuple) -> int:
    return int(np.prod(shape, dtype=np.int64))


def starts_kernel(node: Node, params: set[str], shapes: dict[str, tuple]) -> bool:
    """A node that reads a weight matrix or is matmul-like: the heart of a kernel."""
    return node.op in MATMUL_LIKE or any(i in params and len(shapes[i]) >= 2 for i in node.inputs)


def group_nodes(forward: list[Node], params: set[str], shapes: dict[str, tuple]) -> list[list[Node]]:
    groups: list[list[Node]] = []
    for node in forward:
        if groups and not starts_kernel(node, params, shapes):
            groups[-1].append(node)
        else:
            groups.append([node])
    return groups


def group_cost(group: list[Node], params: set[str], host: set[str], shapes: dict[str, tuple], batch: int,
               train: bool, copies: int) -> Cost:
    made = {o for n in group for o in n.outputs}
    fwd = sum(OPS[n.op].flops([shapes[i] for i in n.inputs], shapes[n.outputs[0]], n.attrs) for n in group) / batch
    read = [i for n in group for i in n.inputs]
    weights = sorted({i for i in read if i in params})
    acts = sorted({i for i in read if i not in params and i not in made and i in shapes})
    weight_elems = sum(elements(shapes[p]) for p in weights)
    # Backward costs as much again per input gradient: 2x, or 3x with a weight gradient.
    flops = fwd * ((3 if weights else 2) if train else 1)
    out = shapes[group[-1].outputs[0]]
    act_bytes = (sum(elements(shapes[a]) for a in acts) + elements(out)) * DTYPE_BYTES // batch
    host_bytes = sum(elements(shapes[a]) for a in acts if a in host) * DTYPE_BYTES // batch
    # A weight is the smallest unit of work a core takes; without weights, an activation element is.
    max_pes = max(weight_elems or max([elements(out), *(elements(shapes[a]) for a in acts)]) // batch, 1)
    return Cost(flops, weight_elems * DTYPE_BYTES, weight_elems * DTYPE_BYTES * copies,
                act_bytes * (2 if train else 1), host_bytes, max_pes)


def kernel_name(node: Node, unit: str, params: set[str], shapes: dict[str, tuple]) -> str:
    """Its weight matrix's name ("block0.qkv", "transformer.h.0.attn.c_attn"), else (no matrix, or
    another unit's: a tied head's) "<unit>.<op>"."""
    matrix = next((i for i in node.inputs if i in params and len(shapes[i]) >= 2), None)
    if matrix is None or not matrix.startswith(unit + "."):
        return f"{unit}.{node.op}"
    for suffix in (".weight", "_weight"):
        if matrix.endswith(suffix):
            return matrix[:-len(suffix)]
    return matrix


def program_kernels(spec: ModelSpec, train: bool, copies: int) -> list[Kernel]:
    """The program's kernels in execution order, each with its cost (see the module's doc)."""
    shapes, _, batch = program_shapes(spec)
    host = set((spec.program or {}).get("inputs", ()))
    kernels: list[Kernel] = []
    seen: dict[str, int] = {}
    for layer in spec.layers:
        unit = unit_of(layer)
        params = set(unit.params)
        for group in group_nodes(unit.forward, params, shapes):
            heart = next((n for n in group if starts_kernel(n, params, shapes)), group[0])
            base = kernel_name(heart, unit.name, params, shapes)
            seen[base] = seen.get(base, 0) + 1
            name = base + (f"#{seen[base]}" if seen[base] > 1 else "")
            kernels.append(Kernel(name, heart.op, unit.name, tuple(n.op for n in group),
                                  group_cost(group, params, host, shapes, batch, train, copies)))
    return kernels


def listing(spec: ModelSpec) -> str:
    """The program as compiled, unit by unit (compile/program.txt)."""
    out = []
    for layer in spec.layers:
        unit = unit_of(layer)
        out.append(f"# unit {unit.name}: params {', '.join(unit.params) or '-'}")
        out += [f"{', '.join(n.outputs)} = {n.op}({', '.join(n.inputs)}) {n.attrs or ''}".rstrip()
                for n in unit.forward]
    return "\n".join(out) + "\n"


def describe(kernels: list[Kernel]) -> dict[str, Any]:
    """What the grouping did, for the report."""
    fused = sum(len(k.nodes) - 1 for k in kernels)
    return {"kernels": len(kernels), "ops": sum(len(k.nodes) for k in kernels), "fused": fused}
