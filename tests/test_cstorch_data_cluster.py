"""A CSX loop over the torch DataLoaders the model zoo gives it, against the CPU backend and torch eager:
a shuffling loader over several epochs (the global generator), an IterableDataset, one of whole
batches read by the loader's worker processes (BERT's, num_workers > 0), and one of cstorch's
DistributedSampler. The CSX run trains
on the batches the CPU run sees, in the same order, and its losses and weights equal torch eager's there.
"""
from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="cs_torch's 2.x API takes torch modules (pip install -e '.[torch]')")

import cerebras_pytorch as cstorch  # noqa: E402  (after the skip: it needs torch)
from cs_torch.backends import reset_backend  # noqa: E402

pytestmark = pytest.mark.cluster   # the CSX runs start a job's processes

STEPS = 13
REL = 1e-5


def shuffled_input_fn(batch_size):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 6, generator=gen)
    y = (x @ torch.randn(6, 4, generator=gen)).argmax(dim=1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size, shuffle=True,
                                       drop_last=True)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        gen = torch.Generator().manual_seed(5)
        for _ in range(30):       # 7 batches of 4 an epoch, the last 2 samples dropped
            x = torch.randn(6, generator=gen)
            yield x, int(x[:4].argmax())


def iterable_input_fn(batch_size):
    return torch.utils.data.DataLoader(Stream(), batch_size, drop_last=True)


class ShardedBatches(torch.utils.data.IterableDataset):
    """Whole batches of 4 from 4 'files', shared among the loader's worker processes by its worker_init_fn,
    as the model zoo's BERT CSV processor does under batch_size=None with num_workers > 0 (so the data set
    can be read only through the loader)."""
    files = None

    def __iter__(self):
        for file in self.files:
            gen = torch.Generator().manual_seed(10 + file)
            for _ in range(2):
                x = torch.randn(4, 6, generator=gen)
                yield x, x[:, :4].argmax(dim=1)


def _share_files(worker_id):
    info = torch.utils.data.get_worker_info()
    info.dataset.files = list(range(info.id, 4, info.num_workers))


def distributed_sampler_input_fn(batch_size):
    """cstorch's own sampler (the model zoo's map-style data sets): 30 samples, batches of 8, so each
    epoch's leftovers open the next; its order is seeded per epoch, not drawn from torch's generators."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(30, 6, generator=gen)
    data = torch.utils.data.TensorDataset(x, x[:, :4].argmax(dim=1))
    return torch.utils.data.DataLoader(data, batch_sampler=cstorch.utils.data.DistributedSampler(
        data, shuffle=True, seed=3, batch_size=batch_size))


def worker_processes_input_fn(batch_size):
    return torch.utils.data.DataLoader(ShardedBatches(), batch_size=batch_size, num_workers=2,
                                       worker_init_fn=_share_files)


def selected(param):
    """The SelectiveGrad mask of the selective run: the larger entries of the first layer's weight."""
    return param.abs() > 0.2


def train(kind: str, input_fn, batch_size: int, steps: int = STEPS, selective: bool = False):
    """(each step's loss, the batches the loop got, the trained model) of a 2.x loop on `kind`; with
    `selective`, AdamW training only the `selected` entries of the first layer's weight (nn.SelectiveGrad)."""
    reset_backend()
    cstorch.manual_seed(1)
    torch.manual_seed(1)
    backend = cstorch.backend(kind, artifact_dir="cerebras")
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    compiled = cstorch.compile(model, backend)
    if selective:
        compiled.apply(cstorch.nn.SelectiveGrad("0.weight", selected))
        optimizer = cstorch.optim.AdamW(model.parameters(), 0.05, weight_decay=0.1)
    else:
        optimizer = cstorch.optim.SGD(model.parameters(), 0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    @cstorch.trace
    def step(x, y):
        loss = loss_fn(compiled(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    losses, seen = [], []
    executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(input_fn, batch_size), num_steps=steps)
    for x, y in executor:
        seen.append((x.clone(), y.clone()))
        losses.append(step(x, y).item())
    return losses, seen, model


def eager(batches):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("input_fn, batch_size", [(shuffled_input_fn, 8), (iterable_input_fn, 4),
                                                   (worker_processes_input_fn, None),
                                                   (distributed_sampler_input_fn, 8)])
def test_csx_trains_on_the_cpu_runs_batches_in_order(input_fn, batch_size, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cpu_losses, cpu_batches, _ = train("CPU", input_fn, batch_size)
    csx_losses, csx_batches, csx_model = train("CSX", input_fn, batch_size)
    assert not multiprocessing.active_children()   # a loader's worker processes stopped with the run
    assert len(csx_batches) == STEPS
    for (a, b), (c, d) in zip(cpu_batches, csx_batches):
        assert torch.equal(a, c) and torch.equal(b, d)
    want, ref = eager(cpu_batches)
    np.testing.assert_allclose(csx_losses, want, rtol=REL)
    np.testing.assert_allclose(cpu_losses, want, rtol=REL)
    for (name, a), (_, b) in zip(csx_model.state_dict().items(), ref.state_dict().items()):
        assert float((a - b).abs().max()) <= 1e-4 * (float(b.abs().max()) or 1.0), name


@pytest.mark.parametrize("workers", [dict(num_workers=1), dict(num_workers=1, persistent_workers=True)])
def test_the_order_drawn_for_the_workers_is_torchs_with_loader_processes(workers):
    """A loader with worker processes (the CPU path starts them) draws its epochs as one without: the same
    order; with persistent workers, one iterator reset each epoch (one draw fewer), still the same."""
    from cs_torch.loader_replay import RunSamples, start_states
    data = torch.utils.data.TensorDataset(torch.arange(20.0).reshape(20, 1), torch.zeros(20))
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(data, 5, shuffle=True, drop_last=True, **workers)
    want = [int(v) for _ in range(3) for x, _ in loader for v in x[:, 0]]
    del loader     # its worker processes stop with it
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(data, 5, shuffle=True, drop_last=True, **workers)
    samples = RunSamples(loader, 12, start_states(loader))
    got = [int(v) for b in range(12) for v in samples.batch(b)]
    assert got == want and sorted(want[:20]) != want[:20]


def test_selective_grad_on_csx_trains_as_the_cpu_backend_and_torch_eager(tmp_path, monkeypatch):
    """nn.SelectiveGrad on CSX: the mask goes to MemoryX with the optimizer's state, and MemoryX's update
    masks as the CPU backend's (the real API's arithmetic): the same losses and weights as the CPU run
    and as torch eager doing that arithmetic; the entries outside the mask keep their starting values."""
    from tests.test_cstorch_zoo_names import eager_selective_steps
    monkeypatch.chdir(tmp_path)
    steps = 4
    cpu_losses, batches, cpu_model = train("CPU", shuffled_input_fn, 8, steps, selective=True)
    csx_losses, csx_batches, csx_model = train("CSX", shuffled_input_fn, 8, steps, selective=True)
    assert all(torch.equal(a, c) for (a, _), (c, _) in zip(batches, csx_batches))
    torch.manual_seed(1)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    start, mask = reference[0].weight.detach().clone(), selected(reference[0].weight.detach())
    want = eager_selective_steps(reference, lambda ps: torch.optim.AdamW(ps, 0.05, weight_decay=0.1, eps=1e-6),
                                 {reference[0].weight: mask}, batches, torch.nn.functional.cross_entropy)
    np.testing.assert_allclose(csx_losses, want, rtol=REL)
    np.testing.assert_allclose(cpu_losses, want, rtol=REL)
    assert 0 < int(mask.sum()) < mask.numel() and torch.equal(csx_model[0].weight_requires_grad, mask)
    assert torch.equal(csx_model[0].weight[~mask], start[~mask])
    assert not torch.equal(csx_model[0].weight[mask], start[mask])
    for name, value in reference.state_dict().items():
        for model in (cpu_model, csx_model):
            assert float((model.state_dict()[name] - value).abs().max()) <= 1e-5 * float(value.abs().max()), name
