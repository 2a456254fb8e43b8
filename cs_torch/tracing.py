"""cstorch.compile, @cstorch.trace, @cstorch.step_closure, @cstorch.checkpoint_closure.

    compiled_model = cstorch.compile(model, backend)

    @cstorch.trace
    def training_step(inputs, targets):
        outputs = compiled_model(inputs)
        loss = loss_fn(outputs, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        lr_scheduler.step()
        return loss

How a step is captured, once, on its first call:

1. The probe: the step runs eagerly with its effects recorded instead of
   done: which arguments the compiled model is called with, which tensor
   `backward()` is called on (the loss), and, in order, the optimizer steps,
   scheduler steps, loss-scaler calls, step closures and summaries.
2. The capture: cs_torch.capture exports the model together with a replay
   of the step as its loss function (the model's output fed in, every
   tensor argument of the step a program input), so whatever the step
   computes between the model and `backward()` is part of the program.
3. Every call (the first included) then runs the program -- with a CSX
   backend as a job of the CS system (cluster_step.py: MemoryX applies the
   update), with a CPU backend here on the one executor, unit by unit --
   and does the recorded effects in their order with the values it
   computed: the optimizer applies the gradients (CPU), the schedulers
   step, the closures get the loss as a host tensor.

What a step may return or hand a closure or a summary: the loss, plain Python
values, and any other tensor it computes from the model's output and its
arguments (an accuracy, the logits, a dict of tensors). For those, each step
has the model's output handed back (by the WSEs, or the CPU program) and
runs the step once more here, eagerly on that output with the optimizer,
schedulers and backward() doing nothing, so they are computed from this
step's values; closures get them as host tensors.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import types

import numpy as np
import torch

from .backend.ltc_backend import after_tensor_to_cpu
from .backends import current_backend, note
from .csx_grads import WeightNorms, norm_grads
from .experimental.listener import naming_tensors, register_traced_tensor_hook
from . import summary
from .nn import CsTorchError
from .recording import _active, current_executor, probing, replaying


class CompiledModel:
    """cstorch.compile's result: calls inside a traced step are compiled; calls outside run eagerly."""

    def __init__(self, model: torch.nn.Module, backend):
        self.model, self.backend = model, backend

    def __call__(self, *args, **kwargs):
        replay = replaying()
        if replay is not None:
            return replay.model_output
        probe = probing()
        if probe is not None:
            if kwargs:
                raise CsTorchError("trace: call the compiled model with positional tensors (no keywords)")
            probe.model_call(args, self)
            with naming_tensors(self.model):   # the capture names its tensors to listeners' hooks
                return self.model(*args, **kwargs)
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.__dict__["model"], name)

    def __repr__(self) -> str:
        return f"CompiledModel({type(self.model).__name__}, backend={self.backend.backend_type})"


def compile(model: torch.nn.Module, backend=None) -> CompiledModel:  # noqa: A001 (the documented name)
    if not isinstance(model, torch.nn.Module):
        raise CsTorchError(f"compile: expected a torch.nn.Module, got {type(model).__name__}")
    backend = backend or current_backend()
    if not hasattr(model, "device"):   # the real API's compiled module names its device (the host's here)
        model.device = torch.device("cpu")
    for module in model.modules():
        _apply_objects(module)
    return CompiledModel(model, backend)


def _apply_objects(module: torch.nn.Module) -> None:
    """As the real compile: the module's `apply(obj)` with an object that is not callable but has an
    `apply` method (nn.SelectiveGrad, experimental.Compression) calls obj.apply(module) once, on the
    module itself (names from it), instead of torch's call on every submodule."""
    def apply(self, fn):
        if callable(fn):
            return type(self).apply(self, fn)   # the class's (torch's) apply: a copy of the module keeps working
        own = getattr(fn, "apply", None)
        if not callable(own):
            raise TypeError(f"apply: expected a callable or an object with an apply method, got "
                            f"{type(fn).__name__}")
        return own(self)

    module.apply = types.MethodType(apply, module)


# ---------------------------------------------------------------- the probe
def _flatten(obj, leaves: list):
    """A template of obj with each leaf replaced by its index in `leaves`."""
    if isinstance(obj, (tuple, list)):
        return type(obj)(_flatten(o, leaves) for o in obj)
    if isinstance(obj, dict):
        return {k: _flatten(v, leaves) for k, v in obj.items()}
    leaves.append(obj)
    return _Leaf(len(leaves) - 1)


class _Leaf(int):
    pass


def _rebuild(template, leaves):
    if isinstance(template, _Leaf):
        return leaves[template]
    if isinstance(template, (tuple, list)):
        return type(template)(_rebuild(t, leaves) for t in template)
    if isinstance(template, dict):
        return {k: _rebuild(v, leaves) for k, v in template.items()}
    return template


class _Probe:
    def __init__(self):
        self.model_args = None
        self.loss = None
        self.effects: list[tuple] = []

    def model_call(self, args, compiled):
        if self.model_args is not None:
            raise CsTorchError("trace: the step calls the compiled model twice; a traced step calls it once")
        # The call's structure as it was made: a model may pop its batch dict's entries (the
        # model zoo's BERT does), and the capture rebuilds the call from this.
        leaves: list = []
        self.model_args, self.compiled = _rebuild(_flatten(args, leaves), leaves), compiled

    def record(self, *effect):
        self.effects.append(effect)


def _backward_recorder(tensor, *args, **kwargs):
    state = probing() or replaying()
    if state.loss is not None and state.loss is not tensor:
        raise CsTorchError("trace: backward() is called twice in one step; a traced step has one loss")
    state.loss = tensor


def _clip_recorder(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch.nn.utils.clip_grad_norm_ inside a traced step: the gradients are the program's, so the
    clipping is an effect done on them (on CSX by MemoryX). It returns what torch's does, the norm
    before clipping, where the step's rerun holds the gradients (or on CSX their norms); a zero
    while the step is captured."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    probe = probing()
    if probe is not None:
        if float(norm_type) != 2.0:
            raise CsTorchError(f"trace: clip_grad_norm_ with norm_type={norm_type}: only the 2-norm is emulated")
        probe.record("clip_norm", params, float(max_norm))
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def _clip_value_refused(*args, **kwargs):
    raise CsTorchError("trace: clip_grad_value_ inside a traced step is not emulated; use clip_grad_norm_")


def clip_grads(grads: dict, params: list, max_norm: float) -> None:
    """torch's clip_grad_norm_ on a step's gradients ({parameter: ndarray}, scaled in place): the 2-norm
    of the per-tensor 2-norms, and a factor max_norm / (norm + 1e-6) when it is below 1, in float32."""
    chosen = [grads[p] for p in dict.fromkeys(params) if p in grads]
    if not chosen:
        return
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(torch.from_numpy(np.asarray(g)))
                                                 for g in chosen]))
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in dict.fromkeys(params):
        if p in grads:
            grads[p] = (torch.from_numpy(np.asarray(grads[p])) * factor).numpy()


class _Patched:
    """Tensor.backward records the loss, and clip_grad_norm_ the clipping, while a step is probed or
    replayed."""

    def __enter__(self):
        self.saved = (torch.Tensor.backward, torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_)
        torch.Tensor.backward = _backward_recorder
        torch.nn.utils.clip_grad_norm_ = _clip_recorder
        torch.nn.utils.clip_grad_value_ = _clip_value_refused

    def __exit__(self, *exc):
        torch.Tensor.backward, torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_ = self.saved


class _Replay:
    """The step run with the model's output given: in the export (a replay) or, with `effects`
    a list, eagerly on a step's values (a rerun), its closures' and summaries' arguments noted."""

    def __init__(self, model_output, effects: list | None = None):
        self.model_output = model_output
        self.loss = None
        self.effects = effects
        self.updated = False   # whether the step called its optimizer's step() yet (a rerun)


# ---------------------------------------------------------------- values to and from the program
class _LossRef:
    """Where the loss goes in a closure's arguments or the step's return value."""


LOSS = _LossRef()


def _has_tensor(obj) -> bool:
    if isinstance(obj, (torch.Tensor, _LossRef)):
        return True
    if isinstance(obj, (tuple, list)):
        return any(_has_tensor(o) for o in obj)
    if isinstance(obj, dict):
        return any(_has_tensor(o) for o in obj.values())
    return False


class _OtherRef:
    """Where a tensor other than the loss goes: computed by the step's rerun (see above)."""


OTHER = _OtherRef()


def _spec(value, loss):
    """value with the loss tensor replaced by LOSS and any other tensor by OTHER. Containers
    without tensors stay the very objects the step gave (a closure may append to a list)."""
    if not _has_tensor(value):
        return value
    if isinstance(value, torch.Tensor):
        return LOSS if value is loss else OTHER
    if isinstance(value, (tuple, list)):
        return type(value)(_spec(v, loss) for v in value)
    if isinstance(value, dict):
        return {k: _spec(v, loss) for k, v in value.items()}
    return value


def _has_other(spec) -> bool:
    if spec is OTHER:
        return True
    if isinstance(spec, (tuple, list)):
        return any(_has_other(s) for s in spec)
    if isinstance(spec, dict):
        return any(_has_other(s) for s in spec.values())
    return False


def _materialize(spec, loss_tensor):
    if not _has_tensor(spec):
        return spec
    if spec is LOSS:
        return loss_tensor
    if isinstance(spec, (tuple, list)):
        return type(spec)(_materialize(s, loss_tensor) for s in spec)
    if isinstance(spec, dict):
        return {k: _materialize(v, loss_tensor) for k, v in spec.items()}
    return spec


def _swap_loss(value, loss, loss_tensor):
    """A rerun's value with its loss replaced by the program's, every tensor a host tensor."""
    if value is loss:
        return loss_tensor
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (tuple, list)) and _has_tensor(value):
        return type(value)(_swap_loss(v, loss, loss_tensor) for v in value)
    if isinstance(value, dict) and _has_tensor(value):
        return {k: _swap_loss(v, loss, loss_tensor) for k, v in value.items()}
    return value


def _eval_loss(returned):
    """An eval step's loss (it calls no backward()): its only tensor, else its "loss" entry, else
    its first scalar float tensor."""
    tensors = [v for v in _flat_values(returned) if isinstance(v, torch.Tensor)]
    if len(tensors) == 1:
        return tensors[0]
    if isinstance(returned, dict) and isinstance(returned.get("loss"), torch.Tensor):
        return returned["loss"]
    return next((t for t in tensors if t.dim() == 0 and t.is_floating_point()), None)


# ---------------------------------------------------------------- the traced step
class TracedStep:
    wants_output = False   # whether each step needs the model's output back (values besides the loss)

    def __init__(self, fn):
        self.fn = fn
        self.engine = None
        functools.update_wrapper(self, fn.func if isinstance(fn, functools.partial) else fn)
        if isinstance(fn, functools.partial):
            self.fn.__name__ = fn.func.__name__

    def __get__(self, instance, owner=None):
        """@cstorch.trace on a method (the model zoo's Trainer.training_step): each instance has its
        own traced step of the bound method, captured on its own first call."""
        if instance is None:
            return self
        key = f"_traced_{self.fn.__name__}"
        bound = instance.__dict__.get(key)
        if bound is None:
            bound = instance.__dict__[key] = TracedStep(functools.partial(self.fn, instance))
        return bound

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise CsTorchError(f"trace: call {self.fn.__name__} with positional arguments")
        leaves: list = []
        template = _flatten(args, leaves)
        if self.engine is None:
            self._capture(template, leaves)
            backend = self.compiled.backend
            if backend.compile_only or backend.validate_only:
                return None
        return self._run(leaves)

    # ------------------------------------------------------------ capture (once)
    def _capture(self, template, leaves):
        from . import capture as capture_mod
        from .engine import StepEngine
        probe = _Probe()
        _active["probe"] = probe
        self.traced_shapes: dict[str, list] = {}   # each traced name's shape at each call, for the loop's listeners
        naming = register_traced_tensor_hook(
            lambda t, name: self.traced_shapes.setdefault(name, []).append(tuple(t.shape))) \
            if getattr(current_executor(), "listeners", None) else None
        try:
            with _Patched():
                returned = self.fn(*_rebuild(template, leaves))
        finally:
            _active["probe"] = None
            if naming is not None:
                naming.remove()
        if probe.model_args is None:
            raise CsTorchError(f"trace: {self.fn.__name__} never calls a compiled model (cstorch.compile(model))")
        self.compiled = probe.compiled
        model = self.compiled.model
        if probe.loss is None:   # an eval step: the loss is the tensor it returns
            probe.loss = _eval_loss(returned)
            if probe.loss is None:
                raise CsTorchError("trace: a step without backward() returns its loss (a scalar tensor, or "
                                   "a dict's \"loss\")")
        if probe.loss.dim() != 0:
            raise CsTorchError(f"trace: the loss has shape {tuple(probe.loss.shape)}, not a scalar")
        tensor_leaves = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        call_leaves: list = []
        call_template = _flatten(tuple(probe.model_args), call_leaves)
        call_tensors = [arg for arg in call_leaves if isinstance(arg, torch.Tensor)]
        for arg in call_tensors:
            if not any(arg is leaves[i] for i in tensor_leaves):
                raise CsTorchError("trace: call the compiled model with the step's own tensor arguments "
                                   "(a tensor computed inside the step cannot be streamed to the CS system)")
        self.tensor_leaves = tensor_leaves
        self.model_arg_leaves = [next(i for i in tensor_leaves if arg is leaves[i]) for arg in call_tensors]
        # A model called with a structure (the model zoo's model(batch), a list or dict of the
        # step's tensors) is captured through a view of it that takes those tensors flat.
        flat_call = len(call_tensors) == len(call_leaves) and all(isinstance(t, _Leaf) for t in call_template)
        capture_model = model if flat_call else _flat_arguments(model, call_template, call_leaves)
        self.returned = _spec(returned, probe.loss)
        self.effects = [self._effect_spec(e, probe.loss) for e in probe.effects]
        self.wants_output = _has_other(self.returned) or any(
            _has_other(e[2:]) for e in self.effects if e[0] in ("closure", "summary"))
        self.template = template
        self.training = any(e[0] in ("opt_step", "scaler_step") for e in self.effects)
        fn, non_tensors = self.fn, list(leaves)
        executor = current_executor()
        pair = executor is not None and executor.on_cluster
        # A model given the labels too computes its own loss (the model zoo's model([inputs, labels])).
        target_in_model = pair and sorted(self.model_arg_leaves) == tensor_leaves and len(tensor_leaves) == 2
        named = _named_batch(template, leaves) if pair else None
        if named is not None:   # a dict batch: its named tensors are the program's inputs, its labels the target
            names, target_leaf = named
            feature_leaves = [i for i in tensor_leaves if i != target_leaf]
            if not set(feature_leaves) <= set(self.model_arg_leaves):
                raise CsTorchError(f"trace: with a CSX backend {self.fn.__name__} calls the compiled model with "
                                   "every tensor of its dict batch but the labels (the input workers stream them "
                                   "as the program's inputs)")
            target_in_model = target_leaf in self.model_arg_leaves
            place = {id(leaf): k for k, leaf in enumerate(call_leaves)}
            capture_model = _named_arguments(model, call_template, call_leaves,
                                             {names[i]: place[id(leaves[i])] for i in feature_leaves},
                                             place[id(leaves[target_leaf])] if target_in_model else None)
            model_inputs = {names[i]: leaves[i] for i in feature_leaves}
            self.model_arg_leaves = feature_leaves
            for i in feature_leaves:
                non_tensors[i] = _sentinel(leaves[i])
        elif pair:   # the CS system streams one input and the labels: the program takes exactly those
            if len(tensor_leaves) != 2 or not (len(self.model_arg_leaves) == 1 or target_in_model):
                raise CsTorchError(f"trace: with a CSX backend {self.fn.__name__} takes two tensors, the model's "
                                   "input and the labels, and calls the compiled model with the first (or with "
                                   "both, the input first, when the model computes its own loss)")
            if target_in_model:
                self.model_arg_leaves = tensor_leaves[:1]
                capture_model = _flat_arguments(model, call_template, call_leaves, order=[
                    next(k for k, leaf in enumerate(call_leaves) if leaf is leaves[i]) for i in tensor_leaves])
            target_leaf = next(i for i in tensor_leaves if i != self.model_arg_leaves[0])
            non_tensors[self.model_arg_leaves[0]] = _sentinel(leaves[self.model_arg_leaves[0]])
            model_inputs = tuple(leaves[i] for i in self.model_arg_leaves) if target_in_model else tuple(call_tensors)
        else:
            model_inputs = tuple(call_tensors)
        self.input_leaves = self.model_arg_leaves + (([target_leaf]) if pair else tensor_leaves)

        def replay_loss(model_output, step_tensors):
            replay = _Replay(model_output)
            values = list(non_tensors)
            if pair:
                values[target_leaf] = step_tensors
            else:
                for index, tensor in zip(tensor_leaves, step_tensors):
                    values[index] = tensor
            _active["replay"] = replay
            try:
                with _Patched():
                    result = fn(*_rebuild(template, values))
            finally:
                _active["replay"] = None
            if replay.loss is None:
                replay.loss = _eval_loss(result)
            return replay.loss

        example = leaves[target_leaf].detach().clone() if pair else \
            _Tensors(leaves[i].detach().clone() for i in tensor_leaves)
        was_training = model.training
        # An eval step (often under torch.no_grad()) is exported with grad off, so that its
        # no_grad is no change of mode and leaves nothing in the graph.
        grad_mode = torch.enable_grad() if self.training else torch.no_grad()
        try:
            with grad_mode:
                captured = capture_mod.capture(capture_model, model_inputs, example, replay_loss,
                                               target_in_model=target_in_model)
        except capture_mod.CaptureError as exc:
            raise CsTorchError(f"trace: {exc}") from None
        finally:
            model.train(was_training)
        if self.wants_output and "output" not in captured.program.outputs:
            raise CsTorchError(f"trace: {self.fn.__name__} hands out tensors other than the loss, which are "
                               "computed from the model's output: the model must return one tensor")
        if pair and any(_is_sentinel(c) for c in captured.program.consts.values()):
            raise CsTorchError(f"trace: {self.fn.__name__} uses the model's input outside the model; on the CS "
                               "system the step's loss may read the model's output and the labels only")
        self.captured = captured
        self.engine = StepEngine(captured, model)
        program = captured.program
        print(f"cs_torch: compiled {self.fn.__name__}: {len(program.nodes)} ops, {len(program.params)} parameters, "
              f"{len(captured.units)} weight-streaming units", file=sys.stderr, flush=True)

    @staticmethod
    def _effect_spec(effect, loss):
        kind = effect[0]
        if kind == "closure":
            _, fn, args, kwargs = effect
            return ("closure", fn, _spec(args, loss), _spec(kwargs, loss))
        if kind == "summary":
            _, name, value = effect
            return ("summary", name, _spec(value, loss))
        return effect

    # ------------------------------------------------------------ one step
    def _run(self, leaves):
        run = self._cluster_run()
        if run is not None:
            loss, applied, output = run.step()   # the batch is the workers'; the arguments are this step's copy
            self.engine.steps += self.training   # the run's step count, as the CPU path keeps it
            held, weights = None, None
            if self.wants_output and self.training:
                held = norm_grads(self.engine.params, run.param_grad_norms())
                weights = WeightNorms(self.engine.params, run.param_norms())
            return self._effects(loss, {}, cluster_applied=applied, rerun=self._rerun(leaves, output, held, weights))
        arrays = [_host(leaves[i]) for i in self.input_leaves]
        self._feed_listeners(arrays)
        scaler = next((e[1] for e in self.effects if e[0] == "scaler_step"), None)
        if self.training:
            seed = scaler.scale_value() if scaler is not None else 1.0
            loss, grads, output = self.engine.train(arrays, seed, self.wants_output)
        else:
            grads = {}
            loss, output = self.engine.evaluate(arrays, output=True) if self.wants_output else \
                (self.engine.evaluate(arrays), None)
        return self._effects(loss, grads, rerun=self._rerun(leaves, output, self._held_grads(grads, scaler)))

    def _feed_listeners(self, arrays) -> None:
        """The loop's listeners (DataExecutor(listeners=)) get this step's values of the traced tensors
        they select and write their summaries at the step (before the step runs: its weights)."""
        executor = current_executor()
        listeners = getattr(executor, "listeners", None)
        if not listeners:
            return
        if getattr(self, "_listened", None) is None:
            self._listened = self._listened_values(listeners)
        values = self.engine.module_outputs(arrays, self._listened, train=self.training)
        writer = summary.writer_of("listeners")
        if writer is not None:
            for listener in listeners:
                listener.write(values, writer, writer.base_step + executor.user_iteration)

    def _listened_values(self, listeners) -> dict[str, str]:
        """{traced name: its program value} of every traced tensor a listener selects. A tensor that is
        no single value of the program (one output of a module of several, a module called more than
        once or whose ops the program does not hold, such as a dropout of 0) is never summarized with
        another value: named exactly, it stops the step in one line; matched by a glob, it is skipped,
        named in one line."""
        from .engine import module_output_value
        model = self.compiled.model
        paths = {path or type(module).__name__: path for path, module in model.named_modules()}
        program, shapes = self.captured.program, self.captured.shapes
        chosen, skipped = {}, []
        for name, seen in self.traced_shapes.items():
            selecting = [listener for listener in listeners if listener.selects(name)]
            if not selecting:
                continue
            value = module_output_value(program, paths[name]) if name in paths and len(seen) == 1 else None
            if value is not None and tuple(shapes.get(value, ())) == seen[0]:
                chosen[name] = value
                continue
            exact = next((listener for listener in selecting if name in listener.tensor_names), None)
            if exact is not None:
                raise CsTorchError(f"listener {exact.listener_name}: the traced tensor {name} is not one value "
                                   "of the compiled program (select module outputs of one tensor, called once)")
            skipped.append(name)
        if not self.traced_shapes:
            note(f"listeners: {self.fn.__name__} was captured outside a loop given listeners; its tensors are "
                 "not summarized")
        if skipped:
            note(f"listeners: {len(skipped)} matched traced tensors are not one value of the compiled program "
                 f"and are not summarized: {', '.join(skipped)}")
        return chosen

    def _held_grads(self, grads: dict, scaler) -> dict | None:
        """The CPU backend's gradients as the rerun's parameters hold them: unscaled, as after the
        GradScaler's unscale_ (the step reads a norm after it), as MemoryX's norms are on CSX."""
        if not (self.wants_output and grads):
            return None
        scale = np.float32(scaler.scale_value()) if scaler is not None else np.float32(1.0)
        return {p: torch.from_numpy(np.asarray(g, dtype=np.float32) if scale == 1.0 else
                                    np.asarray(g, dtype=np.float32) / scale).view_as(p) for p, g in grads.items()}

    def _rerun(self, leaves, output, grads: dict | None = None, weights=None):
        """(the step's return value, its closures' and summaries' arguments in order, its loss), the step
        run here on this step's model output; None when the step hands out nothing but its loss. With
        `grads` ({parameter: tensor}), the parameters hold this step's gradients meanwhile, so what the
        step computes from them after backward() (a gradient norm it logs) has their values: the CPU
        backend's gradients, or on CSX, where the gradients stay in MemoryX, their norms
        (csx_grads.GradientNorm); there `weights` (csx_grads.WeightNorms) gives a parameter's
        norm as the step began, MemoryX's, where the module holds the weights the job began on."""
        if not self.wants_output:
            return None
        replay = _Replay(torch.from_numpy(np.array(output)), effects=[])
        _active["replay"] = replay
        held = {p: p.grad for p in grads or {}}
        try:
            for p, g in (grads or {}).items():
                p.grad = g
            with _Patched(), torch.no_grad(), weights or contextlib.nullcontext():
                returned = self.fn(*_rebuild(self.template, leaves))
        finally:
            _active["replay"] = None
            for p, g in held.items():
                p.grad = g
        loss = replay.loss if replay.loss is not None else _eval_loss(returned)
        return returned, replay.effects, loss

    def _cluster_run(self):
        executor = current_executor()
        if executor is None or not executor.on_cluster:
            if self.compiled.backend.is_csx:
                raise CsTorchError(f"trace: with a CSX backend, call {self.fn.__name__} inside a loop over a "
                                   "cstorch.utils.data.DataExecutor (its input workers feed the CS system)")
            return None
        return executor.cluster_run(self)

    def _effects(self, loss: float, grads: dict, cluster_applied: bool | None = None, rerun=None):
        """The step's recorded effects, in order, with its values. On the CS system MemoryX
        has applied the update already (cluster_applied says whether it did). With a rerun,
        closures, summaries and the return value take its values (the loss the program's)."""
        loss_tensor = torch.tensor(loss, dtype=torch.float32)
        found_inf = cluster_applied is False
        noted = iter(rerun[1]) if rerun is not None else None
        for effect in self.effects:
            if noted is not None and effect[0] in ("closure", "summary"):
                values = [_swap_loss(v, rerun[2], loss_tensor) for v in next(noted)]
                effect = (effect[0], effect[1], *values)
            kind = effect[0]
            if kind == "clip_norm" and cluster_applied is None:
                clip_grads(grads, effect[1], effect[2])
            elif kind == "opt_step" and cluster_applied is None:
                effect[1].apply(grads)
            elif kind == "scaler_step" and cluster_applied is None:
                found_inf = effect[1].step_with(effect[2], grads)
            elif kind == "scaler_update":
                effect[1].update_with(found_inf)
            elif kind == "sched_step":
                effect[1].step()
            elif kind == "closure":   # host tensors (the same objects the step returns), each to the hooks
                args, kwargs = _materialize(effect[2], loss_tensor), _materialize(effect[3], loss_tensor)
                _announce(args)
                for key, value in kwargs.items():
                    _announce(value, key)
                effect[1](*args, **kwargs)
            elif kind == "summary":
                summary.write_scalar(effect[1], _materialize(effect[2], loss_tensor))
        if rerun is not None:
            return _swap_loss(rerun[0], rerun[2], loss_tensor)
        return _materialize(self.returned, loss_tensor)


def _flat_arguments(model: torch.nn.Module, template, call_leaves: list, order: list[int] | None = None):
    """`model` taking the tensors of its call's arguments flat, in order (or in `order`, their
    places among the call's leaves): the same module (one __dict__, so the same parameters,
    names and mode) with a forward that rebuilds the call."""
    positions = order or [i for i, leaf in enumerate(call_leaves) if isinstance(leaf, torch.Tensor)]

    class FlatArguments(type(model)):
        def forward(self, *tensors):
            values = list(call_leaves)
            for position, tensor in zip(positions, tensors):
                values[position] = tensor
            return super().forward(*_rebuild(template, values))

    FlatArguments.__name__ = FlatArguments.__qualname__ = type(model).__name__
    view = object.__new__(FlatArguments)
    view.__dict__ = model.__dict__
    return view


def _named_batch(template, leaves) -> tuple[dict[int, str], int] | None:
    """For a step whose tensors are one dict argument's, with labels (the model zoo's batch, beside
    other arguments that are no tensors: its step number): (each tensor leaf's name, the labels'
    leaf); None for any other step."""
    from .loader_replay import LABELS
    batches = [a for a in template if isinstance(a, dict) and LABELS in a]
    if len(batches) != 1 or not all(isinstance(v, _Leaf) for v in batches[0].values()):
        return None
    names = {int(leaf): str(name) for name, leaf in batches[0].items()}
    if {i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)} != set(names):
        return None
    return names, int(batches[0][LABELS])


def _named_arguments(model: torch.nn.Module, template, call_leaves: list, positions: dict[str, int],
                     target_position: int | None):
    """`model` taking its call's tensors by name (`positions`: each name's place among the call's
    leaves), and the target first when the model is called with it too (`target_position`)."""

    class NamedArguments(type(model)):
        def forward(self, *target, **features):
            values = list(call_leaves)
            for name, tensor in features.items():
                values[positions[name]] = tensor
            if target_position is not None:
                values[target_position] = target[0]
            return super().forward(*_rebuild(template, values))

    NamedArguments.__name__ = NamedArguments.__qualname__ = type(model).__name__
    view = object.__new__(NamedArguments)
    view.__dict__ = model.__dict__
    return view


class _Tensors(tuple):
    """Every tensor of the step, passed to capture as its target (capture copies it with clone())."""

    def clone(self):
        return tuple(t.clone() for t in self)


_SENTINEL_INT = -987654321


def _sentinel(t: torch.Tensor) -> torch.Tensor:
    """A stand-in for the model's input in the replay: if the loss reads it, it shows up in the
    program's constants (and the step is refused), never silently baked in."""
    return torch.full_like(t, float("nan") if t.is_floating_point() else _SENTINEL_INT)


def _is_sentinel(array: np.ndarray) -> bool:
    if np.issubdtype(array.dtype, np.floating):
        return bool(np.isnan(array).any())
    return bool(np.issubdtype(array.dtype, np.integer) and (array == _SENTINEL_INT).any())


def _flat_values(obj):
    leaves: list = []
    _flatten(obj, leaves)
    return leaves


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def trace(fn) -> TracedStep:
    """Capture fn's step once, on its first call, then run every call on the CS system's program."""
    return TracedStep(fn)


# ---------------------------------------------------------------- closures
def _host_values(obj, name: str = ""):
    """obj with its tensors as host tensors, each handed to the after-tensor-to-CPU hooks."""
    if not _has_tensor(obj):
        return obj
    if isinstance(obj, torch.Tensor):
        host = obj.detach().cpu()
        after_tensor_to_cpu(host, name)
        return host
    if isinstance(obj, (tuple, list)):
        return type(obj)(_host_values(o, _joined(name, i)) for i, o in enumerate(obj))
    if isinstance(obj, dict):
        return {k: _host_values(v, _joined(name, k)) for k, v in obj.items()}
    return obj


def _announce(obj, name: str = "") -> None:
    """Hand each tensor of obj (host tensors already) to the after-tensor-to-CPU hooks, by name."""
    if isinstance(obj, torch.Tensor):
        after_tensor_to_cpu(obj, name)
    elif isinstance(obj, (tuple, list)):
        for i, item in enumerate(obj):
            _announce(item, _joined(name, i))
    elif isinstance(obj, dict):
        for key, item in obj.items():
            _announce(item, _joined(name, key))


def _joined(name: str, key) -> str:
    return f"{name}.{key}" if name else str(key)


def step_closure(fn):
    """Run fn with its tensors as host tensors once the step's values exist."""
    @functools.wraps(fn)
    def closure(*args, **kwargs):
        probe = probing()
        if probe is not None:
            probe.record("closure", fn, args, kwargs)
            return None
        replay = replaying()
        if replay is not None:
            if replay.effects is not None:   # a rerun: this step's values of the arguments
                replay.effects.append((args, kwargs))
            return None
        return fn(*_host_values(args), **{k: _host_values(v, k) for k, v in kwargs.items()})
    return closure


def checkpoint_closure(fn):
    """A closure that saves a checkpoint: it may be called on every step, and runs only on the
    DataExecutor's checkpoint steps (elsewhere it does nothing and returns None), as the real API's."""
    @functools.wraps(fn)
    def closure(*args, **kwargs):
        executor = current_executor()
        if executor is not None and not executor.on_checkpoint_step:
            return None
        if probing() is not None or replaying() is not None:
            raise CsTorchError(f"checkpoint_closure {fn.__name__}: call it outside the traced step")
        if executor is not None:
            executor.sync_weights()   # on the CS system: the trained weights into the module first
        return fn(*args, **kwargs)
    return closure

