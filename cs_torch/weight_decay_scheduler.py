"""cstorch.optim.weight_decay_scheduler: the schedules of cs_torch/scheduler.py on the param groups'
"weight_decay", by the real API's names (ConstantWD, LinearWD, ...; the generic argument names).

On CSX, MemoryX applies the weight decay the job started with, so a weight
decay that changes during a CSX run is refused there (cs_torch/cluster_step.py).
"""
from __future__ import annotations

from . import scheduler as s


class WeightDecayScheduler(s.Scheduler):
    param_group_key = "weight_decay"


def _named(name: str, base):
    return type(name, (WeightDecayScheduler, base), {"__module__": __name__, "__doc__": base.__doc__})


ConstantWD = _named("ConstantWD", s.ConstantScheduler)
PolynomialWD = _named("PolynomialWD", s.PolynomialScheduler)
LinearWD = _named("LinearWD", s.LinearScheduler)
ExponentialWD = _named("ExponentialWD", s.ExponentialScheduler)
InverseExponentialTimeDecayWD = _named("InverseExponentialTimeDecayWD", s.InverseExponentialTimeDecayScheduler)
InverseSquareRootDecayWD = _named("InverseSquareRootDecayWD", s.InverseSquareRootDecayScheduler)
CosineDecayWD = _named("CosineDecayWD", s.CosineDecayScheduler)
SequentialWD = _named("SequentialWD", s.SequentialScheduler)
PiecewiseConstantWD = _named("PiecewiseConstantWD", s.PiecewiseConstantScheduler)
MultiStepWD = _named("MultiStepWD", s.MultiStepScheduler)
StepWD = _named("StepWD", s.StepScheduler)
CosineAnnealingWD = _named("CosineAnnealingWD", s.CosineAnnealingScheduler)
LambdaWD = _named("LambdaWD", s.LambdaScheduler)
CosineAnnealingWarmRestartsWD = _named("CosineAnnealingWarmRestartsWD", s.CosineAnnealingWarmRestartsScheduler)
MultiplicativeWD = _named("MultiplicativeWD", s.MultiplicativeScheduler)
ChainedWD = _named("ChainedWD", s.ChainedScheduler)
CyclicWD = _named("CyclicWD", s.CyclicScheduler)
OneCycleWD = _named("OneCycleWD", s.OneCycleScheduler)
ScalePerParamWD = _named("ScalePerParamWD", s.ScalePerParamScheduler)


def annotate() -> None:
    """The schedulers' signatures with their argument types (scheduler.annotate_signatures)."""
    s.annotate_signatures(WeightDecayScheduler, [c for c in list(globals().values())
                                                 if isinstance(c, type) and issubclass(c, WeightDecayScheduler)])


annotate()
