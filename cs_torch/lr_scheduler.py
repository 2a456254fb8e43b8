"""cstorch.optim.lr_scheduler: learning rates as a function of the step, the documented names.

    scheduler = cstorch.optim.lr_scheduler.SequentialLR(optimizer, [
        cstorch.optim.lr_scheduler.LinearLR(optimizer, initial_learning_rate=0.0,
                                            end_learning_rate=1e-3, total_iters=100),
        cstorch.optim.lr_scheduler.CosineDecayLR(optimizer, initial_learning_rate=1e-3,
                                                 end_learning_rate=1e-5, total_iters=900),
    ], milestones=[100])

Each is the schedule of cs_torch/scheduler.py of the same name with the
param group key "lr" and the real API's learning-rate argument names
(initial_learning_rate for initial_val, ...); the generic names
(ConstantScheduler, ...) are here too, as the real module exports them.
On CSX, MemoryX takes each step's rate from the first param group, so
schedulers that leave the groups at different rates are refused there
(cs_torch/cluster_step.py). No torch here.
"""
from __future__ import annotations

from .scheduler import (  # noqa: F401 (the real module exports the generic names too)
    ChainedScheduler as BaseChainedScheduler, ConstantScheduler, CosineAnnealingScheduler,
    CosineAnnealingWarmRestartsScheduler, CosineDecayScheduler, CyclicScheduler, ExponentialScheduler,
    InverseExponentialTimeDecayScheduler, InverseSquareRootDecayScheduler, LambdaScheduler, LinearScheduler,
    MultiplicativeScheduler, MultiStepScheduler, OneCycleScheduler, PiecewiseConstantScheduler, PolynomialScheduler,
    ScalePerParamScheduler, Scheduler, SequentialScheduler, StepScheduler, annotate_signatures,
)


class LRScheduler(Scheduler):
    param_group_key = "lr"

    def lr_at(self, step: int) -> float:
        return self.value_at(step)

    def get_last_lr(self) -> list:
        return self.get_last_value()


class ConstantLR(LRScheduler, ConstantScheduler):
    def __init__(self, optimizer, learning_rate: float, total_iters: int | None = None, param_group_tags=None):
        ConstantScheduler.__init__(self, optimizer, learning_rate, total_iters, param_group_tags)


class PolynomialLR(LRScheduler, PolynomialScheduler):
    def __init__(self, optimizer, initial_learning_rate: float, end_learning_rate: float, total_iters: int,
                 power: float = 1.0, cycle: bool = False, param_group_tags=None):
        PolynomialScheduler.__init__(self, optimizer, initial_learning_rate, end_learning_rate, total_iters, power,
                                     cycle, param_group_tags)


class LinearLR(LRScheduler, LinearScheduler):
    def __init__(self, optimizer, initial_learning_rate: float, end_learning_rate: float, total_iters: int,
                 cycle: bool = False, param_group_tags=None):
        LinearScheduler.__init__(self, optimizer, initial_learning_rate, end_learning_rate, total_iters, cycle,
                                 param_group_tags)


class ExponentialLR(LRScheduler, ExponentialScheduler):
    def __init__(self, optimizer, initial_learning_rate: float, total_iters: int, decay_rate: float,
                 staircase: bool = False, param_group_tags=None):
        ExponentialScheduler.__init__(self, optimizer, initial_learning_rate, total_iters, decay_rate, staircase,
                                      param_group_tags)


class InverseExponentialTimeDecayLR(LRScheduler, InverseExponentialTimeDecayScheduler):
    def __init__(self, optimizer, initial_learning_rate: float, step_exponent: int, total_iters: int,
                 decay_rate: float, staircase: bool = False, param_group_tags=None):
        InverseExponentialTimeDecayScheduler.__init__(self, optimizer, initial_learning_rate, step_exponent,
                                                      total_iters, decay_rate, staircase, param_group_tags)


class InverseSquareRootDecayLR(LRScheduler, InverseSquareRootDecayScheduler):
    def __init__(self, optimizer, initial_learning_rate: float = 1.0, scale: float = 1.0, warmup_steps: int = 1.0,
                 param_group_tags=None):
        InverseSquareRootDecayScheduler.__init__(self, optimizer, initial_learning_rate, scale, warmup_steps,
                                                 param_group_tags)


class CosineDecayLR(LRScheduler, CosineDecayScheduler):
    def __init__(self, optimizer, initial_learning_rate: float, end_learning_rate: float, total_iters: int,
                 param_group_tags=None):
        CosineDecayScheduler.__init__(self, optimizer, initial_learning_rate, end_learning_rate, total_iters,
                                      param_group_tags)


class SequentialLR(LRScheduler, SequentialScheduler):
    pass


class PiecewiseConstantLR(LRScheduler, PiecewiseConstantScheduler):
    values_argument = "learning_rates"

    def __init__(self, optimizer, learning_rates, milestones, param_group_tags=None):
        PiecewiseConstantScheduler.__init__(self, optimizer, learning_rates, milestones, param_group_tags)


class MultiStepLR(LRScheduler, MultiStepScheduler):
    def __init__(self, optimizer, initial_learning_rate: float, gamma: float, milestones, param_group_tags=None):
        MultiStepScheduler.__init__(self, optimizer, initial_learning_rate, gamma, milestones, param_group_tags)


class StepLR(LRScheduler, StepScheduler):
    def __init__(self, optimizer, initial_learning_rate: float, step_size: int, gamma: float, param_group_tags=None):
        StepScheduler.__init__(self, optimizer, initial_learning_rate, step_size, gamma, param_group_tags)


class CosineAnnealingLR(LRScheduler, CosineAnnealingScheduler):
    def __init__(self, optimizer, initial_learning_rate: float, T_max: int, eta_min: float = 0.0,  # noqa: N803
                 param_group_tags=None):
        CosineAnnealingScheduler.__init__(self, optimizer, initial_learning_rate, T_max, eta_min, param_group_tags)


class CosineAnnealingWarmRestarts(LRScheduler, CosineAnnealingWarmRestartsScheduler):
    def __init__(self, optimizer, initial_learning_rate: float, T_0: int, T_mult: int = 1,  # noqa: N803
                 eta_min: float = 0.0, param_group_tags=None):
        CosineAnnealingWarmRestartsScheduler.__init__(self, optimizer, initial_learning_rate, T_0, T_mult, eta_min,
                                                      param_group_tags)


class MultiplicativeLR(LRScheduler, MultiplicativeScheduler):
    def __init__(self, optimizer, initial_learning_rate: float, coefficient: float, param_group_tags=None):
        MultiplicativeScheduler.__init__(self, optimizer, initial_learning_rate, coefficient, param_group_tags)


class LambdaLR(LRScheduler, LambdaScheduler):
    def __init__(self, optimizer, initial_learning_rate: float, param_group_tags=None):
        LambdaScheduler.__init__(self, optimizer, initial_learning_rate, param_group_tags)


class ChainedLR(LRScheduler, BaseChainedScheduler):
    pass


class ChainedScheduler(ChainedLR):
    pass


class CyclicLR(LRScheduler, CyclicScheduler):
    def __init__(self, optimizer, base_lr: float, max_lr: float, step_size_up: int = 2000,
                 step_size_down: int | None = None, mode: str = "triangular", gamma: float = 1.0,
                 scale_mode: str = "cycle", param_group_tags=None):
        CyclicScheduler.__init__(self, optimizer, base_lr, max_lr, step_size_up, step_size_down, mode, gamma,
                                 scale_mode, param_group_tags)


class OneCycleLR(LRScheduler, OneCycleScheduler):
    def __init__(self, optimizer, initial_learning_rate: float, max_lr: float, total_steps: int = 1000,
                 pct_start: float = 0.3, final_div_factor: float = 1e4, three_phase: bool = False,
                 anneal_strategy: str = "cos", param_group_tags=None):
        OneCycleScheduler.__init__(self, optimizer, initial_learning_rate, max_lr, total_steps, pct_start,
                                   final_div_factor, three_phase, anneal_strategy, param_group_tags)


class ScalePerParamLR(LRScheduler, ScalePerParamScheduler):
    pass


def annotate() -> None:
    """The schedulers' signatures with their argument types (scheduler.annotate_signatures)."""
    annotate_signatures(LRScheduler, [c for c in list(globals().values())
                                      if isinstance(c, type) and issubclass(c, Scheduler)])


annotate()
