"""Layers whose maths is a compiled program: a captured torch model's units,
or a params.yaml model's layers lowered by cs_runtime/compiler/families.py.

A ModelSpec built from a program (cs_runtime/compiler/units.py:
program_spec) has one LayerSpec of op "program" per weight-streaming unit;
the layer carries its unit as data (`layer.unit`: the unit's meta and its
parameters' shapes) and the spec carries what the units share
(`spec.program`: input names, constants, the loss value). A program's model
inputs come from the batch's features: one array, or for a model of several
inputs a dict of arrays by feature name (`spec.program["features"]`). Between layers
the activation is not one array but the dict of live values (what later
units read), and the delta the dict of their gradients, so everything that
moves layers along -- the CPU path, the WSE, the pipelined executor --
works unchanged.

A lowered built-in layer keeps its own op and parameter names (`layer.unit`
maps the program's `fc0.weight` to the layer's `weight`), and its dropout
masks come from the run's context (seed, step, the shard's rows, global batch,
train), fed to the first unit as a value.

The loss is part of the program (the last unit computes it). A captured
program's mean over a shard is weighted by rows / global batch, so shards add
up to the global mean; a built-in model's summed loss by its own normaliser.
With mixed precision (`spec.precision`) the units run as executor.py says:
matmul-like ops round as a dense layer does, parameters are used and their
gradients leave in the 16-bit format, and the batch's float tensors are
rounded to it at the first unit, as an input worker sends them to a WSE.
A parameter read by several units (tied
weights) is held by each of those layers; tie_grads gives each copy the sum
of all their gradients, so every copy takes the same update and stays equal.
"""
from __future__ import annotations

import math
import re
import weakref

import numpy as np

from cs_runtime.numerics import kernels
from cs_runtime.numerics.executor import rounded, unit_backward, unit_forward
from cs_runtime.numerics.program import ProgramError, Unit, _const

_UNITS: dict[int, tuple[dict, Unit]] = {}
# How the program's loss value adds up over shards (loss() below)
REDUCTIONS = ("mean", "sum", "share")
FEATURE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")   # a model input's name in a batch


def unit_of(layer) -> Unit:
    """The layer's unit, parsed and validated once per layer object."""
    cached = _UNITS.get(id(layer.unit))
    if cached is None or cached[0] is not layer.unit:
        if not isinstance(layer.unit, dict) or "unit" not in layer.unit:
            raise ProgramError(f"layer {layer.name}: a program layer needs its unit")
        cached = _UNITS[id(layer.unit)] = (layer.unit, Unit.from_meta(layer.unit["unit"]))
    return cached[1]


def check(spec) -> None:
    """A program spec from the wire: its shared data well formed and every layer's unit valid."""
    shared = spec.program
    if not (isinstance(shared, dict) and isinstance(shared.get("inputs"), list) and len(shared["inputs"]) >= 2
            and _features_valid(shared.get("features"), len(shared["inputs"]) - 1)
            and isinstance(shared.get("logits", ""), str) and isinstance(shared.get("ignore_index", -100), int)
            and isinstance(shared.get("output", ""), str) and isinstance(shared.get("label_mean", False), bool)
            and (not shared.get("output") or shared["output"] in shared.get("values", {}))
            and all(isinstance(n, str) for n in shared["inputs"]) and isinstance(shared.get("loss"), str)
            and isinstance(shared.get("context", ""), str) and shared.get("reduction", "mean") in REDUCTIONS
            and _count(shared.get("first_step", 0))
            and isinstance(shared.get("nsp_loss", ""), str) and isinstance(shared.get("nsp_logits", ""), str)
            and (not shared.get("nsp_loss") or shared.get("reduction") == "sum")
            and isinstance(shared.get("consts"), dict) and isinstance(shared.get("values", {}), dict)):
        raise ProgramError(f"model {spec.name}: malformed program data")
    shared_values(spec)
    _check_buffers(spec)
    for layer in spec.layers:
        if layer.unit is None:
            raise ProgramError(f"model {spec.name}: layer {layer.name} is not a program unit")
        unit = unit_of(layer)
        if layer.op != "program":   # a built-in layer: its own parameters, named in the program
            local = layer.unit.get("local")
            if not (isinstance(local, dict) and all(isinstance(v, str) for v in local.values())
                    and set(local) == set(unit.params) and set(local.values()) == set(layer.param_shapes())):
                raise ProgramError(f"layer {layer.name}: the unit's parameters are not the layer's")
            continue
        shapes = layer.unit.get("param_shapes")
        if not (isinstance(shapes, dict) and all(isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s)
                                                for s in shapes.values())):
            raise ProgramError(f"layer {layer.name}: malformed parameter shapes")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_buffers(spec) -> None:
    """spec.program["buffers"]: {buffer: the value a train step leaves in it}, each buffer a
    parameter of the unit that makes its value (program_spec checks the same at capture)."""
    buffers = spec.program.get("buffers", {})
    if not (isinstance(buffers, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in buffers.items())):
        raise ProgramError(f"model {spec.name}: malformed buffers")
    for buffer, value in buffers.items():
        if not any(buffer in unit_of(layer).params and value in unit_of(layer).writes for layer in spec.layers):
            raise ProgramError(f"model {spec.name}: buffer {buffer!r} is not updated by the unit that holds it")


def synced_modules(spec) -> list[str]:
    """The modules (by path) whose batch norm sums its statistics over the shards
    (SyncBatchNorm: ops.py batch_norm's sync), in program order; [] for none."""
    if spec.program is None:
        return []
    found = (node.module for layer in spec.layers for node in unit_of(layer).forward
             if node.op == "batch_norm" and node.attrs.get("sync"))
    return list(dict.fromkeys(found))


def buffers(spec) -> dict[str, str]:
    """{buffer: the value a train step leaves in it} of a program spec ({} for none)."""
    return (spec.program or {}).get("buffers") or {}


def keeps_buffers(ctx) -> bool:
    """Whether this shard's forward leaves its buffers' new values: a train step's, on the
    shard that holds row 0 of the global batch (the CPU path's whole batch, the first WSE,
    the first replica), as torch DDP keeps rank 0's buffers (broadcast_buffers)."""
    return bool(ctx.train) and not (ctx.rows.start or 0)


def buffers_sent(spec, index: int, live: dict, ctx) -> dict[str, np.ndarray]:
    """The new values of the buffers layer `index` holds, as a WSE sends them up with the
    layer's gradients after a train step's forward: its own where it keeps buffers
    (keeps_buffers), zeros elsewhere, so that SwarmX's sum over the WSEs is row 0's shard's."""
    if spec.program is None:
        return {}
    held = unit_of(spec.layers[index]).params
    keep = keeps_buffers(ctx)
    return {buffer: np.array(live[value], dtype=np.float32) if keep else np.zeros(np.shape(live[value]), np.float32)
            for buffer, value in buffers(spec).items() if buffer in held}


def take_buffers(spec, index: int, arrays: dict, weights: dict) -> dict:
    """A layer's GRADS arrays less its buffers' new values, which are copied into `weights`
    (the layer's masters, in place); the rest must be its parameters' gradients, one each."""
    held = unit_of(spec.layers[index]).params if spec.program is not None else ()
    own = {b for b in buffers(spec) if b in held}
    expected = set(weights)
    if set(arrays) != expected:
        missing, extra = sorted(expected - set(arrays)), sorted(set(arrays) - expected)
        raise ProgramError(f"layer {spec.layers[index].name}: GRADS lack {missing} or carry unknown {extra}")
    for buffer in own:
        value = arrays[buffer]
        if value.shape != weights[buffer].shape or value.dtype != np.float32:
            raise ProgramError(f"layer {spec.layers[index].name}: buffer {buffer!r} arrived as {value.dtype} "
                               f"{value.shape}, expected float32 {weights[buffer].shape}")
        np.copyto(weights[buffer], value)
    return {name: g for name, g in arrays.items() if name not in own}


def _features_valid(features, count: int) -> bool:
    """A program's feature names: absent, or one distinct identifier per model input."""
    return features is None or (isinstance(features, list) and len(features) == count
                                and all(isinstance(f, str) and FEATURE_NAME.match(f) for f in features)
                                and len(set(features)) == count)


def feature_names(spec) -> list[str]:
    """The name of each model input in a batch of named arrays (a data set's dict of features)."""
    names = spec.program["inputs"][:-1]
    return list(spec.program.get("features") or names)


def batch_inputs(spec, x) -> dict:
    """The program's model inputs from a batch's features: one array (a model of one
    input), or a dict of arrays by feature name; each as the model was captured with it
    (an integer array travels as int32 and is read as the int64 the model took)."""
    names = spec.program["inputs"][:-1]
    if isinstance(x, dict):
        features = feature_names(spec)
        if set(x) != set(features):
            raise ProgramError(f"model {spec.name}: the batch has features {sorted(x)}, the model takes "
                               f"{features}")
        arrays = {name: x[f] for name, f in zip(names, features)}
    elif len(names) == 1:
        arrays = {names[0]: x}
    else:
        raise ProgramError(f"model {spec.name}: one feature array for a model of {len(names)} inputs "
                           f"({', '.join(feature_names(spec))}); give the data set's features as a dict")
    values = spec.program.get("values") or {}
    return {name: _as_captured(a, values.get(name)) for name, a in arrays.items()}


def _as_captured(array: np.ndarray, value) -> np.ndarray:
    if value is None or array.dtype.kind not in "iub":
        return array
    want = np.dtype(value[1])
    return array if array.dtype == want else array.astype(want)


def batch_rows(x) -> int:
    """Rows (samples) of a batch's features: one array, or a dict of arrays."""
    return len(next(iter(x.values()))) if isinstance(x, dict) else len(x)


def param_shapes(layer) -> dict[str, tuple[int, ...]]:
    return {name: tuple(int(d) for d in shape) for name, shape in layer.unit["param_shapes"].items()}


def shared_values(spec) -> dict:
    """The program's constants (parsed once per spec)."""
    cached = _UNITS.get(id(spec.program))
    if cached is None or cached[0] is not spec.program:
        consts = {name: _const(meta) for name, meta in spec.program["consts"].items()}
        cached = _UNITS[id(spec.program)] = (spec.program, consts)
    return cached[1]


def context(ctx, rows: int, first_step: int = 0) -> np.ndarray:
    """The run's context a program's dropout masks are drawn from (ops.py dropout_mask). A training
    step's number counts from `first_step`: a 2.x loop's later job goes on from the steps its run
    took (the program's "first_step"), as the CPU path's step count does."""
    start = ctx.rows.start or 0
    stop = ctx.rows.stop if ctx.rows.stop is not None else start + rows
    step = ctx.step + first_step if ctx.train else ctx.step
    return np.array([ctx.seed, step, start, stop, ctx.global_batch, int(bool(ctx.train))], dtype=np.int64)


def _program_weights(layer, weights: dict) -> dict:
    """The layer's weights under the program's names (a built-in layer names its own)."""
    local = layer.unit.get("local")
    return weights if local is None else {full: weights[name] for full, name in local.items()}


def forward(spec, index: int, x, weights: dict, ctx, weights_rounded: bool = False):
    """x: the batch's input array at the first layer, the live values after it.
    `weights_rounded`: the weights hold the format's values already (they arrived in it)."""
    layer = spec.layers[index]
    if index == 0:
        names = spec.program["inputs"]
        live = {**shared_values(spec), **rounded({**batch_inputs(spec, x), names[-1]: ctx.labels}, spec.precision)}
        if spec.program.get("context"):
            live[spec.program["context"]] = context(ctx, batch_rows(x), spec.program.get("first_step", 0))
    else:
        live = dict(x)
    unit = unit_of(layer)
    held = _program_weights(layer, weights)
    cache = unit_forward(unit, held, live, spec.precision, weights_rounded, train=bool(ctx.train), reduce=ctx.reduce)
    if keeps_buffers(ctx):
        for buffer, value in buffers(spec).items():
            if buffer in unit.params:   # the running statistics the next step starts from
                held[buffer] = np.array(live[value], dtype=np.float32)
    return live, (cache, live, ctx.reduce)   # the backward sums over the shards as the forward did


def backward(spec, index: int, delta: dict, cache, weights: dict, weights_rounded: bool = False,
             grads_on_wire: bool = False):
    """(the gradients of the live values the unit read, or None at the first; its parameter
    gradients, in the format's values, or with `grads_on_wire` its storage)."""
    kept, live, reduce = cache
    dlive = dict(delta)
    layer = spec.layers[index]
    grads = unit_backward(unit_of(layer), _program_weights(layer, weights), kept, live, dlive, spec.precision,
                          weights_rounded, grads_on_wire, reduce)
    local = layer.unit.get("local")
    if local is not None:
        grads = {local[full]: g for full, g in grads.items()}
    return (dlive if index > 0 else None), grads


def loss(spec, live: dict, labels: np.ndarray, global_batch: int, label_count: int | None = None):
    """(this shard's share of the global loss, the delta that starts backward, the
    shard's summed loss, predictions right, labels counted). With a classification loss the
    counts are of its scores' argmax against the labels it does not ignore; else of rows.

    A captured program's loss is a mean over the shard, weighted rows / global batch; a
    mean over labelled targets (cross-entropy ignoring -100) by the shard's labelled
    targets / the global batch's (`label_count`), as the shards hold different numbers.
    A built-in token model's (reduction "sum") is the shard's summed loss, weighted by the
    token loss scaling; a built-in classifier's (reduction "share") is the shard's share of
    the global batch's mean already (ops.py softmax_cross_entropy). Shards add up to the
    global batch's loss."""
    name = spec.program["loss"]
    value = live[name]
    rows = len(labels)
    correct, count = 0, rows
    logits = live.get(spec.program.get("logits") or "")
    if logits is not None and logits.ndim and logits.size // logits.shape[-1] == labels.size:
        flat = labels.reshape(-1)
        counted = flat != spec.program.get("ignore_index", -100)
        scores = logits.reshape(-1, logits.shape[-1])
        correct, count = int(((scores.argmax(axis=-1) == flat) & counted).sum()), int(counted.sum())
    if spec.program.get("reduction") == "share":   # the shard's share of the global mean already
        share = float(value)
        return share, {name: np.asarray(1.0, dtype=value.dtype)}, share * global_batch, correct, count
    if spec.program.get("reduction") == "sum":
        weight = kernels.token_loss_weight(spec.loss_scaling, spec.loss_weight, global_batch, label_count)
        share, delta, loss_sum = float(value) * weight, {name: np.asarray(weight, dtype=value.dtype)}, float(value)
        if spec.program.get("nsp_loss"):
            share, loss_sum = _add_nsp(spec, live, delta, share, loss_sum, global_batch, label_count)
        return share, delta, loss_sum, correct, count
    weight = rows / global_batch
    if spec.program.get("label_mean") and label_count:
        # A mean over labelled targets (a masked LM's): shards hold different numbers of them.
        weight = int(np.count_nonzero(labels != kernels.IGNORE_INDEX)) / label_count
    return float(value) * weight, {name: np.asarray(weight, dtype=value.dtype)}, float(value) * count, correct, count


def _add_nsp(spec, live: dict, delta: dict, share: float, loss_sum: float, global_batch: int,
             label_count: int | None) -> tuple[float, float]:
    """BERT's total loss, as the model zoo's BertPretrainModelLoss adds it: the masked-LM
    loss + the next-sentence cross-entropy's mean over the global batch's sequences (its
    own seed, 1 / global batch). Eval's loss per masked token gets the next-sentence mean
    too: its sum counted label_count / global batch times, so the report is the two means added."""
    name = spec.program["nsp_loss"]
    value = live[name]
    delta[name] = np.asarray(1.0 / global_batch, dtype=value.dtype)
    per_label = (label_count or 0) / global_batch
    return share + float(value) / global_batch, loss_sum + float(value) * per_label


def step_outputs(spec, live) -> dict:
    """What a step hands back besides its loss: the model's output on this shard's rows,
    when the job asked for it (spec.program["output"]); {} otherwise."""
    name = (spec.program or {}).get("output") if isinstance(live, dict) else None
    if not name:
        return {}
    return {"output": np.ascontiguousarray(live[name])}


def hands_out_outputs(spec) -> bool:
    """Whether a step hands out the model's output (step_outputs), not its loss alone."""
    return bool((spec.program or {}).get("output"))


def _program_names(layer) -> dict[str, str]:
    """{the layer's name of a parameter: the program's}: a lowered built-in layer names its
    own (`unit["local"]`); a captured model's unit uses the program's names."""
    local = layer.unit.get("local") if isinstance(layer.unit, dict) else None
    if local is None:
        return {name: name for name in param_shapes(layer)}
    return {name: full for full, name in local.items()}


def tied_sources(spec) -> dict[tuple[int, str], tuple[int, str]]:
    """(layer index, parameter name) of every copy of a tied parameter after its first
    reader's -> that first reader's (layer index, name). {} for a model without ties."""
    if spec.program is None:   # a built-in model not lowered (yet): its tied heads say it
        index = {layer.name: i for i, layer in enumerate(spec.layers)}
        return {(i, "tokens"): (index[layer.tied], "tokens") for i, layer in enumerate(spec.layers)
                if layer.op == "lm_head" and layer.tied in index}
    first: dict[str, tuple[int, str]] = {}
    copies = {}
    for i, layer in enumerate(spec.layers):
        for name, full in _program_names(layer).items():
            if full in first:
                copies[(i, name)] = first[full]
            else:
                first[full] = (i, name)
    return copies


def has_tied(spec) -> bool:
    """Whether a parameter is read by more than one layer of the spec."""
    return bool(tied_sources(spec))


# spec id -> (a weak reference to the spec, its tied_copies): asked every step, the same
# for a spec's life (a ModelSpec is frozen); the weak reference lets the spec go.
_TIED: dict[int, tuple[weakref.ref, frozenset]] = {}


def tied_copies(spec) -> frozenset:
    """(layer index, parameter name) of every copy of a tied parameter after its first
    reader's: the global gradient norm counts the parameter once (optim.update_model)."""
    cached = _TIED.get(id(spec))
    if cached is None or cached[0]() is not spec:
        cached = _TIED[id(spec)] = (weakref.ref(spec), frozenset(tied_sources(spec)))
    return cached[1]


def param_grad_norms(spec, grads: list[dict], squares: list | None = None) -> dict[str, float]:
    """Each parameter's gradient norm by its program's name, a tied parameter once (its copies hold
    the same summed gradient): from the layers' gradients, or from their squared norms (optim's
    squared_norms, in each dict's order) where the step took them already. {} for a built-in model
    not lowered (its layers name their parameters alike)."""
    if spec.program is None:
        return {}
    from cs_runtime.numerics.optim import squared_norms
    copies = tied_copies(spec)
    norms = {}
    for i, (layer, layer_grads) in enumerate(zip(spec.layers, grads)):
        names = _program_names(layer)
        layer_squares = squares[i] if squares is not None else squared_norms(layer_grads)
        for name, square in zip(layer_grads, layer_squares):
            if (i, name) not in copies:
                norms[names.get(name, name)] = math.sqrt(square)
    return norms


def weight_squares(spec, weights: dict) -> list[dict] | None:
    """Each layer's {array name: its sum of squares} (optim.squared_norms, the gradient norms'
    rule) of `weights` (layer name -> {name: array}) as they are now; None for a built-in model."""
    if spec.program is None:
        return None
    from cs_runtime.numerics.optim import squared_norms
    return [dict(zip(weights[layer.name], squared_norms(weights[layer.name]))) for layer in spec.layers]


def param_norms(spec, squares: list[dict] | None, grads: list[dict]) -> dict[str, float]:
    """Each trained parameter's norm by its program's name, a tied parameter once, from
    weight_squares: the parameters the step has gradients of (param_grad_norms' names)."""
    if squares is None:
        return {}
    return param_grad_norms(spec, grads, [[squares[i][name] for name in layer_grads]
                                          for i, layer_grads in enumerate(grads)])


def tie_grads(spec, grads: list[dict]) -> list[dict]:
    """Every copy of a parameter read by several layers gets the sum of their gradients."""
    if spec.program is not None and not tied_copies(spec):   # no parameter read by two layers
        return grads
    owners: dict[str, list[tuple[int, str]]] = {}
    for i, layer in enumerate(spec.layers):
        local = layer.unit.get("local") if isinstance(getattr(layer, "unit", None), dict) else None
        program = {name: full for full, name in local.items()} if local else {}
        for name in grads[i] or {}:
            owners.setdefault(program.get(name, name), []).append((i, name))
    for readers in owners.values():
        if len(readers) > 1:
            total = sum(np.asarray(grads[i][name], dtype=np.float32) for i, name in readers)
            for n, (i, name) in enumerate(readers):
                # each layer its own copy: a later in-place step (unscaling) must touch each once
                grads[i] = {**grads[i], name: total if n == 0 else total.copy()}
    return grads
