"""`cstorch.backend`: both the function that makes the process's backend, as scripts call it
(`cstorch.backend("CSX", ...)`), and the module of the real API's backend names, as scripts
import from it (`from cerebras.pytorch.backend import current_backend_impl`, `cstorch.backend.use_cs()`).

The real package is one name for both too; here the module is callable, and a call is
cs_torch.backends.backend (where the backend lives).
"""
from __future__ import annotations

import sys
import types

from ..backends import Backend, BackendType, backend, current_backend, current_backend_impl, use_cs

__all__ = ["Backend", "BackendType", "backend", "current_backend", "current_backend_impl", "use_cs"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return backend(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
