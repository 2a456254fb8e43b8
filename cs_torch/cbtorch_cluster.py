"""A 1.x loop (cbtorch.Session) on the emulated CS system: one job for the loop.

A 1.x loop is not one function that could be traced whole, so its step is
learnt from its first iteration:

1. Recording (train mode, first iteration): the model runs eagerly here and
   every torch call from its output until `loss.backward()` is recorded (a
   TorchFunctionMode); backward() names the loss. When the optimizer's
   step() comes, the recorded calls the loss depends on become a replay
   function of (model output, labels), captured with the model as one
   program (cs_torch/capture.py, as @cstorch.trace does), and the job starts
   (cs_torch/cluster_step.py: MemoryX applies the optimizer's rule, as
   torch.optim or cstorch.optim give it). The first step runs then.
2. Every later iteration: calling the model runs one step on the CS system,
   with the batch the input workers stream (the loop's loader yields that
   same batch, built here from the same data set) and the optimizer's
   learning rate of the moment; the call returns the model's output the
   WSEs computed, so whatever the loop computes from it (its loss, an
   accuracy) has the CS system's values. backward() and the optimizer's
   step() change nothing here (MemoryX updated the weights), and step
   closures get the loss the CS system computed, as host tensors.
3. Eval mode: the first call captures the model alone (the program's loss,
   the output's mean, is not used); each call is one eval step on the CS
   system and returns the model's output.

When the Session ends the trained weights and the optimizer's state come
back into the module and the optimizer; during the loop the module keeps
its starting weights. The loop's data set is saved for the input workers
(numpy arrays in artifact_dir, never pickled): a torch DataLoader object
cannot be imported by name as a 2.x input_fn is. An IterableDataset, which
may be endless, is read as the loop iterates, a batch a step
(cs_torch/batch_files.py).
"""
from __future__ import annotations

import os

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from . import capture as capture_mod
from . import session as session_mod
from .batch_files import BatchWriter, streamed_batches
from .cluster_step import ClusterRun, WorkerLoader, loader_settings, plan_batches, saved_loader
from .loader_replay import arrays_of, is_iterable
from .data import Batch
from .nn import CsTorchError


class _Recorder(TorchFunctionMode):
    """Every torch call between the model's output and backward(): (func, args, kwargs, result)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, result))
        return result


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _swap(obj, env: dict):
    """obj with each recorded tensor replaced by its replayed counterpart."""
    if isinstance(obj, torch.Tensor):
        return env.get(id(obj), obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_swap(o, env) for o in obj)
    if isinstance(obj, dict):
        return {k: _swap(v, env) for k, v in obj.items()}
    return obj


def replay_of(calls: list, output, labels, loss, model, model_input):
    """loss_fn(model_output, labels): the recorded calls the loss depends on, replayed."""
    needed, kept = {id(loss)}, []
    for call in reversed(calls):
        if any(id(t) in needed for t in _tensors(call[3])):
            kept.append(call)
            needed.update(id(t) for t in _tensors((call[1], call[2])))
    kept.reverse()
    produced = {id(t) for call in kept for t in _tensors(call[3])}
    if id(loss) not in produced:
        raise CsTorchError("cbtorch.Session (CSX): backward() is called on a tensor not computed from the "
                           "model's output")
    params = {id(p) for p in model.parameters()}
    for call in kept:
        for t in _tensors((call[1], call[2])):
            if id(t) in produced or t is output or t is labels:
                continue
            if id(t) in params:
                raise CsTorchError("cbtorch.Session (CSX): the loss reads a parameter of the model outside the "
                                   "model; on the CS system the loss reads the model's output and the labels")
            if t is model_input:
                raise CsTorchError("cbtorch.Session (CSX): the loss reads the model's input; on the CS system "
                                   "the loss reads the model's output and the labels only")

    def replay(model_output, target):
        env = {id(output): model_output, id(labels): target}
        for func, args, kwargs, result in kept:
            got = func(*_swap(args, env), **_swap(kwargs, env))
            env.update((id(old), new) for old, new in zip(_tensors(result), _tensors(got)))
        return env[id(loss)]
    return replay


def _output_mean(output, target):
    """An eval program's loss: unused (the loop computes its own from the output), but a program has one."""
    return output.float().mean()


class ClusterLoop:
    """The job of one cbtorch.Session with a CSX backend."""

    def __init__(self, session, backend):
        self.mode, self.dataloader, self.backend = session.mode, session.dataloader, backend
        self.model = self.optimizer = self.run = self.recorder = None
        self.plan = self.batch = None
        self.writer = None           # an IterableDataset's batches, written as the loop reads them
        self.yielded = 0             # batches the loop has had: the workers stream batch i for step i
        self.first = None            # (model args, eager output) of the recorded iteration
        self.calls: list | None = None
        self.waiting = False         # the first train step is recorded; it runs at the optimizer's step()
        self.loss_tensor = None      # this iteration's loss (backward() named it)
        self.loss_value = None       # ... and its value on the CS system, once the step ran
        self.pending: list = []      # closures waiting for the step's values

    # ------------------------------------------------------------ the data
    def batches(self, loader):
        """The loop's pass over its loader: the global batches the input workers stream."""
        if is_iterable(loader.loader):
            yield from self._streamed(loader.loader)
            return
        if self.plan is None:
            arrays = arrays_of(loader.loader)
            batch_size = getattr(loader.loader, "batch_size", None)
            if isinstance(batch_size, int) and len(arrays[0]) % batch_size \
                    and not getattr(loader.loader, "drop_last", False):
                raise CsTorchError("cbtorch.Session (CSX): the DataLoader's last batch is short; give it "
                                   "drop_last=True (a compiled program takes one batch shape)")
            self.worker_loader = saved_loader(loader.loader, arrays, self.backend.artifact_dir, session_mod._seed)
            self.plan = plan_batches(self.worker_loader, arrays)
        for _ in range(len(loader)):
            self.batch = next(self.plan)
            self.yielded += 1
            yield self.batch

    def _streamed(self, torch_loader):
        """A pass over an IterableDataset (it may be endless): each batch is read when the loop asks for
        it and written for the workers as that step's file (cs_torch/batch_files.py)."""
        if self.writer is None:
            batch_size = loader_settings(torch_loader)["batch_size"]
            self.writer = BatchWriter(self.backend.artifact_dir, batch_size)
            self.worker_loader = WorkerLoader(streamed_batches, batch_size, self.writer.folder, batch_size,
                                              shuffle=False, drop_last=True, shuffle_seed=session_mod._seed)
        for batch in torch_loader:
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise CsTorchError("cbtorch.Session (CSX): the IterableDataset's loader must give "
                                   "(input, label) batches")
            self.writer.write(*batch)
            self.batch = tuple(batch)
            self.yielded += 1
            yield self.batch

    def worker_batch(self, index: int) -> Batch:
        return Batch(self.worker_loader, index)

    # ------------------------------------------------------------ the loop's calls
    def model_call(self, compiled, args):
        if self.model is None:
            self.model = compiled
        elif compiled is not self.model:
            raise CsTorchError("cbtorch.Session (CSX): one model per Session (the job runs one program)")
        if self.batch is None or len(args) != 1 or args[0] is not self.batch[0]:
            raise CsTorchError("cbtorch.Session (CSX): call the model with the input of the batch the Session's "
                               "dataloader gave (the input workers stream that batch to the WSEs)")
        if self.yielded != (self.run.steps if self.run else 0) + 1:
            raise CsTorchError("cbtorch.Session (CSX): each batch of the Session's dataloader is one step; call "
                               "the model once for every batch (the input workers stream them in order)")
        self.loss_tensor = self.loss_value = None
        if self.run is None and self.mode == "train":
            return self._record(compiled, args)
        if self.run is None:
            self._start(_output_mean, None)
        return self._step()

    def backward(self, tensor) -> None:
        if self.mode != "train":
            raise CsTorchError("cbtorch.Session: backward() in a Session of mode 'eval'")
        if self.recorder is not None:   # the first iteration: backward() names the loss
            self._stop_recording()
            self.waiting = True
        elif self.run is None:
            raise CsTorchError("cbtorch.Session (CSX): backward() before the model was called")
        self.loss_tensor = tensor

    def optimizer_step(self, optimizer) -> None:
        if self.optimizer is None:
            self.optimizer = optimizer
        elif optimizer is not self.optimizer:
            raise CsTorchError("cbtorch.Session (CSX): one optimizer per Session (MemoryX applies one rule)")
        if not self.waiting:
            return   # the step ran when the model was called
        self.waiting = False
        (args, output), calls = self.first, self.calls
        self.first = self.calls = None
        loss_fn = replay_of(calls, output, self.batch[1], self.loss_tensor, self.model.model, args[0])
        self._start(loss_fn, optimizer, args)
        self._step()

    def closure(self, fn, args) -> None:
        self.pending.append((fn, tuple(args)))
        if not self.waiting:
            self._flush()

    # ------------------------------------------------------------ the job
    def _record(self, compiled, args):
        if self.recorder is not None:
            raise CsTorchError("cbtorch.Session (CSX): the model is called twice before backward()")
        output = compiled.model(*args)
        if not isinstance(output, torch.Tensor):
            raise CsTorchError(f"cbtorch.Session (CSX): the model returns {type(output).__name__}; one tensor "
                               "is supported")
        self.first = (args, output)
        self.recorder = _Recorder()
        self.recorder.__enter__()
        return output

    def _stop_recording(self) -> None:
        recorder, self.recorder = self.recorder, None
        recorder.__exit__(None, None, None)
        self.calls = recorder.calls

    def _start(self, loss_fn, optimizer, args=None) -> None:
        model = self.model.model
        args = args or (self.batch[0],)
        train = self.mode == "train"
        was_training = model.training
        try:
            with torch.enable_grad() if train else torch.no_grad():
                captured = capture_mod.capture(model, tuple(args), self.batch[1].clone(), loss_fn, dropout=False)
        except capture_mod.CaptureError as exc:
            raise CsTorchError(f"cbtorch: {exc}") from None
        finally:
            model.train(was_training)
        if "output" not in captured.program.outputs:
            raise CsTorchError("cbtorch.Session (CSX): the model's output is not one tensor of the program")
        params = {name: model.get_parameter(name) for name in captured.program.params}
        self.run = ClusterRun(captured, model, params, self.backend, optimizer, None, train, self.worker_batch,
                              return_output=True, report_eval=False)
        self.run.on_failure = lambda: setattr(self, "run", None)   # the failed job is stopped already

    def _step(self):
        loss, _applied, output = self.run.step()
        self.loss_value = loss
        out = torch.from_numpy(np.array(output, dtype=np.float32))
        if self.mode == "train":
            out.requires_grad_(True)   # the loop's loss.backward() must find a graph (it does nothing)
        self._flush()
        return out

    def _flush(self) -> None:
        pending, self.pending = self.pending, []
        for fn, args in pending:
            fn(*(self._host(a) for a in args))

    def _host(self, value):
        if value is self.loss_tensor and self.loss_value is not None:
            return torch.tensor(self.loss_value, dtype=torch.float32)   # the CS system's loss
        if isinstance(value, torch.Tensor):
            return value.detach().cpu()
        return value

    def finish(self, exc) -> None:
        """The loop ended (exc: how): the weights come back, every process of the job stops."""
        if self.recorder is not None:
            self._stop_recording()
        try:
            if exc is None and self.waiting:
                raise CsTorchError("cbtorch.Session (CSX): backward() was called but no optimizer.step() "
                                   "followed; the step never ran")
            if exc is None:
                self._flush()
        finally:
            run, self.run = self.run, None
            try:
                if run is not None:
                    run.finish(exc)
            finally:
                if self.writer is not None:
                    self.writer.remove()
                else:
                    path = getattr(getattr(self, "worker_loader", None), "args", [None])[0]
                    if path and os.path.exists(path):
                        os.remove(path)
