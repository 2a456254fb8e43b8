"""cstorch.experimental: the module the model zoo's trainer imports; what it holds is not emulated.

    listener.py     register_traced_tensor_hook: hooks on the module outputs a captured step names

Any other name (Compression, start_implicit_loop, ...) fails in one line naming it, when used: the
trainer imports this module whatever the run, and uses them only where a params file asks.
"""
from __future__ import annotations

from . import listener

NOT_EMULATED = "compression and implicit autoregressive loops are not emulated"

__all__ = ["listener"]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"cstorch.experimental.{name} is not supported by the emulator: {NOT_EMULATED}")
