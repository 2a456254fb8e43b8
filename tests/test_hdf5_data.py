"""The model zoo's preprocessed HDF5 data for GPT-2 and BERT (cs_runtime/data/hdf5.py):
the layouts read, vocab_size and the data checked, and a GPT-2 run on `*.h5`
files training exactly as on the same samples given as `*.npy` ids.

    python -m pytest tests/test_hdf5_data.py -q
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from cs_runtime.data.hdf5 import BertHdf5Dataset, GptHdf5Dataset, h5_files
from cs_runtime.data.text import GptDataset, TextDataError, load_corpus
from cs_runtime.numerics.kernels import IGNORE_INDEX
from tests.cluster_utils import train_losses
from tests.test_modelzoo_params import FILES, run_script, token_data

try:   # imported here, at collection: h5py's import runs `uname -p`, which a test may not start
    import h5py
except ImportError:
    h5py = None
needs_h5py = pytest.mark.skipif(h5py is None, reason="the model zoo's HDF5 data needs h5py "
                                "(pip install 'cs-emulator[hdf5]')")


def write_gpt(path: Path, ids: np.ndarray, mask: np.ndarray, labels: np.ndarray, n_examples: int | None = None):
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=np.stack([ids, mask, labels], axis=1).astype(np.int32))
        f.attrs["n_examples"] = len(ids) if n_examples is None else n_examples


def gpt_samples(n: int, seq: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (n, seq + 1))
    mask = np.ones((n, seq), dtype=np.int64)
    mask[:, seq - 2:] = 0                       # padding at the end of every sample
    return ids[:, :-1].copy(), mask, ids[:, 1:].copy()


@needs_h5py
def test_gpt_samples_across_files_in_any_order(tmp_path: Path) -> None:
    ids, mask, labels = gpt_samples(7, 6, 50)
    write_gpt(tmp_path / "b.h5", ids[4:], mask[4:], labels[4:])
    write_gpt(tmp_path / "a.h5", ids[:4], mask[:4], labels[:4])     # name order, not creation order
    data = GptHdf5Dataset(tmp_path, 6, 50)
    assert len(data) == 7 and [p.name for p in h5_files(tmp_path)] == ["a.h5", "b.h5"]
    order = np.array([5, 0, 5, 3, 6])
    x, y = data.get(order)
    np.testing.assert_array_equal(x, ids[order])
    np.testing.assert_array_equal(y, np.where(mask[order] == 1, labels[order], IGNORE_INDEX))
    assert x.dtype == np.int32 and y.dtype == np.int64


@needs_h5py
@pytest.mark.parametrize("change,says", [
    ("vocab", "labels outside [0, 40)"), ("length", "max_sequence_length is 5"),
    ("n_examples", "n_examples 9 but data holds 3"), ("layout", "no dataset 'data'")])
def test_gpt_files_that_do_not_fit_are_one_line(tmp_path: Path, change: str, says: str) -> None:
    ids, mask, labels = gpt_samples(3, 6, 40)
    labels[1, 0] = 45 if change == "vocab" else labels[1, 0]
    if change == "layout":
        with h5py.File(tmp_path / "x.h5", "w") as f:
            f.create_dataset("input_ids", data=ids)
    else:
        write_gpt(tmp_path / "x.h5", ids, mask, labels, 9 if change == "n_examples" else None)
    with pytest.raises(TextDataError) as err:
        GptHdf5Dataset(tmp_path, 5 if change == "length" else 6, 40)
    assert says in str(err.value) and "x.h5" in str(err.value) and "\n" not in str(err.value)


@needs_h5py
def test_padding_labels_are_not_checked_against_the_vocabulary(tmp_path: Path) -> None:
    ids, mask, labels = gpt_samples(3, 6, 40)
    labels[:, -1] = 50000                       # under attention_mask 0: never a target
    write_gpt(tmp_path / "x.h5", ids, mask, labels)
    assert (GptHdf5Dataset(tmp_path, 6, 40).get(np.arange(3))[1][:, -1] == IGNORE_INDEX).all()


def bert_sample_arrays(n: int = 4, seq: int = 8, vocab: int = 30, preds: int = 3, seed: int = 1):
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, vocab, (n, seq))
    ids[:, seq - 2:] = 0                        # [PAD]
    mask = (ids != 0).astype(np.int64)
    positions = np.stack([rng.choice(seq - 2, preds, replace=False) for _ in range(n)])
    lm_mask = np.ones((n, preds), dtype=np.int64)
    lm_mask[0, -1] = 0                          # sample 0 predicts one token fewer
    lm_labels = rng.integers(5, vocab, (n, preds))
    return ids, mask, positions, lm_mask, lm_labels


@needs_h5py
@pytest.mark.parametrize("layout", ["gather", "full"])
def test_bert_labels_in_either_layout(tmp_path: Path, layout: str) -> None:
    ids, mask, positions, lm_mask, lm_labels = bert_sample_arrays()
    expected = np.full(ids.shape, IGNORE_INDEX)
    for row in range(len(ids)):
        for p, lab, keep in zip(positions[row], lm_labels[row], lm_mask[row]):
            if keep:
                expected[row, p] = lab
    with h5py.File(tmp_path / "bert.h5", "w") as f:
        f.create_dataset("data", data=np.stack([ids, mask], axis=1))
        labels = (np.stack([lm_labels, positions, lm_mask], axis=1) if layout == "gather"
                  else np.where(expected == IGNORE_INDEX, -100, expected)[:, None, :])
        f.create_dataset("labels", data=labels)
    x, y = BertHdf5Dataset(tmp_path, 8, 30).get(np.array([2, 0, 3]))
    np.testing.assert_array_equal(x, ids[[2, 0, 3]])
    np.testing.assert_array_equal(y, expected[[2, 0, 3]])
    with pytest.raises(TextDataError, match=r"outside \[0, 20\) \(model.vocab_size 20\)"):
        BertHdf5Dataset(tmp_path, 8, 20)


@needs_h5py
def test_bert_padding_must_be_the_padding_id(tmp_path: Path) -> None:
    ids, mask, positions, lm_mask, lm_labels = bert_sample_arrays()
    mask[1, 0] = 0
    with h5py.File(tmp_path / "bert.h5", "w") as f:
        f.create_dataset("data", data=np.stack([ids, mask], axis=1))
        f.create_dataset("labels", data=np.stack([lm_labels, positions, lm_mask], axis=1))
    with pytest.raises(TextDataError, match="attention_mask is 0 where input_ids is not the padding id 0"):
        BertHdf5Dataset(tmp_path, 8, 30)


@needs_h5py
def test_bert_next_sentence_fields_are_read(tmp_path: Path) -> None:
    """With the next-sentence head: segment_ids the third row of data, next_sentence_labels its own."""
    rng = np.random.default_rng(0)
    n, seq = 5, 8
    ids = rng.integers(4, 30, (n, seq))
    ids[2, 6:] = 0
    segments = np.where(np.arange(seq) >= 4, 1, 0)[None].repeat(n, 0) * (ids != 0)
    labels = np.where(rng.random((n, 1, seq)) < 0.3, ids[:, None], -100)
    nsp = np.array([[0], [1], [1], [0], [1]])
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["data"] = np.stack([ids, (ids != 0).astype(int), segments], axis=1)
        f["labels"] = labels
        f["next_sentence_labels"] = nsp
    x, y = BertHdf5Dataset(tmp_path, seq, 30, nsp=True).get(np.array([4, 1, 2]))
    assert np.array_equal(x["input_ids"], ids[[4, 1, 2]]) and np.array_equal(x["segment_ids"], segments[[4, 1, 2]])
    assert np.array_equal(x["next_sentence_label"], [1, 1, 1])
    assert np.array_equal(y, np.where(labels[[4, 1, 2], 0] < 0, -100, labels[[4, 1, 2], 0]))
    with h5py.File(tmp_path / "a.h5", "a") as f:
        del f["next_sentence_labels"]
    with pytest.raises(TextDataError, match="no dataset 'next_sentence_labels'"):
        BertHdf5Dataset(tmp_path, seq, 30, nsp=True)


@needs_h5py
def test_a_model_zoo_bert_file_with_the_next_sentence_head_on_names_disable_nsp(tmp_path: Path) -> None:
    """The model zoo's BERT files are masked-LM only (two data rows): one line, naming the fix."""
    ids, mask, positions, lm_mask, lm_labels = bert_sample_arrays()
    with h5py.File(tmp_path / "bert.h5", "w") as f:
        f.create_dataset("data", data=np.stack([ids, mask], axis=1))
        f.create_dataset("labels", data=np.stack([lm_labels, positions, lm_mask], axis=1))
    with pytest.raises(TextDataError, match="masked-LM only: set model.disable_nsp: true"):
        BertHdf5Dataset(tmp_path, 8, 30, nsp=True)
    assert len(BertHdf5Dataset(tmp_path, 8, 30)) == len(ids)   # the same file with the head off


def test_without_h5py_the_files_are_one_line(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "x.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(64))
    monkeypatch.setitem(sys.modules, "h5py", None)
    with pytest.raises(TextDataError) as err:
        GptHdf5Dataset(tmp_path, 6, 40)
    assert "needs h5py" in str(err.value) and "\n" not in str(err.value)


@needs_h5py
@pytest.mark.cluster
def test_gpt2_trains_on_h5_files_as_on_the_same_npy_samples(tmp_path: Path) -> None:
    """The oracle: the same samples as *.npy ids (GptDataset's windows); same batches, same losses."""
    npy = Path(token_data(tmp_path / "npy", vocab=512))
    seq = 16
    h5 = tmp_path / "h5"
    for split, name in (("train", "train"), ("val", "eval")):
        windows = GptDataset(load_corpus(str(npy / split), name, 512), seq)
        x, y = windows.get(np.arange(len(windows)))
        (h5 / split).mkdir(parents=True)
        half = len(x) // 2   # two files, so samples are numbered across them
        write_gpt(h5 / split / "part0.h5", x[:half], np.ones_like(x[:half]), y[:half])
        write_gpt(h5 / split / "part1.h5", x[half:], np.ones_like(x[half:]), y[half:])
    losses = {}
    for kind, data in (("npy", npy), ("h5", h5)):
        model_dir = tmp_path / f"model_{kind}"
        result = run_script("gpt2", FILES / "gpt2_tiny_trainer.yaml", model_dir,
                            "--override", f"trainer.fit.train_dataloader.data_dir={data}/train",
                            "--override", f"trainer.fit.val_dataloader.data_dir={data}/val",
                            "--override", "trainer.init.loop.max_steps=5",
                            "--override", "trainer.init.checkpoint.save_initial_checkpoint=false")
        assert result.returncode == 0, result.stdout + result.stderr
        losses[kind] = train_losses(model_dir)
    assert len(losses["h5"]) == 5 and np.isfinite(losses["h5"]).all()
    np.testing.assert_array_equal(losses["h5"], losses["npy"])


@needs_h5py
@pytest.mark.cluster
def test_vocab_size_and_h5_data_must_agree_in_a_run(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    ids, mask, labels = gpt_samples(8, 16, 600)
    write_gpt(tmp_path / "data" / "x.h5", ids, mask, labels)
    result = run_script("gpt2", FILES / "gpt2_tiny_trainer.yaml", tmp_path / "model_dir",
                        "--override", f"trainer.fit.train_dataloader.data_dir={tmp_path}/data",
                        "--override", "trainer.init.loop.max_steps=2")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "outside [0, 512) (model.vocab_size 512)" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
