"""cstorch.experimental.listener: hooks on the tensors a traced step names.

    handle = register_traced_tensor_hook(lambda tensor, name: ...)
    ...
    handle.remove()

While a step is captured (its first call, cs_torch/tracing.py), each hook is called with every
tensor output of every module of the compiled model, named by the module's path in the model
(`transformer_decoder.layers.0.self_attn`; a module of several outputs adds the index or key,
`.0`, `.logits`). These are the tensors the capture names; a hook sees them once per capture.

create_listener (2.0/2.1) makes a listener from a params file's `experimental.listeners` entry
(`listener_type` summary or norm, the later model zoo's two listeners; `listener_name`;
`tensor_names` globs over those names). A DataExecutor given listeners feeds them every step: on the
CPU backend the step's program hands back the value of each module output a listener selects (the
last value its module's ops compute, cs_torch/engine.py), and each listener writes its summaries to
the executor's writer at the step: `summary` each tensor whole (`listener_name/tensor`, read back with
SummaryReader), `norm` each tensor's 2-norm as a scalar and the norms' total as
`listener_name/__all__`. On CSX the traced tensors stay on the WSEs: a loop given listeners stops in
one line naming them.
"""
from __future__ import annotations

import contextlib
import fnmatch

import numpy as np

from ..hooks import Hooks, RemovableHandle

_hooks = Hooks("register_traced_tensor_hook")


def register_traced_tensor_hook(hook) -> RemovableHandle:
    return _hooks.register(hook)


@contextlib.contextmanager
def naming_tensors(model):
    """Around the captured call of `model`: the hooks see each module's tensor outputs by name."""
    if not _hooks:
        yield
        return
    import torch
    names = {id(module): name for name, module in model.named_modules()}

    def forward_hook(module, args, output):
        name = names.get(id(module))
        if name is not None:
            _call_hooks(output, name or type(module).__name__)

    handle = torch.nn.modules.module.register_module_forward_hook(forward_hook)
    try:
        yield
    finally:
        handle.remove()


def _call_hooks(value, name: str) -> None:
    if hasattr(value, "detach") and hasattr(value, "shape"):
        for hook in _hooks:
            hook(value, name)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _call_hooks(item, f"{name}.{index}")
    elif isinstance(value, dict):
        for key, item in value.items():
            _call_hooks(item, f"{name}.{key}")


# ---------------------------------------------------------------- 2.0/2.1: listeners from the params file
LISTENER_TYPES = ("summary", "norm")   # summarize each tensor named, or its norm (and the norms' total)


class TensorListener:
    """A listener of the params file's `experimental.listeners` (2.0/2.1): the tensors whose traced
    names match one of `tensor_names` (globs), summarized under `listener_name`."""

    def __init__(self, listener_type: str, listener_name: str, tensor_names):
        self.listener_type, self.listener_name = listener_type, listener_name
        self.tensor_names = [tensor_names] if isinstance(tensor_names, str) else list(tensor_names)

    def selects(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.tensor_names)

    def write(self, values: dict, writer, step: int) -> None:
        """This step's summaries of the tensors it selects among `values` ({traced name: ndarray})."""
        chosen = {name: value for name, value in values.items() if self.selects(name)}
        if self.listener_type == "summary":
            for name, value in chosen.items():
                writer.add_tensor(f"{self.listener_name}/{name}", np.asarray(value), step)
            return
        norms = {name: float(np.linalg.norm(np.asarray(value, dtype=np.float32).ravel())) for name, value in
                 chosen.items()}
        for name, norm in norms.items():
            writer.add_scalar(f"{self.listener_name}/{name}", norm, step)
        if norms:   # the total norm: the 2-norm of the tensors' norms (torch's clip_grad_norm_ total)
            writer.add_scalar(f"{self.listener_name}/__all__", float(np.sqrt(sum(n * n for n in norms.values()))),
                              step)


def create_listener(listener_type: str = None, listener_name: str = None, tensor_names=None, **unknown):
    """The listener a params file's entry describes, checked (a DataExecutor given it feeds it each step)."""
    if unknown:
        raise ValueError(f"create_listener: unknown settings {sorted(unknown)} (listener_type, listener_name, "
                         "tensor_names)")
    if listener_type not in LISTENER_TYPES:
        raise ValueError(f"create_listener: listener_type must be one of {LISTENER_TYPES}, got {listener_type!r}")
    if not isinstance(listener_name, str) or not listener_name:
        raise ValueError(f"create_listener: listener_name must be a name, got {listener_name!r}")
    if not tensor_names or not all(isinstance(n, str) for n in
                                   ([tensor_names] if isinstance(tensor_names, str) else tensor_names)):
        raise ValueError(f"create_listener: tensor_names must be a glob or a list of globs, got {tensor_names!r}")
    return TensorListener(listener_type, listener_name, tensor_names)
