"""cstorch.optim.scheduler: a value of the optimizer's param groups as a function of the step.

A Scheduler sets the param-group key it names (`param_group_key`: "lr" in
optim.lr_scheduler, "weight_decay" in optim.weight_decay_scheduler) to
value_at(k) for step k: at construction k = 0, and each `step()` (after
optimizer.step(), as in torch) moves to the next. `param_group_tags` limits
it to the groups whose "tags" meet them ([None]: the untagged groups), as
the real API documents. The generic schedules here (ConstantScheduler,
PolynomialScheduler, ...) take the real API's generic argument names
(initial_val, end_val); their subclasses name the key. They also drive
torch.optim optimizers (they only write param_groups). Inside a traced step
`step()` is recorded, and then done after each step's update. No torch here.
"""
from __future__ import annotations

import math

from .nn import CsTorchError
from .recording import probing, replaying


def _positive_int(name, value, cls):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CsTorchError(f"{cls}: {name} must be a positive integer, got {value!r}")
    return value


def _tag_set(param_group_tags):
    if param_group_tags is None:
        return None
    tags = list(param_group_tags) if isinstance(param_group_tags, (list, tuple, set)) else [param_group_tags]
    if len(set(tags)) != len(tags):
        raise ValueError(f"`param_group_tags` contains duplicate values. Tag list: {tags}.")
    return set(tags)


class Scheduler:
    """The step count, the groups it applies to, and torch's state_dict / step protocol."""
    param_group_key: str = ""

    def __init__(self, optimizer, total_iters: int | None = None, param_group_tags=None):
        if not self.param_group_key:
            raise TypeError(f"{type(self).__name__} schedules no param group key: use a subclass that names one "
                            "(optim.lr_scheduler, optim.weight_decay_scheduler)")
        self.optimizer = optimizer
        self.total_iters = total_iters
        self.param_group_tags = _tag_set(param_group_tags)
        self.last_epoch = 0
        self._last_value: list = []
        if optimizer is not None:
            self._check_tags_apply()
            self._set(0)

    def value_at(self, step: int) -> float:
        raise NotImplementedError

    def applies_to(self, group: dict) -> bool:
        if self.param_group_tags is None:
            return True
        tags = group.get("tags") or {None}
        tags = {tags} if isinstance(tags, str) else set(tags)
        return bool(self.param_group_tags & tags)

    def _check_tags_apply(self) -> None:
        if not any(self.applies_to(g) for g in self.optimizer.param_groups):
            known = set().union(*(set(g.get("tags") or ()) for g in self.optimizer.param_groups))
            raise ValueError(f"Scheduler {type(self).__name__} was created with `param_group_tags` "
                             f"{self.param_group_tags} but none of them were applied to any params groups "
                             f"in the optimizer. Available tags: {known}.")

    def group_values(self, step: int) -> list:
        """The value of each param group at `step` (None where the scheduler does not apply)."""
        value = self.value_at(step)
        return [value if self.applies_to(g) else None for g in self.optimizer.param_groups]

    def _set(self, step: int) -> None:
        self._last_value = self.group_values(step)
        for group, value in zip(self.optimizer.param_groups, self._last_value):
            if value is not None:
                group[self.param_group_key] = value

    def step(self, *args, **kwargs) -> None:
        probe = probing()
        if probe is not None:
            probe.record("sched_step", self)
            return
        if replaying() is not None:
            return
        self.last_epoch += 1
        self._set(self.last_epoch)

    def get_last_value(self) -> list:
        return list(self._last_value)

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.last_epoch = int(state["last_epoch"])
        self._set(self.last_epoch)


class ConstantScheduler(Scheduler):
    def __init__(self, optimizer, val: float, total_iters: int | None = None, param_group_tags=None):
        self.val = float(val)
        super().__init__(optimizer, total_iters, param_group_tags)

    def value_at(self, step):
        return self.val


class PolynomialScheduler(Scheduler):
    """end + (initial - end) * (1 - step / total_iters) ** power, then end. `cycle` is accepted as the real
    API takes it; there, as here, the value from total_iters on is end_val, so it changes nothing."""

    def __init__(self, optimizer, initial_val: float, end_val: float, total_iters: int, power: float = 1.0,
                 cycle: bool = False, param_group_tags=None):
        self.initial_val, self.end_val, self.power, self.cycle = (float(initial_val), float(end_val),
                                                                  float(power), bool(cycle))
        super().__init__(optimizer, _positive_int("total_iters", total_iters, type(self).__name__),
                         param_group_tags)

    def value_at(self, step):
        if step >= self.total_iters:
            return self.end_val
        if self.power == 1.0:   # the linear form
            return self.initial_val + (self.end_val - self.initial_val) * step / self.total_iters
        return self.end_val + (self.initial_val - self.end_val) * (1 - step / self.total_iters) ** self.power


class LinearScheduler(PolynomialScheduler):
    def __init__(self, optimizer, initial_val: float, end_val: float, total_iters: int, cycle: bool = False,
                 param_group_tags=None):
        super().__init__(optimizer, initial_val, end_val, total_iters, 1.0, cycle, param_group_tags)


class ExponentialScheduler(Scheduler):
    """initial * decay_rate ** (step / total_iters) (the exponent floored with staircase)."""

    def __init__(self, optimizer, initial_val: float, total_iters: int, decay_rate: float, staircase: bool = False,
                 param_group_tags=None):
        self.initial_val, self.decay_rate, self.staircase = float(initial_val), float(decay_rate), staircase
        super().__init__(optimizer, _positive_int("total_iters", total_iters, type(self).__name__),
                         param_group_tags)

    def value_at(self, step):
        power = step / self.total_iters
        return self.initial_val * self.decay_rate ** (math.floor(power) if self.staircase else power)


class InverseExponentialTimeDecayScheduler(Scheduler):
    """initial / (1 + decay_rate * step ** step_exponent / total_iters) (the quotient floored with staircase)."""

    def __init__(self, optimizer, initial_val: float, step_exponent: int, total_iters: int, decay_rate: float,
                 staircase: bool = False, param_group_tags=None):
        self.initial_val, self.step_exponent = float(initial_val), step_exponent
        self.decay_rate, self.staircase = float(decay_rate), bool(staircase)
        super().__init__(optimizer, _positive_int("total_iters", total_iters, type(self).__name__),
                         param_group_tags)

    def value_at(self, step):
        alpha = float(step) ** self.step_exponent / self.total_iters
        return self.initial_val / (1.0 + self.decay_rate * (math.floor(alpha) if self.staircase else alpha))


class InverseSquareRootDecayScheduler(Scheduler):
    """initial * scale / sqrt(max(step, warmup_steps))."""

    def __init__(self, optimizer, initial_val: float = 1.0, scale: float = 1.0, warmup_steps: int = 1.0,
                 param_group_tags=None):
        self.initial_val, self.scale, self.warmup_steps = float(initial_val), float(scale), warmup_steps
        if not warmup_steps > 0:
            raise CsTorchError(f"{type(self).__name__}: warmup_steps must be positive, got {warmup_steps!r}")
        super().__init__(optimizer, None, param_group_tags)

    def value_at(self, step):
        return self.initial_val * self.scale / math.sqrt(max(step, self.warmup_steps))


class CosineDecayScheduler(Scheduler):
    def __init__(self, optimizer, initial_val: float, end_val: float, total_iters: int, param_group_tags=None):
        self.initial_val, self.end_val = float(initial_val), float(end_val)
        super().__init__(optimizer, _positive_int("total_iters", total_iters, type(self).__name__),
                         param_group_tags)

    def value_at(self, step):
        t = min(step, self.total_iters) / self.total_iters
        return self.end_val + (self.initial_val - self.end_val) * 0.5 * (1 + math.cos(math.pi * t))


class SequentialScheduler(Scheduler):
    """schedulers[i] from milestones[i - 1] on, each counting its steps from its own start."""

    def __init__(self, optimizer, schedulers, milestones, last_epoch: int = -1, param_group_tags=None):
        schedulers, milestones = list(schedulers), [int(m) for m in milestones]
        if len(milestones) != len(schedulers) - 1 or milestones != sorted(milestones):
            raise CsTorchError(f"{type(self).__name__}: {len(schedulers)} schedulers need {len(schedulers) - 1} "
                               f"increasing milestones, got {milestones}")
        self.schedulers, self.milestones = schedulers, milestones
        super().__init__(optimizer, None, param_group_tags)

    def value_at(self, step):
        start = 0
        for scheduler, milestone in zip(self.schedulers, self.milestones):
            if step < milestone:
                return scheduler.value_at(step - start)
            start = milestone
        return self.schedulers[-1].value_at(step - start)


class PiecewiseConstantScheduler(SequentialScheduler):
    """vals[i] until milestones[i], the last from the last milestone on."""
    values_argument = "vals"   # the argument's name in error messages

    def __init__(self, optimizer, vals, milestones, param_group_tags=None):
        rates, milestones = [float(r) for r in vals], [int(m) for m in milestones]
        if len(rates) != len(milestones) + 1:
            raise CsTorchError(f"{type(self).__name__}: {len(milestones)} milestones need {len(milestones) + 1} "
                               f"{self.values_argument}, got {len(rates)}")
        super().__init__(optimizer, [_Constant(r) for r in rates], milestones, param_group_tags=param_group_tags)


class _Constant:
    """A piece of a piecewise-constant schedule (it sets no param group itself)."""

    def __init__(self, val: float):
        self.val = val

    def value_at(self, step):
        return self.val


class MultiStepScheduler(Scheduler):
    """initial * gamma ** (the milestones reached)."""

    def __init__(self, optimizer, initial_val: float, gamma: float, milestones, param_group_tags=None):
        self.initial_val, self.gamma, self.milestones = float(initial_val), float(gamma), [int(m) for m in milestones]
        if self.milestones != sorted(self.milestones):
            raise CsTorchError(f"{type(self).__name__}: milestones must increase, got {self.milestones}")
        super().__init__(optimizer, None, param_group_tags)

    def value_at(self, step):
        return self.initial_val * self.gamma ** sum(step >= m for m in self.milestones)


class StepScheduler(Scheduler):
    """initial * gamma ** floor(step / step_size)."""

    def __init__(self, optimizer, initial_val: float, step_size: int, gamma: float, param_group_tags=None):
        self.initial_val, self.gamma = float(initial_val), float(gamma)
        self.step_size = _positive_int("step_size", step_size, type(self).__name__)
        super().__init__(optimizer, None, param_group_tags)

    def value_at(self, step):
        return self.initial_val * self.gamma ** (step // self.step_size)


class CosineAnnealingScheduler(Scheduler):
    """eta_min + (initial - eta_min) * (1 + cos(pi * step / T_max)) / 2 (periodic, as the real closed form)."""

    def __init__(self, optimizer, initial_val: float, T_max: int, eta_min: float = 0.0,  # noqa: N803
                 param_group_tags=None):
        self.initial_val, self.eta_min = float(initial_val), float(eta_min)
        self.T_max = _positive_int("T_max", T_max, type(self).__name__)
        super().__init__(optimizer, None, param_group_tags)

    def value_at(self, step):
        return self.eta_min + (self.initial_val - self.eta_min) * (1 + math.cos(math.pi * step / self.T_max)) / 2


class CosineAnnealingWarmRestartsScheduler(Scheduler):
    """Cosine from initial to eta_min over T_0 steps, then again over T_0 * T_mult, ... (torch's formula)."""

    def __init__(self, optimizer, initial_val: float, T_0: int, T_mult: int = 1,  # noqa: N803
                 eta_min: float = 0.0, param_group_tags=None):
        self.initial_val, self.eta_min = float(initial_val), float(eta_min)
        self.T_0 = _positive_int("T_0", T_0, type(self).__name__)
        self.T_mult = _positive_int("T_mult", T_mult, type(self).__name__)
        super().__init__(optimizer, None, param_group_tags)

    def value_at(self, step):
        length, start = self.T_0, 0
        while step >= start + length:
            start, length = start + length, length * self.T_mult
        return self.eta_min + (self.initial_val - self.eta_min) * (1 + math.cos(math.pi * (step - start) / length)) / 2


class MultiplicativeScheduler(Scheduler):
    """initial * coefficient ** step."""

    def __init__(self, optimizer, initial_val: float, coefficient: float, param_group_tags=None):
        self.initial_val, self.coefficient = float(initial_val), float(coefficient)
        super().__init__(optimizer, None, param_group_tags)

    def value_at(self, step):
        return self.initial_val * self.coefficient ** step


class LambdaScheduler(Scheduler):
    """initial * the product of set_value_lambda()'s functions of the step. A subclass overrides
    set_value_lambda; the real API's default is [step / 30, 0.95 ** step]."""

    def __init__(self, optimizer, initial_val: float, param_group_tags=None):
        self.initial_val = float(initial_val)
        super().__init__(optimizer, None, param_group_tags)

    def set_value_lambda(self):
        return [lambda step: step / 30, lambda step: 0.95 ** step]

    def value_at(self, step):
        value = 1.0
        for fn in self.set_value_lambda():
            value = self.initial_val * float(fn(step)) * value
        return value


class CyclicScheduler(Scheduler):
    """Between base_val and max_val and back, step_size_up then step_size_down steps a cycle; the height
    scaled per cycle (triangular: 1, triangular2: halved each cycle) or per step (exp_range: gamma ** step)."""

    def __init__(self, optimizer, base_val: float, max_val: float, step_size_up: int = 2000,
                 step_size_down: int | None = None, mode: str = "triangular", gamma: float = 1.0,
                 scale_mode: str = "cycle", param_group_tags=None):
        if mode not in ("triangular", "triangular2", "exp_range"):
            raise ValueError(f"{type(self).__name__}: mode must be triangular, triangular2 or exp_range, got {mode!r}")
        self.base_val, self.max_val, self.mode, self.gamma = float(base_val), float(max_val), mode, float(gamma)
        self.step_size_up = _positive_int("step_size_up", step_size_up, type(self).__name__)
        self.step_size_down = self.step_size_up if step_size_down is None else \
            _positive_int("step_size_down", step_size_down, type(self).__name__)
        self.scale_mode = "iterations" if mode == "exp_range" else "cycle"
        super().__init__(optimizer, None, param_group_tags)

    def _scale(self, x: float) -> float:
        if self.mode == "triangular":
            return 1.0
        if self.mode == "triangular2":
            return 1 / 2.0 ** (x - 1)
        return self.gamma ** x

    def value_at(self, step):
        total = self.step_size_up + self.step_size_down
        ratio = self.step_size_up / total
        cycle = math.floor(1 + step / total)
        x = 1.0 + step / total - cycle
        factor = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
        height = factor * (self.max_val - self.base_val)
        return self.base_val + height * self._scale(cycle if self.scale_mode == "cycle" else step)


class OneCycleScheduler(Scheduler):
    """The 1cycle policy: initial_val up to max_val over pct_start of total_steps, then down to
    initial_val / final_div_factor (three_phase: back to initial_val first), cosine or linear."""

    def __init__(self, optimizer, initial_val: float, max_val: float, total_steps: int = 1000,
                 pct_start: float = 0.3, final_div_factor: float = 1e4, three_phase: bool = False,
                 anneal_strategy: str = "cos", param_group_tags=None):
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"{type(self).__name__}: anneal_strategy must be cos or linear, got {anneal_strategy!r}")
        self.initial_val, self.max_val = float(initial_val), float(max_val)
        self.total_steps = _positive_int("total_steps", total_steps, type(self).__name__)
        self.pct_start, self.final_div_factor = float(pct_start), float(final_div_factor)
        self.three_phase, self.anneal_strategy = bool(three_phase), anneal_strategy
        super().__init__(optimizer, None, param_group_tags)

    def _anneal(self, start, end, pct):
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return start + pct * (end - start)

    def value_at(self, step):
        min_val = self.initial_val / self.final_div_factor
        up = self.pct_start * self.total_steps - 1
        if self.three_phase:
            phases = [(up, self.initial_val, self.max_val), (2 * self.pct_start * self.total_steps - 2,
                                                             self.max_val, self.initial_val),
                      (self.total_steps - 1, self.initial_val, min_val)]
        else:
            phases = [(up, self.initial_val, self.max_val), (self.total_steps - 1, self.max_val, min_val)]
        start = 0.0
        for end, low, high in phases:
            if step <= end or end == phases[-1][0]:
                return self._anneal(low, high, (step - start) / (end - start))
            start = end


class ChainedScheduler(Scheduler):
    """The first scheduler's value times each other's value over its initial_val, on one optimizer."""

    def __init__(self, schedulers, param_group_tags=None):
        self._schedulers = list(schedulers)
        if not self._schedulers:
            raise ValueError(f"{type(self).__name__}: give at least one scheduler")
        for i, scheduler in enumerate(self._schedulers):
            if scheduler.optimizer is not self._schedulers[0].optimizer:
                raise ValueError(f"{type(self).__name__} expects all schedulers to belong to the same optimizer, "
                                 f"but got schedulers at index 0 and {i} to be different")
            if scheduler.param_group_tags != _tag_set(param_group_tags):
                raise ValueError(f"{type(self).__name__} expects all schedulers to have the same "
                                 f"`param_group_tags`, but the one at index {i} differs")
        super().__init__(self._schedulers[0].optimizer, None, param_group_tags)

    def value_at(self, step):
        value = self._schedulers[0].value_at(step)
        for scheduler in self._schedulers[1:]:
            value *= scheduler.value_at(step) / scheduler.initial_val
        return value


class ScalePerParamScheduler(Scheduler):
    """The wrapped scheduler's value times each param group's `adjust_learning_rate` (or `adjust_val`),
    as muP scales each layer's rate."""

    def __init__(self, optimizer, scheduler, param_group_tags=None):
        self._scheduler_nested = scheduler
        self.adjustment_scalars = [g.get("adjust_learning_rate", g.get("adjust_val", 1.0))
                                   for g in optimizer.param_groups]
        if scheduler.param_group_tags != _tag_set(param_group_tags):
            raise ValueError(f"{type(self).__name__} expects the wrapped scheduler to have the same "
                             "`param_group_tags`")
        super().__init__(optimizer, None, param_group_tags)

    def value_at(self, step):
        return self._scheduler_nested.value_at(step)

    def group_values(self, step):
        value = self.value_at(step)
        return [value * scale if self.applies_to(g) else None
                for g, scale in zip(self.optimizer.param_groups, self.adjustment_scalars)]


__all__ = ["Scheduler", "ConstantScheduler", "PolynomialScheduler", "LinearScheduler", "ExponentialScheduler",
           "InverseExponentialTimeDecayScheduler", "InverseSquareRootDecayScheduler", "CosineDecayScheduler",
           "SequentialScheduler", "PiecewiseConstantScheduler", "MultiStepScheduler", "StepScheduler",
           "CosineAnnealingScheduler", "CosineAnnealingWarmRestartsScheduler", "MultiplicativeScheduler",
           "LambdaScheduler", "CyclicScheduler", "OneCycleScheduler", "ChainedScheduler", "ScalePerParamScheduler"]


def annotate_signatures(base: type, classes) -> None:
    """Give the schedulers' __init__ the types of their scheduler arguments as objects: the model
    zoo builds its params schema from these signatures (a nested `schedulers:` list is parsed into
    schedulers of `base`, and the optimizer is left out of the schema, where torch's optimizer type
    names it). torch's type is named only when torch is already imported, as a torch model's is:
    this module imports no torch."""
    import inspect
    import sys
    import types
    from typing import List
    torch = sys.modules.get("torch")
    optimizer_type = torch.optim.Optimizer if torch is not None and hasattr(torch, "optim") else None
    # Each class's __init__ as its MRO finds it, all read before any is set (the base, e.g. LRScheduler,
    # is left as it is: an __init__ set there would come before SequentialScheduler's in SequentialLR).
    inits = [(cls, cls.__init__) for cls in classes if cls is not base]
    for cls, shared in inits:   # a copy per class: SequentialLR and SequentialWD share one __init__
        init = types.FunctionType(shared.__code__, shared.__globals__, shared.__name__, shared.__defaults__,
                                  shared.__closure__)
        init.__kwdefaults__, init.__qualname__ = shared.__kwdefaults__, f"{cls.__qualname__}.__init__"
        params = init.__code__.co_varnames[:init.__code__.co_argcount]
        notes = inspect.get_annotations(shared, eval_str=True)   # types, not their source text
        if "schedulers" in params:
            notes["schedulers"] = List[base]
        if "scheduler" in params:
            notes["scheduler"] = base
        if "optimizer" in params and optimizer_type is not None:
            notes["optimizer"] = optimizer_type
        init.__annotations__ = notes
        cls.__init__ = init
