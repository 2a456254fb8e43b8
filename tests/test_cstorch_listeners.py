"""A DataExecutor's tensor listeners (2.0/2.1 create_listener) on the CPU backend: at every step each
writes the summaries of the module outputs it selects, equal to torch eager's values of the same
module outputs (forward hooks) at that step. Cheap: a tiny model, three steps, no process.

    python -m pytest tests/test_cstorch_listeners.py -q
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="cs_torch's 2.x API takes torch modules (pip install -e '.[torch]')")
pytest.importorskip("tensorboardX", reason="the listeners' scalars are written with tensorboardX")

import cerebras_pytorch as cstorch  # noqa: E402  (after the skip: it needs torch)
from cs_torch.backends import reset_backend  # noqa: E402
from cs_torch.nn import CsTorchError  # noqa: E402
from tests.test_summaries import read_scalars  # noqa: E402

STEPS, ROWS = 3, 4


pytestmark = pytest.mark.usefixtures("fresh_backend")   # tests/conftest.py


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh())   # its output: its last op's
        self.fc2 = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(self.block(x))


def batches():
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(ROWS, 5, generator=generator), torch.randint(0, 3, (ROWS,), generator=generator))
            for _ in range(STEPS)]


def eager_outputs(model: Net) -> list[dict]:
    """torch eager's outputs of block and block.0 at each step of the same SGD training."""
    seen, steps = {}, []
    for name in ("block", "block.0"):
        model.get_submodule(name).register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.detach()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for x, y in batches():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps.append(dict(seen))
    return steps


def traced_sgd_step(compiled, model, lr: float):
    """A classifier's traced training step: cross entropy of the compiled model's scores, SGD."""
    optimizer = cstorch.optim.SGD(model.parameters(), lr=lr)

    @cstorch.trace
    def step(x, y):
        loss = torch.nn.functional.cross_entropy(compiled(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss
    return step


def test_listeners_write_torch_eagers_module_outputs_at_every_step(tmp_path) -> None:
    torch.manual_seed(0)
    model = Net()
    expected = eager_outputs(_copy(model))
    cstorch.backend("CPU")
    compiled = cstorch.compile(model)
    step = traced_sgd_step(compiled, model, lr=0.5)

    listeners = [cstorch.experimental.listener.create_listener(listener_type="norm", listener_name="norms",
                                                               tensor_names=["block.0", "block", "fc*"]),
                 cstorch.experimental.listener.create_listener(listener_type="summary", listener_name="acts",
                                                               tensor_names="block")]
    writer = cstorch.utils.tensorboard.SummaryWriter(log_dir=str(tmp_path))
    loader = cstorch.utils.data.DataLoader(batches)
    for x, y in cstorch.utils.data.DataExecutor(loader, num_steps=STEPS, writer=writer, listeners=listeners):
        step(x, y)
    writer.close()

    scalars = {(s, tag): value for s, tag, value, _ in read_scalars(tmp_path)}
    assert {tag for _, tag in scalars} == {"norms/block.0", "norms/block", "norms/fc2", "norms/__all__"}
    for index, outputs in enumerate(expected):
        at = index + 1
        norms = {name: torch.linalg.vector_norm(value).item() for name, value in outputs.items()}
        assert scalars[(at, "norms/block.0")] == pytest.approx(norms["block.0"], rel=1e-5)
        assert scalars[(at, "norms/block")] == pytest.approx(norms["block"], rel=1e-5)
        (written,) = cstorch.utils.tensorboard.SummaryReader(str(tmp_path)).read_tensor("acts/block", step=at)
        torch.testing.assert_close(written.tensor, outputs["block"], rtol=1e-5, atol=1e-6)
        parts = [scalars[(at, f"norms/{name}")] for name in ("block.0", "block", "fc2")]
        assert scalars[(at, "norms/__all__")] == pytest.approx(sum(p * p for p in parts) ** 0.5, rel=1e-6)


def _copy(model: Net) -> Net:
    twin = Net()
    twin.load_state_dict(model.state_dict())
    return twin


def test_a_listener_of_no_tensor_listener_kind_is_one_line() -> None:
    loader = cstorch.utils.data.DataLoader(batches)
    with pytest.raises(CsTorchError, match="listeners must be made by experimental.listener.create_listener, got str"):
        cstorch.utils.data.DataExecutor(loader, num_steps=1, listeners=["a listener"])


def test_listeners_on_csx_stop_the_loop_in_one_line_before_any_job() -> None:
    cstorch.backend("CSX")
    listener = cstorch.experimental.listener.create_listener(listener_type="norm", listener_name="norms",
                                                             tensor_names="*")
    executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(batches), num_steps=1,
                                               listeners=[listener])
    with pytest.raises(CsTorchError, match=r"^DataExecutor: listener norms is fed on the CPU backend only; on CSX"):
        next(iter(executor))


class Pair(torch.nn.Module):
    def forward(self, x):
        return x.sin(), x.cos()


class TwoOutputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.pair = torch.nn.Linear(5, 3), Pair()

    def forward(self, x):
        first, second = self.pair(self.fc(x))
        return first + second


def train_two_outputs(tmp_path, tensor_names) -> list[tuple]:
    """One step of TwoOutputs with a norm listener of `tensor_names`: the scalars it wrote."""
    reset_backend()
    cstorch.backend("CPU")
    torch.manual_seed(0)
    model = TwoOutputs()
    compiled = cstorch.compile(model)
    step = traced_sgd_step(compiled, model, lr=0.1)

    listener = cstorch.experimental.listener.create_listener(listener_type="norm", listener_name="norms",
                                                             tensor_names=tensor_names)
    writer = cstorch.utils.tensorboard.SummaryWriter(log_dir=str(tmp_path))
    try:
        for x, y in cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(batches), num_steps=1,
                                                    writer=writer, listeners=[listener]):
            step(x, y)
    finally:
        writer.close()
    return read_scalars(tmp_path)


def test_a_tensor_of_no_single_program_value_is_one_line_by_name_and_skipped_by_glob(tmp_path, capsys) -> None:
    with pytest.raises(CsTorchError, match=r"^listener norms: the traced tensor pair\.0 is not one value"):
        train_two_outputs(tmp_path / "exact", ["fc", "pair.0"])
    written = train_two_outputs(tmp_path / "glob", "*")
    assert "listeners: 2 matched traced tensors are not one value of the compiled program and are not " \
           "summarized: pair.0, pair.1" in capsys.readouterr().err
    x, _ = batches()[0]
    torch.manual_seed(0)
    fc = TwoOutputs().fc
    by_tag = {tag: value for _, tag, value, _ in written}
    assert set(by_tag) == {"norms/fc", "norms/TwoOutputs", "norms/__all__"}
    assert by_tag["norms/fc"] == pytest.approx(torch.linalg.vector_norm(fc(x)).item(), rel=1e-5)
