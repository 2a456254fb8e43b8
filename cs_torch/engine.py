"""The step engine of the 2.x API: one captured program, run on the one
executor (cs_runtime/numerics/executor.py) in weight-streaming order (unit
by unit, forward then backward), with the weights kept in the torch
module's own parameter storage.

    engine = StepEngine(captured, model)
    loss, grads, _ = engine.train(inputs, seed=loss_scale)   # grads: {torch.nn.Parameter: ndarray}
    loss = engine.evaluate(inputs)

The parameters' storage is shared with numpy (`p.detach().numpy()`), so an
optimizer's in-place update is the torch module's update: `model.state_dict()`
and cstorch.save see the trained weights with no copy back.

With a half dtype set (cstorch.amp.set_half_dtype) the program runs in that
format, as on CSX: the gradients come back as its values.
"""
from __future__ import annotations

import numpy as np
import torch

from cs_runtime.numerics.executor import forward_backward, rounded, run_nodes

from . import amp
from .capture import CONTEXT
from .nn import CsTorchError


class StepEngine:
    def __init__(self, captured, model: torch.nn.Module):
        self.captured = captured
        self.program = captured.program
        self.params: dict[str, torch.nn.Parameter] = {}
        for name in self.program.params:
            try:
                p = model.get_parameter(name)
            except AttributeError:
                raise CsTorchError(f"trace: the captured parameter {name!r} is not a parameter of the model") from None
            if p.dtype != torch.float32:
                raise CsTorchError(f"trace: parameter {name} is {p.dtype}; the CS system trains float32 master "
                                   "weights (use cstorch.amp for half precision)")
            self.params[name] = p
        self.loss_name = self.program.outputs["loss"]
        self.steps = 0   # training steps run: the step number dropout masks are drawn for (0-based, as a job's)

    def weights(self) -> dict[str, np.ndarray]:
        return {name: p.detach().numpy() for name, p in self.params.items()}

    def feed(self, arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
        inputs = {}
        for name, array in zip(self.captured.input_names, arrays):
            want = self.program.inputs[name]
            if tuple(array.shape) != tuple(want.shape):
                raise CsTorchError(f"trace: {name} has shape {tuple(array.shape)}, but the step was compiled for "
                                   f"{tuple(want.shape)} (one shape per traced step: use drop_last=True)")
            inputs[name] = np.ascontiguousarray(array, dtype=want.dtype)
        return inputs

    def with_context(self, inputs: dict, train: bool) -> dict:
        """The inputs, and the run's context where the program draws dropout masks: the same
        (seed, step, rows) a job's WSEs feed it, so the CPU path and CSX drop the same units."""
        if CONTEXT in self.program.inputs:
            from . import session as session_mod
            rows = int(inputs[self.captured.input_names[0]].shape[0])
            inputs[CONTEXT] = np.array([session_mod._seed, self.steps if train else 0, 0, rows, rows, int(train)],
                                       dtype=np.int64)
        return inputs

    def train(self, arrays, seed: float = 1.0, output: bool = False):
        """(loss, {parameter: gradient}, the model's output when `output`, else None)."""
        live = {} if output else None
        inputs = self.with_context(self.feed(arrays), train=True)
        loss, grads = forward_backward(self.captured.units, self.weights(), inputs,
                                       self.program.consts, self.loss_name, seed, amp.precision(), live_out=live)
        self.steps += 1
        return loss, {self.params[name]: g for name, g in grads.items()}, self._output(live)

    def evaluate(self, arrays, output: bool = False):
        """The loss; with `output`, (loss, the model's output)."""
        fmt = amp.precision()
        feed = self.with_context(self.feed(arrays), train=False)
        env = {**rounded(self.weights(), fmt), **rounded(feed, fmt), **self.program.consts}
        env = run_nodes(self.program.nodes, env, fmt=fmt)
        loss = float(env[self.loss_name])
        return (loss, self._output(env)) if output else loss

    def module_outputs(self, arrays, values: dict[str, str], train: bool) -> dict[str, np.ndarray]:
        """{name: this step's value of the program value `values[name]`}: the program's forward on the
        step's weights and inputs, drawing the step's dropout masks (call it before train())."""
        fmt = amp.precision()
        feed = self.with_context(self.feed(arrays), train=train)
        env = {**rounded(self.weights(), fmt), **rounded(feed, fmt), **self.program.consts}
        env = run_nodes(self.program.nodes, env, fmt=fmt)
        return {name: np.array(env[value]) for name, value in values.items()}

    def _output(self, env):
        return None if env is None else np.array(env[self.program.outputs["output"]])


def module_output_value(program, path: str) -> str | None:
    """The program value that is module `path`'s output: the last value its ops (its own or its
    submodules') compute; for the root module, the model's output. None when its ops are none."""
    if not path:
        return program.outputs.get("output")
    inside = path + "."
    last = None
    for node in program.nodes:
        if node.module == path or node.module.startswith(inside):
            last = node.outputs[0]
    return last
