"""A CSX loop over dict batches (the model zoo's: input_ids, attention_mask, labels), a model that
computes its own loss from the whole dict (`model(batch)`), on 1 and 2 WSEs against torch eager: the
dict's named tensors reach the WSEs as the program's inputs and its labels as the target.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="cs_torch's 2.x API takes torch modules (pip install -e '.[torch]')")

import cerebras_pytorch as cstorch  # noqa: E402  (after the skip: it needs torch)
from cs_torch.backends import reset_backend  # noqa: E402

pytestmark = pytest.mark.cluster   # the CSX runs start a job's processes

STEPS = 5
VOCAB, SEQ, CLASSES = 20, 6, 3


class Tokens(torch.utils.data.IterableDataset):
    """Sequences of token ids padded at the end, their mask, and a class each (as the model zoo's dicts)."""

    def __iter__(self):
        gen = torch.Generator().manual_seed(3)
        for _ in range(48):
            length = int(torch.randint(2, SEQ + 1, (1,), generator=gen))
            mask = (torch.arange(SEQ) < length).to(torch.int32)
            ids = torch.randint(1, VOCAB, (SEQ,), generator=gen, dtype=torch.int32) * mask
            yield {"input_ids": ids, "attention_mask": mask, "labels": ids[:length].sum().remainder(CLASSES).long()}


def input_fn(batch_size):
    return torch.utils.data.DataLoader(Tokens(), batch_size, drop_last=True)


class MaskedClassifier(torch.nn.Module):
    """Mean of the unmasked tokens' embeddings, a classifier on it, its own cross-entropy."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, CLASSES)

    def forward(self, batch):
        mask = batch["attention_mask"].to(torch.float32).unsqueeze(-1)
        pooled = (self.embed(batch["input_ids"].long()) * mask).sum(1) / mask.sum(1)
        return torch.nn.functional.cross_entropy(self.head(pooled), batch["labels"].long())


def train(kind: str, num_csx: int = 1):
    """(each step's loss, the batches the loop got, the trained model) of a 2.x loop on `kind`."""
    reset_backend()
    cstorch.manual_seed(1)
    torch.manual_seed(1)
    backend = cstorch.backend(kind, artifact_dir="cerebras", **({"num_csx": num_csx} if kind == "CSX" else {}))
    model = MaskedClassifier()
    compiled = cstorch.compile(model, backend)
    optimizer = cstorch.optim.SGD(model.parameters(), 0.5)

    @cstorch.trace
    def step(batch):
        loss = compiled(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    losses, seen = [], []
    executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(input_fn, 8), num_steps=STEPS)
    for batch in executor:
        seen.append({k: v.clone() for k, v in batch.items()})
        losses.append(step(batch).item())
    return losses, seen, model


def eager(batches):
    torch.manual_seed(1)
    model = MaskedClassifier()
    opt = torch.optim.SGD(model.parameters(), 0.5)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = model(batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("num_csx, rtol", [(1, 1e-5), (2, 1e-5)])
def test_a_dict_batch_trains_on_csx_as_torch_eager(num_csx, rtol, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    csx_losses, csx_batches, csx_model = train("CSX", num_csx)
    assert len(csx_batches) == STEPS
    want, ref = eager(csx_batches)
    assert len({round(v, 6) for v in want}) > 1   # the loss moves: the check is not of a constant
    np.testing.assert_allclose(csx_losses, want, rtol=rtol)
    for (name, a), (_, b) in zip(csx_model.state_dict().items(), ref.state_dict().items()):
        assert float((a - b).abs().max()) <= 1e-5 * max(float(b.abs().max()), 1.0), name
