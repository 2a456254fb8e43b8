"""cstorch.experimental.listener: hooks on the tensors a traced step names.

    handle = register_traced_tensor_hook(lambda tensor, name: ...)
    ...
    handle.remove()

While a step is captured (its first call, cs_torch/tracing.py), each hook is called with every
tensor output of every module of the compiled model, named by the module's path in the model
(`transformer_decoder.layers.0.self_attn`; a module of several outputs adds the index or key,
`.0`, `.logits`). These are the tensors the capture names; a hook sees them once per capture.
"""
from __future__ import annotations

import contextlib

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
