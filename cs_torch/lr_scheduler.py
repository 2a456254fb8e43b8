"""cstorch.optim.lr_scheduler: learning rates as a function of the step, the documented names.

    scheduler = cstorch.optim.lr_scheduler.SequentialLR(optimizer, [
        cstorch.optim.lr_scheduler.LinearLR(optimizer, initial_learning_rate=0.0,
                                            end_learning_rate=1e-3, total_iters=100),
        cstorch.optim.lr_scheduler.CosineDecayLR(optimizer, initial_learning_rate=1e-3,
                                                 end_learning_rate=1e-5, total_iters=900),
    ], milestones=[100])

A scheduler sets every param group's "lr" to lr_at(k) for step k: at
construction k = 0, and each `step()` (after optimizer.step(), as in torch)
moves to the next. It works with torch.optim optimizers as well (it only
writes param_groups). Inside a traced step `step()` is recorded, and then
done after each step's update.
"""
from __future__ import annotations

import math

from .nn import CsTorchError
from .recording import probing, replaying


def _positive_int(name, value, cls):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CsTorchError(f"{cls}: {name} must be a positive integer, got {value!r}")
    return value


class LRScheduler:
    def __init__(self, optimizer, total_iters: int | None = None):
        self.optimizer = optimizer
        self.total_iters = total_iters
        self.last_epoch = 0
        if optimizer is not None:
            self._set(self.lr_at(0))

    def lr_at(self, step: int) -> float:
        raise NotImplementedError

    def _set(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._last_lr = [lr for _ in self.optimizer.param_groups]

    def step(self) -> None:
        probe = probing()
        if probe is not None:
            probe.record("sched_step", self)
            return
        if replaying() is not None:
            return
        self.last_epoch += 1
        self._set(self.lr_at(self.last_epoch))

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.last_epoch = int(state["last_epoch"])
        self._set(self.lr_at(self.last_epoch))


class ConstantLR(LRScheduler):
    def __init__(self, optimizer, learning_rate: float, total_iters: int | None = None):
        self.learning_rate = float(learning_rate)
        super().__init__(optimizer, total_iters)

    def lr_at(self, step):
        return self.learning_rate


class PolynomialLR(LRScheduler):
    """end + (initial - end) * (1 - step / total_iters) ** power, then end. `cycle` is accepted as the real
    API takes it; there, as here, the value from total_iters on is end_learning_rate, so it changes nothing."""

    def __init__(self, optimizer, initial_learning_rate: float, end_learning_rate: float, total_iters: int,
                 power: float = 1.0, cycle: bool = False):
        self.initial, self.end, self.power, self.cycle = (float(initial_learning_rate), float(end_learning_rate),
                                                          float(power), bool(cycle))
        super().__init__(optimizer, _positive_int("total_iters", total_iters, type(self).__name__))

    def lr_at(self, step):
        if step >= self.total_iters:
            return self.end
        if self.power == 1.0:   # the linear form, as LinearLR always computed it
            return self.initial + (self.end - self.initial) * step / self.total_iters
        return self.end + (self.initial - self.end) * (1 - step / self.total_iters) ** self.power


class LinearLR(PolynomialLR):
    def __init__(self, optimizer, initial_learning_rate: float, end_learning_rate: float, total_iters: int,
                 cycle: bool = False):
        super().__init__(optimizer, initial_learning_rate, end_learning_rate, total_iters, 1.0, cycle)


class ExponentialLR(LRScheduler):
    def __init__(self, optimizer, initial_learning_rate: float, total_iters: int, decay_rate: float,
                 staircase: bool = False):
        self.initial, self.decay_rate, self.staircase = float(initial_learning_rate), float(decay_rate), staircase
        super().__init__(optimizer, _positive_int("total_iters", total_iters, "ExponentialLR"))

    def lr_at(self, step):
        power = step / self.total_iters
        return self.initial * self.decay_rate ** (math.floor(power) if self.staircase else power)


class CosineDecayLR(LRScheduler):
    def __init__(self, optimizer, initial_learning_rate: float, end_learning_rate: float, total_iters: int):
        self.initial, self.end = float(initial_learning_rate), float(end_learning_rate)
        super().__init__(optimizer, _positive_int("total_iters", total_iters, "CosineDecayLR"))

    def lr_at(self, step):
        t = min(step, self.total_iters) / self.total_iters
        return self.end + (self.initial - self.end) * 0.5 * (1 + math.cos(math.pi * t))


class SequentialLR(LRScheduler):
    def __init__(self, optimizer, schedulers, milestones):
        schedulers, milestones = list(schedulers), [int(m) for m in milestones]
        if len(milestones) != len(schedulers) - 1 or milestones != sorted(milestones):
            raise CsTorchError(f"SequentialLR: {len(schedulers)} schedulers need {len(schedulers) - 1} "
                               f"increasing milestones, got {milestones}")
        self.schedulers, self.milestones = schedulers, milestones
        super().__init__(optimizer)

    def lr_at(self, step):
        start = 0
        for scheduler, milestone in zip(self.schedulers, self.milestones):
            if step < milestone:
                return scheduler.lr_at(step - start)
            start = milestone
        return self.schedulers[-1].lr_at(step - start)


class InverseExponentialTimeDecayLR(LRScheduler):
    """initial / (1 + decay_rate * step ** step_exponent / total_iters) (the quotient floored with staircase)."""

    def __init__(self, optimizer, initial_learning_rate: float, step_exponent: int, total_iters: int,
                 decay_rate: float, staircase: bool = False):
        self.initial, self.step_exponent = float(initial_learning_rate), step_exponent
        self.decay_rate, self.staircase = float(decay_rate), bool(staircase)
        super().__init__(optimizer, _positive_int("total_iters", total_iters, "InverseExponentialTimeDecayLR"))

    def lr_at(self, step):
        alpha = float(step) ** self.step_exponent / self.total_iters
        return self.initial / (1.0 + self.decay_rate * (math.floor(alpha) if self.staircase else alpha))


class InverseSquareRootDecayLR(LRScheduler):
    """initial * scale / sqrt(max(step, warmup_steps))."""

    def __init__(self, optimizer, initial_learning_rate: float = 1.0, scale: float = 1.0,
                 warmup_steps: int = 1.0):
        self.initial, self.scale, self.warmup_steps = float(initial_learning_rate), float(scale), warmup_steps
        if not warmup_steps > 0:
            raise CsTorchError(f"InverseSquareRootDecayLR: warmup_steps must be positive, got {warmup_steps!r}")
        super().__init__(optimizer)

    def lr_at(self, step):
        return self.initial * self.scale / math.sqrt(max(step, self.warmup_steps))


class StepLR(LRScheduler):
    """initial * gamma ** floor(step / step_size)."""

    def __init__(self, optimizer, initial_learning_rate: float, step_size: int, gamma: float):
        self.initial, self.gamma = float(initial_learning_rate), float(gamma)
        self.step_size = _positive_int("step_size", step_size, "StepLR")
        super().__init__(optimizer)

    def lr_at(self, step):
        return self.initial * self.gamma ** (step // self.step_size)


class MultiStepLR(LRScheduler):
    """initial * gamma ** (the milestones reached)."""

    def __init__(self, optimizer, initial_learning_rate: float, gamma: float, milestones):
        self.initial, self.gamma, self.milestones = float(initial_learning_rate), float(gamma), [int(m) for m in milestones]
        if self.milestones != sorted(self.milestones):
            raise CsTorchError(f"MultiStepLR: milestones must increase, got {self.milestones}")
        super().__init__(optimizer)

    def lr_at(self, step):
        return self.initial * self.gamma ** sum(step >= m for m in self.milestones)


class CosineAnnealingLR(LRScheduler):
    """eta_min + (initial - eta_min) * (1 + cos(pi * step / T_max)) / 2 (periodic, as the real closed form)."""

    def __init__(self, optimizer, initial_learning_rate: float, T_max: int, eta_min: float = 0.0):  # noqa: N803
        self.initial, self.eta_min = float(initial_learning_rate), float(eta_min)
        self.T_max = _positive_int("T_max", T_max, "CosineAnnealingLR")
        super().__init__(optimizer)

    def lr_at(self, step):
        return self.eta_min + (self.initial - self.eta_min) * (1 + math.cos(math.pi * step / self.T_max)) / 2


class CosineAnnealingWarmRestarts(LRScheduler):
    """Cosine from initial to eta_min over T_0 steps, then again over T_0 * T_mult, ... (torch's formula)."""

    def __init__(self, optimizer, initial_learning_rate: float, T_0: int, T_mult: int = 1,  # noqa: N803
                 eta_min: float = 0.0):
        self.initial, self.eta_min = float(initial_learning_rate), float(eta_min)
        self.T_0 = _positive_int("T_0", T_0, "CosineAnnealingWarmRestarts")
        self.T_mult = _positive_int("T_mult", T_mult, "CosineAnnealingWarmRestarts")
        super().__init__(optimizer)

    def lr_at(self, step):
        length, start = self.T_0, 0
        while step >= start + length:
            start, length = start + length, length * self.T_mult
        return self.eta_min + (self.initial - self.eta_min) * (1 + math.cos(math.pi * (step - start) / length)) / 2


class MultiplicativeLR(LRScheduler):
    """initial * coefficient ** step."""

    def __init__(self, optimizer, initial_learning_rate: float, coefficient: float):
        self.initial, self.coefficient = float(initial_learning_rate), float(coefficient)
        super().__init__(optimizer)

    def lr_at(self, step):
        return self.initial * self.coefficient ** step


class PiecewiseConstantLR(SequentialLR):
    """learning_rates[i] until milestones[i], the last from the last milestone on."""

    def __init__(self, optimizer, learning_rates, milestones):
        rates, milestones = [float(r) for r in learning_rates], [int(m) for m in milestones]
        if len(rates) != len(milestones) + 1:
            raise CsTorchError(f"PiecewiseConstantLR: {len(milestones)} milestones need {len(milestones) + 1} "
                               f"learning_rates, got {len(rates)}")
        super().__init__(optimizer, [ConstantLR(None, r) for r in rates], milestones)
