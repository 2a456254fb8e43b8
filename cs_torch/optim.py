"""Optimizers: the learning rules MemoryX applies (cs_runtime/numerics/optim.py), PyTorch-style names.

    optimizer = cs_torch.optim.SGD(lr=0.01, momentum=0.9)
    optimizer = cs_torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

Each becomes the `optimizer` section of a params.yaml, so the CS system and
the CPU path apply exactly the rule a csrun_wse run with those params does.

Given the parameters of a torch.nn.Module (the 2.x API), the same names
make the optimizers of cs_torch/optimizers.py instead: torch's signatures
(positional lr), nesterov, state_dict(); `optim.lr_scheduler` holds the
learning-rate schedules.
"""
from __future__ import annotations

import sys

from . import lr_scheduler, scheduler, weight_decay_scheduler  # noqa: F401 (cstorch.optim.<name>)
from . import optim_params as optimizer  # noqa: F401 (cstorch.optim.optimizer.ParamsT)
from .nn import CsTorchError


CPU_ONLY_OPTIMIZERS = ("Adagrad", "RMSprop", "Adamax", "Adadelta", "Lion", "RAdam", "ASGD", "Rprop")


def __getattr__(name: str):
    # The model zoo flow's helpers (they need torch): loaded when asked for.
    if name in ("configure_param_groups", "configure_optimizer", "configure_lr_scheduler"):
        from . import optim_configure
        return getattr(optim_configure, name)
    if name in CPU_ONLY_OPTIMIZERS:   # torch modules' optimizers MemoryX has no rule for (cs_torch/optimizers.py)
        from . import optimizers
        return getattr(optimizers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _torch_params(params):
    """params as a list when they are torch tensors or param-group dicts (the 2.x API), else None."""
    torch = sys.modules.get("torch")
    if torch is None or params is None or isinstance(params, (str, bytes)):
        return None
    items = list(params) if not isinstance(params, list) else params
    if items and all(isinstance(p, (torch.Tensor, dict)) for p in items):
        return items
    return None


class _Dispatch:
    """SGD(model.parameters(), 0.01): a torch module's optimizer (cs_torch/optimizers.py)."""

    def __new__(cls, params=None, *args, **kwargs):
        items = _torch_params(params)
        if items is not None:
            from . import optimizers
            return getattr(optimizers, cls.__name__)(items, *args, **kwargs)
        return super().__new__(cls)


class Optimizer:
    kind = ""

    def __init__(self, params=None, *, lr: float, weight_decay: float = 0.0,
                 max_gradient_norm: float | None = None, **rule):
        # `params` (model.parameters()) is accepted for PyTorch's spelling: every weight is trained.
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise CsTorchError(f"{type(self).__name__}: lr must be a positive number, got {lr!r}")
        self.section = {"optimizer_type": self.kind, "learning_rate": float(lr),
                        "weight_decay": float(weight_decay), "max_gradient_norm": max_gradient_norm,
                        # torch's optimizers decay every parameter they are given
                        "exclude_bias_and_norm": False, **rule}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.section})"


class SGD(_Dispatch, Optimizer):
    kind = "sgd"

    def __init__(self, params=None, *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, dampening: float = 0.0, max_gradient_norm: float | None = None):
        if nesterov and (momentum <= 0 or dampening):
            raise CsTorchError("SGD: nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, lr=lr, weight_decay=weight_decay, max_gradient_norm=max_gradient_norm,
                         momentum=float(momentum), nesterov=bool(nesterov), dampening=float(dampening))


class Adam(_Dispatch, Optimizer):
    kind = "adam"

    # eps 1e-6: the real cstorch.optim.Adam's default (torch.optim.Adam's is 1e-8), as optimizers.Adam.
    def __init__(self, params=None, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, max_gradient_norm: float | None = None):
        super().__init__(params, lr=lr, weight_decay=weight_decay, max_gradient_norm=max_gradient_norm,
                         betas=[float(b) for b in betas], eps=float(eps))


class AdamW(Adam):
    kind = "adamw"

    # The real cstorch.optim.AdamW's defaults: eps 1e-6, weight_decay 0 (torch.optim.AdamW's: 1e-8, 0.01).
    def __init__(self, params=None, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, max_gradient_norm: float | None = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         max_gradient_norm=max_gradient_norm)



def document_signatures() -> None:
    """Give SGD, Adam and AdamW the signatures the real API documents, for code that reads them (the
    model zoo builds its params schema from them): those of the torch modules' optimizers they make
    (cs_torch/optimizers.py), the parameters first and typed ParamsT. A call may still use the
    ModelSpec spelling (SGD(lr=0.01)). Needs torch: called where torch is imported (cerebras.pytorch)."""
    import inspect
    from . import optimizers
    for cls in (SGD, Adam, AdamW):
        signature = inspect.signature(getattr(optimizers, cls.__name__).__init__, eval_str=True)
        parameters = [p.replace(annotation=optimizer.ParamsT) if p.name == "params" else p
                      for p in signature.parameters.values()]
        cls.__init__.__signature__ = signature.replace(parameters=parameters)
