"""cstorch.sparse.static (the 2.0/2.1 API the model zoo's flow calls): static weight sparsity.

    sparsity = cstorch.sparse.configure_sparsity_optimizer(
        "static", model.named_parameters(), sparsity=0.75, init_method="random",
        param_name_patterns=[".*linear_layer.weight"])
    sparsity.hook_module(model)
    optimizer = cstorch.sparse.SparsityWrapperOptimizer(optimizer, sparsity)
    # or, the three steps in one: cstorch.sparse.configure_sparsity_wrapper(model, optimizer, "static", ...)

As the real API: each selected parameter gets a mask that keeps (1 - sparsity) of its
entries (init_method "random": a random choice, drawn from torch's generator; "topk":
the largest in magnitude); the parameter is masked before the model runs and its
gradient after the backward, so a masked weight stays 0 and its optimizer state (the
tensors of its shape) stays 0 too. Here the masks are applied where the update is:
the parameters once when the masks are drawn, the gradients before the optimizer's
update (and before a GradScaler's clipping sees them), the parameters and their
optimizer state after it; for elementwise optimizers that is the same arithmetic.
The masks are drawn by initialize_sparsity() (the 2.1 flow calls it after loading
a checkpoint, whose masks are the optimizer's state), or else at the hooked
module's first call, and the parameters are masked then.

Static sparsity only, on the CPU backend: a dynamic algorithm (gmp, set, rigl) or a
CSX run (MemoryX holds dense weights and has no masks) is refused with one line.
"""
from __future__ import annotations

import re

import torch

from ..nn import CsTorchError
from ..optimizers import Optimizer

INIT_METHODS = ("random", "topk")
DYNAMIC_TYPES = ("gmp", "set", "rigl")


def _selected(named_parameters, patterns) -> list[tuple[str, torch.Tensor]]:
    """The parameters whose names match one of the patterns (regular expressions, searched)."""
    if patterns is None:
        raise CsTorchError("sparse: give param_name_patterns (the parameters to sparsify); the emulator does "
                           "not guess the real default's choice")
    if isinstance(patterns, str):
        patterns = [patterns]
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise CsTorchError(f"sparse: param_name_patterns must be a pattern or a list of patterns, got {patterns!r} "
                           "(per-pattern settings are not emulated)")
    compiled = [re.compile(p) for p in patterns]
    chosen = [(name, p) for name, p in named_parameters if any(c.search(name) for c in compiled)]
    if not chosen:
        raise CsTorchError(f"sparse: no parameter matches param_name_patterns {list(patterns)}")
    return chosen


def _mask(param: torch.Tensor, sparsity: float, init_method: str) -> torch.Tensor:
    """A mask keeping round((1 - sparsity) * n) of the parameter's n entries."""
    keep = round((1.0 - sparsity) * param.numel())
    score = torch.rand(param.shape) if init_method == "random" else param.detach().abs()
    mask = torch.zeros(param.numel(), dtype=torch.bool)
    mask[torch.topk(score.flatten(), keep).indices] = True
    return mask.reshape(param.shape)


class BaseSparsityOptimizer:
    """Masks of named parameters, drawn by initialize_sparsity() (or loaded from a checkpoint's state);
    step() updates them (a static pattern never changes)."""

    def __init__(self, params, sparsity: float, init_method: str = "random"):
        if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
            raise CsTorchError(f"sparse: sparsity must be a number in [0, 1), got {sparsity!r}")
        if init_method not in INIT_METHODS:
            raise CsTorchError(f"sparse: init_method must be one of {', '.join(INIT_METHODS)}, got {init_method!r}")
        self.sparsity, self.init_method = float(sparsity), init_method
        self.params = list(params)
        self._masks: dict | None = None

    def initialize_sparsity(self) -> None:
        """Draw the masks unless a checkpoint's were loaded (the 2.1 flow calls this after loading one, so
        `topk` sees the loaded weights), and mask the parameters."""
        if self._masks is None:
            with torch.no_grad():
                self._masks = {p: _mask(p, self.sparsity, self.init_method) for _, p in self.params}
        self.apply_sparsity()

    @property
    def masks(self) -> dict:
        if self._masks is None:
            self.initialize_sparsity()
        return self._masks

    def apply_sparsity(self) -> None:
        """Zero every masked entry of the parameters."""
        with torch.no_grad():
            for p, mask in self.masks.items():
                p.mul_(mask)

    def hook_module(self, module: torch.nn.Module) -> None:
        """The module computes with the sparse parameters from its next call on: the masks are drawn then
        if initialize_sparsity() has not been called (the wrapper keeps the parameters masked after every
        update, so nothing else is needed per call)."""
        owned = {id(p) for p in module.parameters()}
        if not all(id(p) in owned for _, p in self.params):
            raise CsTorchError("sparse.hook_module: a sparsified parameter is not the module's")
        module.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module, args) -> None:
        if self._masks is None:
            self.initialize_sparsity()

    def mask_gradients(self, grads: dict) -> dict:
        """{parameter: ndarray} with the masked entries of the sparsified parameters' gradients zeroed."""
        return {p: (g * self.masks[p].numpy() if p in self.masks else g) for p, g in grads.items()}

    def mask_state(self, state: dict) -> None:
        """After an update: the parameters, and each optimizer state tensor of a parameter's shape, masked."""
        self.apply_sparsity()
        with torch.no_grad():
            for p, mask in self.masks.items():
                for value in state.get(p, {}).values():
                    if isinstance(value, torch.Tensor) and value.shape == mask.shape:
                        value.mul_(mask)

    def step(self) -> None:
        """A static pattern does not change."""

    def state_dict(self) -> dict:
        return {"sparsity": self.sparsity, "init_method": self.init_method,
                "masks": {name: self.masks[p].clone() for name, p in self.params}}

    def load_state_dict(self, state: dict) -> None:
        masks = state.get("masks", {})
        for name, p in self.params:
            if name not in masks or tuple(masks[name].shape) != tuple(p.shape):
                raise CsTorchError(f"sparse.load_state_dict: no mask of {tuple(p.shape)} for {name}")
        self._masks = {p: masks[name].to(torch.bool).clone() for name, p in self.params}


class StaticSparsityOptimizer(BaseSparsityOptimizer):
    """A sparsity pattern chosen at the start and kept for the whole run."""


class SparsityWrapperOptimizer(Optimizer):
    """The model's optimizer with sparsity applied: the gradients masked before its update, the
    parameters and its state after; in a traced step, recorded and applied as the optimizer is."""

    cluster_refusal = ("weight sparsity is not emulated on CSX (MemoryX holds dense weights, without masks); "
                       "use backend('CPU')")

    def __init__(self, optimizer, sparsity_optimizer: BaseSparsityOptimizer):
        if not isinstance(optimizer, Optimizer):
            raise CsTorchError(f"sparse.SparsityWrapperOptimizer: wraps a cstorch.optim optimizer, got "
                               f"{type(optimizer).__name__}")
        self.optimizer, self.sparsity_optimizer = optimizer, sparsity_optimizer
        # One set of groups and state with the wrapped optimizer: schedulers set its rates.
        self.defaults, self.param_groups, self.state = optimizer.defaults, optimizer.param_groups, optimizer.state

    def mask_gradients(self, grads: dict) -> dict:
        return self.sparsity_optimizer.mask_gradients(grads)

    def apply(self, grads: dict) -> None:
        self.optimizer.apply(self.mask_gradients(grads))
        self.sparsity_optimizer.mask_state(self.optimizer.state)
        self.sparsity_optimizer.step()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "sparsity": self.sparsity_optimizer.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.state = self.optimizer.state
        self.sparsity_optimizer.load_state_dict(state_dict["sparsity"])


def configure_sparsity_optimizer(sparsity_type: str, params, sparsity: float, init_method: str = "random",
                                 param_name_patterns=None, **kwargs) -> BaseSparsityOptimizer:
    """A sparsity optimizer from the params file's `sparsity` section (its `type` passed apart)."""
    if sparsity_type in DYNAMIC_TYPES:
        raise CsTorchError(f"sparse: dynamic sparsity ({sparsity_type}) is not emulated; static sparsity is")
    if sparsity_type != "static":
        raise CsTorchError(f"sparse: sparsity type must be 'static' (or {', '.join(DYNAMIC_TYPES)}, not emulated), "
                           f"got {sparsity_type!r}")
    if kwargs:
        raise CsTorchError(f"sparse: static sparsity takes no {', '.join(sorted(kwargs))}")
    return StaticSparsityOptimizer(_selected(params, param_name_patterns), sparsity, init_method)


def configure_sparsity_wrapper(model: torch.nn.Module, optimizer, sparsity_type: str, **kwargs):
    """configure_sparsity_optimizer on the model's parameters, hook_module, and the wrapped optimizer."""
    sparsity_optimizer = configure_sparsity_optimizer(sparsity_type, model.named_parameters(), **kwargs)
    sparsity_optimizer.hook_module(model)
    return SparsityWrapperOptimizer(optimizer, sparsity_optimizer)
