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

try:   # imported here, at collection: h5py's import runs `uname -p`, which a test may not start
    import h5py
except ImportError:
    h5py = None

LR = cstorch.optim.lr_scheduler
TORCH_LR = torch.optim.lr_scheduler


pytestmark = pytest.mark.usefixtures("fresh_backend")   # tests/conftest.py


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
    assert LR.ChainedScheduler.__mro__[1] is LR.ChainedLR
    assert LR.BaseChainedScheduler is cstorch.optim.scheduler.ChainedScheduler
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


def lion_reference(params, lr, betas, weight_decay):
    """Lion as its paper and the real API's documentation write it, in torch."""
    state = {p: torch.zeros_like(p) for p in params}

    def step():
        with torch.no_grad():
            for p in params:
                m = state[p]
                p.mul_(1 - lr * weight_decay)
                p.add_(-lr * torch.sign(m * betas[0] + (1 - betas[0]) * p.grad))
                m.mul_(betas[1]).add_(p.grad, alpha=1 - betas[1])
    return step


@pytest.mark.parametrize("name, kwargs, reference", [
    ("Adagrad", dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.5, eps=1e-6),
     lambda ps, k: torch.optim.Adagrad(ps, **k).step),
    ("RMSprop", dict(lr=0.01, alpha=0.9, eps=1e-8, weight_decay=0.05, momentum=0.8, centered=True),
     lambda ps, k: torch.optim.RMSprop(ps, **k).step),
    ("RMSprop", dict(lr=0.01), lambda ps, k: torch.optim.RMSprop(ps, **k).step),
    ("Adamax", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
     lambda ps, k: torch.optim.Adamax(ps, **k).step),
    ("Adadelta", dict(lr=0.5, rho=0.8, eps=1e-6, weight_decay=0.1), lambda ps, k: torch.optim.Adadelta(ps, **k).step),
    ("Lion", dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.1), lambda ps, k: lion_reference(ps, **k)),
    ("RAdam", dict(lr=0.01, eps=1e-6, weight_decay=0.1), lambda ps, k: torch.optim.RAdam(ps, **k, foreach=False).step),
    ("ASGD", dict(lr=0.05, lambd=1e-3, alpha=0.75, t0=2, weight_decay=0.1),
     lambda ps, k: torch.optim.ASGD(ps, **k, foreach=False).step),
    ("Rprop", dict(lr=0.01, etas=(0.4, 1.3), step_sizes=(1e-4, 0.05)), lambda ps, k: torch.optim.Rprop(ps, **k).step),
])
def test_cpu_only_optimizers_equal_torch_eager(name, kwargs, reference) -> None:
    torch.manual_seed(0)
    ours, ref = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    ref.load_state_dict(ours.state_dict())
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    opt = getattr(cstorch.optim, name)(ours.parameters(), **kwargs)
    ref_step = reference(list(ref.parameters()), kwargs)
    for _ in range(10):      # RAdam rectifies from its 6th step on
        for model, step in ((ours, opt.step), (ref, ref_step)):
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            step()
    for a, b in zip(ours.parameters(), ref.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_cpu_only_optimizers_have_the_real_defaults_and_are_refused_on_csx() -> None:
    params = list(torch.nn.Linear(2, 2).parameters())
    assert cstorch.optim.Adagrad(params).defaults["eps"] == 1e-6 and cstorch.optim.Lion(params).defaults["lr"] == 1e-4
    assert cstorch.optim.Adadelta(params).defaults["lr"] == 1.0 and cstorch.optim.RMSprop(params).defaults["lr"] == 1e-2
    from cs_torch.cluster_step import memoryx_optimizer
    with pytest.raises(Exception, match="CSX backend: optimizer Lion has no MemoryX rule"):
        memoryx_optimizer(cstorch.optim.Lion(params))


def test_tensor_factories_and_device_are_the_hosts() -> None:
    assert torch.equal(cstorch.full((2, 2), 3.0), torch.full((2, 2), 3.0))
    like = torch.zeros(3, dtype=torch.int32)
    for made, value in ((cstorch.full_like(like, 7), 7), (cstorch.ones_like(like), 1), (cstorch.zeros_like(like), 0)):
        assert made.dtype == torch.int32 and made.tolist() == [value] * 3
    assert cstorch.ones(2, dtype=torch.float16).dtype == torch.float16 and cstorch.zeros((1, 2)).shape == (1, 2)
    assert cstorch.ones_like(like, dtype=torch.float32).dtype == torch.float32
    assert cstorch.current_torch_device() == torch.device("cpu") == cstorch.backend.current_torch_device()
    args = cstorch.backend.get_backend_args("CSX")
    assert "cluster_config" in args and "artifact_dir" in args
    with pytest.raises(ValueError, match="TPU backend not yet supported"):
        cstorch.backend.get_backend_args("TPU")
    assert cstorch.nn.Parameter is torch.nn.Parameter and cstorch.nn.Buffer is torch.nn.Buffer


def test_synthetic_dataset_as_documented() -> None:
    data = cstorch.utils.data.SyntheticDataset({"x": torch.ones(2), "i": lambda i: torch.tensor(i)}, num_samples=3)
    samples = list(data)
    assert len(data) == 3 and [int(s["i"]) for s in samples] == [0, 1, 2]
    assert torch.equal(samples[0]["x"], torch.ones(2))
    assert samples[0]["x"] is not samples[1]["x"]          # each sample's tensors are clones
    assert cstorch.utils.SyntheticDataset is cstorch.utils.data.SyntheticDataset
    with pytest.raises(ValueError, match="`num_samples` must be a positive integer"):
        cstorch.utils.data.SyntheticDataset(torch.ones(1), num_samples=0)
    with pytest.raises(TypeError, match="does not have a length"):
        len(cstorch.utils.data.SyntheticDataset(torch.ones(1)))
    with pytest.raises(ValueError, match="got an item of type"):
        cstorch.utils.data.SyntheticDataset([1.0])


def test_distributed_tasks_of_the_emulated_job(tmp_path, monkeypatch) -> None:
    dist = cstorch.distributed
    cstorch.backend("CSX", cluster_config=dist.ClusterConfig(num_csx=2, num_workers_per_csx=3))
    spec = dist.service_resolver().cluster_spec
    assert dist.num_tasks() == 7 == spec.num_tasks() and dist.num_streamers() == dist.num_receivers() == 6
    assert [t.wse_id for t in spec.filter_tasks_by_role(dist.TaskRole.WORKER)] == [0, 0, 0, 1, 1, 1]
    assert spec.task().roles == [dist.TaskRole.MASTER] and not dist.is_receiver() and not dist.is_streamer()
    assert isinstance(dist.service_resolver(), dist.BaseServiceResolver)
    with pytest.raises(Exception, match="get_worker_state"):
        dist.WorkerState.get_worker_state()
    assert (dist.SSD_LIMIT, dist.WORKER_CACHE_ROOT) == (0.8, "/n0/cache")
    monkeypatch.setattr(dist, "WORKER_CACHE_ROOT", str(tmp_path))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"x" * 1536)
    hit, size, room = dist.hit_worker_cache_limit(str(tmp_path / "src"), str(tmp_path / "dest"))
    assert hit is False and size == "1.50KiB" and room.endswith("B")
    with pytest.raises(ValueError):
        dist.hit_worker_cache_limit(str(tmp_path / "src"), "/elsewhere")    # not under the cache root


def test_dice_and_at_k_metrics_against_their_definitions() -> None:
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 2, 0])
    preds = torch.tensor([0, 1, 1, 1, 2, 0, 2, 0])
    dice = cstorch.metrics.DiceCoefficientMetric(3, name="dice")
    dice(labels, preds)
    per_class = [2 * int(((preds == c) & (labels == c)).sum()) / int((preds == c).sum() + (labels == c).sum())
                 for c in range(3)]
    assert float(dice) == pytest.approx(sum(per_class) / 3)
    logits = torch.tensor([[0.1, 0.5, 0.4, 0.0], [0.9, 0.05, 0.03, 0.02]])
    targets = torch.tensor([[2, 3], [0, 1]])
    p_at_2, r_at_1 = cstorch.metrics.PrecisionAtKMetric(2, name="p2"), cstorch.metrics.RecallAtKMetric(1, name="r1")
    p_at_2(targets, logits)
    r_at_1(targets, logits)
    # top 2: {1, 2} and {0, 1}: hits 1 and 2 of 4 predictions; top 1: {1}, {0}: 1 of 4 labels found.
    assert float(p_at_2) == pytest.approx(3 / 4) and float(r_at_1) == pytest.approx(1 / 4)


def test_auc_against_the_rank_statistic_and_its_sums() -> None:
    torch.manual_seed(1)
    scores = torch.rand(40)
    labels = (torch.rand(40) < scores).long()
    pos, neg = scores[labels == 1], scores[labels == 0]
    exact = float((pos[:, None] > neg[None, :]).float().mean())   # P(a positive outranks a negative)
    at_every_score = sorted(set((scores - 1e-6).clamp(min=0).tolist()))
    roc = cstorch.metrics.AUCMetric(thresholds=at_every_score, name="roc")
    roc(labels, scores)
    assert float(roc) == pytest.approx(exact, abs=1e-6)
    sums = {}
    for method in ("minoring", "interpolation", "majoring"):
        metric = cstorch.metrics.AUCMetric(num_thresholds=50, curve="PR", summation_method=method, name=f"pr_{method}")
        metric(labels, scores)
        sums[method] = float(metric)
    assert sums["minoring"] <= sums["majoring"] and 0 < sums["interpolation"] <= 1
    with pytest.raises(ValueError, match="must be in \\[0, 1\\]"):
        cstorch.metrics.AUCMetric(name="bad")(labels, scores * 2)


def test_restartable_data_loader_is_the_real_protocol() -> None:
    class Restartable:
        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

        def aggregate_state_dict(self, worker_states):
            return {}

        def deaggregate_state_dict(self, aggregated_state_dict):
            return {}
    assert isinstance(Restartable(), cstorch.utils.data.RestartableDataLoader)
    assert not isinstance(torch.utils.data.DataLoader([1, 2]), cstorch.utils.data.RestartableDataLoader)


def test_hdf5_checkpoints_round_trip_and_read_by_names(tmp_path) -> None:
    if h5py is None:
        pytest.skip("the model zoo's HDF5 checkpoints need h5py (pip install 'cs-emulator[hdf5]')")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    opt = cstorch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "global_step": 7, "note": "run a",
             "nothing": None, "half": torch.ones(2, dtype=torch.bfloat16), "pair": (1, 2.5)}
    path = tmp_path / "ckpt_7.mdl"
    cstorch.storage.save(state, path)
    back = cstorch.load(path)                              # cstorch.load reads the HDF5 layout too
    assert back["global_step"] == 7 and back["note"] == "run a" and back["nothing"] is None
    assert back["pair"] == (1, 2.5) and back["half"].dtype == torch.bfloat16
    assert list(back["model"]) == list(state["model"]) and back["optimizer"]["param_groups"][0]["lr"] == 0.01
    for key, value in state["model"].items():
        assert torch.equal(back["model"][key], value)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    fresh.load_state_dict(back["model"])
    cstorch.optim.AdamW(fresh.parameters(), lr=0.01).load_state_dict(back["optimizer"])
    with h5py.File(path, "r") as f:                        # the model zoo's names and version attributes
        assert "model.0.weight" in f and "optimizer.state.0.exp_avg" in f and f.attrs["__version__"] == 0.4
    assert cstorch.saver.PyTorchH5Saver.extract_version(path).ckpt_version == 0.4
    # A file as the vendor writes it (its tree a pickled attribute, never read): rebuilt by its names.
    vendor = tmp_path / "vendor.mdl"
    with h5py.File(vendor, "w") as f:
        f.create_dataset("model.fc1.weight", data=np.ones((2, 3), np.float32))
        f.create_dataset("optimizer.state.0.exp_avg", data=np.zeros((2, 3), np.float32))
        f.create_dataset("optimizer.param_groups.0.lr", data=np.asarray(0.1)).attrs["is_scalar"] = True
        f.create_dataset("global_step", data=np.asarray(3)).attrs["is_scalar"] = True
        f.attrs["__spec__"] = "80049500"                  # a pickle's hex: must not be unpickled
    loaded = cstorch.load(vendor)
    assert list(loaded["model"]) == ["fc1.weight"] and loaded["optimizer"]["param_groups"] == [{"lr": 0.1}]
    assert loaded["global_step"] == 3 and loaded["optimizer"]["state"][0]["exp_avg"].shape == (2, 3)
    assert cstorch.saver.PyTorchH5Saver.extract_version(vendor).ckpt_version == 0.1   # no version: the oldest
    zip_file = tmp_path / "zip.mdl"
    cstorch.save({"a": torch.ones(1)}, zip_file)
    assert cstorch.saver.PyTorchH5Saver.extract_version(zip_file) is None
    with pytest.raises(Exception, match="storage.save: .*object"):
        cstorch.storage.save({"x": object()}, tmp_path / "bad.mdl")


def test_nest_scopes_as_the_model_zoo_flattens() -> None:
    from cerebras_pytorch.utils.nest import recurse_spec, visit_torch_tensors
    batch = {"input": torch.ones(2), "extra": [torch.zeros(1), 3, (torch.ones(1),)]}
    assert [s for s, _ in visit_torch_tensors(batch, scope=["top"])] == [["top", "input"], ["top", "extra", "0"],
                                                                        ["top", "extra", "2", "0"]]
    with pytest.raises(ValueError, match="Unknown data structure: 3"):
        list(visit_torch_tensors(batch, strict=True))
    state = {"model": {"fc.weight": torch.ones(1), "fc.bias": torch.zeros(1)}, "step": 4, "groups": [{"lr": 0.1}]}
    leaves, spec = torch.utils._pytree.tree_flatten(state)
    names = [".".join(s) for s in recurse_spec(spec)]
    assert len(names) == len(leaves) and dict(zip(names, leaves))["model.fc.bias"] is state["model"]["fc.bias"]
    assert set(names) == {"model.fc.weight", "model.fc.bias", "step", "groups.0.lr"}


def test_pol_checks_its_levels_and_changes_no_number() -> None:
    torch.manual_seed(0)
    head, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
    assert torch.equal(cstorch.pol(bwd_level=0)(head)(x), head(x))          # as the model zoo's GPT-2 calls it
    seen = []

    @cstorch.pol(level=2)
    def inside():
        seen.append(cstorch.current_pol())
    inside()
    assert seen == [2] and cstorch.current_pol() == 1
    with pytest.raises(ValueError, match="range \\[0, 3\\) but got backward level 3"):
        cstorch.pol(bwd_level=3)


# ---------------------------------------------------------------- the data path on CSX (no job is started:
# the loop's batches are listed without a traced step)
def shuffled_input_fn(batch_size, with_generator):
    x = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3)
    data = torch.utils.data.TensorDataset(x, torch.arange(40) % 4)
    generator = torch.Generator().manual_seed(7) if with_generator else None
    return torch.utils.data.DataLoader(data, batch_size, shuffle=True, drop_last=True, generator=generator)


class Counting(torch.utils.data.IterableDataset):
    """An IterableDataset of n (input, label) pairs, or endless with n None."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        i = 0
        while self.n is None or i < self.n:
            yield torch.full((2,), float(i)), torch.tensor(i % 3)
            i += 1


def iterable_input_fn(batch_size, n):
    return torch.utils.data.DataLoader(Counting(n), batch_size, drop_last=True)


def loop_batches(kind: str, input_fn, *args, steps: int):
    reset_backend()
    cstorch.backend(kind)
    torch.manual_seed(11)
    loader = cstorch.utils.data.DataLoader(input_fn, *args)
    return [(x.clone(), y.clone()) for x, y in cstorch.utils.data.DataExecutor(loader, num_steps=steps)]


@pytest.mark.parametrize("input_fn, args, steps", [
    (shuffled_input_fn, (8, True), 13),       # its own generator: every epoch in torch's order
    (shuffled_input_fn, (8, False), 13),      # the global generator: nothing draws between epochs here
    (iterable_input_fn, (4, 10), 7),           # an IterableDataset of 10 samples: 2 batches an epoch
    (iterable_input_fn, (4, None), 5),         # an endless one
])
def test_csx_loop_gets_the_torch_loaders_batches_in_its_order(input_fn, args, steps, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)      # the generators' states are saved in the backend's artifact_dir for the workers
    cpu = loop_batches("CPU", input_fn, *args, steps=steps)
    csx = loop_batches("CSX", input_fn, *args, steps=steps)
    assert len(cpu) == len(csx) == steps
    for (a, b), (c, d) in zip(cpu, csx):
        assert torch.equal(a, c) and torch.equal(b, d)
    if input_fn is shuffled_input_fn:        # shuffled anew each epoch (5 batches an epoch)
        assert not torch.equal(cpu[0][0], cpu[5][0]) and not torch.equal(cpu[0][0], x_sorted(cpu[:5])[:8])


def x_sorted(batches):
    return torch.cat([x for x, _ in batches]).sort(dim=0).values


def test_autocast_changes_nothing_as_on_csx() -> None:
    x = torch.ones(2, 2)
    for kind in ("CPU", "CSX"):
        reset_backend()
        cstorch.backend(kind)
        with cstorch.amp.autocast() as ctx:
            assert ctx is None and (x @ x).dtype == torch.float32


def test_csx_refuses_schedules_memoryx_cannot_follow() -> None:
    """MemoryX takes one learning rate a step and the job's first weight decay: a step whose param groups
    differ in rate, or whose weight decay changed, is refused with one line (not trained with other numbers)."""
    from cs_torch.cluster_step import _step_rate
    model = torch.nn.Linear(2, 2)
    opt = cstorch.optim.SGD([{"params": [model.weight], "tags": {"w"}}, {"params": [model.bias]}], lr=0.1)
    rate = _step_rate(opt)
    assert rate() == 0.1
    sched = LR.StepLR(opt, 0.1, step_size=1, gamma=0.5, param_group_tags="w")
    sched.step()
    with pytest.raises(Exception, match=r"CSX backend: the param groups' learning rates differ at this step"):
        rate()
    opt2 = cstorch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    rate2 = _step_rate(opt2)
    cstorch.optim.weight_decay_scheduler.StepWD(opt2, initial_val=0.1, step_size=1, gamma=0.5).step()
    with pytest.raises(Exception, match="weight_decay changed during the run"):
        rate2()


def test_job_labels_label_the_job_csctl_lists() -> None:
    from cs_torch import session
    config = cstorch.distributed.ClusterConfig(num_csx=2, job_labels=["name=bert_pt", "team=nlp"])
    assert config.labels() == {"name": "bert_pt", "team": "nlp"}
    options = session.Backend(None, 2, 1, job_labels=tuple(config.labels().items())).job_options()
    assert options.job_labels == {"name": "bert_pt", "team": "nlp"} and options.cs_ip is None
    for bad, says in ((["bert"], "job label 'bert' is not KEY=VALUE"), (["a b=c"], "job_labels: label key 'a b'")):
        with pytest.raises(Exception, match=says):
            cstorch.distributed.ClusterConfig(job_labels=bad)
