"""cstorch.experimental: the real API's experimental names the model zoo uses.

    listener.py       register_traced_tensor_hook: hooks on the module outputs a captured step names;
                      create_listener (2.0/2.1): a tensor listener from the params file
    implicit_loop.py  implicit autoregressive loops: get_loop_iteration_slice; the loops refused as the
                      real CPU backend refuses them (and on the emulated CS system)
    compression.py    Compression: weights marked for an MX format (CPU: float32 as the real; CSX refuses)

Any other name fails in one line naming it, when used.
"""
from __future__ import annotations

from . import listener
from .compression import Compression
from .implicit_loop import (get_loop_iteration_slice, run_implicit_autoregressive_loop, start_implicit_loop,
                            update_implicit_loop)

__all__ = ["Compression", "get_loop_iteration_slice", "listener", "run_implicit_autoregressive_loop",
           "start_implicit_loop", "update_implicit_loop"]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"cstorch.experimental.{name} is not supported by the emulator: not one of its "
                         f"experimental names ({', '.join(__all__)})")
