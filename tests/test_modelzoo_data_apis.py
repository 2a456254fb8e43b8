"""Contracts of what the model zoo's data processors (FC-MNIST through torchvision, GptHDF5DataProcessor,
BertCSVDataProcessor; Release_2.1.1) call, written here against torch and the formats as documented: the
processors themselves run from a model zoo checkout in scripts/modelzoo_data.py (never committed here).

cstorch.utils.data.DataLoader(input_fn, params) gives an executor the torch loader input_fn makes from
the params dict: its batches as they are (tuples, or dicts of a processor's features), epoch after epoch,
an IterableDataset read anew each pass, a loader of pre-made batches (batch_size=None, BERT's CSV
processor) as well; torchvision's MNIST reader and transforms, imported past the registry wheel's
compiled-ops failure (docs/testing.md), read MNIST's idx files as the FC-MNIST processor reads them.
"""
from __future__ import annotations

import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the model zoo's loaders are torch DataLoaders (pip install -e '.[torch]')")

import cerebras_pytorch as cstorch  # noqa: E402  (after the skip: it needs torch)
from cs_torch.backends import reset_backend  # noqa: E402
from tests.other_models import importable_torchvision  # noqa: E402  (past the wheel's compiled ops)

SEQ = 6


class Rows(torch.utils.data.IterableDataset):
    """A processor-like IterableDataset: dicts of int32 features read from a 'file' each pass (GPT-2's)."""

    def __init__(self, data):
        self.data, self.passes = data, 0

    def __iter__(self):
        self.passes += 1
        for row in self.data:
            yield {"input_ids": row[0], "attention_mask": row[1], "labels": row[2]}


class Batches(torch.utils.data.IterableDataset):
    """Pre-made batches (BERT's CSV processor: DataLoader(self, batch_size=None))."""

    def __init__(self, data, batch_size):
        self.data, self.batch_size = data, batch_size

    def __iter__(self):
        for start in range(0, len(self.data) - self.batch_size + 1, self.batch_size):
            yield {"input_ids": torch.from_numpy(self.data[start:start + self.batch_size, 0])}

    def __len__(self):   # batches, as the processor counts them
        return len(self.data) // self.batch_size


DATA = np.random.default_rng(0).integers(0, 50, (20, 3, SEQ)).astype(np.int32)


def processor_input_fn(params):
    section = params["train_input"]
    if section["pre_batched"]:
        return torch.utils.data.DataLoader(Batches(DATA, section["batch_size"]), batch_size=None)
    return torch.utils.data.DataLoader(Rows(DATA), batch_size=section["batch_size"], drop_last=True)


@pytest.mark.parametrize("pre_batched", [False, True])
def test_a_processors_dict_batches_come_as_torch_makes_them_epoch_after_epoch(pre_batched):
    reset_backend()
    cstorch.backend("CPU")
    params = {"train_input": {"batch_size": 4, "pre_batched": pre_batched}}
    loader = cstorch.utils.data.DataLoader(processor_input_fn, params)
    if pre_batched:
        assert len(loader) == 5 and len(cstorch.utils.data.DataExecutor(loader)) == 5   # one pass by default
    executor = cstorch.utils.data.DataExecutor(loader, num_steps=12)   # 5 batches a pass: 2 passes and 2 batches
    got = [batch["input_ids"].clone() for batch in executor]
    want = [torch.from_numpy(DATA[s:s + 4, 0]) for _ in range(3) for s in range(0, 20, 4)][:12]
    assert len(got) == 12 and all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[0].dtype == torch.int32        # the processors' int32 features stay int32 on the CPU path
    if not pre_batched:
        assert loader.loader.dataset.passes == 3   # read anew each pass, as iterating the torch loader does


# ---------------------------------------------------------------- torchvision's MNIST reader (FC-MNIST's processor)
def write_mnist(root, images, labels):
    """MNIST's idx files (both splits, as torchvision checks) in root/MNIST/raw."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix in ("train", "t10k"):
        n = len(images)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, n) + labels.tobytes())


def test_torchvisions_mnist_reader_and_transforms_give_the_fc_mnist_processors_tensors(tmp_path):
    torchvision = importable_torchvision()
    if torchvision is None:
        pytest.skip("torchvision is not installed (the FC-MNIST processor reads through it; pip install -e "
                    "'.[models]')")
    from torchvision import datasets, transforms
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (12, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 12, dtype=np.uint8)
    write_mnist(tmp_path, images, labels)
    half = cstorch.amp.get_half_dtype()
    dataset = datasets.MNIST(str(tmp_path), train=True, download=False, transform=transforms.Compose([
        transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,)),
        transforms.Lambda(lambda x: torch.as_tensor(x, dtype=half))]),
        target_transform=transforms.Lambda(lambda y: torch.as_tensor(y, dtype=torch.int32)))
    x, y = next(iter(torch.utils.data.DataLoader(dataset, batch_size=12, shuffle=False, drop_last=True)))
    want = ((torch.from_numpy(images).float() / 255 - 0.1307) / 0.3081).unsqueeze(1).to(half)
    assert x.dtype == half and y.dtype == torch.int32 and x.shape == (12, 1, 28, 28)
    assert torch.equal(x, want) and y.tolist() == labels.tolist()
