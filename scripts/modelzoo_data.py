"""The Cerebras model zoo's data processors as shipped, run on data made here, with the emulator's cstorch.

    python scripts/modelzoo_data.py /path/to/modelzoo-checkout [--work DIR]

For FC-MNIST (torchvision's MNIST reader and transforms), GPT-2
(GptHDF5DataProcessor) and BERT (BertCSVDataProcessor) this makes a small
data set in the format the processor reads (MNIST's idx files, HDF5 files of
[n, 3, seq] token rows, CSV files with meta.dat), builds the processor's
DataLoader from the checkout's own code under a CPU and a CSX backend
(`cstorch.use_cs()` decides the dtypes the processors give), reads two
epochs and checks every batch against the data as made: the same samples,
in file order when unshuffled, each sample once an epoch when shuffled.
Then a small model trains on the FC-MNIST loader (shuffled, 3 epochs) on
the CPU backend and as a CSX job, whose input workers build the loader
themselves: the same batches in the same order, and the same loss each step.

The model zoo is not part of this project: bring a checkout of its public
repository (Release_2.1.1's layout, `modelzoo/...`). Its own requirements
(jsonschema, h5py) must import. torchvision's registry wheel does not import
beside the CPU torch; this script imports it past that with the lines
docs/testing.md gives. The contract tests of each cstorch API these processors call are
tests/test_modelzoo_data_apis.py. CI does not run this script.

Exit status 0 when every check passes, 1 when one fails, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import csv
import struct
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BATCH = 8
SEQ = 16
PREDICTIONS = 4
VOCAB = 100


# ---------------------------------------------------------------- data made here
def make_mnist(folder: Path, rng, count: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """MNIST's four idx files where torchvision's MNIST reads them (it wants both splits); the train split's
    (images, labels)."""
    raw = folder / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, (count,), dtype=np.uint8)
    for prefix in ("train", "t10k"):
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, count, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, count) + labels.tobytes())
    return images, labels


def make_gpt_hdf5(folder: Path, rng, count: int = 40) -> np.ndarray:
    """The GPT HDF5 format: files of data [n, 3, seq] (input_ids, input_mask, labels), attribute n_examples;
    every file's rows in file-name order."""
    import h5py
    folder.mkdir(parents=True, exist_ok=True)
    tokens = rng.integers(0, VOCAB, (count, SEQ + 1), dtype=np.int32)
    data = np.stack([tokens[:, :-1], (rng.random((count, SEQ)) < 0.9).astype(np.int32), tokens[:, 1:]], axis=1)
    for index, part in enumerate(np.split(data, [24])):   # two files, 24 and 16 rows
        with h5py.File(folder / f"data-{index}.h5", "w") as f:
            f.attrs["n_examples"] = len(part)
            f.create_dataset("data", data=part)
    return data


BERT_COLUMNS = ("input_ids", "attention_mask", "token_type_ids", "masked_lm_positions", "masked_lm_weights",
                "labels", "next_sentence_label")


def make_bert_csv(folder: Path, rng, count: int = 40) -> list[dict]:
    """The BERT CSV format: rows whose features are lists written as text, meta.dat naming each file's rows."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for _ in range(count):
        length = int(rng.integers(SEQ // 2, SEQ + 1))
        split = int(rng.integers(1, length))
        rows.append({"input_ids": [int(t) for t in rng.integers(5, VOCAB, length)] + [0] * (SEQ - length),
                     "attention_mask": [1] * length + [0] * (SEQ - length),
                     "token_type_ids": [0] * split + [1] * (length - split) + [0] * (SEQ - length),
                     "masked_lm_positions": sorted(int(p) for p in rng.choice(np.arange(1, length), PREDICTIONS,
                                                                              replace=False)),
                     "masked_lm_weights": [1] * PREDICTIONS,
                     "labels": [int(t) for t in rng.integers(5, VOCAB, PREDICTIONS)],
                     "next_sentence_label": [int(rng.integers(0, 2))]})
    with open(folder / "data-0.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=BERT_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (folder / "meta.dat").write_text(f"data-0.csv {count}\n")
    return rows


# ---------------------------------------------------------------- the checks
class Checks:
    def __init__(self):
        self.failed = []

    def expect(self, ok: bool, what: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            self.failed.append(what)


def epochs(loader, count: int = 2) -> list[list]:
    return [list(loader) for _ in range(count)]


def check_mnist(checks: Checks, work: Path, kind: str) -> None:
    import torch
    import cerebras_pytorch as cstorch
    from modelzoo.fc_mnist.pytorch.data import get_train_dataloader
    images, labels = make_mnist(work / "mnist", np.random.default_rng(0))
    want_x = torch.from_numpy((images / 255.0).astype(np.float32)).sub(0.1307).div(0.3081).unsqueeze(1)
    for shuffle in (False, True):
        params = {"train_input": {"data_dir": str(work / "mnist"), "batch_size": BATCH, "drop_last_batch": True,
                                  "to_float16": kind == "CSX", "shuffle": shuffle}}
        seen = epochs(get_train_dataloader(params))
        x = torch.cat([b[0] for b in seen[0]])
        y = torch.cat([b[1] for b in seen[0]])
        dtype, label_dtype = (cstorch.amp.get_half_dtype(), torch.int32) if kind == "CSX" else \
            (torch.float32, torch.int64)
        checks.expect(x.dtype == dtype and y.dtype == label_dtype,
                      f"MNIST {kind}: images {x.dtype}, labels {y.dtype} (want {dtype}, {label_dtype})")
        order = [int(i) for i in _rows_of(x.float(), want_x.to(dtype).float())]
        want_order = sorted(order) if shuffle else list(range(len(images)))
        checks.expect(sorted(order) == want_order == list(range(len(images))) and
                      (order != want_order) == shuffle and np.array_equal(y.numpy(), labels[order]),
                      f"MNIST {kind} shuffle={shuffle}: every image normalised as torchvision does, "
                      f"{'a new order' if shuffle else 'in file order'}, its label with it")


def _rows_of(got, want):
    """The index in `want` of each row of `got` (-1 where none is equal)."""
    flat_want = want.reshape(len(want), -1)
    return [next((j for j in range(len(flat_want)) if bool((flat_want[j] == row).all())), -1)
            for row in got.reshape(len(got), -1)]


def check_gpt(checks: Checks, work: Path, kind: str) -> None:
    from modelzoo.transformers.pytorch.gpt2.input.GptHDF5DataProcessor import GptHDF5DataProcessor
    data = make_gpt_hdf5(work / "gpt_h5", np.random.default_rng(1))
    loader = GptHDF5DataProcessor({"data_dir": str(work / "gpt_h5"), "batch_size": BATCH, "shuffle": False,
                                   "num_workers": 0}).create_dataloader()
    for number, epoch in enumerate(epochs(loader)):
        got = {k: np.concatenate([b[k].numpy() for b in epoch]) for k in ("input_ids", "attention_mask", "labels")}
        want = {"input_ids": data[:, 0], "attention_mask": data[:, 1], "labels": data[:, 2]}
        checks.expect(all(np.array_equal(got[k], want[k]) for k in want),
                      f"GPT-2 HDF5 {kind} epoch {number}: input_ids, attention_mask and labels of every row, in file "
                      "order")


def check_bert(checks: Checks, work: Path, kind: str) -> None:
    from modelzoo.transformers.pytorch.bert.input.BertCSVDataProcessor import BertCSVDataProcessor
    rows = make_bert_csv(work / "bert_csv", np.random.default_rng(2))
    loader = BertCSVDataProcessor({"data_dir": str(work / "bert_csv"), "batch_size": BATCH, "shuffle": False,
                                   "max_sequence_length": SEQ, "max_predictions_per_seq": PREDICTIONS,
                                   "num_workers": 0}).create_dataloader()
    names = {"masked_lm_mask": "masked_lm_weights"}
    for number, epoch in enumerate(epochs(loader)):
        keys = sorted(epoch[0])
        got = {k: np.concatenate([b[k].numpy() for b in epoch]) for k in keys}
        ok = len(got["input_ids"]) == len(rows) and all(
            np.array_equal(got[k], np.array([r[names.get(k, k)] for r in rows], dtype=np.int32)) for k in keys)
        checks.expect(ok, f"BERT CSV {kind} epoch {number}: {', '.join(keys)} of every row, in file order")


def mnist_input_fn(params: dict, checkout: str):
    """The model zoo's FC-MNIST loader, as the input workers of a CSX job import it (by name, from this file):
    each process puts the checkout on its path and imports torchvision past the wheel's compiled ops."""
    if checkout not in sys.path:
        sys.path.insert(0, checkout)
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    from modelzoo.fc_mnist.pytorch.data import get_train_dataloader
    return get_train_dataloader(params)


def train_on_mnist(kind: str, work: Path, checkout: Path, steps: int = 12) -> tuple[list, list]:
    """(each step's loss, the batches the loop got) of a 2.x loop over the model zoo's shuffled MNIST loader."""
    import torch
    import cerebras_pytorch as cstorch
    from cs_torch.backends import reset_backend
    reset_backend()
    torch.manual_seed(1)
    backend = cstorch.backend(kind, artifact_dir=str(work / "artifacts"))
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    compiled = cstorch.compile(model, backend)
    optimizer = cstorch.optim.SGD(model.parameters(), 0.002)

    @cstorch.trace
    def step(x, y):
        loss = torch.nn.functional.cross_entropy(compiled(x), y.long())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    params = {"train_input": {"data_dir": str(work / "mnist"), "batch_size": BATCH, "drop_last_batch": True,
                              "to_float16": False, "shuffle": True}}
    loader = cstorch.utils.data.DataLoader(mnist_input_fn, params, str(checkout.resolve()))
    losses, seen = [], []
    for x, y in cstorch.utils.data.DataExecutor(loader, num_steps=steps):   # 5 batches an epoch: 3 epochs
        seen.append((x.clone(), y.long()))
        losses.append(float(step(x, y)))
    reset_backend()
    return losses, seen


def check_mnist_training(checks: Checks, work: Path, checkout: Path) -> None:
    """The model zoo's shuffled MNIST loader on a CSX job (its input workers build it) against the CPU backend."""
    make_mnist(work / "mnist", np.random.default_rng(0))
    cpu_losses, cpu_seen = train_on_mnist("CPU", work, checkout)
    csx_losses, csx_seen = train_on_mnist("CSX", work, checkout)
    same = all(bool((a == c).all()) and bool((b == d).all()) for (a, b), (c, d) in zip(cpu_seen, csx_seen))
    checks.expect(same and len(csx_seen) == len(cpu_seen), "MNIST on a CSX job: the CPU loop's shuffled batches, "
                  "in its order, over 3 epochs")
    spread = max(abs(a - b) / abs(b) for a, b in zip(csx_losses, cpu_losses))
    checks.expect(spread <= 1e-5, f"MNIST on a CSX job: every step's loss the CPU backend's ({csx_losses[0]:.4f} "
                  f"to {csx_losses[-1]:.4f}; largest relative difference {spread:.1e}, 1e-5 allowed)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args(argv)
    if not (args.checkout / "modelzoo" / "fc_mnist" / "pytorch" / "data.py").is_file():
        print(f"modelzoo_data: {args.checkout} is not a Release_2.1.1-layout model zoo checkout "
              "(no modelzoo/fc_mnist/pytorch/data.py)", file=sys.stderr)
        return 2
    sys.path[:0] = [str(args.checkout), str(REPO)]
    # As a user's script would (docs/testing.md): the registry's torchvision wheel does not import beside the
    # CPU torch (its detection ops' fake kernels fail to register); the MNIST reader and transforms need none.
    sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
    try:
        import torchvision  # noqa: F401
    except ModuleNotFoundError:
        print("modelzoo_data: torchvision is not installed (the MNIST processor reads through it)", file=sys.stderr)
        return 2
    import cerebras_pytorch as cstorch
    from cs_torch.backends import reset_backend
    checks = Checks()
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or Path(scratch)
        for kind in ("CPU", "CSX"):
            reset_backend()
            cstorch.backend(kind, artifact_dir=str(work / "artifacts"))
            for check in (check_mnist, check_gpt, check_bert):
                check(checks, work / kind, kind)
        reset_backend()
        check_mnist_training(checks, work / "training", args.checkout)
    print(f"{len(checks.failed)} failed" if checks.failed else "every check passed")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
