"""cstorch.amp: GradScaler with dynamic loss scaling, and the half dtype setting.

    cstorch.amp.set_half_dtype("bfloat16")     # or torch.bfloat16, "float16", "cbfloat16";
    cstorch.amp.use_bfloat16(True)             # the 1.x-style spelling

As in the real API, the half dtype is which 16-bit format mixed precision
uses (float16 unless set); it does not switch mixed precision on. A backend
made with `mixed_precision=True`, or `enable_mixed_precision()` (the 2.3+
model zoo trainer calls it for every CSX run), trains programs in mixed
precision in that format (cs_runtime/numerics/mixed_ops.py: the matmul-like ops round their
operands as the CS system's 16-bit matmuls do; master weights stay float32):
on CSX, where the weights also stream in 16 bits, and on the CPU backend,
which runs the same program in the same format (the reference for the CSX
numbers). Otherwise programs run in float32, on CSX too: the real CS system
trains only in mixed precision, the emulator in float32 unless asked, so that
a run's numbers are torch eager's (the model zoo's 2.1 flow sets the half
dtype on every run and passes `mixed_precision` to its CPU backend only).

`CS_EMULATOR_FLOAT32=1` (an emulator-only switch, no part of the real API)
keeps every program in float32 even where the script enables mixed precision:
the 2.3+ trainer enables it for every CSX run whatever its params say, and
with the switch its CSX runs can be held to torch eager's float32 numbers.
The first time it overrides a request it says so in one line.

    grad_scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    ...
    grad_scaler.scale(loss).backward()
    grad_scaler.unscale_(optimizer)
    grad_scaler.step(optimizer)      # skipped when a gradient is inf or nan
    grad_scaler.update()

The loss scale seeds the backward pass (so every gradient is scaled), the
gradients are divided by it before the update, and a step whose gradients
are not finite is skipped and halves the scale; after steps_per_increase
good steps it doubles, between min_loss_scale and max_loss_scale.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from cs_runtime import env

from .backends import note
from .nn import CsTorchError
from .recording import probing, replaying

HALF_DTYPES = ("float16", "bfloat16", "cbfloat16")
_half = {"dtype": "float16", "enabled": False}   # enabled: enable_mixed_precision's
_overridden = []   # the switch's line, once it was said


def set_half_dtype(dtype):
    """The 16-bit dtype mixed precision uses (mixed_precision() says whether it is on); returns the
    torch dtype a model uses for it (cbfloat16 has none of its own: float16 stands in, as in cstorch)."""
    name = str(dtype).replace("torch.", "")
    if name not in HALF_DTYPES:
        raise CsTorchError(f"amp.set_half_dtype: expected one of {', '.join(HALF_DTYPES)}, got {dtype!r}")
    _half.update(dtype=name)
    return _torch_dtype(name)


def enable_mixed_precision(enabled: bool = True) -> None:
    """Turn mixed precision on (in the half dtype set, float16 by default) or off (float32)."""
    if not isinstance(enabled, bool):
        raise CsTorchError(f"amp.enable_mixed_precision: expected True or False, got {enabled!r}")
    _half["enabled"] = enabled


def mixed_precision() -> bool:
    """Whether mixed precision is on: enable_mixed_precision() turned it on, or the backend was
    made with mixed_precision=True."""
    from .backends import _current
    asked = _half["enabled"] or getattr(_current, "mixed_precision", False)
    if asked and env.EMULATOR_FLOAT32.get():
        if not _overridden:
            _overridden.append(True)
            note(f"{env.EMULATOR_FLOAT32.name}=1: mixed precision was enabled, the emulator trains in float32 "
                 "(an emulator-only switch, not part of the real API)")
        return False
    return asked


def get_floating_point_dtype():
    """The dtype a model's floating-point inputs take: the half dtype under mixed precision, else
    float32 (a torch dtype)."""
    return get_half_dtype() if mixed_precision() else _torch_dtype("float32")


def get_floating_point_dtype_str() -> str:
    return _half["dtype"] if mixed_precision() else "float32"


def is_cbfloat16_tensor(tensor) -> bool:
    """Whether a tensor holds cbfloat16 values: never here (float16 tensors stand in for cbfloat16 on the
    host, and a program's 16-bit rounding happens inside it)."""
    return False


def use_bfloat16(enabled: bool):
    """bfloat16 (True) or float16 (False) as the half dtype."""
    return set_half_dtype("bfloat16" if enabled else "float16")


def _torch_dtype(name: str):
    """The torch dtype of a half dtype's name (float16 stands in for cbfloat16); the name without torch."""
    try:
        import torch
    except ImportError:     # the ModelSpec API runs without torch
        return name
    return getattr(torch, "float16" if name == "cbfloat16" else name)


def get_half_dtype():
    """The 16-bit dtype models use, as a torch dtype (the real API's; float16 stands in for cbfloat16)."""
    return _torch_dtype(_half["dtype"])


def get_half_dtype_str() -> str:
    """The 16-bit dtype's name: float16, bfloat16 or cbfloat16."""
    return _half["dtype"]


@contextlib.contextmanager
def autocast(dtype=None):
    """The real API's autocast has no effect on CSX, whose backend runs in the half dtype set_half_dtype set;
    every backend here runs programs as CSX does (to the same bits), so it has none on either."""
    yield None


def precision() -> str:
    """The format compiled programs run in: the half dtype under mixed precision, else float32."""
    return _half["dtype"] if mixed_precision() else "float32"


class GradScaler:
    # The real API's defaults: no scaling (loss_scale 1.0); dynamic scaling starts at, and is capped by,
    # 2**15, or 2**31 when the half dtype is cbfloat16; it doubles after 2000 good steps, floor 2**-14.
    def __init__(self, loss_scale=None, init_scale: float | None = None, steps_per_increase: int | None = None,
                 min_loss_scale: float | None = None, max_loss_scale: float | None = None,
                 overflow_tolerance: float = 0.0, max_gradient_norm: float | None = None):
        largest = 2.0 ** 31 if get_half_dtype_str() == "cbfloat16" else 2.0 ** 15
        loss_scale = 1.0 if loss_scale is None else loss_scale
        init_scale = largest if init_scale is None else init_scale
        max_loss_scale = largest if max_loss_scale is None else max_loss_scale
        steps_per_increase = 2000 if steps_per_increase is None else steps_per_increase
        min_loss_scale = 2.0 ** -14 if min_loss_scale is None else min_loss_scale
        if loss_scale != "dynamic" and not (isinstance(loss_scale, (int, float)) and loss_scale > 0):
            raise CsTorchError(f"GradScaler: loss_scale must be 'dynamic' or a positive number, got {loss_scale!r}")
        if overflow_tolerance:
            note("GradScaler: overflow_tolerance is not honoured; every overflow skips its step")
        self.dynamic = loss_scale == "dynamic"
        self.scale_ = float(min(init_scale, max_loss_scale) if self.dynamic else loss_scale)
        self.steps_per_increase = int(steps_per_increase)
        self.min_loss_scale, self.max_loss_scale = float(min_loss_scale), float(max_loss_scale)
        self.max_gradient_norm = max_gradient_norm
        self.good_steps = 0
        self.skipped_steps = 0
        self._found_inf = False

    def scale_value(self) -> float:
        return self.scale_

    # ------------------------------------------------------------ the calls a step makes
    def scale(self, loss):
        if probing() is not None or replaying() is not None:
            return loss    # the scale seeds the compiled backward instead
        return loss * self.scale_

    def unscale_(self, optimizer) -> None:
        """Inside a traced step the gradients are unscaled by step(); eagerly, here."""
        if probing() is not None or replaying() is not None:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(self.scale_)
        optimizer._cs_unscaled = True

    def step(self, optimizer) -> None:
        probe = probing()
        if probe is not None:
            probe.record("scaler_step", self, optimizer)
            return
        if replaying() is not None:
            replaying().updated = True   # as optimizer.step() in a rerun
            return
        grads = {p: p.grad.detach().numpy() for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None}
        if not getattr(optimizer, "_cs_unscaled", False):
            grads = {p: g / np.float32(self.scale_) for p, g in grads.items()}
        optimizer._cs_unscaled = False
        self._found_inf = self._apply(optimizer, grads, unscale=False)

    def update(self) -> None:
        probe = probing()
        if probe is not None:
            probe.record("scaler_update", self)
            return
        if replaying() is not None:
            return
        self.update_with(self._found_inf)

    # ------------------------------------------------------------ what the engine calls
    def step_with(self, optimizer, grads: dict) -> bool:
        """Unscale the compiled step's gradients and update unless one is not finite: True if skipped."""
        return self._apply(optimizer, grads, unscale=True)

    def _apply(self, optimizer, grads: dict, unscale: bool) -> bool:
        if hasattr(optimizer, "mask_gradients"):   # sparsity masks the gradients before they are clipped
            grads = optimizer.mask_gradients(grads)
        with np.errstate(over="ignore", invalid="ignore"):   # an overflow is what this looks for
            if unscale:
                grads = {p: (g.astype(np.float64) / self.scale_).astype(np.float32) for p, g in grads.items()}
            finite = all(np.isfinite(g).all() for g in grads.values())
        if not finite:
            self.skipped_steps += 1
            return True
        if self.max_gradient_norm:
            norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
            if norm > self.max_gradient_norm:
                factor = np.float32(self.max_gradient_norm / (norm + 1e-6))
                grads = {p: g * factor for p, g in grads.items()}
        optimizer.apply(grads)
        return False

    def update_with(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.scale_ = max(self.scale_ / 2, self.min_loss_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.steps_per_increase:
            self.scale_ = min(self.scale_ * 2, self.max_loss_scale)
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale_, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale_, self.good_steps = float(state["scale"]), int(state["good_steps"])


def optimizer_step(loss, optimizer, grad_scaler: GradScaler, max_gradient_norm: float | None = None,
                   max_gradient_value: float | None = None) -> None:
    """The real API's one call for a step with loss scaling: backward of the scaled loss, then the
    scaler's step (unscale, clip the global norm to max_gradient_norm, skip a step that overflowed)
    and its update."""
    import torch
    if not isinstance(loss, torch.Tensor):
        raise CsTorchError(f"amp.optimizer_step: expected the loss tensor, got {type(loss).__name__}")
    if not isinstance(grad_scaler, GradScaler):
        raise CsTorchError(f"amp.optimizer_step: expected a cstorch.amp.GradScaler, got {type(grad_scaler).__name__}")
    if isinstance(optimizer, (list, tuple)):
        raise CsTorchError("amp.optimizer_step: one optimizer a step here; give one")
    if max_gradient_value is not None:
        raise CsTorchError("amp.optimizer_step: max_gradient_value (clipping each gradient element) is not "
                           "emulated; use max_gradient_norm")
    if max_gradient_norm is not None:
        if grad_scaler.max_gradient_norm not in (None, max_gradient_norm):
            raise CsTorchError(f"amp.optimizer_step: max_gradient_norm {max_gradient_norm} contradicts the "
                               f"GradScaler's {grad_scaler.max_gradient_norm}")
        grad_scaler.max_gradient_norm = max_gradient_norm
    grad_scaler.scale(loss).backward()
    grad_scaler.step(optimizer)
    grad_scaler.update()
