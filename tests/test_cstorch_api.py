"""More names of the real cerebras.pytorch API, each against torch eager or its documented formula:
the generic schedulers (optim.scheduler, weight_decay_scheduler), ...

    python -m pytest tests/test_cstorch_api.py -q
"""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="cs_torch's 2.x API takes torch modules (pip install -e '.[torch]')")

import cerebras_pytorch as cstorch  # noqa: E402  (after the skip: it needs torch)
from cs_torch.backends import reset_backend  # noqa: E402

LR = cstorch.optim.lr_scheduler
TORCH_LR = torch.optim.lr_scheduler


@pytest.fixture(autouse=True)
def fresh_backend():
    reset_backend()
    yield
    reset_backend()


def values_of(make, steps: int = 30, key: str = "lr", groups=None) -> list:
    """Each group's `key` before each step (one list per step), torch's order: optimizer.step, then the scheduler's."""
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(groups(model) if groups else model.parameters(), lr=0.1, weight_decay=0.0)
    scheduler = make(opt)
    out = []
    for _ in range(steps):
        out.append([g[key] for g in opt.param_groups])
        opt.step()
        scheduler.step()
    return out


def first(rows):
    return [r[0] for r in rows]


@pytest.mark.parametrize("ours, theirs", [
    (lambda o: LR.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=4, step_size_down=3),
     lambda o: TORCH_LR.CyclicLR(o, 0.01, 0.1, step_size_up=4, step_size_down=3, cycle_momentum=False)),
    (lambda o: LR.CyclicLR(o, 0.01, 0.1, step_size_up=3, mode="triangular2"),
     lambda o: TORCH_LR.CyclicLR(o, 0.01, 0.1, step_size_up=3, mode="triangular2", cycle_momentum=False)),
    (lambda o: LR.CyclicLR(o, 0.01, 0.1, step_size_up=3, mode="exp_range", gamma=0.9),
     lambda o: TORCH_LR.CyclicLR(o, 0.01, 0.1, step_size_up=3, mode="exp_range", gamma=0.9, cycle_momentum=False)),
    (lambda o: LR.OneCycleLR(o, initial_learning_rate=0.004, max_lr=0.1, total_steps=30, pct_start=0.3),
     lambda o: TORCH_LR.OneCycleLR(o, 0.1, total_steps=30, pct_start=0.3, div_factor=25, cycle_momentum=False)),
    (lambda o: LR.OneCycleLR(o, 0.01, 0.1, total_steps=30, three_phase=True, anneal_strategy="linear",
                             final_div_factor=100),
     lambda o: TORCH_LR.OneCycleLR(o, 0.1, total_steps=30, div_factor=10, three_phase=True, anneal_strategy="linear",
                                   final_div_factor=100, cycle_momentum=False)),
])
def test_cyclic_and_one_cycle_follow_torchs(ours, theirs) -> None:
    np.testing.assert_allclose(first(values_of(ours)), first(values_of(theirs)), rtol=1e-6, atol=1e-12)


def test_chained_lambda_and_generic_names_follow_their_documented_formulas() -> None:
    chained = first(values_of(lambda o: LR.ChainedLR([LR.StepLR(o, 0.1, step_size=5, gamma=0.5),
                                                      LR.ExponentialLR(o, 0.2, total_iters=10, decay_rate=0.1)]), 12))
    assert chained == pytest.approx([0.1 * 0.5 ** (t // 5) * 0.1 ** (t / 10) for t in range(12)])
    assert LR.ChainedScheduler.__mro__[1] is LR.ChainedLR and LR.BaseChainedScheduler is cstorch.optim.scheduler.ChainedScheduler
    lam = first(values_of(lambda o: LR.LambdaLR(o, 0.5), 6))
    assert lam == pytest.approx([0.5 * (t / 30) * 0.5 * 0.95 ** t for t in range(6)])   # the real default lambdas

    class Warmup(LR.LambdaLR):
        def set_value_lambda(self):
            return [lambda step: min(1.0, (step + 1) / 4)]
    assert first(values_of(lambda o: Warmup(o, 0.2), 6)) == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.2, 0.2])
    # The generic schedules name no key: the real API's are abstract too.
    with pytest.raises(TypeError, match="ConstantScheduler schedules no param group key"):
        cstorch.optim.scheduler.ConstantScheduler(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), 0.1), 0.1)
    assert issubclass(LR.CosineDecayLR, LR.CosineDecayScheduler) and LR.Scheduler is cstorch.optim.scheduler.Scheduler


def tagged_groups(model):
    return [{"params": [model.weight], "tags": {"decay"}, "adjust_learning_rate": 0.5},
            {"params": [model.bias]}]


def test_param_group_tags_and_scale_per_param() -> None:
    rows = values_of(lambda o: LR.StepLR(o, 0.1, step_size=2, gamma=0.5, param_group_tags="decay"), 4,
                     groups=tagged_groups)
    assert rows == [[0.1, 0.1], [0.1, 0.1], [0.05, 0.1], [0.05, 0.1]]      # the untagged group keeps its rate
    untagged = values_of(lambda o: LR.ConstantLR(o, 0.3, param_group_tags=[None]), 2, groups=tagged_groups)
    assert untagged == [[0.1, 0.3], [0.1, 0.3]]
    scaled = values_of(lambda o: LR.ScalePerParamLR(o, LR.ConstantLR(o, 0.2)), 2, groups=tagged_groups)
    np.testing.assert_allclose(scaled, [[0.1, 0.2]] * 2)      # 0.2 times each group's adjust_learning_rate
    with pytest.raises(ValueError, match="none of them were applied .* Available tags: {'decay'}"):
        values_of(lambda o: LR.ConstantLR(o, 0.3, param_group_tags="nope"), 1, groups=tagged_groups)


def test_weight_decay_schedulers_set_the_groups_weight_decay() -> None:
    wd = cstorch.optim.weight_decay_scheduler
    rows = values_of(lambda o: wd.LinearWD(o, initial_val=0.1, end_val=0.0, total_iters=4), 6, key="weight_decay")
    assert first(rows) == pytest.approx([0.1, 0.075, 0.05, 0.025, 0.0, 0.0])
    assert issubclass(wd.CosineDecayWD, cstorch.optim.scheduler.CosineDecayScheduler)
    # A weight decay schedule trains on the CPU path as torch does with the same decays set each step.
    torch.manual_seed(0)
    ours, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(4, 3)
    opt, ref_opt = cstorch.optim.SGD(ours.parameters(), lr=0.1, weight_decay=0.2), \
        torch.optim.SGD(ref.parameters(), lr=0.1, weight_decay=0.2)
    sched = wd.StepWD(opt, initial_val=0.2, step_size=2, gamma=0.5)
    for step in range(5):
        for model, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            model(x).square().mean().backward()
            o.step()
        sched.step()
        ref_opt.param_groups[0]["weight_decay"] = 0.2 * 0.5 ** ((step + 1) // 2)
    for a, b in zip(ours.parameters(), ref.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-6)


def test_scheduler_state_dict_round_trip() -> None:
    model = torch.nn.Linear(1, 1)
    opt = cstorch.optim.SGD(model.parameters(), lr=0.1)
    a = LR.OneCycleLR(opt, 0.01, 0.1, total_steps=20)
    for _ in range(7):
        a.step()
    b = LR.OneCycleLR(opt, 0.01, 0.1, total_steps=20)
    b.load_state_dict(a.state_dict())
    assert b.get_last_lr() == a.get_last_lr() and math.isclose(opt.param_groups[0]["lr"], a.value_at(7))
