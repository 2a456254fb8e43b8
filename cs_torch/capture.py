"""Capture a torch.nn.Module, an example batch and a loss function as the
project's program (cs_runtime/numerics/program.py). The only module of the
project that needs torch for a model, and only when a user brings one.

    captured = capture(model, (x,), y, torch.nn.functional.cross_entropy)
    captured = capture(model, {"input_ids": ids, "attention_mask": mask}, labels, loss_fn)
    captured.program      # params named by module path, inputs, nodes over the op set
    captured.units        # weight-streaming units, each with its backward
    captured.weights      # the module's own initial weights, as float32 numpy

Why torch.export and not torch.fx's symbolic tracer: export runs the module
on fake tensors, so data-dependent Python (shapes read off tensors, `.view(B,
T, ...)`, `split`, loops over a ModuleList) resolves to plain ATen ops and
shapes that are numbers, but for the batch: dim 0 of the inputs is one
symbolic size, so that a program holds for a shard of any number of rows
(docs/torch.md, "A program holds for any shard"); it names every parameter by its module path, records each
node's module stack and source line, and de-duplicates tied parameters.
symbolic_trace keeps `.shape` as proxies and calls to modules as
call_module nodes that would each need their own lowering.

The model and the loss are exported together (one wrapper module), so the
loss is part of the program and its backward comes from the same rules.
ATen ops become ops of the op set by the table `_LOWER`; a node whose
inputs are all constants (an arange of positions, a causal mask built with
tril) is evaluated here by torch once and enters as a constant. An op not in
the table fails here, naming the module path, the op and the source line.

The example batch is one tensor, a tuple of tensors (the model's positional
arguments) or a dict of them (keyword arguments, e.g. input_ids,
attention_mask, token_type_ids). The program's inputs are input0, input1, ...
then "target", in the order of forward()'s signature; `feature_names` says
which argument each is, and a data set hands a multi-input model a dict of
arrays under those names (docs/torch.md).

Dropout in training (nn.Dropout, F.dropout with p > 0) becomes the op
dropout_mask, fed the run's context (seed, step, the shard's rows, global
batch, train): a sample's mask depends only on (seed, step, dropout site,
its row in the global batch), so the CPU path and every WSE draw the same
masks, and an eval step (train 0 in the context) drops nothing. torch.rand,
randn, randperm and their _like forms become the op draw, from the same
context: fresh each step, a sample's draws the same on any shard (DRAWS).
"""
from __future__ import annotations

import inspect
import operator
import os
import re
from dataclasses import dataclass

import numpy as np
import torch

from cs_runtime.errors import UserInputError
from cs_runtime.compiler.units import split_units
from cs_runtime.numerics.program import BUFFER_ROLE, Node, Program, ProgramError, Unit, Value, infer_values
from cs_runtime.numerics.program_layer import FEATURE_NAME

_TORCH_DIR = os.path.dirname(torch.__file__)
_INT64_MAX = 2 ** 63 - 1
_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.int64: "int64", torch.int32: "int32",
           torch.bool: "bool"}


class CaptureError(UserInputError):
    """The model cannot be captured; one line naming the module path, the op and the source line."""


@dataclass
class Captured:
    program: Program
    units: list[Unit]
    shapes: dict[str, tuple]
    dtypes: dict[str, str]
    weights: dict[str, np.ndarray]          # parameter name -> float32 initial value (the module's own)
    input_names: list[str]                  # the model's inputs, then "target"
    aliases: dict[str, str]                 # state_dict key of a tied parameter -> its program name
    feature_names: list[str]                # forward()'s argument name of each model input, in order


# The run's context a captured dropout draws its masks from (as the built-in families' programs)
CONTEXT = "dropout_context"   # int64 [seed, step, row_start, row_stop, global_batch, train]


class _WithLoss(torch.nn.Module):
    def __init__(self, model, loss_fn, keywords: list[str] | None, target_in_model: bool = False):
        super().__init__()
        self.model, self.loss_fn, self.keywords = model, loss_fn, keywords
        self.target_in_model = target_in_model

    def forward(self, *args):
        inputs = args if self.target_in_model else args[:-1]
        if self.keywords:   # a model taking its inputs by name (and the target first, when it takes it too)
            out = self.model(*args[len(self.keywords):len(inputs)], **dict(zip(self.keywords, inputs)))
        else:
            out = self.model(*inputs)
        loss = self.loss_fn(out, args[-1])
        # The model's own output too, when it is one tensor: a job hands it back on request.
        return (loss, out) if isinstance(out, torch.Tensor) else (loss,)


def capture(model: torch.nn.Module, example_inputs, example_target, loss_fn, dropout: bool = True,
            target_in_model: bool = False) -> Captured:
    """The program of `loss_fn(model(*example_inputs), example_target)` at these shapes
    (`model(**example_inputs)` when they are a dict). `dropout`: whether dropout in
    training may draw masks (the caller feeds the run's context); without, it is refused.
    `target_in_model`: the model takes the target as its last argument too (a model that
    computes its own loss from its input and the labels: `model(*example_inputs, target)`)."""
    names, inputs, keywords = _example_inputs(model, example_inputs)
    _refuse_batch_norm_unsupported(model)
    # Copies: export treats one tensor passed twice (ids as input and as target) as one input.
    examples = tuple(t.clone() for t in (*inputs, example_target))
    wrapped = _WithLoss(model, loss_fn, keywords, target_in_model)
    batch = _batch_size(inputs)
    exported = _export_batch_free(wrapped, examples, batch)
    try:
        captured = _Lowering(_functional(exported), model, dropout, batch).run()
        _dry_run(captured, [t for example in examples for t in _tensors(example)])
    except ProgramError as exc:   # an op's shape or attribute rule: it names the module, op and line
        raise CaptureError(str(exc)) from None
    captured.feature_names = names
    return captured


def _dry_run(captured: Captured, examples: list) -> None:
    """The program once on the example batch, as a step runs it: forward and backward in
    training, forward in eval. What an op refuses only as it runs (an attribute it does not
    take, a value it cannot hold) fails here, at --validate_only, in one line naming the
    module, the op and the line, and never during a step."""
    from cs_runtime.numerics.executor import forward_backward, unit_forward
    from cs_runtime.numerics.ops import OpError
    program = captured.program
    if len(examples) != len(captured.input_names):
        return   # a traced step's target of several parts: its own engine runs it
    inputs = {name: _numpy(t).astype(program.inputs[name].dtype)
              for name, t in zip(captured.input_names, examples) if name in program.inputs}
    rows = len(next(iter(inputs.values())))
    try:
        for train in (1, 0):
            if CONTEXT in program.inputs:
                inputs[CONTEXT] = np.array([0, 0, 0, rows, rows, train], dtype=np.int64)
            if train:
                forward_backward(captured.units, captured.weights, inputs, program.consts, program.outputs["loss"])
                continue
            live = {**program.consts, **inputs}
            for unit in captured.units:
                unit_forward(unit, captured.weights, live, train=False)
    except OpError as exc:
        raise CaptureError(f"{exc} (the program run once on the example batch)") from None


def _tensors(example) -> list:
    """The tensors of an example (a target may be a tuple of them: a traced step's)."""
    if isinstance(example, (tuple, list)):
        return [t for part in example for t in _tensors(part)]
    return [example] if isinstance(example, torch.Tensor) else []


def _batch_size(inputs) -> int:
    sizes = {int(t.shape[0]) for t in _tensors(inputs) if t.dim()}
    if not sizes:
        raise CaptureError("the example inputs have no batch: each model input's dim 0 is its batch")
    if len(sizes) != 1:
        raise CaptureError(f"the example inputs have {len(sizes)} different batch sizes "
                           f"({', '.join(str(n) for n in sorted(sizes))}): dim 0 is the batch of each")
    return sizes.pop()


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _per_tensor(example, fn):
    """`example` with fn applied to each of its tensors, its tuples kept."""
    if isinstance(example, (tuple, list)):
        return tuple(_per_tensor(part, fn) for part in example)
    return fn(example)


def _export_batch_free(wrapped, examples, batch: int):
    """torch.export with dim 0 of every input and of the target one symbolic size, the
    batch: a shape computed from it stays a function of it (`view(B, T, -1, hs)`,
    `buffer.expand(B, T)`), so the program holds for a shard of any number of rows.
    A model that fixes the batch (a buffer or a shape of the capture's batch size) is
    refused here, at its source line: run on a shard, it would compute wrong numbers."""
    dim = torch.export.Dim("batch")

    def follows(t):   # a tensor of the step that is not the batch's (a traced step's scalar) stays
        return isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch
    dynamic = _per_tensor(examples, lambda t: {0: dim} if follows(t) else None)
    # Export takes a size of 1 for a constant; two rows are the same program.
    traced = _per_tensor(examples, lambda t: torch.cat([t, t]) if batch == 1 and follows(t) else t)
    try:
        return torch.export.export(wrapped, traced, dynamic_shapes=(dynamic,))   # forward(*args)
    except Exception as exc:  # torch raises many types; the user needs the one line
        if "Constraints violated (batch)" in str(exc):
            if "specialized it to be a constant" in str(exc):
                raise _fixed_batch_error(wrapped, examples, batch) from exc
            raise _batch_range_error(str(exc)) from exc
        first = _first_line(exc)
        cause = exc
        while cause.__cause__ is not None:   # code that wraps errors (the model zoo's callbacks): say the root
            cause = cause.__cause__
        if cause is not exc:
            first = f"{first}: {_first_line(cause)}"
        where = _user_frame(exc.__traceback__, wrapped.model)
        raise CaptureError(f"{where + ': ' if where else ''}torch.export could not trace the model: {first}") from exc


def _fixed_batch_error(wrapped, examples, batch: int) -> CaptureError:
    """Where the model fixes its batch size: the module and line that fail when it runs one row more."""
    grown = _per_tensor(examples, lambda t: torch.cat([t, t[:1]]) if t.dim() and t.shape[0] == batch else t)
    where, why = "", ""
    try:
        with torch.no_grad():
            wrapped(*grown)
    except Exception as exc:  # the model's own error at another batch size names the line
        where = _user_frame(exc.__traceback__, wrapped.model)
        why = " (" + (str(exc).strip().splitlines() or [type(exc).__name__])[0] + f" at {batch + 1} rows)"
    return CaptureError(f"{where + ': ' if where else ''}the model fixes the batch size at {batch}{why}: a buffer "
                        "or a shape of the capture's batch size would compute wrong numbers on a shard of other "
                        "rows; write shapes from x.shape or with -1, and broadcast buffers over the batch")


def _batch_range_error(message: str) -> CaptureError:
    """The model holds only for some batch sizes (x[1:] of the batch needs 3 rows or more)."""
    found = re.search(r"generated guard (.*)", message)
    guard = re.sub(r"L\[[^\]]*\](\[\d+\])?\.size\(\)\[0\]", "batch", found.group(1)) if found else "?"
    guard = guard.replace(" and batch <= IntInfinity()", "")
    return CaptureError(f"the model holds for a batch only where {guard}: a "
                        "shard of other rows would fail (does it cut or compare rows of the batch?)")


def _user_frame(tb, model) -> str:
    """module path and file:line of a traceback's innermost frame outside torch and this module."""
    paths = {id(m): path for path, m in model.named_modules()}
    best = ""
    while tb is not None:
        code, owner = tb.tb_frame.f_code, tb.tb_frame.f_locals.get("self")
        if not _in_torch(code.co_filename) and code.co_filename != __file__:
            module = paths.get(id(owner)) if owner is not None else None
            best = (f"module {module or '<root>'}: " if module is not None else "") + \
                f"at {os.path.basename(code.co_filename)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return best


def _in_torch(path: str) -> bool:
    """torch's own files (not torchvision's, whose folder name starts the same)."""
    return path.startswith(_TORCH_DIR + os.sep)


def _refuse_batch_norm_unsupported(model) -> None:
    """A cumulative average (momentum None) reads the step count as a Python number, which
    export would fix at its capture value."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.training and \
                module.track_running_stats and module.momentum is None:
            raise CaptureError(f"module {name or '<root>'}: {type(module).__name__} with momentum=None (a cumulative "
                               "average over num_batches_tracked) in training is not supported; give it a momentum")


def _example_inputs(model, example_inputs) -> tuple[list[str], tuple, list[str] | None]:
    """(forward()'s argument name of each input, the tensors in that order, the keywords
    to call the model with, or None to call it positionally)."""
    try:
        signature = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        signature = []
    positional = [p.name for p in signature if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if isinstance(example_inputs, dict):
        if not example_inputs:
            raise CaptureError("the example batch is an empty dict; give the model's inputs by name")
        known = {p.name for p in signature}
        takes_any = any(p.kind == p.VAR_KEYWORD for p in signature)
        order = [n for n in (p.name for p in signature) if n in example_inputs]
        order += [n for n in example_inputs if n not in order]
        for name in order:
            if not takes_any and name not in known:
                raise CaptureError(f"example input {name!r} is not an argument of "
                                   f"{type(model).__name__}.forward ({', '.join(p.name for p in signature)})")
        inputs, keywords = tuple(example_inputs[n] for n in order), order
    else:
        inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        keywords = None
        order = [positional[i] if i < len(positional) else f"input{i}" for i in range(len(inputs))]
    for name, tensor in zip(order, inputs):
        if not isinstance(tensor, torch.Tensor):
            raise CaptureError(f"example input {name!r} is a {type(tensor).__name__}, not a tensor")
        if not FEATURE_NAME.match(name):
            raise CaptureError(f"model input {name!r}: a feature name is a Python identifier of at most 64 "
                               "characters")
    return order, inputs, keywords


def _packet(op) -> str:
    return op._overloadpacket.__name__ if hasattr(op, "_overloadpacket") else ""


def _functional(exported):
    """The exported program with in-place ops made functional (relu_ -> relu, x.add_(y) ->
    add, a buffer's update -> an output that says which buffer) and every op outside the
    op set decomposed into the Core ATen ops torch defines it by (hardswish -> clamp,
    unbind -> select, ...). The op set's own ops stay whole: they are worth it for speed
    or accuracy (attention, layer norm, batch norm, GELU)."""
    _inplace_to_functional(exported.graph_module.graph)
    exported.graph_module.recompile()
    if all(_packet(n.target) in _LOWER or _packet(n.target) in MADE_AT_CAPTURE or _packet(n.target) in DRAWS
           for n in exported.graph.nodes
           if n.op == "call_function" and n.target is not operator.getitem and "_assert" not in str(n.target)):
        return exported   # nothing to do, and run_decompositions costs a second or more
    table = torch.export.default_decompositions()
    keep = [op for op in table.keys() if _packet(op) in _LOWER or _packet(op).rstrip("_") in _LOWER]
    for op in keep:
        del table[op]
    try:
        return exported.run_decompositions(table)
    except Exception as exc:  # torch raises many types; the user needs the one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CaptureError(f"torch could not make the model's graph functional: {first}") from exc


# Ops whose output shares the input's storage: an in-place op on their output changes
# the input too, which only torch's functionalization (run_decompositions) follows.
_VIEWS = frozenset({"view", "_unsafe_view", "reshape", "slice", "select", "transpose", "t", "permute",
                    "expand", "unsqueeze", "squeeze", "alias", "as_strided", "diagonal", "unfold",
                    "split", "split_with_sizes", "chunk", "unbind", "narrow", "flatten", "view_as",
                    "detach", "unflatten", "movedim", "expand_as", "contiguous"})


def _inplace_to_functional(graph) -> None:
    """x.op_(...) on a fresh intermediate x (not an input, parameter or buffer, not a view
    of one) as y = op(x, ...), later readers of x reading y. Done here for every such op,
    because torch's functionalization decomposes some of them (dropout_ into bernoulli,
    which would be drawn once, at capture) where the functional op stays whole."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_function" or not _packet(node.target).endswith("_") or not node.args:
            continue
        name = _packet(node.target)
        functional = getattr(torch.ops.aten, name[:-1], None)
        overload = getattr(functional, node.target._overloadname, None) if functional is not None else None
        target = node.args[0]
        if overload is None or name.startswith("_") or not isinstance(target, torch.fx.Node) or \
                target.op != "call_function" or _packet(target.target) in _VIEWS or \
                any(_packet(u.target) in _VIEWS for u in target.users if u.op == "call_function"):
            continue
        node.target = overload
        for user in [u for u in target.users if order[u] > order[node]]:
            user.replace_input_with(target, node)


def _needed(outputs) -> set:
    """The nodes the outputs depend on: what the loss function computes besides the
    loss (a traced step's accuracy) is not the program's, nor are the asserts that read it."""
    needed, todo = set(), list(outputs)
    while todo:
        node = todo.pop()
        if node not in needed:
            needed.add(node)
            todo.extend(node.all_input_nodes)
    return needed


def _source(fx_node) -> str:
    """file:line of the innermost frame outside torch (the user's line)."""
    trace = fx_node.meta.get("stack_trace") or ""
    best = ""
    for line in trace.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            path, _, rest = line[6:].partition('", line ')
            if not _in_torch(path) and path != __file__:
                best = f"{os.path.basename(path)}:{rest.split(',')[0]}"
    return best


def _module_path(fx_node) -> str:
    stack = fx_node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    path = path.replace("L['self'].", "").replace("L__self__.", "")
    if path == "model" or path == "loss_fn":
        return ""
    for prefix in ("model.", "loss_fn."):
        if path.startswith(prefix):
            return path[len(prefix):]
    return path


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


class _Lowering:
    def __init__(self, exported, model, dropout: bool = True, batch: int = 1):
        self.ep, self.model, self.dropout, self.batch = exported, model, dropout, batch
        self.names: dict = {}          # fx node -> program value name (or list of names, for split)
        self.constants: dict = {}      # fx node -> torch value, for nodes computed at capture
        self.const_names: dict = {}    # fx node of a constant -> its program constant, once an op reads it
        self.symbolic: set = set()     # fx nodes of sizes that follow the batch (x.shape[0], B * T)
        self.batch_inputs: list = []   # inputs whose dim 0 is the batch
        self.reduced: dict = {}        # fx node computed from a reduction over the batch -> that reduction
        self.nodes: list[Node] = []
        self.params: dict[str, Value] = {}
        self.inputs: dict[str, Value] = {}
        self.consts: dict[str, np.ndarray] = {}
        self.fx_node = None
        self.buffer_updates: dict = {}  # buffer (state_dict target) -> the fx node of its value after a train step
        # SyncBatchNorm modules in training, by path: their batch norms are synchronized over the
        # shards (ops.py batch_norm's sync). Outside torch.distributed their forward exports as a
        # plain batch norm, so the module is what says it; each must be found (run()).
        self.synced = {name for name, m in model.named_modules()
                       if isinstance(m, torch.nn.SyncBatchNorm) and m.training}
        self.synced_found: set = set()

    def run(self) -> Captured:
        sig = self.ep.graph_signature
        state = {**self.ep.state_dict, **getattr(self.ep, "constants", {})}
        user_inputs = []
        user_outputs = self._user_outputs(sig)
        needed = _needed([*user_outputs, *self.buffer_updates.values()])
        for node in self.ep.graph.nodes:
            self.fx_node = node
            if node.op == "placeholder":
                self._placeholder(node, sig, state, user_inputs)
            elif node.op == "call_function" and node in needed:
                self._call(node)
            elif node.op == "output":
                loss, *model_out = [self._value(out) for out in user_outputs]
        names = [*(f"input{i}" for i in range(len(user_inputs) - 1)), "target"]
        rename = dict(zip(user_inputs, names))
        outputs = {"loss": loss}
        for target, arg in self.buffer_updates.items():
            self.fx_node = _first_op(arg)
            outputs[BUFFER_ROLE + _strip(target)] = self._value(arg)
        if model_out and model_out[0] not in rename:
            outputs["output"] = model_out[0]
        last = self.nodes[-1] if self.nodes else None
        if last is not None and last.outputs[0] == loss and last.op == "cross_entropy":
            # The scores a classification loss reads: eval counts the predictions they get right.
            outputs["logits"] = last.inputs[0]
        missed = sorted(self.synced - self.synced_found)
        if missed:   # never train per-shard statistics where the model asked for synchronized ones
            raise CaptureError(f"module {missed[0]}: SyncBatchNorm in training whose batch norm the exported "
                               "program does not show as the module's; use BatchNorm, or capture it in eval mode")
        program = _renamed(Program(self.params, self.inputs, self.consts, self.nodes, outputs), rename)
        program.validate()
        shapes, dtypes = infer_values(program)
        self._check_another_shard(program, [rename.get(n, n) for n in self.batch_inputs])
        if shapes[program.outputs["loss"]] != ():
            raise CaptureError(f"the loss function returns shape {shapes[program.outputs['loss']]}, not a scalar")
        units = split_units(program, shapes, dtypes)
        weights = {name: _numpy(state[self._param_targets[name]]).astype(np.float32)
                   for name in program.params}
        return Captured(program, units, shapes, dtypes, weights, names, self._aliases(), [])

    def _check_another_shard(self, program: Program, batch_inputs: list[str]) -> None:
        """The shape rules once more with a shard of one row more than captured: what would
        fail on a WSE's shard fails here, at --validate_only, and never during a step."""
        rows = self.batch + 1
        inputs = {name: Value((rows, *v.shape[1:]), v.dtype) if name in batch_inputs else v
                  for name, v in program.inputs.items()}
        try:
            shapes, _ = infer_values(Program(program.params, inputs, program.consts, program.nodes, program.outputs))
        except ProgramError as exc:
            raise CaptureError(f"{exc} (on a shard of {rows} rows; captured at {self.batch})") from None
        if shapes[program.outputs["loss"]] != ():
            raise CaptureError(f"the loss is not a scalar on a shard of {rows} rows: {shapes[program.outputs['loss']]}")

    # ------------------------------------------------------------ sources

    def _placeholder(self, node, sig, state, user_inputs):
        val = node.meta.get("val")
        name = node.name
        self._param_targets = getattr(self, "_param_targets", {})
        if name in sig.inputs_to_parameters:
            pname = _strip(sig.inputs_to_parameters[name])
            self.params[pname] = Value(tuple(val.shape), self._dtype(val))
            self._param_targets[pname] = sig.inputs_to_parameters[name]
            self.names[node] = pname
        elif sig.inputs_to_buffers.get(name) in self.buffer_updates:
            # State a train step updates (running statistics): held and streamed with the parameters,
            # as float32 (num_batches_tracked too: exact to 2**24 steps), but given no gradient.
            pname = _strip(sig.inputs_to_buffers[name])
            self.params[pname] = Value(tuple(val.shape), "float32")
            self._param_targets[pname] = sig.inputs_to_buffers[name]
            self.names[node] = pname
        elif name in sig.inputs_to_buffers or name in getattr(sig, "inputs_to_lifted_tensor_constants", {}):
            target = sig.inputs_to_buffers.get(name) or sig.inputs_to_lifted_tensor_constants[name]
            self.constants[node] = state[target]
            self.names[node] = None
        else:
            self.inputs[name] = Value(self._at_capture(val.shape), self._dtype(val))
            if val.dim() and _symbolic(val.shape[0]):
                self.batch_inputs.append(name)
            self.names[node] = name
            user_inputs.append(name)

    def _user_outputs(self, sig) -> list:
        """The graph's outputs that are the wrapper's (the loss, the model's output). The
        others are state a step carries to the next: BatchNorm's running statistics and
        count, noted in self.buffer_updates; any other update in place is refused in one line."""
        output = next(n for n in self.ep.graph.nodes if n.op == "output")
        outs = []
        for arg, spec in zip(output.args[0], sig.output_specs):
            if spec.kind == torch.export.graph_signature.OutputKind.USER_OUTPUT:
                outs.append(arg)
            elif spec.kind == torch.export.graph_signature.OutputKind.BUFFER_MUTATION:
                self.fx_node = _first_op(arg)
                if not _batch_norm_state(arg, spec.target):
                    self._refuse_a_metric_inside(_strip(spec.target))
                    raise self.error(f"the forward updates buffer {_strip(spec.target)!r} in place; a run carries "
                                     "only BatchNorm's running statistics from step to step")
                if not self.dropout:
                    raise self.error(f"the forward updates buffer {_strip(spec.target)!r} (BatchNorm's running "
                                     "statistics in training); a traced step carries no buffers yet: capture such "
                                     "layers in eval mode, or hand the model to run() with "
                                     "cs_torch.capture.model_spec")
                self.buffer_updates[spec.target] = arg
            else:
                self.fx_node = _first_op(arg)
                raise self.error(f"the forward changes its {spec.kind.name.lower()} {spec.target!r} in place")
        return outs

    def _aliases(self) -> dict[str, str]:
        """state_dict keys that share a captured parameter's storage (tied weights)."""
        state = self.model.state_dict(keep_vars=True)
        owner_of = {state[name].data_ptr(): name for name in self.params}
        aliases = {}
        for key, t in state.items():
            owner = owner_of.get(t.data_ptr())
            if owner is not None and key != owner:
                aliases[key] = owner
        return aliases

    def _dtype(self, val) -> str:
        if val.dtype not in _DTYPES:
            raise self.error(f"tensor of dtype {val.dtype} (supported: {sorted(_DTYPES.values())})")
        return _DTYPES[val.dtype]

    # ------------------------------------------------------------ ops

    def _refuse_a_metric_inside(self, buffer: str) -> None:
        """A cstorch.metrics metric the model's own forward calls (the model zoo's GPT-2 and BERT in
        eval, compute_eval_metrics): its state is not a program's; refused in one line that says so."""
        from .metrics import Metric
        owner, _, _ = buffer.rpartition(".")
        try:
            module = self.model.get_submodule(_strip(owner))
        except AttributeError:
            return
        if isinstance(module, Metric):
            raise self.error(f"the model's forward calls the metric {owner!r} ({type(module).__name__}); a metric "
                             "inside the compiled model is not emulated: call it in the step on the model's "
                             "outputs (the model zoo: model compute_eval_metrics: false)")

    def error(self, what: str) -> CaptureError:
        return CaptureError(f"{_located(self.fx_node)}: {what}")

    def batch_norm_attrs(self) -> dict:
        """{"sync": True} for the batch norm of a SyncBatchNorm module in training, else {}."""
        path = _module_path(self.fx_node)
        if path not in self.synced:
            return {}
        self.synced_found.add(path)
        return {"sync": True}

    def _check_rows_stay_apart(self, node):
        """Refuse an op that meets a value reduced over the batch (x.mean(0), x[:1]) with the
        batch's rows: on a shard the reduction sees its own rows, not the whole batch's, and
        the numbers would differ from the CPU path's. A reduction into the loss is the loss's."""
        tensors = [n for n in node.all_input_nodes if n not in self.symbolic and n not in self.constants]
        reduced = [self.reduced[n] for n in tensors if n in self.reduced]
        rows = any(_batch_shaped(n.meta.get("val")) for n in tensors)
        keeps_rows = _batch_shaped(node.meta.get("val")) or _per_target_loss(node)
        if reduced and (rows or keeps_rows):
            line = _source(node)
            raise CaptureError(f"{_located(reduced[0])}: reduces over the batch (dim 0), and op {node.target}"
                               f"{' at ' + line if line else ''} meets the result with the batch's rows: a "
                               "shard would reduce over its own rows only (keep the batch dim apart)")
        if reduced or (rows and not keeps_rows):
            self.reduced[node] = reduced[0] if reduced else node
        dims = _mixing_dims(node)
        source = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        if dims and source is not None and _batch_shaped(source.meta.get("val")):
            shape = source.meta["val"].shape
            if any(_symbolic(shape[d % max(len(shape), 1)]) for d in dims):
                raise self.error("computes along the batch dim (each row from others): a shard would see "
                                 "its own rows only")

    def _is_const(self, arg) -> bool:
        if isinstance(arg, torch.fx.Node):
            return arg in self.constants
        if isinstance(arg, (list, tuple)):
            return all(self._is_const(a) for a in arg)
        return True

    def _concrete(self, arg):
        if isinstance(arg, torch.fx.Node):
            return self.constants[arg]
        if isinstance(arg, (list, tuple)):
            return type(arg)(self._concrete(a) for a in arg)
        return arg

    def _call(self, node):
        if node.target is operator.getitem:
            source, index = node.args
            if source in self.constants:
                self.constants[node] = self.constants[source][index]
            else:
                self.names[node] = self.names[source][index]
                if self.names[node] is None:
                    self.fx_node = source
                    raise self.error(f"output {index} (only the op's first output is supported)")
            if source in self.reduced:
                self.reduced[node] = self.reduced[source]
            return
        if "_assert" in str(node.target) or "constrain_range" in str(node.target):
            return
        if isinstance(node.meta.get("val"), torch.SymInt) and not _from_data(node.meta["val"]):
            self.symbolic.add(node)   # a size computed from the batch: its ops read it from their output
            return
        if _packet(node.target) in DRAWS:   # before the constants: a draw is made anew each step
            self.names[node] = _draw(self, node, DRAWS[_packet(node.target)])
            return
        if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()) and _packet(node.target) not in _LOWER:
            raise self.error("a random op other than rand, randn, randperm and their _like forms: capture would "
                             "draw its values once, and every step would reuse them")
        self._check_rows_stay_apart(node)
        packet = node.target._overloadpacket.__name__ if hasattr(node.target, "_overloadpacket") else ""
        if packet in _BATCH_SIZED and (self._follows_batch(list(node.args)) or _follows_batch_shape(node)
                                       or (packet in _FILLED_LIKE and not self._is_const(list(node.args)))):
            self.names[node] = _BATCH_SIZED[packet](self, node, *node.args, **node.kwargs)
            return
        if packet in ("div", "mul") and len(node.args) == 2 and node.args[1] in self.symbolic and \
                not self._follows_batch(node.args[0]) and not _batch_shaped(node.args[0].meta.get("val")):
            # x / batch (the model zoo's BERT: its masked-LM loss summed over the batch, over its
            # rows): on a shard, over the shard's rows -- the program's loss is a mean over the
            # shard, weighted by its rows, so this is the shard's share as the CPU path's is the whole.
            self.names[node] = self.emit(packet, [node.args[0], _batch_count(self, node.args[1])])
            return
        if packet not in _READS_BATCH_FROM_INPUT and self._follows_batch(list(node.args) + list(node.kwargs.values())):
            raise self.error("an argument follows the batch size: a shard of other rows would compute "
                             "other numbers (write it without the batch size)")
        if self._is_const(list(node.args)) and self._is_const(list(node.kwargs.values())):
            # A constant of the program (positions, a causal mask): torch computes it once, here.
            self.constants[node] = node.target(*self._concrete(node.args), **self._concrete(node.kwargs))
            return
        lower = _LOWER.get(packet)
        if lower is None:
            raise self.error("not in the op set (docs/torch.md lists the supported ops)")
        result = lower(self, node, *node.args, **node.kwargs)
        self.names[node] = result

    def _value(self, arg) -> str:
        """The program value of an fx argument (a constant tensor becomes a program constant)."""
        if arg in self.const_names:
            return self.const_names[arg]
        if arg in self.constants:
            # The node stays a constant: an op of constants after this one is still computed here.
            self.const_names[arg] = self.constant(self.constants[arg])
            return self.const_names[arg]
        name = self.names.get(arg)
        if name is None or isinstance(name, list):
            raise self.error(f"argument {arg} has no single value")
        return name

    def emit(self, op: str, inputs, attrs=None, out: str | None = None) -> str:
        node = self.fx_node
        name = out or node.name
        if any(o == name for n in self.nodes for o in n.outputs):
            name = f"{name}_{len(self.nodes)}"
        self.nodes.append(Node(op, tuple(self._value(i) if not isinstance(i, str) else i for i in inputs),
                               (name,), attrs or {}, _module_path(node), _source(node)))
        return name

    def constant(self, value: torch.Tensor) -> str:
        """A program constant made here (not an fx node's value: batch norm's ones and zeros, a row to broadcast)."""
        if value.dtype not in _DTYPES:
            raise self.error(f"constant of dtype {value.dtype}")
        name = f"const{len(self.consts)}"
        self.consts[name] = _numpy(value)
        return name

    def _follows_batch(self, arg) -> bool:
        if isinstance(arg, torch.fx.Node):
            return arg in self.symbolic
        if isinstance(arg, (list, tuple)):
            return any(self._follows_batch(a) for a in arg)
        return isinstance(arg, (torch.SymInt, torch.SymFloat))

    def _at_capture(self, shape) -> tuple:
        """A shape with the batch as captured."""
        return tuple(int(d) if not _symbolic(d) else int(d.node.expr.subs(_batch_symbol(d), self.batch))
                     for d in shape)

    def batch_input(self) -> str:
        """A program input whose dim 0 is the batch: what a shape that grows with it reads it from."""
        if not self.batch_inputs:
            raise self.error("a shape follows the batch size, but no input has the batch in dim 0")
        return self.batch_inputs[0]

    def scalar_of(self, arg):
        """A Python number, from a literal or a 0-d constant tensor; None when arg is a tensor value."""
        if isinstance(arg, (int, float, bool)):
            return arg
        if isinstance(arg, torch.fx.Node) and arg in self.constants and self.constants[arg].dim() == 0:
            return self.constants[arg].item()
        return None


def _symbolic(size) -> bool:
    return isinstance(size, torch.SymInt) and not size.node.expr.is_number


def _batch_symbol(size):
    return next(iter(size.node.expr.free_symbols))


def _from_data(size) -> bool:
    """Whether a symbolic number is a tensor's value (.item(): an unbacked symbol), not a size."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    return bool(free_unbacked_symbols(size))


def _batch_shaped(val) -> bool:
    """Whether a node's value (a tensor, or a list of them) has a dim that follows the batch."""
    if isinstance(val, (list, tuple)):
        return any(_batch_shaped(v) for v in val)
    return isinstance(val, torch.Tensor) and any(_symbolic(d) for d in val.shape)


def _per_target_loss(node) -> bool:
    """A classification loss with reduction "none" of batch-shaped targets: each target's loss,
    in the targets' rows. (torch.export's value of it may be a scalar: seen for the model zoo's
    GPT-2 loss, its meta val size () while the op's result is [B*T].)"""
    if _packet(node.target) not in ("cross_entropy_loss", "nll_loss", "nll_loss_nd") or len(node.args) < 2:
        return False
    reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)
    target = node.args[1]
    return reduction == 0 and isinstance(target, torch.fx.Node) and _batch_shaped(target.meta.get("val"))


def _follows_batch_shape(node) -> bool:
    return _batch_shaped(node.meta.get("val"))


# Ops whose output keeps a dim's size but computes each element from others along it:
# along the batch, a shard's rows would differ from the whole batch's.
_ALONG_DIM = {"softmax", "_softmax", "log_softmax", "_log_softmax", "cumsum", "cumprod", "logcumsumexp",
              "sort", "argsort", "gather", "index_select", "scatter", "scatter_add", "scatter_reduce", "flip",
              "roll", "cummax", "cummin", "diagonal"}


def _mixing_dims(node) -> list[int]:
    """The dims an op of _ALONG_DIM computes along (its `dim` or `dims` argument; diagonal's two)."""
    packet = node.target._overloadpacket.__name__ if hasattr(node.target, "_overloadpacket") else ""
    if packet not in _ALONG_DIM:
        return []
    names = ("dim1", "dim2") if packet == "diagonal" else ("dim", "dims")
    dims = []
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name in names:
            value = node.kwargs.get(arg.name, node.args[i] if i < len(node.args) else arg.default_value)
            values = value if isinstance(value, (list, tuple)) else [value]
            dims += [int(v) for v in values if isinstance(v, int)]
    return dims


def _located(fx_node) -> str:
    """module path, op and source line of an fx node, as a capture error names them."""
    line = _source(fx_node)
    return f"module {_module_path(fx_node) or '<root>'}: op {fx_node.target}{' at ' + line if line else ''}"


def _batch_norm_state(arg, target: str) -> bool:
    """Whether a buffer's update is BatchNorm's: its running mean or variance (outputs 3
    and 4 of the functional batch norm), or num_batches_tracked + 1."""
    op = _first_op(arg)
    if _packet(op.target) == "_native_batch_norm_legit_functional":
        return arg.target is operator.getitem and arg.args[1] in (3, 4)
    return (target.endswith("num_batches_tracked") and _packet(op.target) == "add"
            and isinstance(op.args[0], torch.fx.Node) and op.args[0].op == "placeholder" and op.args[1] == 1)


def _first_op(node):
    """The op that makes `node` (the batch norm behind a getitem of its outputs)."""
    while isinstance(node, torch.fx.Node) and node.target is operator.getitem:
        node = node.args[0]
    return node


def _numpy(t) -> np.ndarray:
    return t.detach().cpu().numpy().copy()


def _renamed(program: Program, rename: dict) -> Program:
    r = lambda n: rename.get(n, n)  # noqa: E731
    nodes = [Node(n.op, tuple(r(i) for i in n.inputs), tuple(r(o) for o in n.outputs), n.attrs, n.module, n.source)
             for n in program.nodes]
    inputs = {r(k): v for k, v in program.inputs.items()}
    return Program(program.params, inputs, program.consts, nodes, {k: r(v) for k, v in program.outputs.items()})


# ---------------------------------------------------------------- ATen -> op set

def _binary(op):
    def lower(L, node, a, b, alpha=1, **kw):
        if kw.get("rounding_mode"):
            raise L.error(f"division with rounding_mode={kw['rounding_mode']!r}")
        attrs = {"alpha": alpha} if alpha != 1 else {}
        sa, sb = L.scalar_of(a), L.scalar_of(b)
        if sb is not None:
            return L.emit(op, [a], {**attrs, "scalar": sb})
        if sa is not None:
            return L.emit(op, [b], {**attrs, "scalar": sa, "reverse": True})
        return L.emit(op, [a, b], attrs)
    return lower


def _unary(op, **fixed):
    return lambda L, node, x, *a, **kw: L.emit(op, [x], dict(fixed))


def _identity(L, node, x, *args, **kw):
    return L.names[x] if x not in L.constants else L._value(x)


def _rsub(L, node, x, other, alpha=1):
    s = L.scalar_of(other)
    if s is None:
        return L.emit("sub", [other, x], {"alpha": alpha} if alpha != 1 else {})
    if alpha != 1:
        raise L.error("rsub with alpha")
    return L.emit("sub", [x], {"scalar": s, "reverse": True})


def _compare(cmp):
    def lower(L, node, a, b):
        s = L.scalar_of(b)
        return L.emit("compare", [a], {"cmp": cmp, "scalar": s}) if s is not None else \
            L.emit("compare", [a, b], {"cmp": cmp})
    return lower


def _to(L, node, x, *args, **kw):
    dtype = kw.get("dtype") or next((a for a in args if isinstance(a, torch.dtype)), None)
    if dtype is None or node.meta["val"].dtype == x.meta["val"].dtype:
        return _identity(L, node, x)
    return L.emit("cast", [x], {"dtype": L._dtype(node.meta["val"])})


def _dropout(L, node, x, p, train=True):
    """In training, x times a scaled keep-mask drawn from the run's context (its own site
    number: the masks of two dropouts differ); in eval mode, or with p 0, x itself."""
    if not (p and train):
        return _identity(L, node, x)
    if not L.dropout:
        raise L.error(f"dropout with p={p} in training: a 1.x loop draws no masks yet (set p=0, or use a "
                      "2.x traced step, or hand the model to run() with cs_torch.capture.model_spec)")
    if not 0 < p < 1:
        raise L.error(f"dropout with p={p} (0 <= p < 1)")
    L.inputs.setdefault(CONTEXT, Value((6,), "int64"))
    site = sum(n.op == "dropout_mask" for n in L.nodes)
    mask = L.emit("dropout_mask", [x, CONTEXT], {"p": float(p), "kind": "flat", "layer": site, "site": 0},
                  out=f"{node.name}_mask")
    return L.emit("dropout", [x, mask], {"p": float(p)})


# torch's random ops a program draws anew each step (ops.py draw), and from what
DRAWS = {"rand": "uniform", "rand_like": "uniform", "randn": "normal", "randn_like": "normal",
         "randperm": "permutation"}


def _draw(L, node, dist: str) -> str:
    """A fresh draw each step from the run's context, seeded as dropout's masks (its own
    site number). A draw whose dim 0 is the batch (randn_like of the activations, rand(B, n))
    draws each sample's elements by its row in the global batch, so any shard split draws
    what the whole batch does; one without the batch is the same on every shard."""
    if not L.dropout:
        raise L.error(f"a random draw ({dist}) in training: a 1.x loop feeds no run context to draw from (use "
                      "a 2.x traced step, or hand the model to run() with cs_torch.capture.model_spec)")
    dims = list(node.meta["val"].shape)
    if any(_symbolic(d) for d in dims[1:]):
        raise L.error(f"a draw of shape {dims}: only dim 0 may follow the batch")
    rows = []
    if dims and _symbolic(dims[0]):
        if dist == "permutation":
            raise L.error("a permutation of the batch's rows: a shard would permute its own rows only")
        if _packet(node.target).endswith("_like"):
            rows = [node.args[0]]
        elif dims[0].node.expr.is_Symbol:
            rows = [L.batch_input()]
        else:
            raise L.error(f"a draw of shape {dims}: only the batch itself can size it (or draw _like a value)")
    L.inputs.setdefault(CONTEXT, Value((6,), "int64"))
    site = sum(n.op == "draw" for n in L.nodes)
    shape = [-1 if _symbolic(d) else int(d) for d in dims]
    return L.emit("draw", [*rows, CONTEXT], {"dist": dist, "shape": shape, "site": site,
                                             "dtype": L._dtype(node.meta["val"])})


def _strided_view(L, node, x, *args, **kw):
    """as_strided (and unfold, a window view torch makes by strides): the elements the view's
    strides reach in x's storage, as a gather of fixed indices from x's values. Where x's dim
    0 is the batch, the view keeps it (the same size and stride) and reaches into each row
    only, so the gather is per row and holds for any shard; a view across rows is refused."""
    src, out = x.meta["val"], node.meta["val"]
    batched = src.dim() > 0 and _symbolic(src.shape[0])
    if batched and not (out.dim() and _symbolic(out.shape[0]) and out.shape[0].node.expr == src.shape[0].node.expr
                        and src.stride()[0] == out.stride()[0]):
        raise L.error("a strided view across the batch's rows: a shard holds its own rows only (keep dim 0 as "
                      "the input's, and view inside each row)")
    lead = 1 if batched else 0
    fixed = [src.shape[lead:], src.stride()[lead:], out.shape[lead:], out.stride()[lead:],
             [src.storage_offset(), out.storage_offset()]]
    if any(_symbolic(d) for part in fixed for d in part):
        raise L.error("a strided view whose other dims, strides or offset follow the batch size")
    src_shape, src_strides, out_shape, out_strides, (src_at, out_at) = ([int(d) for d in part] for part in fixed)
    offset = out_at - src_at
    reach = offset + sum((n - 1) * stride for n, stride in zip(out_shape, out_strides) if n)
    if batched and (_symbolic(src.stride()[0]) or offset < 0 or reach >= int(src.stride()[0])):
        raise L.error("a strided view across the batch's rows: a shard holds its own rows only (view inside "
                      "each row)")
    index = _strided_index(src_shape, src_strides, out_shape, out_strides, offset)
    if index is None:
        raise L.error("a strided view that reaches storage outside its input's elements (a view of a view's "
                      "base): its values are not the input's")
    row = int(np.prod(src_shape, dtype=np.int64))
    flat = L.emit("reshape", [x], {"shape": [-1, row] if batched else [row]}, out=f"{node.name}_rows")
    picked = L.emit("index_select", [flat, L.constant(torch.from_numpy(index.ravel()))], {"dim": lead},
                    out=f"{node.name}_picked")
    return L.emit("reshape", [picked], {"shape": [-1 if _symbolic(d) else int(d) for d in out.shape]})


def _strided_index(src_shape, src_strides, out_shape, out_strides, offset):
    """For each element of a view (shape, strides, storage offset relative to its input's), the
    index of the input's element (in C order) at that place of storage; None where one is not
    an input element's place."""
    def places(shape, strides):
        grid = np.zeros(shape, dtype=np.int64)
        for dim, (size, stride) in enumerate(zip(shape, strides)):
            along = [-1 if d == dim else 1 for d in range(len(shape))]
            grid += (np.arange(size, dtype=np.int64) * stride).reshape(along)
        return grid
    held = places(src_shape, src_strides).ravel()
    wanted = offset + places(out_shape, out_strides)
    if held.size == 0 or held.min() < 0 or wanted.size and (wanted.min() < 0 or wanted.max() > held.max()):
        return None
    element = np.full(int(held.max()) + 1, -1, dtype=np.int64)
    element[held] = np.arange(held.size, dtype=np.int64)
    index = element[wanted]
    return None if (index < 0).any() else index


def _layer_norm(L, node, x, normalized_shape, weight=None, bias=None, eps=1e-5, *rest):
    if weight is None and bias is not None:
        raise L.error("layer_norm with a bias but no weight")
    ins = [x] + ([weight] if weight is not None else []) + ([bias] if bias is not None else [])
    return L.emit("layer_norm", ins, {"normalized_shape": list(normalized_shape), "eps": float(eps)})


def _linear(L, node, x, w, b=None):
    return L.emit("linear", [x, w] + ([b] if b is not None else []))


def _addmm(L, node, bias, a, b, beta=1, alpha=1):
    if beta != 1 or alpha != 1:
        raise L.error(f"addmm with beta={beta}, alpha={alpha}")
    return L.emit("addmm", [bias, a, b])


def _embedding(L, node, weight, ids, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if scale_grad_by_freq or sparse:
        raise L.error("embedding with scale_grad_by_freq or sparse")
    return L.emit("embedding", [weight, ids], {"padding_idx": int(padding_idx)})


# Ops that take a tensor's value as a Python number (.item()) as an operand, as a 0-d value does
_TAKE_A_NUMBER = frozenset({"add", "sub", "rsub", "mul", "div"})


def _item(L, node, x):
    """.item(): a tensor's value as a Python number, which only scales or shifts values here:
    the 0-d value itself, detached (torch's number carries no gradient), in the dtype its
    users compute in (as torch casts a Python number to a tensor's). As a size, an index or
    in control flow it would fix data-dependent shapes: refused."""
    users = list(node.users)
    taken = [_packet(u.target) in _TAKE_A_NUMBER and node in u.args[:2] and isinstance(u.meta.get("val"), torch.Tensor)
             for u in users]
    if not users or not all(taken):
        what = next((str(u.target) for u, ok in zip(users, taken) if not ok), "nothing")
        raise L.error(f".item() read by {what}: only a tensor's add, sub, mul or div takes a tensor's value as "
                      "a number (as a size, an index, in control flow or Python arithmetic it is data-dependent, "
                      "and a program is fixed at capture)")
    dtypes = {u.meta["val"].dtype for u in users}
    if len(dtypes) != 1:
        raise L.error(f".item() read by ops of dtypes {sorted(map(str, dtypes))}")
    value = L.emit("detach", [x], out=f"{node.name}_value")
    if dtypes.pop() == x.meta["val"].dtype:
        return value
    return L.emit("cast", [value], {"dtype": L._dtype(users[0].meta["val"])})


_BAG_REDUCE = {0: "sum", 1: "mean", 2: "amax"}   # _embedding_bag's mode


def _fixed_bags(offsets, indices) -> int | None:
    """The bag size L where `offsets` is arange(0, B * L, L) over `indices` of B * L ids: an
    EmbeddingBag of a 2-d input (every sample one bag of its L ids), whose bags a shard's rows
    hold whole; else None."""
    if not (isinstance(offsets, torch.fx.Node) and _packet(offsets.target) == "arange" and len(offsets.args) == 3):
        return None
    start, end, step = offsets.args
    if start != 0 or not isinstance(step, int) or not isinstance(end, torch.fx.Node):
        return None
    size, count = end.meta.get("val"), indices.meta["val"].shape
    if not (_symbolic(size) and len(count) == 1 and _symbolic(count[0]) and count[0].node.expr == size.node.expr
            and (size.node.expr / step).is_Symbol):
        return None
    return step


def _embedding_bag(L, node, weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                   per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    """EmbeddingBag of a 2-d input: embedding(ids).sum / .mean / .amax over each sample's L ids.
    Bags given by offsets of the data are refused: a data-dependent grouping of the ids."""
    bag = _fixed_bags(offsets, indices)
    if bag is None:
        raise L.error("bags given by offsets (a data-dependent grouping of the ids): give EmbeddingBag a 2-d "
                      "input, one bag of fixed size per sample")
    if scale_grad_by_freq or per_sample_weights is not None or include_last_offset or padding_idx not in (None, -1):
        raise L.error("an embedding bag with scale_grad_by_freq, per_sample_weights, include_last_offset or "
                      "padding_idx")
    ids = L.emit("reshape", [indices], {"shape": [-1, bag]}, out=f"{node.name}_ids")
    rows = L.emit("embedding", [weight, ids], {"padding_idx": -1}, out=f"{node.name}_rows")
    return [L.emit(_BAG_REDUCE[int(mode)], [rows], {"dim": [1], "keepdim": False}), None, None, None]


def _softmax(op):
    return lambda L, node, x, dim, *rest, **kw: L.emit(op, [x], {"dim": int(dim)})


def _sum(op):
    def lower(L, node, x, dim=None, keepdim=False, dtype=None):
        return L.emit(op, [x], {"dim": None if dim is None else list(dim), "keepdim": bool(keepdim)})
    return lower


def _along_batch(L, x, dim, what: str) -> None:
    """Refuse cutting the dim that follows the batch: a shard would cut its own rows."""
    if _symbolic(x.meta["val"].shape[dim]):
        raise L.error(f"{what} along dim {dim}, the batch: a shard would cut its own rows, not the batch's")


def _slice(L, node, x, dim=0, start=None, end=None, step=1):
    end = None if end is not None and end >= _INT64_MAX else end
    if (start or 0) != 0 or end is not None or step != 1:
        _along_batch(L, x, dim, "slice")
    return L.emit("slice", [x], {"dim": int(dim), "start": start, "end": end, "step": int(step)})


def _split(L, node, x, split_size, dim=0):
    _along_batch(L, x, dim, "split")
    size = x.meta["val"].shape[dim]
    sizes = list(split_size) if isinstance(split_size, (list, tuple)) else \
        [min(split_size, size - s) for s in range(0, size, split_size)]
    names, start = [], 0
    for i, n in enumerate(sizes):
        names.append(L.emit("slice", [x], {"dim": int(dim), "start": start, "end": start + n, "step": 1},
                            out=f"{node.name}_{i}"))
        start += n
    return names


def _chunk(L, node, x, chunks, dim=0):
    _along_batch(L, x, dim, "chunk")
    size = x.meta["val"].shape[dim]
    return _split(L, node, x, -(-size // chunks), dim)


def _squeeze(L, node, x, dim=None):
    """The dims squeezed are those of size 1 at capture: never the batch, even on a shard of one row."""
    shape = x.meta["val"].shape
    dims = range(len(shape)) if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    kept = [d % len(shape) for d in dims if not _symbolic(shape[d]) and shape[d] == 1] if shape else None
    return L.emit("squeeze", [x], {"dims": kept})


def _where(L, node, cond, a, b):
    attrs, ins = {}, [cond]
    for key, v in (("self_scalar", a), ("other_scalar", b)):
        s = L.scalar_of(v)
        if s is not None:
            attrs[key] = s
        else:
            ins.append(v)
    return L.emit("where", ins, attrs)


def _masked_fill(L, node, x, mask, value):
    s = L.scalar_of(value)
    if s is None:
        raise L.error("masked_fill with a tensor value that is not a constant")
    return L.emit("masked_fill", [x, mask], {"value": float(s)})


def _sdpa(L, node, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if dropout_p and not enable_gqa:
        return _sdpa_with_dropout(L, node, q, k, v, attn_mask, dropout_p, is_causal, scale)
    if enable_gqa:
        raise L.error("scaled_dot_product_attention with enable_gqa")
    ins = [q, k, v] + ([attn_mask] if attn_mask is not None else [])
    return L.emit("scaled_dot_product_attention", ins, {"is_causal": bool(is_causal), "scale": scale})


def _sdpa_with_dropout(L, node, q, k, v, attn_mask, dropout_p, is_causal, scale):
    """Attention with dropout on its probabilities (transformers' BERT and GPT-2 in training),
    written out as torch's reference math, so that the probabilities pass through a
    dropout drawing the run's masks: softmax(q k^T * scale + mask), dropped, @ v."""
    lq, lk, e = q.meta["val"].shape[-2], k.meta["val"].shape[-2], q.meta["val"].shape[-1]
    name = node.name
    keys = L.emit("transpose", [k], {"dim0": -2, "dim1": -1}, out=f"{name}_kt")
    scores = L.emit("matmul", [q, keys], out=f"{name}_scores")
    scores = L.emit("mul", [scores], {"scalar": float(scale if scale is not None else 1.0 / e ** 0.5)},
                    out=f"{name}_scaled")
    if is_causal:
        hidden = L.constant(torch.ones(lq, lk, dtype=torch.bool).tril().logical_not())
        scores = L.emit("masked_fill", [scores, hidden], {"value": float("-inf")}, out=f"{name}_causal")
    if attn_mask is not None:
        if attn_mask.meta["val"].dtype == torch.bool:
            hidden = L.emit("logical_not", [attn_mask], out=f"{name}_hidden")
            scores = L.emit("masked_fill", [scores, hidden], {"value": float("-inf")}, out=f"{name}_masked")
        else:
            scores = L.emit("add", [scores, attn_mask], out=f"{name}_masked")
    probs = L.emit("softmax", [scores], {"dim": -1}, out=f"{name}_probs")
    dropped = _dropout(L, node, probs, dropout_p)
    return L.emit("matmul", [dropped, v])


def _conv2d(L, node, x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    if isinstance(padding, str):
        raise L.error(f"conv2d with padding={padding!r} (give the padding as numbers)")
    attrs = {"stride": list(_pair(stride)), "padding": list(_pair(padding)), "dilation": list(_pair(dilation)),
             "groups": int(groups)}
    return L.emit("conv2d", [x, w] + ([b] if b is not None else []), attrs)


def _pair(v):
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return (int(v[0]), int(v[-1]))


def _max_pool(L, node, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return L.emit("max_pool2d", [x], {"kernel_size": list(_pair(kernel_size)),
                                      "stride": list(_pair(stride)) if stride else None,
                                      "padding": list(_pair(padding)), "dilation": list(_pair(dilation)),
                                      "ceil_mode": bool(ceil_mode)})


def _avg_pool(L, node, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
              divisor_override=None):
    if divisor_override:
        raise L.error("avg_pool2d with divisor_override")
    return L.emit("avg_pool2d", [x], {"kernel_size": list(_pair(kernel_size)),
                                      "stride": list(_pair(stride)) if stride else None,
                                      "padding": list(_pair(padding)), "ceil_mode": bool(ceil_mode),
                                      "count_include_pad": bool(count_include_pad)})


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
_PER_TARGET = ("mean", "sum", "none")   # the classification losses may keep each target's loss


def _reduction(L, r, allowed=("mean", "sum")):
    name = _REDUCTIONS.get(r, r)
    if name not in allowed:
        raise L.error(f"loss reduction {name!r} (only {', '.join(allowed[:-1])} and {allowed[-1]})")
    return name


def _cross_entropy(L, node, x, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    if weight is not None or label_smoothing:
        raise L.error("cross_entropy with class weights or label smoothing")
    return L.emit("cross_entropy", [x, target], {"reduction": _reduction(L, reduction, _PER_TARGET),
                                                 "ignore_index": int(ignore_index)})


def _nll(L, node, x, target, weight=None, reduction=1, ignore_index=-100):
    if weight is not None:
        raise L.error("nll_loss with class weights")
    return L.emit("nll_loss", [x, target], {"reduction": _reduction(L, reduction, _PER_TARGET),
                                            "ignore_index": int(ignore_index)})


def _mse(L, node, a, b, reduction=1):
    return L.emit("mse_loss", [a, b], {"reduction": _reduction(L, reduction)})


def _gelu(L, node, x, approximate="none"):
    return L.emit("gelu", [x], {"approximate": approximate})


# ---------------------------------------------------------------- shapes that follow the batch
# A program runs on shards of any number of rows, so a shape captured from the batch
# (x.shape[0], B * T) must not enter it as the capture's number. Its ops take their
# shape from the output's symbolic sizes: a reshape puts -1 at the one dim that
# follows the batch; an expand keeps such a dim (-1), or, to broadcast a constant
# over the batch (a token_type_ids buffer), reads the batch from a program input.

def _reshape(L, node, x, shape):
    out = node.meta["val"].shape
    following = [i for i, d in enumerate(out) if _symbolic(d)]
    if len(following) > 1:
        raise L.error(f"reshape to {list(out)}: {len(following)} dims follow the batch size, a shard "
                      "could not tell them apart (keep the batch in one dim)")
    return L.emit("reshape", [x], {"shape": [-1 if _symbolic(d) else int(d) for d in out]})


def _expand_to(L, x, out, name=None, src=None) -> str:
    """x (an fx node, or a program constant of shape `src`) broadcast to the output shape
    `out` (symbolic sizes where it follows the batch)."""
    src = x.meta["val"].shape if src is None else src
    lead = len(out) - len(src)
    shape, batch_dims = [], []
    for i, d in enumerate(out):
        if not _symbolic(d):
            shape.append(int(d))
        elif i >= lead and _symbolic(src[i - lead]) and src[i - lead].node.expr == d.node.expr:
            shape.append(-1)
        elif d.node.expr.is_Symbol:
            shape.append(L.batch)
            batch_dims.append(i)
        else:
            raise L.error(f"expand to {list(out)}: dim {i} grows with the batch as {d}; only the batch "
                          "itself can be broadcast to")
    if not batch_dims:
        return L.emit("expand", [x], {"shape": shape}, out=name)
    return L.emit("expand", [x, L.batch_input()], {"shape": shape, "batch_dims": batch_dims}, out=name)


def _expand(L, node, x, shape, implicit=False):
    return _expand_to(L, x, node.meta["val"].shape)


def _broadcast_tensors(L, node, tensors):
    shape = node.meta["val"][0].shape
    return [_expand_to(L, t, shape, f"{node.name}_{i}") for i, t in enumerate(tensors)]


def _batch_count(L, size_node) -> str:
    """A program value of a size that follows the batch (k * batch): the shard's rows, as a float
    (a one-row constant broadcast over them, summed), times k."""
    size = size_node.meta["val"]
    expr = size.node.expr
    batch = _batch_symbol(size)
    factor = expr / batch
    if not factor.is_number or factor <= 0:
        raise L.error(f"divides by {expr}: only a multiple of the batch size is taken")
    shape = (size if expr.is_Symbol else _batch_sym_of(L, size),)
    ones = _expand_to(L, L.constant(torch.full((1,), float(factor))), shape, src=(1,))
    return L.emit("sum", [ones], {"dim": None, "keepdim": False}, out=f"{size_node.name}_count")


def _batch_sym_of(L, size):
    """The batch symbol itself as a size, from a program input's dim 0."""
    for node in L.ep.graph_module.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() and \
                _symbolic(val.shape[0]) and val.shape[0].node.expr.is_Symbol:
            return val.shape[0]
    raise L.error("a size of the batch, but no input has the batch in dim 0")


def _filled(fill_of):
    """A tensor filled with one value (ones, zeros, full, new_*): uniform over the batch, so
    it is a constant of one row broadcast over the shard's rows."""
    def lower(L, node, *args, **kw):
        out = node.meta["val"]
        if any(_symbolic(d) and not d.node.expr.is_Symbol for d in out.shape):
            raise L.error(f"a tensor of shape {list(out.shape)}: only the batch itself can size a dim")
        fill = fill_of(*args, **kw)
        if L._follows_batch(fill):
            raise L.error("a fill value that follows the batch size")
        if isinstance(fill, torch.fx.Node) and fill not in L.constants:
            raise L.error("a fill value computed from the model's inputs")
        fill = L._concrete(fill) if isinstance(fill, torch.fx.Node) else fill
        if not any(_symbolic(d) for d in out.shape):   # a *_like of a value of fixed shape
            return L.constant(torch.full(tuple(out.shape), fill, dtype=out.dtype))
        row = torch.full([1 if _symbolic(d) else int(d) for d in out.shape], fill, dtype=out.dtype)
        return _expand_to(L, L.constant(row), out.shape, src=tuple(row.shape))
    return lower


def _arange(L, node, *args, **kw):
    """torch.arange of the batch size (transformers' batch index of its masks): on a shard, its rows
    0..n-1, which pick the shard's own rows as the whole batch's pick the batch's. Only that use is
    taken (`_indexes_own_rows`); any other (a row number as a value) would differ on a shard."""
    out = node.meta["val"]
    if node.users and all(_packet(user.target) == "_embedding_bag" and user.args[2] is node and
           _fixed_bags(node, user.args[1]) for user in node.users):
        return None   # a 2-d input's bag offsets: _embedding_bag reads them as its bag size
    start, end, step = (0, args[0], 1) if len(args) == 1 else (*args, kw.get("step", 1))[:3]
    whole_batch = (out.dim() == 1 and _symbolic(out.shape[0]) and out.shape[0].node.expr.is_Symbol
                   and start == 0 and step == 1)
    if not (whole_batch and _indexes_own_rows(node)):
        raise L.error("an arange of the batch size used other than to index the batch's own rows: a shard "
                      "of other rows would compute other numbers")
    ones = _expand_to(L, L.constant(torch.ones(1, dtype=out.dtype)), out.shape, src=(1,))
    counted = L.emit("cumsum", [ones], {"dim": 0}, out=f"{node.name}_count")
    return L.emit("sub", [counted], {"scalar": 1})


# What an arange of the batch may pass through on its way to an index: ops that only reshape it.
_ROW_INDEX_PASSTHROUGH = frozenset({"unsqueeze", "expand", "view", "reshape", "_unsafe_view", "slice"})


def _whole_slice(node) -> bool:
    """A slice that keeps every element: dim 0 of a 1-d value, from 0 to the end, step 1."""
    dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
    return dim == 0 and start in (None, 0) and (end is None or isinstance(end, int) and end >= 2 ** 62) and step == 1


def _indexes_own_rows(node) -> bool:
    """Whether every use of `node` ends, through ops that only reshape it (a slice only whole), as the
    row index (indices[0]) of an index op on a value whose dim 0 is the batch."""
    for user in node.users:
        packet = _packet(user.target)
        if packet == "slice" and not _whole_slice(user):
            return False
        if packet in _ROW_INDEX_PASSTHROUGH and user.args[0] is node:
            if not _indexes_own_rows(user):
                return False
        elif not (packet == "index" and len(user.args) > 1 and user.args[1] and user.args[1][0] is node
                  and _symbolic(user.args[0].meta["val"].shape[0])):
            return False
    return bool(node.users)


_BATCH_SIZED = {
    "arange": _arange,
    "view": _reshape, "reshape": _reshape, "_unsafe_view": _reshape, "expand": _expand,
    "ones": _filled(lambda size, **kw: 1), "zeros": _filled(lambda size, **kw: 0),
    "empty": _filled(lambda size, **kw: 0), "full": _filled(lambda size, fill_value, **kw: fill_value),
    "new_ones": _filled(lambda x, size, **kw: 1), "new_zeros": _filled(lambda x, size, **kw: 0),
    "new_empty": _filled(lambda x, size, **kw: 0),
    "new_full": _filled(lambda x, size, fill_value, **kw: fill_value),
    # of another value's shape, whatever it holds: no read of it
    "ones_like": _filled(lambda x, **kw: 1), "zeros_like": _filled(lambda x, **kw: 0),
    "empty_like": _filled(lambda x, **kw: 0), "full_like": _filled(lambda x, fill_value, **kw: fill_value),
}
_FILLED_LIKE = ("ones_like", "zeros_like", "empty_like", "full_like")
# Ops handed the batch size as an argument (group norm's N) whose lowering takes it from the
# input's own rows instead: on a shard they compute what they would on the whole batch's rows.
_READS_BATCH_FROM_INPUT = frozenset({"native_group_norm", "as_strided"})


# ---------------------------------------------------------------- torch's Core ATen ops beyond the above

def _float_unary(op):
    """An op whose value is a float (sqrt, exp, ...): an integer input is cast first, as torch promotes it."""
    def lower(L, node, x, *args, **kw):
        if x.meta["val"].dtype != node.meta["val"].dtype:
            x = L.emit("cast", [x], {"dtype": L._dtype(node.meta["val"])}, out=f"{node.name}_in")
        return L.emit(op, [x])
    return lower


def _round(L, node, x, decimals=0):
    if decimals:
        raise L.error(f"round with decimals={decimals}")
    return L.emit("round", [x])


def _clamp(L, node, x, min=None, max=None):
    bounds = {}
    for key, v in (("min", min), ("max", max)):
        if v is None:
            continue
        s = L.scalar_of(v)
        if s is None:
            raise L.error(f"clamp with a tensor {key} that is not a constant number")
        bounds[key] = s
    return L.emit("clamp", [x], bounds)


def _reduce(op):
    """amax, amin, any: over `dim` (all dims when absent or empty)."""
    def lower(L, node, x, dim=None, keepdim=False):
        dims = None if dim is None else ([dim] if isinstance(dim, int) else list(dim))
        return L.emit(op, [x], {"dim": dims or None, "keepdim": bool(keepdim)})
    return lower


def _extreme(reduce_op, pick_op, arg_op, binary_op):
    """torch.max / torch.min: of everything (amax), over a dim (values and indices), or of two tensors."""
    def lower(L, node, x, dim=None, keepdim=False):
        if isinstance(dim, torch.fx.Node):
            return _binary(binary_op)(L, node, x, dim)
        if dim is None:
            return L.emit(reduce_op, [x], {"dim": None, "keepdim": False})
        return _values_and_indices(L, node, x, pick_op, arg_op, {"dim": int(dim), "keepdim": bool(keepdim)})
    return lower


def _arg(op):
    def lower(L, node, x, dim=None, keepdim=False):
        return L.emit(op, [x], {"dim": None if dim is None else int(dim), "keepdim": bool(keepdim)})
    return lower


def _var(L, node, x, dim=None, unbiased=None, keepdim=False, correction=None):
    """var.dim (unbiased) and var.correction (correction): torch's default corrects by 1."""
    if correction is None:
        correction = 1 if unbiased is None or isinstance(unbiased, bool) and unbiased else 0
        if isinstance(unbiased, (list, tuple)):     # var(x, dims) by position
            dim, correction = unbiased, 1
    dims = None if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    return L.emit("var", [x], {"dim": dims or None, "correction": float(correction), "keepdim": bool(keepdim)})


def _prod(L, node, x, dim=None, keepdim=False, dtype=None):
    if isinstance(dim, torch.dtype):
        dim = None
    return L.emit("prod", [x], {"dim": None if dim is None else [int(dim)], "keepdim": bool(keepdim)})


def _cat(L, node, tensors, dim=0):
    # torch's cat skips 1-d empty tensors (a legacy rule); the op set's cat takes same-rank pieces.
    pieces = [t for t in tensors if tuple(t.meta["val"].shape) != (0,)]
    return L.emit("cat", pieces, {"dim": int(dim)})


_EDGE_MODES = {"reflect": "reflect", "replicate": "replicate", "circular": "circular"}


def _pad(L, node, x, pad, mode="constant", value=None):
    if mode == "constant":
        return L.emit("constant_pad_nd", [x], {"pad": [int(p) for p in pad], "value": float(value or 0.0)})
    if mode not in _EDGE_MODES:
        raise L.error(f"pad with mode={mode!r} (constant, reflect, replicate or circular)")
    return L.emit("pad_edges", [x], {"pad": [int(p) for p in pad], "mode": _EDGE_MODES[mode]})


def _edge_pad(mode):
    """reflection_pad1d/2d/3d and replication_pad1d/2d/3d: F.pad's modes as ATen spells them."""
    return lambda L, n, x, padding: _pad(L, n, x, padding, mode)


def _upsample_bilinear(L, node, x, output_size=None, align_corners=False, *scales):
    """upsample_bilinear2d (scales_h, scales_w) and its .vec overload (scale_factors)."""
    if len(scales) == 1 and isinstance(scales[0], (list, tuple)):
        scales = tuple(scales[0])
    scales = [float(v) if v is not None else None for v in (list(scales) + [None, None])[:2]]
    size = [int(v) for v in node.meta["val"].shape[-2:]]
    return L.emit("upsample_bilinear2d", [x], {"size": size, "align_corners": bool(align_corners),
                                               "scales": scales})


def _grid_sampler(L, node, x, grid, interpolation_mode, padding_mode, align_corners):
    if interpolation_mode not in (0, 1) or padding_mode not in (0, 1):
        raise L.error("grid_sample other than mode 'bilinear' or 'nearest' with padding_mode 'zeros' or 'border'")
    return L.emit("grid_sampler_2d", [x, grid], {"interpolation_mode": int(interpolation_mode),
                                                 "padding_mode": int(padding_mode),
                                                 "align_corners": bool(align_corners)})


def _scatter_reduce(L, node, x, dim, index, src, reduce, include_self=True):
    if reduce not in ("sum", "mean", "amax", "amin"):
        raise L.error(f"scatter_reduce with reduce={reduce!r} (sum, mean, amax or amin)")
    return L.emit("scatter_reduce", [x, index, src], {"dim": int(dim), "reduce": reduce,
                                                      "include_self": bool(include_self)})


def _pdist(L, node, x, p=2.0):
    if _batch_shaped(x.meta.get("val")):
        raise L.error("pdist of the batch's rows (each distance from two rows): a shard would see its own rows only")
    return L.emit("pdist", [x], {"p": float(p)})


def _col2im(L, node, x, output_size, kernel_size, dilation, padding, stride):
    return L.emit("col2im", [x], {"output_size": [int(v) for v in output_size],
                                  "kernel_size": list(_pair(kernel_size)), "dilation": list(_pair(dilation)),
                                  "padding": list(_pair(padding)), "stride": list(_pair(stride))})


def _triple(v):
    v = [int(v)] if isinstance(v, int) else [int(x) for x in v]
    return v * 3 if len(v) == 1 else v


def _max_pool3d(L, node, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return L.emit("max_pool3d", [x], {"kernel_size": _triple(kernel_size),
                                      "stride": _triple(stride) if stride else None, "padding": _triple(padding),
                                      "dilation": _triple(dilation), "ceil_mode": bool(ceil_mode)})


def _avg_pool3d(L, node, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    if divisor_override:
        raise L.error("avg_pool3d with divisor_override")
    return L.emit("avg_pool3d", [x], {"kernel_size": _triple(kernel_size),
                                      "stride": _triple(stride) if stride else None, "padding": _triple(padding),
                                      "ceil_mode": bool(ceil_mode), "count_include_pad": bool(count_include_pad)})


def _adaptive_avg_pool3d(L, node, x, output_size):
    sizes, outs = list(x.meta["val"].shape[-3:]), _triple(output_size)
    if any(n % o for n, o in zip(sizes, outs)):
        raise L.error(f"adaptive_avg_pool3d from {sizes} to {outs}: only where the output divides the input")
    k = [n // o for n, o in zip(sizes, outs)]
    return L.emit("avg_pool3d", [x], {"kernel_size": k, "stride": k, "padding": [0, 0, 0], "ceil_mode": False,
                                      "count_include_pad": True})


def _index(L, node, x, indices):
    dims = [d for d, i in enumerate(indices) if i is not None]
    for d in dims:
        if indices[d].meta["val"].dtype == torch.bool:
            raise L.error("indexing with a boolean mask (its result's shape depends on the data)")
    return L.emit("index", [x, *(indices[d] for d in dims)], {"dims": dims})


def _adaptive_avg_pool(L, node, x, output_size):
    h, w = x.meta["val"].shape[-2:]
    oh, ow = _pair(output_size)
    if h % oh or w % ow:
        raise L.error(f"adaptive_avg_pool2d from {h}x{w} to {oh}x{ow}: only where the output divides the input")
    return L.emit("avg_pool2d", [x], {"kernel_size": [h // oh, w // ow], "stride": [h // oh, w // ow],
                                      "padding": [0, 0], "ceil_mode": False, "count_include_pad": True})


def _pool1d(L, node, x, kernel, stride, padding, ceil_mode=False, count_include_pad=True):
    """A 1-d average pool over [N, C, L] as the 2-d one over [N, C, 1, L]."""
    if x.meta["val"].dim() != 3:
        raise L.error("a 1-d pool of an input that is not [N, C, L]")
    wide = L.emit("unsqueeze", [x], {"dim": 2}, out=f"{node.name}_2d")
    pooled = L.emit("avg_pool2d", [wide], {"kernel_size": [1, int(kernel)], "stride": [1, int(stride)],
                                           "padding": [0, int(padding)], "ceil_mode": bool(ceil_mode),
                                           "count_include_pad": bool(count_include_pad)},
                    out=f"{node.name}_pooled")
    return L.emit("squeeze", [pooled], {"dims": [2]})


def _avg_pool1d(L, node, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True):
    k = _pair(kernel_size)[0]
    return _pool1d(L, node, x, k, _pair(stride)[0] if stride else k, _pair(padding)[0], ceil_mode,
                   count_include_pad)


def _adaptive_avg_pool1d(L, node, x, output_size):
    n, out = x.meta["val"].shape[-1], _pair(output_size)[0]
    if n % out:
        raise L.error(f"adaptive_avg_pool1d from {n} to {out}: only where the output divides the input")
    return _pool1d(L, node, x, n // out, n // out, 0)


def _convolution(L, node, x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    if transposed or x.meta["val"].dim() != 4:
        raise L.error("convolution other than a 2-d, not transposed one")
    return _conv2d(L, node, x, w, b, stride, padding, dilation, groups)


def _first_of(lower, outputs: int):
    """An op of several outputs whose first the op set makes (the rest: None, refused if read)."""
    def lowered(L, node, *args, **kw):
        return [lower(L, node, *args, **kw)] + [None] * (outputs - 1)
    return lowered


def _native_layer_norm(L, node, x, normalized_shape, weight, bias, eps):
    return _layer_norm(L, node, x, normalized_shape, weight, bias, eps)


def _native_dropout(L, node, x, p, train=True):
    return _dropout(L, node, x, p, bool(train))


def _bn_affine(L, node, x, weight, bias):
    """weight and bias, or ones and zeros (constants) where the module has none."""
    channels = x.meta["val"].shape[1]
    dtype = x.meta["val"].dtype
    out = []
    for v, fill in ((weight, torch.ones), (bias, torch.zeros)):
        out.append(v if v is not None else L.constant(fill(channels, dtype=dtype)))
    return out


def _bn_train(L, node, x, weight, bias, *rest):
    """_native_batch_norm_legit without running statistics (track_running_stats=False):
    the batch's statistics, in training and in eval alike."""
    training, momentum, eps = rest[-3:]
    if not training:
        raise L.error("batch norm in eval mode without running statistics")
    w, b = _bn_affine(L, node, x, weight, bias)
    return [L.emit("batch_norm", [x, w, b], {"training": True, "eps": float(eps), **L.batch_norm_attrs()}),
            None, None]


def _bn_eval(L, node, x, weight, bias, running_mean, running_var, momentum, eps):
    """Eval mode: the running statistics, constants of the program."""
    w, b = _bn_affine(L, node, x, weight, bias)
    return [L.emit("batch_norm", [x, w, b, running_mean, running_var], {"training": False, "eps": float(eps)}),
            None, None]


def _bn_running(L, node, x, weight, bias, running_mean, running_var, training, momentum, eps):
    """Training with running statistics (torchvision's default): the batch's statistics in
    a train step, the running ones in an eval step (the run's context says which), and the
    running mean and variance after the step (outputs 3 and 4: buffers the run carries)."""
    if not training:
        raise L.error("batch norm in eval mode that updates its running statistics")
    L.inputs.setdefault(CONTEXT, Value((6,), "int64"))
    w, b = _bn_affine(L, node, x, weight, bias)
    sync = L.batch_norm_attrs()
    y = L.emit("batch_norm", [x, w, b, running_mean, running_var, CONTEXT],
               {"running": True, "eps": float(eps), **sync})
    stats = [L.emit("batch_norm_running", [x, stat], {"stat": kind, "momentum": float(momentum), **sync},
                    out=f"{node.name}_running_{kind}") for stat, kind in ((running_mean, "mean"), (running_var, "var"))]
    return [y, None, None, *stats]


def _full_like(L, node, x, value, **kw):
    return L.emit("full_like", [x], {"value": value, "dtype": L._dtype(node.meta["val"])})


def _slice_scatter(L, node, x, src, dim=0, start=None, end=None, step=1):
    end = None if end is not None and end >= _INT64_MAX else end
    return L.emit("slice_scatter", [x, src], {"dim": int(dim), "start": start, "end": end, "step": int(step)})


def _scatter(L, node, x, dim, index, src=None, value=None, reduce=None):
    if reduce is not None:
        raise L.error(f"scatter with reduce={reduce!r}")
    if src is None or L.scalar_of(src) is not None:
        return L.emit("scatter", [x, index], {"dim": int(dim), "value": float(L.scalar_of(src) if src is not None
                                                                               else value)})
    return L.emit("scatter", [x, index, src], {"dim": int(dim)})


def _index_put(L, node, x, indices, values, accumulate=False):
    dims = [d for d, i in enumerate(indices) if i is not None]
    for d in dims:
        if indices[d].meta["val"].dtype == torch.bool:
            raise L.error("index_put with a boolean mask (x[mask] = v: the positions depend on the data)")
    return L.emit("index_put", [x, *(indices[d] for d in dims), values],
                  {"dims": dims, "accumulate": bool(accumulate)})


def _fill(L, node, x, value):
    s = L.scalar_of(value)
    if s is None:
        raise L.error("fill with a tensor value that is not a constant")
    return _full_like(L, node, x, s)


def _native_group_norm(L, node, x, weight, bias, n, c, hw, groups, eps):
    w, b = _bn_affine(L, node, x, weight, bias)
    return [L.emit("group_norm", [x, w, b], {"groups": int(groups), "eps": float(eps)}), None, None]


def _upsample_nearest(L, node, x, output_size=None, *scales):
    size = list(node.meta["val"].shape[-2:])
    return L.emit("upsample_nearest2d", [x], {"size": [int(v) for v in size]})


def _values_and_indices(L, node, x, values_op, indices_op, attrs):
    """[values, indices] of an op with both outputs; the indices only where something reads them."""
    values = L.emit(values_op, [x], attrs, out=f"{node.name}_values")
    read = any(u.target is operator.getitem and u.args[1] == 1 for u in node.users)
    return [values, L.emit(indices_op, [x], attrs, out=f"{node.name}_indices") if read else None]


def _topk(L, node, x, k, dim=-1, largest=True, sorted=True):
    attrs = {"k": int(k), "dim": int(dim), "largest": bool(largest)}
    return _values_and_indices(L, node, x, "topk", "topk_indices", attrs)


def _sort(L, node, x, dim=-1, descending=False, stable=None):
    """sort is topk of them all; ties keep their order whether or not `stable` asks for it."""
    return _values_and_indices(L, node, x, "topk", "topk_indices", {"dim": int(dim), "largest": bool(descending)})


_CORE_LOWER = {
    **{op: _float_unary(op) for op in ("exp", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt",
                                       "reciprocal", "sin", "cos", "tan", "sinh", "cosh", "asin", "acos", "atan",
                                       "asinh", "acosh", "atanh", "erf")},
    **{op: _unary(op) for op in ("abs", "sign", "floor", "ceil", "trunc", "isnan", "isinf")},
    "round": _round,
    **{op: _binary(op) for op in ("pow", "maximum", "minimum", "atan2", "fmod", "remainder", "logical_and",
                                  "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor")},
    "__and__": _binary("bitwise_and"), "__or__": _binary("bitwise_or"), "__xor__": _binary("bitwise_xor"),
    "clamp": _clamp, "clip": _clamp,
    "clamp_min": lambda L, n, x, m: _clamp(L, n, x, min=m), "clamp_max": lambda L, n, x, m: _clamp(L, n, x, max=m),
    "hardtanh": lambda L, n, x, min_val=-1.0, max_val=1.0: _clamp(L, n, x, min_val, max_val),
    "leaky_relu": lambda L, n, x, negative_slope=0.01: L.emit("leaky_relu", [x],
                                                              {"negative_slope": float(negative_slope)}),
    "elu": lambda L, n, x, alpha=1.0, scale=1.0, input_scale=1.0: L.emit(
        "elu", [x], {"alpha": float(alpha), "scale": float(scale), "input_scale": float(input_scale)}),
    "amax": _reduce("amax"), "amin": _reduce("amin"), "any": _reduce("any"),
    "max": _extreme("amax", "max_dim", "argmax", "maximum"), "min": _extreme("amin", "min_dim", "argmin", "minimum"),
    "argmax": _arg("argmax"), "argmin": _arg("argmin"),
    "var": _var, "prod": _prod,
    "cumsum": lambda L, n, x, dim, dtype=None: L.emit("cumsum", [x], {"dim": int(dim)}),
    "cat": _cat, "concat": _cat, "concatenate": _cat,
    "select": lambda L, n, x, dim, index: L.emit("select", [x], {"dim": int(dim), "index": int(index)}),
    "constant_pad_nd": lambda L, n, x, pad, value=0: _pad(L, n, x, pad, "constant", value), "pad": _pad,
    "index": _index,
    "index_select": lambda L, n, x, dim, index: L.emit("index_select", [x, index], {"dim": int(dim)}),
    "as_strided": _strided_view, "unfold": _strided_view,
    "_embedding_bag": _embedding_bag,
    "_local_scalar_dense": _item,
    "flip": lambda L, n, x, dims: L.emit("flip", [x], {"dims": [int(d) for d in dims]}),
    "repeat": lambda L, n, x, repeats: L.emit("repeat", [x], {"repeats": [int(r) for r in repeats]}),
    "avg_pool1d": _avg_pool1d, "adaptive_avg_pool1d": _adaptive_avg_pool1d,
    "adaptive_avg_pool2d": _adaptive_avg_pool, "_adaptive_avg_pool2d": _adaptive_avg_pool,
    "convolution": _convolution,
    "max_pool2d_with_indices": _first_of(_max_pool, 2),
    "native_layer_norm": _first_of(_native_layer_norm, 3),
    "native_dropout": _first_of(_native_dropout, 2),
    "_native_batch_norm_legit": _bn_train,
    "_native_batch_norm_legit_no_training": _bn_eval,
    "_native_batch_norm_legit_functional": _bn_running,
    "slice_scatter": _slice_scatter,
    "select_scatter": lambda L, n, x, src, dim, index: L.emit("select_scatter", [x, src],
                                                              {"dim": int(dim), "index": int(index)}),
    "scatter": _scatter,
    "scatter_add": lambda L, n, x, dim, index, src: L.emit("scatter", [x, index, src], {"dim": int(dim),
                                                                                         "reduce": "sum"}),
    "index_put": _index_put,
    "copy": lambda L, n, x, src, non_blocking=False: L.emit("copy", [x, src]),
    "fill": _fill,
    "native_group_norm": _native_group_norm,
    "upsample_nearest2d": _upsample_nearest,
    "topk": _topk, "sort": _sort,
    "diagonal": lambda L, n, x, offset=0, dim1=0, dim2=1: L.emit("diagonal", [x], {"offset": int(offset),
                                                                                   "dim1": int(dim1),
                                                                                   "dim2": int(dim2)}),
    **{f"reflection_pad{d}d": _edge_pad("reflect") for d in (1, 2, 3)},
    **{f"replication_pad{d}d": _edge_pad("replicate") for d in (1, 2, 3)},
    "upsample_bilinear2d": _upsample_bilinear, "grid_sampler_2d": _grid_sampler,
    "_cdist_forward": lambda L, n, a, b, p=2.0, compute_mode=None: L.emit("cdist", [a, b], {"p": float(p)}),
    "_pdist_forward": _pdist,
    "scatter_reduce": _scatter_reduce,
    "col2im": _col2im,
    "max_pool3d_with_indices": _first_of(_max_pool3d, 2), "max_pool3d": _max_pool3d,
    "avg_pool3d": _avg_pool3d, "_adaptive_avg_pool3d": _adaptive_avg_pool3d,
    "adaptive_avg_pool3d": _adaptive_avg_pool3d,
    "full_like": _full_like,
    "zeros_like": lambda L, n, x, **kw: _full_like(L, n, x, 0),
    "ones_like": lambda L, n, x, **kw: _full_like(L, n, x, 1),
}


_LOWER = {
    "linear": _linear, "addmm": _addmm,
    "mm": lambda L, n, a, b: L.emit("mm", [a, b]), "bmm": lambda L, n, a, b: L.emit("bmm", [a, b]),
    "matmul": lambda L, n, a, b: L.emit("matmul", [a, b]),
    "add": _binary("add"), "sub": _binary("sub"), "mul": _binary("mul"), "div": _binary("div"),
    "rsub": _rsub, "neg": _unary("neg"),
    "relu": _unary("relu"), "gelu": _gelu, "tanh": _unary("tanh"), "sigmoid": _unary("sigmoid"),
    "silu": _unary("silu"),
    "softmax": _softmax("softmax"), "_softmax": _softmax("softmax"),
    "log_softmax": _softmax("log_softmax"), "_log_softmax": _softmax("log_softmax"),
    "layer_norm": _layer_norm, "embedding": _embedding, "dropout": _dropout,
    "view": _reshape, "reshape": _reshape, "_unsafe_view": _reshape,
    "flatten": lambda L, n, x, start_dim=0, end_dim=-1: L.emit("flatten", [x], {"start_dim": start_dim,
                                                                               "end_dim": end_dim}),
    "permute": lambda L, n, x, dims: L.emit("permute", [x], {"dims": list(dims)}),
    "transpose": lambda L, n, x, d0, d1: L.emit("transpose", [x], {"dim0": int(d0), "dim1": int(d1)}),
    "t": lambda L, n, x: L.emit("transpose", [x], {"dim0": 0, "dim1": -1}),
    "expand": _expand,
    "slice": _slice, "split": _split, "split_with_sizes": _split, "chunk": _chunk,
    "unsqueeze": lambda L, n, x, dim: L.emit("unsqueeze", [x], {"dim": int(dim)}),
    "squeeze": _squeeze, "clone": lambda L, n, x, **kw: L.emit("clone", [x]),
    "contiguous": _identity, "alias": _identity, "lift_fresh_copy": _identity,
    "detach": lambda L, n, x: L.emit("detach", [x]),
    "to": _to, "_to_copy": _to, "type_as": lambda L, n, x, other: _to(L, n, x, dtype=other.meta["val"].dtype),
    "where": _where, "masked_fill": _masked_fill,
    "eq": _compare("eq"), "ne": _compare("ne"), "lt": _compare("lt"), "le": _compare("le"),
    "gt": _compare("gt"), "ge": _compare("ge"),
    "bitwise_not": lambda L, n, x: L.emit("logical_not", [x]), "logical_not": lambda L, n, x: L.emit("logical_not", [x]),
    "scaled_dot_product_attention": _sdpa,
    "sum": _sum("sum"), "mean": _sum("mean"),
    "gather": lambda L, n, x, dim, index, sparse_grad=False: L.emit("gather", [x, index], {"dim": int(dim)}),
    "conv2d": _conv2d, "max_pool2d": _max_pool, "avg_pool2d": _avg_pool,
    "cross_entropy_loss": _cross_entropy, "nll_loss": _nll, "nll_loss_nd": _nll, "mse_loss": _mse,
    "broadcast_tensors": _broadcast_tensors,
    **_CORE_LOWER,
}


# ---------------------------------------------------------------- coverage of torch's Core ATen opset

# Core ATen ops without a tensor input: always constants of the program, made once here by
# torch (positions, masks). The random ones are drawn each step instead (DRAWS).
MADE_AT_CAPTURE = frozenset({"arange", "full", "empty", "empty_strided", "scalar_tensor"})


# Core ATen ops of sizes, not tensors: torch.export writes sym_numel, sym_stride and
# sym_storage_offset as sym_size and numbers and decides sym_is_contiguous at export; capture
# reads a sym_size that follows the batch in the shapes it makes (_Lowering._call's SymInt).
READ_AS_SIZES = frozenset({"sym_size", "sym_numel", "sym_stride", "sym_storage_offset", "sym_is_contiguous"})


def core_aten_ops() -> set[str]:
    """torch's Core ATen opset: the names of the ops torch tags `core` (what
    run_decompositions() leaves a model in)."""
    names = set()
    # Every registered op (dir(torch.ops.aten) lists only those looked up so far)
    for full in torch._C._dispatch_get_all_op_names():
        if not full.startswith("aten::"):
            continue
        name, _, overload = full[len("aten::"):].partition(".")
        op = getattr(getattr(torch.ops.aten, name, None), overload or "default", None)
        if op is not None and torch.Tag.core in op.tags:
            names.add(name)
    return names


def core_aten_coverage() -> tuple[set[str], set[str]]:
    """(the Core ATen ops capture takes, those it does not); docs/torch.md gives the count
    and says why each of the second is left out."""
    core = core_aten_ops()
    taken = core & (set(_LOWER) | MADE_AT_CAPTURE | set(DRAWS) | READ_AS_SIZES)
    return taken, core - taken


# ---------------------------------------------------------------- weights back and forth

def load_into(module: torch.nn.Module, weights: dict[str, np.ndarray], aliases: dict[str, str] | None = None) -> None:
    """Load program weights (a checkpoint's, or a run's) into the torch module with
    load_state_dict; a tied parameter's other state_dict keys get the same tensor."""
    state = {name: torch.from_numpy(np.array(w, dtype=np.float32)) for name, w in weights.items()}
    for key, owner in (aliases or {}).items():
        if owner in state:
            state[key] = state[owner]
    current = module.state_dict()
    for key, value in current.items():   # buffers (causal masks) stay as the module has them
        state.setdefault(key, value)
    module.load_state_dict(state)


def weights_from_state_dict(state_dict: dict, param_names) -> dict[str, np.ndarray]:
    """A torch state_dict as the program's starting weights (float32 numpy)."""
    missing = [n for n in param_names if n not in state_dict]
    if missing:
        raise CaptureError(f"state_dict lacks parameter {missing[0]!r} ({len(missing)} missing)")
    return {n: _numpy(state_dict[n]).astype(np.float32) for n in param_names}


# ---------------------------------------------------------------- hand it to run()

def model_spec(name: str, module: torch.nn.Module, example_inputs, example_target, loss_fn,
               state_dict: dict | None = None):
    """What a run.py's model_fn returns for a torch model: the captured program as a
    ModelSpec of weight-streaming units, starting from the module's own weights
    (or from `state_dict`, a torch state_dict)."""
    from cs_runtime.compiler.units import program_spec
    captured = capture(module, example_inputs, example_target, loss_fn)
    weights = captured.weights if state_dict is None else \
        weights_from_state_dict(_untied(state_dict, captured.aliases), captured.program.params)
    spec = program_spec(name, captured.program, captured.units, captured.shapes, captured.dtypes, weights,
                        features=captured.feature_names, context=CONTEXT)
    return spec


def _untied(state_dict: dict, aliases: dict[str, str]) -> dict:
    """A state_dict with a tied parameter under its program name too."""
    out = dict(state_dict)
    for key, owner in aliases.items():
        if owner not in out and key in out:
            out[owner] = out[key]
    return out


def checkpoint_weights(path: str) -> dict[str, np.ndarray]:
    """A run's checkpoint as {parameter name: array}, ready for load_into."""
    from cs_runtime import checkpoint as ckpt
    state = ckpt.load(path)
    return {p: w for layer in state.weights.values() for p, w in layer.items()}
