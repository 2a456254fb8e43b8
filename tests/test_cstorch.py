"""The Cerebras PyTorch API (2.x: import cs_torch as cstorch; 1.x: cs_torch.cbtorch) against torch eager."""
import copy
import os
import signal
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="the cstorch API trains torch modules; torch is an optional extra")

import cs_torch as cstorch  # noqa: E402
import cs_torch.backends as backends  # noqa: E402
import cs_torch.cbtorch as cbtorch  # noqa: E402
from cs_torch.nn import CsTorchError  # noqa: E402
from examples.cstorch import cbtorch_mlp, cnn, gpt2, mlp  # noqa: E402

REL = 1e-5


@pytest.fixture(autouse=True)
def fresh_backend(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    backends.reset_backend()
    yield
    backends.reset_backend()


def batches(input_fn, *args, steps=None):
    """The batches a DataExecutor's loop got: with a CSX backend those the input workers streamed."""
    loader = cstorch.utils.data.DataLoader(input_fn, *args)
    return list(cstorch.utils.data.DataExecutor(loader, num_steps=steps))


def assert_close_losses(got, want):
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert abs(g - w) <= REL * abs(w), f"step {step}: {g} vs torch eager {w}"


def assert_same_weights(model, ref, rel=1e-4):
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        scale = float(b.abs().max()) or 1.0
        assert float((a - b).abs().max()) <= rel * scale, name


def eager_train(model, optimizer, data, loss_of, scheduler=None, accuracies=None):
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        out = model(x)
        loss = loss_of(out, y)
        if accuracies is not None:
            accuracies.append((out.argmax(-1) == y).float().mean().item())
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------- the examples vs torch eager
@pytest.mark.cluster
@pytest.mark.parametrize("num_csx", [1, 2])
def test_mlp_example_matches_torch_eager(num_csx):
    losses, eval_losses, model, accuracy, correct = mlp.main(steps=24, num_csx=num_csx, log=lambda *a: None)
    torch.manual_seed(1)
    ref = mlp.MLP()
    opt = torch.optim.SGD(ref.parameters(), 0.05, momentum=0.9, nesterov=True)   # MemoryX's nesterov rule
    loss_fn = torch.nn.CrossEntropyLoss()
    assert_close_losses(losses, eager_train(ref, opt, batches(mlp.input_fn, 32, "train", steps=24), loss_fn))
    assert_same_weights(model, ref)
    with torch.no_grad():
        eval_batches = batches(mlp.input_fn, 32, "eval")
        want = [loss_fn(ref(x), y).item() for x, y in eval_batches]
        want_correct = [int((ref(x).argmax(-1) == y).sum()) for x, y in eval_batches]
    assert_close_losses(eval_losses, want)
    # values besides the loss (a dict's entry, a metric) come from the WSEs' outputs of each step
    assert correct == want_correct
    assert accuracy == pytest.approx(sum(want_correct) / (32 * len(eval_batches)), rel=1e-6)


@pytest.mark.cluster
@pytest.mark.parametrize("num_csx", [1, 2])
def test_cnn_example_matches_torch_eager_and_checkpoints_load(num_csx, tmp_path):
    losses, model, accuracies = cnn.main(steps=12, num_csx=num_csx, model_dir=str(tmp_path / "cnn"),
                                         log=lambda *a: None)
    torch.manual_seed(2)
    ref = cnn.CNN()
    opt = torch.optim.Adam(ref.parameters(), 2e-3, eps=1e-8)
    want_accuracies = []
    assert_close_losses(losses, eager_train(ref, opt, batches(cnn.input_fn, 16, steps=12),
                                            torch.nn.CrossEntropyLoss(), accuracies=want_accuracies))
    assert accuracies == want_accuracies   # a training step's closure value from the WSEs' logits
    assert_same_weights(model, ref)
    saved = sorted(p.name for p in (tmp_path / "cnn").iterdir())
    assert saved == ["checkpoint_10.mdl", "checkpoint_12.mdl"]
    state = torch.load(tmp_path / "cnn" / "checkpoint_12.mdl", weights_only=True)   # a torch user opens it
    fresh = cnn.CNN()
    fresh.load_state_dict(state["model"])
    assert_same_weights(fresh, model, rel=0)
    assert state["step"] == 12 and state["optimizer"]["state"][0]["step"] == 12


@pytest.mark.cluster
@pytest.mark.parametrize("num_csx", [1, 2])
def test_gpt2_example_with_warmup_matches_torch_eager(num_csx, tmp_path):
    steps = 12
    losses, model = gpt2.main(steps=steps, num_csx=num_csx, model_dir=str(tmp_path / "g"), log=lambda *a: None)
    data = batches(gpt2.input_fn, 8, steps=steps)

    def eager(dtype):
        torch.manual_seed(3)
        ref = gpt2.GPT2().to(dtype)
        opt = torch.optim.AdamW(ref.parameters(), 3e-3, eps=1e-8, weight_decay=0.01)
        sched = gpt2.schedule(opt, warmup=steps // 4, total=steps)   # cstorch's schedules drive torch's AdamW
        lm_loss = lambda logits, y: torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),  # noqa
                                                                      y.reshape(-1))
        return ref, eager_train(ref, opt, data, lm_loss, sched)
    ref, want = eager(torch.float32)
    assert_close_losses(losses, want)
    # AdamW turns float32 noise in a gradient that is zero in exact arithmetic (the attention's key
    # bias) into whole steps, in torch too: such a tensor is held to torch's own float32-vs-float64 spread.
    ref64, _ = eager(torch.float64)
    for (name, a), (_, b), (_, c) in zip(model.state_dict().items(), ref.state_dict().items(),
                                         ref64.state_dict().items()):
        spread = float((b.double() - c).abs().max())
        assert float((a - b).abs().max()) <= 1e-4 * float(b.abs().max()) + 2 * spread, name
    assert list((tmp_path / "g" / "train").iterdir()), "no TensorBoard events written"


def _check_cbtorch_run(result):
    """A 1.x run's losses (train and eval) and final weights against torch eager on the batches it got."""
    losses, eval_losses, model, seen, eval_seen, accuracy = result
    torch.manual_seed(1)
    ref = mlp.MLP()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    assert len(seen) == 2 * len(mlp.input_fn(32, "train"))
    assert_close_losses(losses, eager_train(ref, opt, seen, loss_fn))
    assert_same_weights(model, ref)
    with torch.no_grad():
        assert_close_losses(eval_losses, [loss_fn(ref(x), y).item() for x, y in eval_seen])
        correct = sum(int((ref(x).argmax(-1) == y).sum()) for x, y in eval_seen)
    assert accuracy == pytest.approx(correct / sum(len(y) for _, y in eval_seen), rel=1e-6)


@pytest.mark.cluster
@pytest.mark.parametrize("num_csx", [1, 2])
def test_cbtorch_loop_on_the_cs_system_matches_torch_eager(num_csx, capsys):
    _check_cbtorch_run(cbtorch_mlp.main(epochs=2, num_csx=num_csx, log=lambda *a: None))
    out = capsys.readouterr().out
    assert "| Train Device=WSE" in out and "Step=32," in out   # both epochs were steps of the one job
    assert "| Eval Device" not in out   # the eval program's loss is a stand-in: the loop reports its own


def test_cbtorch_loop_on_the_cpu_matches_torch_eager():
    _check_cbtorch_run(cbtorch_mlp.main(epochs=2, log=lambda *a: None, cpu=True))


# ---------------------------------------------------------------- optimizers, schedules, loss scaling
def _pair(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("make, make_ref", [
    (lambda p: cstorch.optim.SGD(p, 0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
     lambda p: torch.optim.SGD(p, 0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (lambda p: cstorch.optim.SGD(p, 0.1, momentum=0.5, dampening=0.1),
     lambda p: torch.optim.SGD(p, 0.1, momentum=0.5, dampening=0.1)),
    (lambda p: cstorch.optim.Adam(p, 0.01, eps=1e-8, weight_decay=0.1),
     lambda p: torch.optim.Adam(p, 0.01, eps=1e-8, weight_decay=0.1)),
    (lambda p: cstorch.optim.AdamW(p, 0.01, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1),
     lambda p: torch.optim.AdamW(p, 0.01, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1)),
])
def test_optimizers_follow_torch_rules_and_state_dict(make, make_ref):
    model, ref = _pair()
    opt, ropt = make(model.parameters()), make_ref(ref.parameters())
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    for _ in range(5):
        for m, o in ((model, opt), (ref, ropt)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    assert_same_weights(model, ref, rel=1e-6)
    ours, theirs = opt.state_dict(), ropt.state_dict()
    assert set(ours["state"]) == set(theirs["state"])
    for key, value in theirs["state"][0].items():
        assert torch.allclose(torch.as_tensor(ours["state"][0][key]).float(), value.float(), rtol=1e-5), key
    fresh = make(copy.deepcopy(model).parameters())
    fresh.load_state_dict(ours)
    assert fresh.state_dict()["param_groups"] == ours["param_groups"]


def test_old_optimizer_spelling_still_makes_memoryx_sections():
    assert cstorch.optim.SGD(lr=0.1, momentum=0.9).section["optimizer_type"] == "sgd"
    assert type(cstorch.optim.Adam(torch.nn.Linear(2, 2).parameters(), 0.1)).__module__ == "cs_torch.optimizers"


def test_schedules_follow_their_formulas():
    lr = cstorch.optim.lr_scheduler
    opt = cstorch.optim.SGD(torch.nn.Linear(2, 2).parameters(), 1.0)
    assert lr.ConstantLR(opt, 0.3).lr_at(50) == 0.3
    assert lr.LinearLR(opt, 1.0, 0.0, 10).lr_at(5) == pytest.approx(0.5)
    assert lr.LinearLR(opt, 1.0, 0.0, 10).lr_at(20) == pytest.approx(0.0)
    assert lr.ExponentialLR(opt, 1.0, 10, 0.5).lr_at(20) == pytest.approx(0.25)
    assert lr.ExponentialLR(opt, 1.0, 10, 0.5, staircase=True).lr_at(19) == pytest.approx(0.5)
    assert lr.CosineDecayLR(opt, 1.0, 0.0, 10).lr_at(5) == pytest.approx(0.5)
    seq = lr.SequentialLR(opt, [lr.LinearLR(opt, 0.0, 1.0, 4), lr.CosineDecayLR(opt, 1.0, 0.1, 6)], [4])
    assert [round(seq.lr_at(k), 6) for k in (0, 2, 4, 10)] == [0.0, 0.5, 1.0, 0.1]
    assert opt.param_groups[0]["lr"] == 0.0   # a scheduler sets step 0's rate when made
    seq.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25) and seq.get_last_lr() == [pytest.approx(0.25)]
    with pytest.raises(CsTorchError, match="SequentialLR: 2 schedulers need 1 increasing milestones"):
        lr.SequentialLR(opt, [seq, seq], [])


def _traced_linear(scaler, optimizer_lr=0.1):
    model = torch.nn.Linear(4, 2)
    compiled = cstorch.compile(model, cstorch.backend("CPU"))
    opt = cstorch.optim.SGD(model.parameters(), optimizer_lr)

    return model, _scaled_step(compiled, opt, scaler, torch.nn.functional.mse_loss)


def _scaled_step(compiled, opt, scaler, loss_fn):
    """The docs' training step under a GradScaler, traced."""
    @cstorch.trace
    def step(x, y):
        loss = loss_fn(compiled(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss
    return step


def test_dynamic_loss_scaling_skips_overflowing_steps_and_grows_back():
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=2.0 ** 200, steps_per_increase=2,
                                    max_loss_scale=2.0 ** 200)
    model, step = _traced_linear(scaler)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    before = copy.deepcopy(model.state_dict())
    step(x, y)             # 2**200 overflows float32: the step is skipped and the scale halves
    assert scaler.skipped_steps == 1 and scaler.scale_value() == 2.0 ** 199
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    scaler.scale_ = 4.0
    step(x, y)
    step(x, y)             # two good steps double it
    assert scaler.scale_value() == 8.0 and scaler.skipped_steps == 1
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_gradient_norm_read_after_unscale_is_the_unscaled_norm():
    """The trainer's precision callback unscales, then clips (and its ComputeNorm reads the norm): inside
    a traced step with a loss scale of 8 the norm read is torch eager's of the unscaled gradients."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    reference = copy.deepcopy(model)
    compiled = cstorch.compile(model, cstorch.backend("CPU"))
    opt = cstorch.optim.SGD(model.parameters(), 0.1)
    scaler = cstorch.amp.GradScaler(loss_scale=8.0)

    @cstorch.trace
    def step(x, y):
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(list(compiled.parameters()), 1e6)
        scaler.step(opt)
        scaler.update()
        return loss, norm

    x, y = torch.randn(8, 4), torch.randn(8, 2)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    want = float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))
    assert float(step(x, y)[1]) == pytest.approx(want, rel=1e-6)


# ---------------------------------------------------------------- mixed precision
def _scaled_mlp_loop(kind, fmt, data=None, steps=10):
    """An MLP under GradScaler (from 2**20: float16 overflows) in `fmt` (cstorch.amp.set_half_dtype and
    the backend's mixed_precision); with a CSX backend over a DataExecutor, else over `data`.
    (losses, weights, batches, final scale)."""
    if fmt != "float32":
        assert cstorch.amp.set_half_dtype(fmt) == getattr(torch, "float16" if fmt == "cbfloat16" else fmt)
    cstorch.manual_seed(1)
    model = mlp.MLP(hidden=16)
    compiled = cstorch.compile(model, cstorch.backend(kind, mixed_precision=fmt != "float32"))
    opt = cstorch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=2.0 ** 20, max_loss_scale=2.0 ** 20,
                                    steps_per_increase=3)

    step = _scaled_step(compiled, opt, scaler, torch.nn.functional.cross_entropy)
    if data is None:
        data = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(mlp.input_fn, 32), num_steps=steps)
    losses, seen = [], []
    for x, y in data:
        seen.append((x.clone(), y.clone()))
        losses.append(step(x, y).item())
    return losses, copy.deepcopy(model.state_dict()), seen, scaler.scale_value()


@pytest.fixture
def half_dtype_unset(monkeypatch):
    """cstorch.amp's setting is process-wide: each test starts without one and leaves none behind."""
    monkeypatch.setattr(cstorch.amp, "_half", {"dtype": "float16", "enabled": False})


@pytest.mark.cluster
@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "cbfloat16"])
def test_half_dtype_trains_in_16_bits_on_csx_as_on_the_cpu_backend(fmt, half_dtype_unset):
    """mixed_precision=True makes the program's matmuls 16-bit in the half dtype on CSX (weights streamed in
    16 bits, MemoryX unscaling and skipping overflowed steps) and on the CPU backend: the same
    batches give the same losses and weights, to the bit."""
    losses, weights, data, scale = _scaled_mlp_loop("CSX", fmt)
    backends.reset_backend()
    cpu_losses, cpu_weights, _, cpu_scale = _scaled_mlp_loop("CPU", fmt, data)
    assert losses == cpu_losses and scale == cpu_scale
    for name, w in cpu_weights.items():
        assert torch.equal(weights[name], w), name
    if fmt == "float16":
        assert scale < 2.0 ** 20, "2**20 should have overflowed float16 at least once"
    backends.reset_backend()
    float32_losses, _, _, _ = _scaled_mlp_loop("CPU", "float32", data)
    assert losses != float32_losses
    assert max(abs(a - b) / b for a, b in zip(losses, float32_losses)) < 2e-2


def test_use_cbfloat16_of_cbtorch_sets_the_half_dtype(half_dtype_unset):
    assert cstorch.amp.precision() == "float32"
    cbtorch.initialize(use_cbfloat16=True)
    assert cstorch.amp.precision() == "cbfloat16"


def test_the_half_dtype_alone_leaves_programs_in_float32(half_dtype_unset):
    """As the real API: set_half_dtype picks the 16-bit format; the backend's mixed_precision (default
    False) switches mixed precision on, on CSX as on CPU."""
    cstorch.amp.set_half_dtype("bfloat16")
    for kind in ("CPU", "CSX"):
        backends.reset_backend()
        cstorch.backend(kind)
        assert cstorch.amp.precision() == "float32"
        backends.reset_backend()
        cstorch.backend(kind, mixed_precision=True)
        assert cstorch.amp.precision() == "bfloat16"


# ---------------------------------------------------------------- save, load, closures, errors
def test_load_refuses_a_pickle_that_runs_code(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("ran",))
    bad = tmp_path / "evil.mdl"
    bad.write_bytes(pickle.dumps({"x": Evil()}))
    with pytest.raises(CsTorchError, match=r"load: .*evil.mdl is not a checkpoint this can load safely"):
        cstorch.load(bad)
    with pytest.raises(CsTorchError, match="weights_only=True"):
        cstorch.load(bad, weights_only=False)
    cstorch.save({"w": torch.ones(2), "step": 3}, tmp_path / "ok" / "c.mdl")
    assert cstorch.load(tmp_path / "ok" / "c.mdl")["step"] == 3


def test_step_closure_gets_host_tensors_and_checkpoint_closure_runs_on_its_steps_only():
    model = torch.nn.Linear(3, 2)
    compiled = cstorch.compile(model, cstorch.backend("CPU"))
    opt = cstorch.optim.SGD(model.parameters(), 0.1)
    seen, saved = [], []

    @cstorch.step_closure
    def on_loss(loss, tag):
        seen.append((tag, type(loss).__name__, loss.item()))

    @cstorch.checkpoint_closure
    def save(step):
        saved.append(step)

    @cstorch.trace
    def step(x, y):
        loss = torch.nn.functional.cross_entropy(compiled(x), y)
        on_loss(loss, "in-step")
        loss.backward()
        opt.step()
        return {"loss": loss, "tag": 7}

    data = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(4)]
    executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: data), num_steps=4,
                                               checkpoint_steps=2)
    for i, (x, y) in enumerate(executor, start=1):
        out = step(x, y)
        assert out["tag"] == 7 and seen[-1][2] == out["loss"].item()
        assert save(i) is None   # called on every step, as the real API allows: runs on steps 2 and 4
    assert [s[:2] for s in seen] == [("in-step", "Tensor")] * 4 and saved == [2, 4]


def test_a_step_hands_out_other_tensors_computed_from_its_values():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    compiled = cstorch.compile(model, cstorch.backend("CPU"))
    opt = cstorch.optim.SGD(model.parameters(), 0.1)
    seen = []

    @cstorch.step_closure
    def note(accuracy, logits, loss):
        seen.append((accuracy, logits, loss))

    @cstorch.trace
    def step(x, y):
        logits = compiled(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        accuracy = (logits.argmax(-1) == y).float().mean()
        note(accuracy, logits, loss)
        return {"loss": loss, "accuracy": accuracy, "logits": logits}

    ref_opt = torch.optim.SGD(ref.parameters(), 0.1)
    for i in range(3):
        x, y = torch.randn(16, 3), torch.randint(0, 4, (16,))
        out = step(x, y)
        logits = ref(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        accuracy = (logits.argmax(-1) == y).float().mean()
        assert torch.allclose(out["logits"], logits.detach(), rtol=1e-5, atol=1e-6), i
        assert out["accuracy"].item() == accuracy.item() and seen[-1][0].item() == accuracy.item()
        assert out["loss"].item() == pytest.approx(loss.item(), rel=1e-6) and seen[-1][2] is out["loss"]
        assert not seen[-1][1].requires_grad


def test_an_eval_step_returning_a_dict_takes_its_loss_entry():
    model = torch.nn.Linear(3, 2)
    compiled = cstorch.compile(model, cstorch.backend("CPU"))

    @cstorch.trace
    @torch.no_grad()
    def step(x, y):
        out = compiled(x)
        return {"accuracy": (out.argmax(-1) == y).float().mean(),
                "loss": torch.nn.functional.cross_entropy(out, y)}
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    got = step(x, y)
    with torch.no_grad():
        out = model(x)
    assert got["loss"].item() == pytest.approx(torch.nn.functional.cross_entropy(out, y).item(), rel=1e-6)
    assert got["accuracy"].item() == (out.argmax(-1) == y).float().mean().item()


def test_metrics_and_tensor_summaries_in_an_eval_loop(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5))
    compiled = cstorch.compile(model, cstorch.backend("CPU"))
    accuracy = cstorch.metrics.AccuracyMetric("accuracy")
    perplexity = cstorch.metrics.PerplexityMetric("perplexity")

    @cstorch.trace
    @torch.no_grad()
    def eval_step(x, y):
        logits = compiled(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        accuracy(labels=y.clone(), predictions=logits.argmax(-1).int())
        perplexity(labels=y, loss=loss * y.numel())
        cstorch.summarize_tensor("logits", logits)
        return loss

    data = [(torch.randn(8, 3), torch.randint(0, 5, (8,))) for _ in range(3)]
    writer = cstorch.utils.tensorboard.SummaryWriter(log_dir=str(tmp_path / "eval"))
    executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: data), writer=writer)
    for x, y in executor:
        assert eval_step(x, y).dim() == 0
    with torch.no_grad():
        logits = [model(x) for x, _ in data]
    correct = sum(int((lg.argmax(-1) == y).sum()) for lg, (_, y) in zip(logits, data))
    assert float(accuracy) == pytest.approx(correct / 24, rel=1e-6) and accuracy.num_updates == 3
    nll = sum(float(torch.nn.functional.cross_entropy(lg, y, reduction="sum")) for lg, (_, y) in zip(logits, data))
    assert float(perplexity) == pytest.approx(float(torch.exp(torch.tensor(nll / 24))), rel=1e-5)
    reader = cstorch.utils.tensorboard.SummaryReader(str(tmp_path / "eval"))
    assert reader.tensor_names() == ["logits"]
    saved = reader.read_tensor("logits")
    assert [d.step for d in saved] == [1, 2, 3]
    for d, want in zip(saved, logits):
        assert torch.allclose(d.tensor, want, rtol=1e-5, atol=1e-6)
    assert [d.step for d in reader.read_tensor("logits", step=2)] == [2]
    accuracy.reset()
    assert accuracy.num_updates == 0 and float(accuracy.total_num_tokens) == 0.0


def test_metrics_outside_a_traced_step_update_at_once():
    metric = cstorch.metrics.AccuracyMetric("eager")
    value = metric(labels=torch.tensor([1, 2, 3, 4]), predictions=torch.tensor([1, 2, 0, 4]),
                   weights=torch.tensor([1.0, 1.0, 1.0, 0.0]))
    assert float(value) == pytest.approx(2 / 3) and float(metric) == pytest.approx(2 / 3)
    assert ("eager", metric) in list(cstorch.metrics.get_all_metrics())


def test_an_unsupported_op_names_module_and_op():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 2)

        def forward(self, x):
            return torch.special.i0(self.fc(x))   # an op of no meaning here: not in the op set
    compiled = cstorch.compile(Odd(), cstorch.backend("CPU"))

    @cstorch.trace
    def step(x, y):
        return torch.nn.functional.mse_loss(compiled(x), y)
    with pytest.raises(CsTorchError, match=r"trace: module <root>: op \S*i0.*not in the op set"):
        step(torch.randn(4, 3), torch.randn(4, 2))


def test_an_exception_in_the_loop_propagates_and_stops_the_executor():
    loader = cstorch.utils.data.DataLoader(lambda: [1, 2, 3])
    executor = cstorch.utils.data.DataExecutor(loader, num_steps=3)
    with pytest.raises(KeyboardInterrupt):
        for batch in executor:
            raise KeyboardInterrupt
    from cs_torch.utils.data import current_executor
    assert current_executor() is None


def test_backend_arguments_it_cannot_honour_say_so(capsys):
    cstorch.backend("CSX", cluster_config={"num_csx": 2, "max_wgt_servers": 4, "mount_dirs": ["/data"]},
                    transfer_processes=4)
    err = capsys.readouterr().err.splitlines()
    assert any("transfer_processes=4 is not honoured" in line for line in err)
    assert any("cluster_config.max_wgt_servers=4 is not honoured" in line for line in err)
    assert any("cluster_config.mount_dirs=['/data'] is not honoured" in line for line in err)
    with pytest.raises(CsTorchError, match="cannot instantiate multiple backends"):
        cstorch.backend("CPU")
    with pytest.raises(CsTorchError, match="unknown setting 'num_wse'"):
        backends.ClusterConfig.of({"num_wse": 2})


def test_unsupported_parts_of_the_api_say_so():
    with pytest.raises(AttributeError, match="cstorch.mesh is not supported by the emulator: "):
        getattr(cstorch, "mesh")


def test_cbtorch_session_checks_its_mode():
    with pytest.raises(CsTorchError, match="mode must be one of train, eval"):
        cbtorch.Session(None, mode="predict")


@pytest.mark.cluster
def test_cs_torch_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import cs_torch\n"
            "print(cs_torch.optim.SGD(lr=0.1).section['optimizer_type'], cs_torch.Session.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sgd", "Session"]


def test_tied_gradients_are_unscaled_once_per_layer():
    import numpy as np
    from types import SimpleNamespace
    from cs_runtime.numerics.precision import unscale_and_check
    from cs_runtime.numerics.program_layer import tie_grads
    spec = SimpleNamespace(program=None, layers=[SimpleNamespace(name="a"), SimpleNamespace(name="b")])
    grads = tie_grads(spec, [{"wte": np.full(3, 2.0, np.float32)}, {"wte": np.full(3, 6.0, np.float32)}])
    assert unscale_and_check(grads, 4.0)
    assert [float(g["wte"][0]) for g in grads] == [2.0, 2.0]   # (2 + 6) / 4 in both layers


# ---------------------------------------------------------------- lifecycle on the CS system
def _small_csx_loop(on_step):
    """A two-layer MLP trained on the CS system (1 WSE); on_step(step) runs after each step."""
    cstorch.backend("CSX")
    model = mlp.MLP(hidden=16)
    compiled = cstorch.compile(model)
    opt = cstorch.optim.SGD(model.parameters(), 0.05)

    @cstorch.trace
    def step(x, y):
        loss = torch.nn.functional.cross_entropy(compiled(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
    for i, (x, y) in enumerate(cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(mlp.input_fn, 32),
                                                               num_steps=1000), start=1):
        step(x, y)
        on_step(i)


def _job_processes():
    from tests.test_api import job_processes
    return job_processes(os.getpid())


def train_mlp_steps(compiled, opt, steps: int) -> tuple[list[float], list]:
    """`steps` traced cross-entropy steps of the MLP example's data on the current backend: (losses, batches)."""
    @cstorch.trace
    def step(x, y):
        loss = torch.nn.functional.cross_entropy(compiled(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
    losses, data = [], []
    for x, y in cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(mlp.input_fn, 32), num_steps=steps):
        losses.append(step(x, y).item())
        data.append((x, y))
    return losses, data


@pytest.mark.cluster
def test_sgd_with_dampening_on_the_cs_system_matches_torch_eager():
    cstorch.backend("CSX")
    torch.manual_seed(4)
    model = mlp.MLP(hidden=16)
    ref = copy.deepcopy(model)
    compiled = cstorch.compile(model)
    opt = cstorch.optim.SGD(model.parameters(), 0.05, momentum=0.5, dampening=0.3, weight_decay=0.01)
    losses, data = train_mlp_steps(compiled, opt, 6)
    ref_opt = torch.optim.SGD(ref.parameters(), 0.05, momentum=0.5, dampening=0.3, weight_decay=0.01)
    assert_close_losses(losses, eager_train(ref, ref_opt, data, torch.nn.functional.cross_entropy))
    assert_same_weights(model, ref)
    ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert set(ours) == set(theirs)
    for key, state in theirs.items():   # MemoryX's buffers came back; its update count did not (torch keeps none)
        assert set(ours[key]) == {"momentum_buffer"}
        assert torch.allclose(ours[key]["momentum_buffer"], state["momentum_buffer"], rtol=1e-4, atol=1e-6)


@pytest.mark.cluster
def test_a_dead_wse_in_a_cstorch_loop_raises_one_error_and_stops_the_job():
    from tests.cluster_utils import alive
    seen = {}

    def kill_wse(i):
        if i == 2:
            seen["procs"] = _job_processes()
            os.kill(next(pid for pid, args in seen["procs"] if "-m wse" in args), signal.SIGKILL)
    with pytest.raises(cstorch.JobFailed, match=r"wse 0 on \S+ \(pid \d+\) exited with signal SIGKILL"):
        _small_csx_loop(kill_wse)
    assert len(seen["procs"]) == 4   # memoryx, swarmx, the WSE, the input worker
    assert [pid for pid, _ in seen["procs"] if alive(pid)] == []


@pytest.mark.cluster
def test_an_exception_in_a_cbtorch_loop_stops_every_process():
    from tests.cluster_utils import alive
    from cs_torch.recording import legacy_loop
    original_backward = torch.Tensor.backward
    cbtorch.initialize()
    model = cbtorch.module(mlp.MLP(hidden=16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = cbtorch.dataloader(mlp.input_fn(32))
    seen = {}
    with pytest.raises(RuntimeError, match="boom"):
        with cbtorch.Session(loader, mode="train"):
            for step, (x, y) in enumerate(loader, start=1):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                if step == 3:
                    seen["procs"] = _job_processes()
                    raise RuntimeError("boom")
    assert len(seen["procs"]) == 4
    assert [pid for pid, _ in seen["procs"] if alive(pid)] == []
    assert torch.Tensor.backward is original_backward and legacy_loop() is None


@pytest.mark.cluster
def test_an_exception_in_a_cstorch_loop_stops_every_process():
    from tests.cluster_utils import alive
    seen = {}

    def boom(i):
        if i == 2:
            seen["procs"] = _job_processes()
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        _small_csx_loop(boom)
    assert len(seen["procs"]) == 4
    assert [pid for pid, _ in seen["procs"] if alive(pid)] == []
    assert _job_processes() == []


@pytest.mark.cluster
def test_ctrl_c_in_a_cstorch_script_stops_every_process(tmp_path):
    from tests.cluster_utils import REPO, alive, kill_tree
    from tests.test_api import job_processes
    cmd = [sys.executable, str(REPO / "examples" / "cstorch" / "mlp.py"), "--steps", "100000"]
    # Ctrl-C as at a terminal, also where pytest runs with SIGINT ignored (see test_api's Ctrl-C test)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:
            if line.startswith("step 10:"):
                break
        procs = job_processes(proc.pid)
        assert len(procs) == 4, procs     # the script's input_fn is imported by the worker from __main__'s file
        proc.send_signal(signal.SIGINT)
        output = proc.stdout.read()
        assert proc.wait(timeout=60) != 0
        assert "KeyboardInterrupt" in output
        assert [pid for pid, _ in procs if alive(pid)] == []
    finally:
        kill_tree(proc)


@pytest.mark.parametrize("flag", ["compile_only", "validate_only"])
def test_compile_only_captures_and_runs_no_step(flag, capsys):
    cstorch.backend("CSX", **{flag: True})
    model = mlp.MLP()
    before = copy.deepcopy(model.state_dict())
    compiled = cstorch.compile(model)
    opt = cstorch.optim.SGD(model.parameters(), 0.1)

    @cstorch.trace
    def step(x, y):
        loss = torch.nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        opt.step()
        return loss
    executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(mlp.input_fn, 32), num_steps=50)
    results = [step(x, y) for x, y in executor]
    assert results == [None]                     # one batch, captured, nothing run
    assert "compiled step: 6 ops, 6 parameters, 3 weight-streaming units" in capsys.readouterr().err
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.cluster
def test_the_model_zoos_two_param_groups_train_on_the_cs_system_as_torch_eager():
    """Weights decayed, biases not, as the model zoo's configure_param_groups splits them: one MemoryX rule."""
    cstorch.backend("CSX")
    torch.manual_seed(5)
    model = mlp.MLP(hidden=16)
    ref = copy.deepcopy(model)
    compiled = cstorch.compile(model)

    def groups(module):
        named = list(module.named_parameters())
        return [{"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.1},
                {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]
    opt = cstorch.optim.AdamW(groups(model), 0.01)
    losses, data = train_mlp_steps(compiled, opt, 5)
    ref_opt = torch.optim.AdamW(groups(ref), 0.01, eps=1e-6)
    assert_close_losses(losses, eager_train(ref, ref_opt, data, torch.nn.functional.cross_entropy))
    assert_same_weights(model, ref)


def test_param_groups_that_are_not_one_memoryx_rule_are_one_line():
    from cs_torch.cluster_step import memoryx_optimizer
    model = torch.nn.Linear(3, 2)
    params = dict(model.named_parameters())
    both_decayed = cstorch.optim.AdamW([{"params": [model.weight], "weight_decay": 0.1},
                                        {"params": [model.bias], "weight_decay": 0.1}], 0.01)
    assert memoryx_optimizer(both_decayed, params).section["exclude_bias_and_norm"] is False   # as one group
    bias_decayed = cstorch.optim.AdamW([{"params": [model.weight], "weight_decay": 0.0},
                                        {"params": [model.bias], "weight_decay": 0.1}], 0.01)
    with pytest.raises(CsTorchError, match="parameter weight has weight decay 0.0 in its param group"):
        memoryx_optimizer(bias_decayed, params)
    other_lr = cstorch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.5}], 0.01)
    with pytest.raises(CsTorchError, match="param groups differing in lr"):
        memoryx_optimizer(other_lr, params)


class Endless(torch.utils.data.IterableDataset):
    """(input, label) pairs without end; counts what was read of it."""

    def __init__(self):
        self.read = 0

    def __iter__(self):
        gen = torch.Generator().manual_seed(4)
        while True:
            self.read += 1
            x = torch.randn(32, generator=gen)
            yield x, int(x[:10].argmax())


@pytest.mark.cluster
def test_a_cbtorch_loop_over_an_endless_iterable_dataset_reads_only_its_steps(tmp_path):
    torch.manual_seed(1)
    cbtorch.initialize(service_workdir=str(tmp_path / "work"))
    net = mlp.MLP(hidden=16)
    ref = copy.deepcopy(net)
    model = cbtorch.module(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = Endless()
    loader = cbtorch.dataloader(torch.utils.data.DataLoader(data, batch_size=8))
    losses, seen = [], []
    with cbtorch.Session(loader, mode="train") as session:
        for step, (x, y) in enumerate(loader, start=1):
            seen.append((x, y))
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            session.add_step_closure(lambda loss: losses.append(loss.item()), [loss])
            if step == 5:
                break
    assert data.read == 5 * 8     # nothing read ahead of the loop (the workers waited for each batch)
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    assert_close_losses(losses, eager_train(ref, ref_optimizer, seen, torch.nn.functional.cross_entropy))
    assert_same_weights(net, ref)
    assert not [p for p in (tmp_path / "work").rglob("*.npz")]   # the batches' files went with the job
