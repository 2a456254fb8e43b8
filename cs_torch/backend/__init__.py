"""`cstorch.backend`: both the function that makes the process's backend, as scripts call it
(`cstorch.backend("CSX", ...)`), and the module of the real API's backend names, as scripts
import from it (`from cerebras.pytorch.backend import current_backend_impl`, `cstorch.backend.use_cs()`).

The real package is one name for both too; here the module is callable, and a call is
cs_torch.backends.backend (where the backend lives).

    ltc_backend.py  register_after_tensor_to_cpu: hooks on the tensors a traced step brings to the host
"""
from __future__ import annotations

import inspect
import sys
import types

from ..backends import Backend, BackendType, backend, current_backend, current_backend_impl, current_torch_device, use_cs

__all__ = ["Backend", "BackendType", "backend", "current_backend", "current_backend_impl", "current_torch_device",
           "get_backend_args", "use_cs"]


def get_backend_args(backend_type) -> dict:
    """The arguments cstorch.backend takes for a backend of that type (every type takes the same here)."""
    if not isinstance(backend_type, BackendType):
        names = [t.value for t in BackendType]
        if str(backend_type).upper() not in names:
            raise ValueError(f"{backend_type} backend not yet supported. Supported backends include: "
                             f"{', '.join(names)}")
    return {name: p for name, p in inspect.signature(backend).parameters.items()
            if name != "backend_type" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return backend(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
