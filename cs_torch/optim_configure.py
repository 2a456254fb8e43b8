"""cstorch.optim.configure_param_groups / configure_optimizer / configure_lr_scheduler: the model
zoo's 2.0 and 2.1 training flow builds its optimizer and schedule from the params file's optimizer
section with these.

    groups = cstorch.optim.configure_param_groups(model, params["optimizer"])
    optimizer = cstorch.optim.configure_optimizer(optimizer_type="AdamW", params=groups, **rest)
    scheduler = cstorch.optim.configure_lr_scheduler(optimizer, rest["learning_rate"])

A schedule is read by the params file's own rules (cs_runtime/config.py), so a script and run.py
given the same `learning_rate` follow the same rates.
"""
from __future__ import annotations

import inspect

import torch

from cs_runtime.config import OptimizerConfig, ParamsError, params_from_dict

from .lr_scheduler import LRScheduler
from .nn import CsTorchError

_NORM_MODULES = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._BatchNorm,
                 torch.nn.modules.instancenorm._InstanceNorm)


def configure_param_groups(model: torch.nn.Module, optimizer_params: dict) -> list[dict]:
    """Two groups of the trainable parameters: those decayed by optimizer_params' weight_decay, and
    biases and normalisation layers' parameters at weight decay 0 (as the model zoo never decays them)."""
    if optimizer_params.get("adjust_learning_rate"):
        raise CsTorchError("optim.configure_param_groups: adjust_learning_rate (per-layer learning-rate "
                           "scaling, muP) is not emulated")
    norm_params = {id(p) for m in model.modules() if isinstance(m, _NORM_MODULES) for p in m.parameters()}
    decayed, kept = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (kept if "bias" in name or id(param) in norm_params else decayed).append(param)
    weight_decay = optimizer_params.get("weight_decay", optimizer_params.get("weight_decay_rate", 0.0))
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": kept, "weight_decay": 0.0}]


def _optimizer_classes() -> dict:
    from . import optimizers
    return {"sgd": optimizers.SGD, "adam": optimizers.Adam, "adamw": optimizers.AdamW}


def configure_optimizer(optimizer_type: str, params, **kwargs):
    """The optimizer named `optimizer_type` (SGD, Adam, AdamW) over `params`, given the keys of kwargs
    its constructor takes (the optimizer section's other keys are for other parts of the flow);
    `learning_rate` is its lr when a number (a schedule sets the rate each step)."""
    classes = _optimizer_classes()
    cls = classes.get(str(optimizer_type).lower())
    if cls is None:
        raise CsTorchError(f"optim.configure_optimizer: optimizer_type {optimizer_type!r} is not emulated "
                           "(MemoryX applies SGD, Adam and AdamW)")
    learning_rate = kwargs.pop("learning_rate", None)
    if "weight_decay_rate" in kwargs:
        kwargs.setdefault("weight_decay", kwargs.pop("weight_decay_rate"))
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params", "lr"}
    given = {k: (tuple(v) if k == "betas" else v) for k, v in kwargs.items() if k in accepted}
    lr = float(learning_rate) if isinstance(learning_rate, (int, float, str)) else 0.1   # a schedule sets it
    return cls(params, lr, **given)


class _ParamsSchedule(LRScheduler):
    """A params file's learning_rate (a schedule or a list of them), rate by rate as run.py follows it."""

    def __init__(self, optimizer, config: OptimizerConfig):
        self.config = config
        super().__init__(optimizer)

    def value_at(self, step):
        return self.config.lr_at(step)


def _schedule_entry(entry):
    """A 2.x scheduler name (LinearLR, CosineDecayLR) as the params file spells it (Linear, CosineDecay)."""
    if isinstance(entry, dict) and isinstance(entry.get("scheduler"), str):
        name = entry["scheduler"]
        entry = {**entry, "scheduler": name[:-2] if name.lower().endswith("lr") else name}
    return entry


def configure_lr_scheduler(optimizer, learning_rate, adjust_learning_rate=None):
    """None for a constant rate (a number); else the scheduler of a params file's learning_rate: one
    schedule or a list run one after the other (Linear, CosineDecay, Exponential, Constant)."""
    if adjust_learning_rate:
        raise CsTorchError("optim.configure_lr_scheduler: adjust_learning_rate (muP) is not emulated")
    if learning_rate is None or isinstance(learning_rate, (int, float)):
        return None
    entries = [_schedule_entry(e) for e in learning_rate] if isinstance(learning_rate, list) \
        else _schedule_entry(learning_rate)
    try:
        config = params_from_dict({"optimizer": {"learning_rate": entries}}, "learning_rate").optimizer
    except ParamsError as exc:
        raise CsTorchError(f"optim.configure_lr_scheduler: {exc.lines[0]}") from None
    return _ParamsSchedule(optimizer, config)
