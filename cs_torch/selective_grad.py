"""cstorch.nn.SelectiveGrad: only some entries of chosen parameters are trained.

    compiled = cstorch.compile(model, backend)
    model.apply(cstorch.nn.SelectiveGrad("*fc*.weight", "outlier"))     # or a function param -> bool mask

(as the real API, a compiled model's `apply` hands the whole model to the object's `apply`, so the
filter sees names from the model's root; `selective_grad.apply(model)` is the same call.)

As the real API: each parameter whose name the filter accepts (a glob, a list of globs or a function
of (name, param)) gets a mask, kept as a persistent buffer `<name>_requires_grad` of its module (so
checkpoints hold it): "outlier" keeps the entries at least 2.25 standard deviations (of the
magnitudes, per output column) from zero, or the mask is the given function's. In every optimizer
update the parameter's gradient is masked, the optimizer's state tensors of the parameter's shape
are zeroed outside the mask, and the entries outside it keep their values: the update runs on the
masked parameter (zeros outside) and the kept values are added back, the real API's arithmetic.
Here the mask acts in cstorch.optim's update (Optimizer._masked_update), on the CPU backend; `p.grad`
itself is left as the backward made it. On CSX the mask goes to MemoryX as a slot of the parameter's
optimizer state (cluster_step.memoryx_slots), and MemoryX's update applies it by the same rule
(cs_runtime/numerics/optim.py masked_update).
"""
from __future__ import annotations

import inspect

import torch

from .utils.param_filter import make_param_filter

OUTLIER_THRESHOLD = 2.25   # the real "outlier" mask: |w| >= 2.25 std(|w|) along the output dimension


def outlier_mask(param: torch.Tensor) -> torch.Tensor:
    magnitude = param.detach().abs()
    return magnitude >= OUTLIER_THRESHOLD * torch.std(magnitude, dim=0, keepdim=True)


_INIT_METHODS = {"outlier": outlier_mask}


def _init_method(init_method):
    if isinstance(init_method, str):
        if init_method not in _INIT_METHODS:
            raise ValueError(f"SelectiveGrad: unknown init_method {init_method!r}; one of {sorted(_INIT_METHODS)} "
                             "or a function param -> bool tensor")
        return _INIT_METHODS[init_method]
    if callable(init_method) and len(inspect.signature(init_method).parameters) == 1:
        return init_method
    raise ValueError(f"SelectiveGrad: init_method must be one of {sorted(_INIT_METHODS)} or a function "
                     f"param -> bool tensor, got {init_method!r}")


class SelectedEntries:
    """A parameter's mask: the buffer of the module that owns the parameter."""

    def __init__(self, module: torch.nn.Module, param_name: str, mask: torch.Tensor):
        self.module, self.buffer_name = module, f"{param_name}_requires_grad"
        module.register_buffer(self.buffer_name, mask, persistent=True)

    @property
    def mask(self) -> torch.Tensor:
        return self.module._buffers[self.buffer_name]


class SelectiveGrad:
    def __init__(self, param_filter, init_method="outlier"):
        self.param_filter = make_param_filter(param_filter)
        self.init_method = _init_method(init_method)

    def apply(self, module: torch.nn.Module) -> None:
        """Masks for the module's parameters (recursively) that the filter accepts and have none yet."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"SelectiveGrad.apply: expected a torch.nn.Module, got {type(module).__name__}")
        for owner_name, owner in module.named_modules():
            for param_name, param in list(owner._parameters.items()):
                name = f"{owner_name}.{param_name}" if owner_name else param_name
                if param is None or getattr(param, "_selective_grad", None) is not None:
                    continue
                if self.param_filter(name, param):
                    mask = self.init_method(param)
                    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != param.shape:
                        raise ValueError(f"SelectiveGrad: the mask of {name} must be a bool tensor of "
                                         f"{tuple(param.shape)}")
                    param._selective_grad = SelectedEntries(owner, param_name, mask)


