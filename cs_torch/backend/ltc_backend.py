"""cstorch.backend.ltc_backend: hooks on the tensors the backend brings to the host.

    handle = register_after_tensor_to_cpu(lambda tensor, name: ...)
    ...
    handle.remove()

A hook is called with each tensor a traced step hands to the host (to a step closure or a
summary), after its values exist, and its name there (the argument's name, and the key or index
within it, joined by '.').
"""
from __future__ import annotations

from ..hooks import Hooks, RemovableHandle

_hooks = Hooks("register_after_tensor_to_cpu")


def register_after_tensor_to_cpu(hook) -> RemovableHandle:
    return _hooks.register(hook)


def after_tensor_to_cpu(tensor, name: str) -> None:
    """Call the hooks (cs_torch.tracing calls this for each tensor it brings to the host)."""
    for hook in _hooks:
        hook(tensor, name)
