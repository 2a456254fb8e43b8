"""Cut a program into weight-streaming units, and give each its backward.

The unit rule (shown in compile_report.txt):
  1. An op inside a block -- an element of a ModuleList or Sequential, a
     module path ending in an index such as `transformer.h.3` -- belongs to
     that block's unit, when the block reads a parameter.
  2. Otherwise an op belongs to the unit of its own module (its innermost
     module path, such as `lm_head` or `conv1`), when that module's ops read
     a parameter.
  3. Ops in no such module (functional code in forward(), the loss,
     parameter-free modules such as ReLU or Dropout) join the unit of the op
     before them; before the first unit, the first unit.
Consecutive ops with the same key form one unit; a module whose ops come
back later (a module called twice) makes a second unit of that name + "#2".

A parameter read by two units (a token embedding tied to the output head)
is streamed to both; each unit's backward yields its own gradient of it and
the runner sums them before the one update.
"""
from __future__ import annotations

import re

import numpy as np

from cs_runtime.compiler.autodiff import FLOAT_DTYPES, backward_nodes, requires_grad, residual_output
from cs_runtime.compiler.errors import CompileError
from cs_runtime.numerics.ops import OPS
from cs_runtime.numerics.program import Node, Program, Unit

_INDEX = re.compile(r"^\d+$")
LOSS_OUTPUTS = ("loss", "nsp_loss")   # the program outputs backward starts from


def _candidate(module: str) -> str:
    parts = module.split(".") if module else []
    for i, part in enumerate(parts):
        if _INDEX.match(part):
            return ".".join(parts[:i + 1])
    return module


def unit_keys(program: Program) -> list[str]:
    """Each forward node's unit key, by the rule above."""
    candidates = [_candidate(n.module) for n in program.nodes]
    owning = {c for c, n in zip(candidates, program.nodes) if c and any(i in program.params for i in n.inputs)}
    keys, previous = [], None
    for c in candidates:
        key = c if c in owning else previous
        keys.append(key)
        previous = key
    first = next((k for k in keys if k is not None), "model")
    return [first if k is None else k for k in keys]


def split_units(program: Program, shapes: dict[str, tuple], dtypes: dict[str, str]) -> list[Unit]:
    """The units in execution order, each with its forward and backward node lists."""
    keys = unit_keys(program)
    groups: list[tuple[str, list[Node]]] = []
    seen: dict[str, int] = {}
    for key, node in zip(keys, program.nodes):
        if groups and groups[-1][0] == key:
            groups[-1][1].append(node)
            continue
        seen[key] = seen.get(key, 0) + 1
        groups.append((key if seen[key] == 1 else f"{key}#{seen[key]}", [node]))
    needs = requires_grad(program, dtypes)
    later_reads = _reads_after(groups, set(program.outputs.values()))
    # Gradients flow only into what leads to the loss: an output such as the logits
    # (kept for accuracy) gets no seed of zeros.
    # (BERT's next-sentence loss is a second loss value, seeded on its own: program_layer.loss.)
    grad_later = _reads_after(groups, {v for k, v in program.outputs.items() if k in LOSS_OUTPUTS})
    units = []
    for index, (name, nodes) in enumerate(groups):
        units.append(_unit(name, nodes, program, needs, later_reads[index], grad_later[index], dtypes))
    return units


def _reads_after(groups, final: set[str]) -> list[set[str]]:
    """Per group, the values read by the groups after it (plus the program's outputs)."""
    result, acc = [], set(final)
    for _, nodes in reversed(groups):
        result.append(set(acc))
        for n in nodes:
            acc.update(n.inputs)
    return result[::-1]


def _unit(name, nodes, program, needs, read_later, toward_loss, dtypes) -> Unit:
    produced = {o for n in nodes for o in n.outputs}
    read = [i for n in nodes for i in n.inputs]
    params = tuple(dict.fromkeys(i for i in read if i in program.params))
    reads = tuple(dict.fromkeys(i for i in read if i not in produced and i not in program.params))
    writes = tuple(o for n in nodes for o in n.outputs if o in read_later)
    grad_writes = tuple(w for w in writes if w in needs and w in toward_loss)
    grad_reads_wanted = {r for r in reads if r in needs}
    buffers = program.buffers()
    trainable = {p for p in params if program.params[p].dtype in FLOAT_DTYPES and p not in buffers}
    nodes, backward, grads = backward_nodes(nodes, trainable | grad_reads_wanted, list(grad_writes), needs)
    produced.update(o for n in nodes for o in n.outputs)   # the residuals kept for the backward
    param_grads = {p: grads[p] for p in params if p in grads}
    input_grads = {r: grads[r] for r in reads if r in grads}
    fwd_values = produced | set(reads)
    read_by_rules, shape_of = [], []
    for n in backward:
        flags = n.attrs.get("reads", [True] * (len(n.inputs) - 1))
        for value, read in zip(n.inputs[1:], flags):
            if value in fwd_values:
                (read_by_rules if read else shape_of).append(value)
    kept = tuple(dict.fromkeys(read_by_rules))
    shape_only = tuple(v for v in dict.fromkeys(shape_of) if v not in kept)
    return Unit(name, params, reads, writes, nodes, backward, grad_writes, tuple(input_grads),
                param_grads, input_grads, kept, shape_only)


def unit_flops(unit: Unit, shapes: dict[str, tuple]) -> tuple[int, int]:
    """(forward FLOPs, backward FLOPs ~ 2x forward for the ops that have a backward)."""
    fwd = sum(OPS[n.op].flops([shapes[i] for i in n.inputs], shapes[n.outputs[0]], n.attrs) for n in unit.forward)
    bwd = sum(2 * OPS[n.attrs["of"]].flops([shapes[i] for i in n.inputs[1:-1]],
                                           shapes[residual_output(n.inputs[-1])], n.attrs["attrs"])
              for n in unit.backward if n.op == "vjp")
    return fwd, bwd


def kept_bytes(unit: Unit, shapes: dict[str, tuple], dtypes: dict[str, str]) -> int:
    """Bytes of the values the unit's forward keeps for its backward (a residual has its
    output's dtype and the shape its op says: Op.residual_shape)."""
    residuals = {n.outputs[1]: n for n in unit.forward if len(n.outputs) == 2}

    def shape(value):
        node = residuals.get(value)
        if node is None or OPS[node.op].residual_shape is None:
            return shapes[residual_output(value)]
        return OPS[node.op].residual_shape([shapes[i] for i in node.inputs], shapes[node.outputs[0]], node.attrs)
    return sum(int(np.prod(shape(k), dtype=np.int64)) * np.dtype(dtypes[residual_output(k)]).itemsize
               for k in unit.kept)


# ---------------------------------------------------------------- the spec every path runs

UNIT_RULE = "The unit rule:" + __doc__[__doc__.index("The unit rule") + len("The unit rule (shown in compile_report.txt):"):__doc__.index("A parameter read by two units")].strip()


def program_spec(name: str, program: Program, units: list[Unit], shapes: dict[str, tuple],
                 dtypes: dict[str, str], weights: dict[str, np.ndarray], return_output: bool = False,
                 features: list[str] | None = None, context: str = "dropout_context"):
    """A ModelSpec whose layers are the program's units (op "program"), with the
    starting weights. The program's inputs are the model's inputs, then the labels
    (and `context`, the run's context its dropout masks are drawn from, when it reads
    it). `features`: each model input's name in a batch of named arrays (a data set's
    dict of features; forward()'s argument names). With `return_output` each step hands
    back the model's output (the program's "output" value) with its loss, gathered over
    the WSEs in row order."""
    if return_output and "output" not in program.outputs:
        raise CompileError(f"model {name}: the model's output is not one tensor, so no step can hand it back")
    from cs_runtime.numerics.model import LayerSpec, ModelSpec
    inputs = [n for n in program.inputs if n != context]
    if len(inputs) < 2:
        raise CompileError(f"model {name}: the program takes no model input besides the labels")
    features = list(features) if features is not None else [f"input{i}" for i in range(len(inputs) - 1)]
    if len(features) != len(inputs) - 1 or len(set(features)) != len(features):
        raise CompileError(f"model {name}: {len(features)} feature names for {len(inputs) - 1} model inputs")
    _check_buffers(name, program, units)
    layers = tuple(LayerSpec(u.name, "program", 0, 0, unit={
        "unit": u.to_meta(), "param_shapes": {p: list(shapes[p]) for p in u.params}}) for u in units)
    shared = {"inputs": inputs, "features": features, "loss": program.outputs["loss"],
              "context": context if context in program.inputs else "",
              # A classification loss's scores, and its ignored label: what eval's accuracy counts
              "logits": program.outputs.get("logits", ""),
              "ignore_index": _ignore_index(program),
              "label_mean": _label_mean(program),
              "output": program.outputs["output"] if return_output else "",
              "buffers": program.buffers(),
              "values": {v: [list(shapes[v]), dtypes[v]] for v in shapes},   # at the capture's batch
              "consts": {k: [list(a.shape), str(a.dtype), np.ascontiguousarray(a).tobytes()]
                         for k, a in program.consts.items()}}
    return ModelSpec(name, layers, loss="program", program=shared, initial_weights=dict(weights))


def _check_buffers(name: str, program: Program, units: list[Unit]) -> None:
    """A buffer's new value is made in the unit that holds the buffer, which writes it back
    (program_layer.forward): a module called from two units (a batch norm used twice) is refused."""
    for buffer, value in program.buffers().items():
        maker = next((u for u in units if any(value in n.outputs for n in u.forward)), None)
        if maker is None or buffer not in maker.params:
            raise CompileError(f"model {name}: buffer {buffer!r} is updated outside the unit that holds it "
                               "(a module with running statistics called twice in one forward)")


def _label_mean(program: Program) -> bool:
    """Whether the loss is a mean over the labels not ignored (-100, torch's default): a
    shard's share of the global mean is then its labelled targets over the global batch's
    (the input workers count them), not its rows over the batch's."""
    from cs_runtime.numerics.batch_check import IGNORE_INDEX
    loss = program.outputs["loss"]
    node = next((n for n in program.nodes if n.outputs[0] == loss), None)
    return (node is not None and node.op in ("cross_entropy", "nll_loss")
            and node.attrs.get("reduction", "mean") == "mean"
            and int(node.attrs.get("ignore_index", IGNORE_INDEX)) == IGNORE_INDEX)


def _ignore_index(program: Program) -> int:
    loss = program.outputs["loss"]
    node = next((n for n in program.nodes if n.outputs[0] == loss), None)
    return int(node.attrs.get("ignore_index", -100)) if node is not None else -100


def unit_table(spec, shapes: dict[str, tuple], dtypes: dict[str, str]) -> list[dict]:
    """Per unit: its parameters (count; shared ones named), activations kept (bytes), FLOPs."""
    from cs_runtime.numerics.program_layer import unit_of
    readers: dict[str, int] = {}
    for layer in spec.layers:
        for p in unit_of(layer).params:
            readers[p] = readers.get(p, 0) + 1
    rows = []
    for layer in spec.layers:
        unit = unit_of(layer)
        fwd, bwd = unit_flops(unit, shapes)
        rows.append({"unit": unit.name, "ops": len(unit.forward),
                     "params": sum(int(np.prod(shapes[p])) for p in unit.params),
                     "tied": [p for p in unit.params if readers[p] > 1],
                     "kept_bytes": kept_bytes(unit, shapes, dtypes), "kept": list(unit.kept),
                     "fwd_flops": fwd, "bwd_flops": bwd})
    return rows
