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


class LinearLR(LRScheduler):
    def __init__(self, optimizer, initial_learning_rate: float, end_learning_rate: float, total_iters: int):
        self.initial, self.end = float(initial_learning_rate), float(end_learning_rate)
        super().__init__(optimizer, _positive_int("total_iters", total_iters, "LinearLR"))

    def lr_at(self, step):
        return self.initial + (self.end - self.initial) * min(step, self.total_iters) / self.total_iters


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
