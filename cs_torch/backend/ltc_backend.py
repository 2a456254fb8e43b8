"""cstorch.backend.ltc_backend: hooks on the tensors the backend brings to the host.

    handle = register_after_tensor_to_cpu(lambda tensor, name: ...)
    ...
    handle.remove()

A hook is called with each tensor a traced step hands to the host (to a step closure or a
summary), after its values exist, and its name there (the argument's name, and the key or index
within it, joined by '.').
"""
from __future__ import annotations

_hooks: dict[int, object] = {}
_next_id = [0]


class RemovableHandle:
    def __init__(self, key: int):
        self.key = key

    def remove(self) -> None:
        _hooks.pop(self.key, None)


def register_after_tensor_to_cpu(hook) -> RemovableHandle:
    if not callable(hook):
        raise TypeError(f"register_after_tensor_to_cpu: the hook must be callable, got {type(hook).__name__}")
    _next_id[0] += 1
    _hooks[_next_id[0]] = hook
    return RemovableHandle(_next_id[0])


def after_tensor_to_cpu(tensor, name: str) -> None:
    """Call the hooks (cs_torch.tracing calls this for each tensor it brings to the host)."""
    for hook in list(_hooks.values()):
        hook(tensor, name)
