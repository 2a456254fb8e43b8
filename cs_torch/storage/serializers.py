"""cstorch.storage.serializers: the real API's switches for how deferred tensors are saved and loaded.

    with cstorch.storage.serializers.use_external_link(True):
        cstorch.save(state, path)
    if cstorch.storage.serializers.cache_deferred_tensors: ...

On the real system a tensor may be deferred: its value stays in a file (or on the appliance) until
used. `use_external_link` (default off) saves such a tensor as an HDF5 link to its file instead of
its values; `cache_deferred_tensors` (default on) keeps a deferred tensor's values once read. Every
tensor here is a host tensor with its values at hand, none deferred, so both switches hold their
value (read as booleans, set for a `with` block) and a checkpoint always holds the values, which
is what the real API writes for a tensor that is not deferred.
"""
from __future__ import annotations

import contextlib


class BooleanSwitch:
    """A flag read as a bool; `with flag(value):` sets it for the block and restores it after."""

    def __init__(self, name: str, default: bool):
        self.name, self.value = name, default

    def __bool__(self) -> bool:
        return self.value

    @contextlib.contextmanager
    def __call__(self, value: bool):
        if not isinstance(value, bool):
            raise TypeError(f"storage.serializers.{self.name}: expected True or False, got {value!r}")
        before, self.value = self.value, value
        try:
            yield self
        finally:
            self.value = before

    def __repr__(self) -> str:
        return f"{self.name}={self.value}"


use_external_link = BooleanSwitch("use_external_link", default=False)
cache_deferred_tensors = BooleanSwitch("cache_deferred_tensors", default=True)

__all__ = ["cache_deferred_tensors", "use_external_link"]
