"""The backward program, built from one vector-Jacobian rule per op.

    forward, nodes, grads = backward_nodes(forward, wrt={"fc1.weight", "x"}, seeds=["loss"],
                                           needs_grad=requires_grad(program, dtypes))

Reverse-mode over the forward node list: for each forward node whose output
has a gradient, one `vjp` node reads (that gradient, the forward inputs, the
forward output; attrs["reads"] marks those its rule reads, see Op.saves_inputs) and writes a gradient contribution for each input that needs
one; a value read by several nodes gets its contributions summed by one
`add_n` node. The seed gradients are named "d:<value>" (inputs of the
backward program); `grads` maps each value of `wrt` to the name of its
gradient (absent where no path leads from it to a seed).

An op with a residual (Op.residual: GELU, attention) instead gets a second
output in the returned forward, "r:<output>", which its vjp node reads in
place of the output (attrs["residual"]), with the inputs in Op.residual_reads.
"""
from __future__ import annotations

from cs_runtime.numerics.ops import OPS
from cs_runtime.numerics.program import Node, Program

# Ops whose output has no gradient whatever their inputs (comparisons, masks, random draws).
NON_DIFFERENTIABLE = frozenset({"compare", "logical_not", "detach", "dropout_mask", "draw", "batch_norm_running"})
FLOAT_DTYPES = ("float32", "float64")


def requires_grad(program: Program, dtypes: dict[str, str]) -> set[str]:
    """The values that depend on a parameter through differentiable ops (a buffer takes none)."""
    buffers = program.buffers()
    needs = {name for name, v in program.params.items() if v.dtype in FLOAT_DTYPES and name not in buffers}
    for node in program.nodes:
        if node.op in NON_DIFFERENTIABLE:
            continue
        if any(name in needs for name in node.inputs) and dtypes.get(node.outputs[0]) in FLOAT_DTYPES:
            needs.add(node.outputs[0])
    return needs


RESIDUAL_PREFIX = "r:"


def residual_output(name: str) -> str:
    """The forward value a residual belongs to (its shape and dtype are the residual's)."""
    return name[len(RESIDUAL_PREFIX):] if name.startswith(RESIDUAL_PREFIX) else name


def backward_nodes(forward: list[Node], wrt: set[str], seeds: list[str],
                   needs_grad: set[str]) -> tuple[list[Node], list[Node], dict[str, str]]:
    contributions: dict[str, list[str]] = {seed: [f"d:{seed}"] for seed in seeds}
    nodes: list[Node] = []
    counter = iter(range(1 << 30))

    def total(value: str, module: str, source: str) -> str | None:
        parts = contributions.get(value)
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        name = f"d{next(counter)}:{value}"
        nodes.append(Node("add_n", tuple(parts), (name,), {}, module, source))
        contributions[value] = [name]
        return name

    forward = list(forward)
    for index in reversed(range(len(forward))):
        node = forward[index]
        out = node.outputs[0]
        if node.op in NON_DIFFERENTIABLE or out not in needs_grad:
            continue
        g = total(out, node.module, node.source)
        if g is None:
            continue
        outputs = []
        for name in node.inputs:
            if name in needs_grad or name in wrt:
                grad = f"d{next(counter)}:{name}"
                contributions.setdefault(name, []).append(grad)
                outputs.append(grad)
            else:
                outputs.append("")
        if not any(outputs):
            continue
        # attrs["reads"]: which of (forward inputs..., output) the rule reads; the
        # rest only lend their shape and dtype (the executor passes stand-ins), so
        # the forward need not keep them.
        op = OPS[node.op]
        attrs = {"of": node.op, "attrs": dict(node.attrs)}
        if op.residual is not None:
            saved = RESIDUAL_PREFIX + out
            forward[index] = Node(node.op, node.inputs, (out, saved), node.attrs, node.module, node.source)
            attrs.update(reads=[i in op.residual_reads for i in range(len(node.inputs))] + [True], residual=True)
        else:
            saved = out
            attrs["reads"] = [i in op.saves_inputs for i in range(len(node.inputs))] + [op.saves_output]
        nodes.append(Node("vjp", (g, *node.inputs, saved), tuple(outputs), attrs, node.module, node.source))
    grads = {}
    for value in sorted(wrt):
        name = total(value, "", "")
        if name is not None:
            grads[value] = name
    return forward, nodes, grads

