"""User hooks kept in registration order, each removed by the handle its registration returns
(torch's RemovableHandle pattern): the backend's and the listeners' hooks."""
from __future__ import annotations


class RemovableHandle:
    def __init__(self, hooks: "Hooks", key: int):
        self.hooks, self.key = hooks, key

    def remove(self) -> None:
        self.hooks.by_key.pop(self.key, None)


class Hooks:
    def __init__(self, registrar: str):
        self.registrar = registrar          # the API function that registers them, for its error
        self.by_key: dict[int, object] = {}
        self.next_key = 0

    def register(self, hook) -> RemovableHandle:
        if not callable(hook):
            raise TypeError(f"{self.registrar}: the hook must be callable, got {type(hook).__name__}")
        self.next_key += 1
        self.by_key[self.next_key] = hook
        return RemovableHandle(self, self.next_key)

    def __iter__(self):
        return iter(list(self.by_key.values()))   # a copy: a hook may remove itself

    def __bool__(self) -> bool:
        return bool(self.by_key)
