"""The Cerebras PyTorch API (2.x: import cs_torch as cstorch; 1.x: cs_torch.cbtorch) against torch eager."""
import copy
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


def batches(loader, steps):
    out = []
    while len(out) < steps:
        for batch in loader:
            out.append(batch)
            if len(out) == steps:
                break
    return out


def assert_close_losses(got, want):
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert abs(g - w) <= REL * abs(w), f"step {step}: {g} vs torch eager {w}"


def assert_same_weights(model, ref, rel=1e-4):
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        scale = float(b.abs().max()) or 1.0
        assert float((a - b).abs().max()) <= rel * scale, name


def eager_train(model, optimizer, loader, steps, loss_of, scheduler=None):
    losses = []
    for x, y in batches(loader, steps):
        optimizer.zero_grad()
        loss = loss_of(model(x), y)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------- the examples vs torch eager
@pytest.mark.parametrize("num_csx", [1, 2])
def test_mlp_example_matches_torch_eager(num_csx):
    losses, eval_losses, model = mlp.main(steps=24, num_csx=num_csx, log=lambda *a: None)
    torch.manual_seed(1)
    ref = mlp.MLP()
    opt = torch.optim.SGD(ref.parameters(), 0.05, momentum=0.9, nesterov=True)
    loss_fn = torch.nn.CrossEntropyLoss()
    assert_close_losses(losses, eager_train(ref, opt, mlp.input_fn(32, "train"), 24, loss_fn))
    assert_same_weights(model, ref)
    with torch.no_grad():
        want = [loss_fn(ref(x), y).item() for x, y in mlp.input_fn(32, "eval")]
    assert_close_losses(eval_losses, want)


@pytest.mark.parametrize("num_csx", [1, 2])
def test_cnn_example_matches_torch_eager_and_checkpoints_load(num_csx, tmp_path):
    losses, model = cnn.main(steps=12, num_csx=num_csx, model_dir=str(tmp_path / "cnn"), log=lambda *a: None)
    torch.manual_seed(2)
    ref = cnn.CNN()
    opt = torch.optim.Adam(ref.parameters(), 2e-3, eps=1e-8)
    assert_close_losses(losses, eager_train(ref, opt, cnn.input_fn(16), 12, torch.nn.CrossEntropyLoss()))
    assert_same_weights(model, ref)
    saved = sorted(p.name for p in (tmp_path / "cnn").iterdir())
    assert saved == ["checkpoint_10.mdl", "checkpoint_12.mdl"]
    state = torch.load(tmp_path / "cnn" / "checkpoint_12.mdl", weights_only=True)   # a torch user opens it
    fresh = cnn.CNN()
    fresh.load_state_dict(state["model"])
    assert_same_weights(fresh, model, rel=0)
    assert state["step"] == 12 and state["optimizer"]["state"][0]["step"] == 12


@pytest.mark.parametrize("num_csx", [1, 2])
def test_gpt2_example_with_warmup_matches_torch_eager(num_csx, tmp_path):
    steps = 12
    losses, model = gpt2.main(steps=steps, num_csx=num_csx, model_dir=str(tmp_path / "g"), log=lambda *a: None)
    torch.manual_seed(3)
    ref = gpt2.GPT2()
    opt = torch.optim.AdamW(ref.parameters(), 3e-3, eps=1e-8, weight_decay=0.01)
    sched = gpt2.schedule(opt, warmup=steps // 4, total=steps)   # cstorch's schedules drive torch's optimizer
    want = eager_train(ref, opt, gpt2.input_fn(8), steps,
                       lambda logits, y: torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                                           y.reshape(-1)), sched)
    assert_close_losses(losses, want)
    assert_same_weights(model, ref, rel=1e-3)   # AdamW turns float32 noise into steps (docs/cstorch.md)
    assert list((tmp_path / "g" / "train").iterdir()), "no TensorBoard events written"


@pytest.mark.parametrize("num_csx", [1, 2])
def test_cbtorch_example_matches_torch_eager(num_csx):
    losses, eval_losses, model = cbtorch_mlp.main(epochs=2, num_csx=num_csx, log=lambda *a: None)
    torch.manual_seed(1)
    ref = mlp.MLP()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    loader = mlp.input_fn(32, "train")
    assert_close_losses(losses, eager_train(ref, opt, loader, 2 * len(loader), loss_fn))
    assert_same_weights(model, ref)
    with torch.no_grad():
        assert_close_losses(eval_losses, [loss_fn(ref(x), y).item() for x, y in mlp.input_fn(32, "eval")])
