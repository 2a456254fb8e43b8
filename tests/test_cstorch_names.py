"""Names of the real cerebras.pytorch API the model zoo's training flow calls, each
against torch eager or the real API's documented behaviour.

    python -m pytest tests/test_cstorch_names.py -q
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="cs_torch's 2.x API takes torch modules (pip install -e '.[torch]')")

import cerebras_pytorch as cstorch  # noqa: E402  (after the skip: it needs torch)


pytestmark = pytest.mark.usefixtures("fresh_backend")   # tests/conftest.py


def test_top_level_names_the_model_zoo_calls() -> None:
    assert cstorch.__version__ == "2.1.1"
    assert cstorch.use_cs() is False                       # a CPU backend unless CSX was asked for
    cstorch.backend("CSX")
    assert cstorch.use_cs() is True
    t = torch.arange(3.0)
    assert cstorch.make_constant(t) is t
    np.testing.assert_array_equal(cstorch.to_numpy(t * 2), [0.0, 2.0, 4.0])
    assert torch.equal(cstorch.from_numpy(np.ones(2, np.float32)), torch.ones(2))
    assert cstorch.current_executor() is None               # outside a DataExecutor loop
    from cs_torch.core.name_scope import current_scope
    with cstorch.name_scope("encoder"):
        with cstorch.name_scope("layer0"):
            assert current_scope() == "encoder.layer0"
    assert current_scope() == ""


def test_debug_names_are_module_paths() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU()))
    cstorch.add_debug_name(model, "model")
    assert cstorch.get_debug_name(model[1][0]) == "model.1.0"
    assert cstorch.get_debug_name(torch.nn.Tanh()).startswith("tanh_")


def test_submodules_by_the_real_dotted_names() -> None:
    lr = importlib.import_module("cerebras_pytorch.optim.lr_scheduler")
    assert lr is importlib.import_module("cs_torch.lr_scheduler") and lr.SequentialLR is cstorch.optim.lr_scheduler.SequentialLR
    from cerebras.pytorch.core import modes
    assert modes.EVAL_ALL == "eval_all"


def test_a_name_not_emulated_is_one_line_naming_it() -> None:
    with pytest.raises(AttributeError, match=r"^cstorch\.mesh is not supported by the emulator: "):
        getattr(cstorch, "mesh")
    with pytest.raises(AttributeError, match=r"^cstorch\.experimental\.Quantization is not supported by the emulator"):
        getattr(cstorch.experimental, "Quantization")
    with pytest.raises(NotImplementedError, match=r"^cstorch\.sparse\.Static: the 2.3\+ sparsity algorithms are not emulated"):
        cstorch.sparse.Static(sparsity=0.5)
    with pytest.raises(NotImplementedError, match=r"^cstorch\.sparse\.configure: the 2.3\+ sparsity algorithms are not emulated"):
        cstorch.sparse.configure({"sparsity": 0.5})


def test_optimizer_defaults_are_the_real_apis() -> None:
    model = torch.nn.Linear(2, 2)
    adam, adamw = cstorch.optim.Adam(model.parameters()), cstorch.optim.AdamW(model.parameters())
    assert adam.defaults["eps"] == adamw.defaults["eps"] == 1e-6 and adamw.defaults["weight_decay"] == 0.0
    # The ModelSpec path (no parameters given) has the same defaults: one eps whichever way it is spelled.
    assert cstorch.optim.Adam(lr=0.1).section["eps"] == cstorch.optim.AdamW(lr=0.1).section["eps"] == 1e-6
    assert cstorch.optim.AdamW(lr=0.1).section["weight_decay"] == 0.0


def test_grad_scaler_defaults_are_the_real_apis() -> None:
    plain = cstorch.amp.GradScaler()
    assert not plain.dynamic and plain.scale_value() == 1.0            # loss_scale None: no scaling
    dynamic = cstorch.amp.GradScaler(loss_scale="dynamic")
    assert (dynamic.scale_value(), dynamic.max_loss_scale, dynamic.steps_per_increase) == (2.0 ** 15, 2.0 ** 15, 2000)
    assert dynamic.min_loss_scale == 2.0 ** -14


def test_compute_num_steps_takes_the_smallest_as_the_real_api() -> None:
    loader = list(range(10))       # ten batches an epoch
    f = cstorch.utils.data.compute_num_steps
    assert f(loader, num_epochs=1, steps_per_epoch=4, max_steps=100) == 4
    assert f(loader, num_epochs=2) == 20 and f(loader, num_steps=7, max_steps=5) == 5
    assert f(loader, initial_step=3, max_steps=5) == 2 and f(loader, num_epochs=1, grad_accum_steps=3) == 3
    assert f(iter(range(5)), num_steps=9) == 9        # a loader of unknown length: steps only
    for kwargs, message in (({"num_epochs": 1, "num_steps": 2}, "num_epochs or num_steps, not both"),
                            ({}, "give one of num_epochs, num_steps or max_steps"),
                            ({"num_epochs": 1, "steps_per_epoch": 11}, "steps_per_epoch 11 exceeds the 10"),
                            ({"initial_step": 5, "max_steps": 5}, "initial step 5 is already at max_steps 5"),
                            ({"num_steps": 0}, "num_steps must be a positive integer")):
        with pytest.raises(ValueError, match=message):
            f(loader, **kwargs)
    with pytest.raises(ValueError, match="num_epochs needs a data loader of known length"):
        f(iter(range(5)), num_epochs=1)


def test_optimizer_step_matches_torch_eager_with_scaling_and_clipping() -> None:
    """amp.optimizer_step on the CPU backend: the same weights as torch's own scaled backward, clip, step."""
    torch.manual_seed(0)
    ours, ref = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    ref.load_state_dict(ours.state_dict())
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    opt = cstorch.optim.SGD(ours.parameters(), lr=0.5, momentum=0.9)
    scaler = cstorch.amp.GradScaler(loss_scale=64.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        cstorch.amp.optimizer_step(torch.nn.functional.cross_entropy(ours(x), y), opt, scaler,
                                   max_gradient_norm=0.1)
        ref_opt.zero_grad()
        (torch.nn.functional.cross_entropy(ref(x), y) * 64.0).backward()
        for p in ref.parameters():
            p.grad.div_(64.0)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
    for a, b in zip(ours.parameters(), ref.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="max_gradient_value .* is not emulated"):
        cstorch.amp.optimizer_step(ours(x).sum(), opt, scaler, max_gradient_value=1.0)


def test_fbeta_score_against_its_definition() -> None:
    labels = torch.tensor([0, 1, 2, 2, 1, 0, 2, 1])
    preds = torch.tensor([0, 2, 2, 1, 1, 0, 2, 0])
    micro = cstorch.metrics.FBetaScoreMetric(3, beta=2.0, name="fb_micro")
    micro(labels, preds)
    # Pooled over classes, every prediction counts once: precision = recall = accuracy = 5/8.
    assert float(micro) == pytest.approx(5 / 8)
    macro = cstorch.metrics.FBetaScoreMetric(3, beta=1.0, average_type="macro", ignore_labels=[0], name="fb_macro")
    macro(labels, preds)
    f1 = []
    for c in (1, 2):
        tp = int(((preds == c) & (labels == c)).sum())
        p, r = tp / int((preds == c).sum()), tp / int((labels == c).sum())
        f1.append(2 * p * r / (p + r))
    assert float(macro) == pytest.approx(sum(f1) / 2)
    assert set(cstorch.metrics.compute_all_metrics()) >= {"fb_micro", "fb_macro"}


def lrs_of(make, steps: int = 25) -> list[float]:
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


LR = cstorch.optim.lr_scheduler
TORCH_LR = torch.optim.lr_scheduler


@pytest.mark.parametrize("ours, theirs", [
    (lambda o: LR.StepLR(o, 0.1, step_size=4, gamma=0.5), lambda o: TORCH_LR.StepLR(o, 4, gamma=0.5)),
    (lambda o: LR.MultiStepLR(o, 0.1, gamma=0.3, milestones=[3, 10]),
     lambda o: TORCH_LR.MultiStepLR(o, [3, 10], gamma=0.3)),
    (lambda o: LR.CosineAnnealingLR(o, 0.1, T_max=20, eta_min=0.01),
     lambda o: TORCH_LR.CosineAnnealingLR(o, 20, eta_min=0.01)),
    (lambda o: LR.CosineAnnealingWarmRestarts(o, 0.1, T_0=3, T_mult=2, eta_min=0.001),
     lambda o: TORCH_LR.CosineAnnealingWarmRestarts(o, 3, T_mult=2, eta_min=0.001)),
    (lambda o: LR.PolynomialLR(o, 0.1, 0.0, total_iters=12, power=2.0),
     lambda o: TORCH_LR.PolynomialLR(o, total_iters=12, power=2.0)),
    (lambda o: LR.MultiplicativeLR(o, 0.1, coefficient=0.9),
     lambda o: TORCH_LR.MultiplicativeLR(o, lambda _: 0.9)),
])
def test_schedulers_follow_torchs_where_torch_has_them(ours, theirs) -> None:
    np.testing.assert_allclose(lrs_of(ours), lrs_of(theirs), rtol=1e-6, atol=1e-12)


def test_schedulers_torch_lacks_follow_their_documented_formulas() -> None:
    inv_sqrt = lrs_of(lambda o: LR.InverseSquareRootDecayLR(o, 2.0, scale=0.5, warmup_steps=4), 8)
    assert inv_sqrt == pytest.approx([2.0 * 0.5 / max(t, 4) ** 0.5 for t in range(8)])
    inv_exp = lrs_of(lambda o: LR.InverseExponentialTimeDecayLR(o, 0.1, 2, 10, 0.5, staircase=True), 8)
    assert inv_exp == pytest.approx([0.1 / (1 + 0.5 * (t * t // 10)) for t in range(8)])
    piecewise = lrs_of(lambda o: LR.PiecewiseConstantLR(o, [0.3, 0.2, 0.1], [2, 5]), 7)
    assert piecewise == [0.3, 0.3, 0.2, 0.2, 0.2, 0.1, 0.1]
    with pytest.raises(Exception, match="2 milestones need 3 learning_rates"):
        LR.PiecewiseConstantLR(None, [0.3, 0.2], [2, 5])


def api_table() -> list[tuple[str, str]]:
    """(name, status) of each row of docs/cstorch.md's "The real API's names"."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "docs" / "cstorch.md").read_text()
    section = text.split("## The real API's names", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            name, status = line[3:].split("` | ", 1)
            rows.append((name, status.split(":", 1)[0].rstrip(" |")))
    return rows


def resolve(name: str):
    """cerebras_pytorch.<name>: through the module attributes, as a script reaches it."""
    obj = cstorch
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_api_table_says_what_the_package_has() -> None:
    rows = api_table()
    assert len(rows) == 168 and len({name for name, _ in rows}) == 168
    counts = {status: sum(s == status for _, s in rows) for status in ("present", "partial", "not supported")}
    assert sum(counts.values()) == 168, counts
    assert counts["present"] + counts["partial"] >= 0.8 * 168, counts       # the target: 80% of the table
    for name, status in rows:
        if status in ("present", "partial"):
            resolve(name)   # raises if the table says present and the package has no such name
        else:
            with pytest.raises(AttributeError) as info:
                resolve(name)
            assert name.split(".")[0] in str(info.value) or name.split(".")[-1] in str(info.value), name
            assert "\n" not in str(info.value)


def test_half_dtypes_are_torch_dtypes_as_the_real_api() -> None:
    from cs_torch import amp
    state = dict(amp._half)
    try:
        assert cstorch.amp.set_half_dtype(torch.bfloat16) is torch.bfloat16
        assert cstorch.amp.get_half_dtype() is torch.bfloat16 and cstorch.amp.get_half_dtype_str() == "bfloat16"
        assert cstorch.amp.set_half_dtype("cbfloat16") is torch.float16      # float16 stands in, as in cstorch
        assert cstorch.amp.get_half_dtype_str() == "cbfloat16"
        assert cstorch.amp.GradScaler(loss_scale="dynamic").scale_value() == 2.0 ** 31
        assert torch.ones(2).to(cstorch.amp.get_half_dtype()).dtype == torch.float16
    finally:
        amp._half.update(state)


def test_distributed_answers_as_the_users_process_of_an_emulated_job() -> None:
    dist = importlib.import_module("cerebras_pytorch.distributed")
    assert (dist.get_ordinal(), dist.is_master_ordinal(), dist.is_streamer()) == (0, True, False)
    assert dist.get_streaming_batch_size(96) == 96                 # the input function makes the global batch
    with pytest.raises(ValueError, match="positive batch size"):
        dist.get_streaming_batch_size(0)
    cstorch.backend("CSX", cluster_config=cstorch.distributed.ClusterConfig(num_csx=2, num_workers_per_csx=2))
    assert dist.num_streamers() == 4
    for call in (dist.get_streaming_rank, dist.get_worker_state):
        with pytest.raises(Exception, match=r"^distributed\.get_\w+: .*emulated"):
            call()
    from cerebras_pytorch.distributed.cluster_resolver import ClusterSpec, TaskSpec
    spec = ClusterSpec([TaskSpec(rank=0, local_rank=0, wse_id=0, node_name="unknown")], 0, 1, 1)
    assert spec.task().wse_id == 0 and spec.task(0).node_name == "unknown"
    with pytest.raises(ValueError, match="no task of rank 3"):
        spec.task(3)


def test_mean_iou_per_class_accuracy_and_mean_against_their_definitions() -> None:
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 2, 0])
    preds = torch.tensor([0, 1, 1, 1, 2, 0, 2, 0])
    iou = cstorch.metrics.MeanIOUMetric(3, name="iou")
    iou(labels, preds)
    per_class = []
    for c in range(3):
        tp = int(((preds == c) & (labels == c)).sum())
        union = int(((preds == c) | (labels == c)).sum())
        per_class.append(tp / union)
    assert float(iou) == pytest.approx(sum(per_class) / 3)
    ignoring = cstorch.metrics.MeanIOUMetric(3, ignore_classes=[0], name="iou_no0")
    ignoring(labels, preds)
    assert float(ignoring) == pytest.approx(sum(per_class[1:]) / 2)
    acc = cstorch.metrics.MeanPerClassAccuracyMetric(3, name="pca")
    acc(labels, preds)
    assert float(acc) == pytest.approx((2 / 3 + 2 / 2 + 2 / 3) / 3)
    mean = cstorch.metrics.MeanMetric("mean")
    mean(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 3.0]))
    mean(torch.tensor(5.0))
    assert float(mean) == pytest.approx((1 + 9 + 5) / (1 + 3 + 1))


def test_backend_is_the_function_and_the_module_of_its_names() -> None:
    assert cstorch.backend("CPU").backend_type == "CPU"          # called, as every script does
    assert cstorch.backend.use_cs() is False and cstorch.backend.current_backend_impl().backend_type == "CPU"
    from cerebras.pytorch.backend import BackendType, current_backend_impl
    assert current_backend_impl() is cstorch.current_backend() and BackendType.CSX.is_csx


def test_nn_functional_one_hot_by_its_real_name() -> None:
    from cerebras_pytorch.nn.functional import one_hot
    assert torch.equal(one_hot(torch.tensor([2, 0]), 3), torch.tensor([[0, 0, 1], [1, 0, 0]]))
    with pytest.raises(ValueError, match="num_classes cannot be -1"):
        one_hot(torch.tensor([1]), -1)


def test_data_executor_names_what_it_does_not_honour(capsys: pytest.CaptureFixture) -> None:
    loader = cstorch.utils.data.DataLoader(lambda: [(torch.zeros(2, 1), torch.zeros(2))])
    executor = cstorch.utils.data.DataExecutor(loader, num_steps=1, profiler_activities=["host"])
    assert len(executor) == 1
    assert "DataExecutor: profiler_activities is not honoured" in capsys.readouterr().err


def test_configure_helpers_build_what_the_params_section_says() -> None:
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.ln = torch.nn.LayerNorm(4)
    model = Block()
    section = {"optimizer_type": "AdamW", "weight_decay": 0.01, "betas": [0.9, 0.95], "eps": 1e-8,
               "max_gradient_norm": 1.0, "loss_scaling_factor": "dynamic",
               "learning_rate": [{"scheduler": "Linear", "initial_learning_rate": 0.0, "end_learning_rate": 1e-3,
                                  "total_iters": 10},
                                 {"scheduler": "CosineDecayLR", "initial_learning_rate": 1e-3,
                                  "end_learning_rate": 1e-4, "total_iters": 20}]}
    groups = cstorch.optim.configure_param_groups(model, section)
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    assert groups[0]["params"] == [model.fc.weight]
    assert groups[1]["params"] == [model.fc.bias, model.ln.weight, model.ln.bias]
    rest = {k: v for k, v in section.items() if k != "optimizer_type"}
    opt = cstorch.optim.configure_optimizer(optimizer_type=section["optimizer_type"], params=groups, **rest)
    from cs_torch.optimizers import AdamW
    assert isinstance(opt, AdamW) and opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8
    scheduler = cstorch.optim.configure_lr_scheduler(opt, section["learning_rate"])
    from cs_runtime.config import params_from_dict
    same = params_from_dict({"optimizer": {"learning_rate": [dict(section["learning_rate"][0]),
                                                             {**section["learning_rate"][1],
                                                              "scheduler": "CosineDecay"}]}}).optimizer
    rates = []
    for _ in range(35):
        rates.append(opt.param_groups[0]["lr"])
        scheduler.step()
    assert rates == [same.lr_at(s) for s in range(35)] and rates[10] == 1e-3
    assert cstorch.optim.configure_lr_scheduler(opt, 0.01) is None      # a constant rate: no scheduler
    with pytest.raises(Exception, match="optimizer_type 'Lamb' is not emulated"):
        cstorch.optim.configure_optimizer("Lamb", groups)
    with pytest.raises(Exception, match="configure_lr_scheduler: .*learning_rate"):
        cstorch.optim.configure_lr_scheduler(opt, {"scheduler": "Cyclic", "base_lr": 0.1})
