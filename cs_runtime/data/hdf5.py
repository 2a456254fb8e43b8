"""The model zoo's preprocessed HDF5 data for GPT-2 and BERT (`*.h5` in data_dir; h5py, optional extra).

GPT-2 (GptHDF5DataProcessor, GptHDF5MapDataProcessor): every file holds
`data`, integers of shape [n, 3, max_sequence_length]: per sample its
input_ids, attention_mask and labels (the next tokens); the file attribute
`n_examples`, where present, must equal n. Positions whose attention_mask is
0 (padding) carry no loss, as the model zoo weights the loss by the mask.

BERT (BertHDF5DataProcessor): `data` of shape [n, 2, max_sequence_length]
(input_ids, attention_mask) and `labels`, either [n, 3, max_predictions]
(labels, masked_lm_positions, masked_lm_mask: the "gather" layout) or
[n, 1, max_sequence_length] (the masked tokens' ids, -100 elsewhere).
The model zoo's BERT files are masked-LM only; to train the next-sentence head
(disable_nsp false) on HDF5 data this project also reads (its own extension)
`data` of [n, 3, length], the third row the segment_ids, and
`next_sentence_labels` ([n] or [n, 1], 0 or 1).
Padding is token id 0 with attention_mask 0, as the model zoo's BERT
vocabularies have it ([PAD] = 0): this model masks padding keys by that id.

Files are read in file-name order, each split from its own data_dir (no
train/eval cut). When a data set is made, every file's shapes are checked and
its ids scanned against model.vocab_size, so a mismatch stops the run before
it starts, one line naming the file; batches are then read from the files as
they are needed.

    pip install 'cs-emulator[hdf5]'      # h5py
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from cs_runtime.data.text import TextDataError
from cs_runtime.numerics.transformer_params import NSP_FEATURES
from cs_runtime.numerics.batch_check import IGNORE_INDEX

PAD_ID = 0
NSP_KEY = "next_sentence_labels"   # BERT with its next-sentence head: each sample's label
SCAN_ROWS = 4096      # samples read at a time when the ids are checked


def h5_files(data_dir) -> list[Path]:
    """The `*.h5` files of data_dir in name order ([] when there is none or no folder)."""
    if not data_dir or not Path(data_dir).is_dir():
        return []
    return sorted(Path(data_dir).glob("*.h5"))


def _h5py(data_dir):
    try:
        import h5py
    except ImportError:
        raise TextDataError(f"data_dir {data_dir} holds the model zoo's HDF5 files (*.h5); reading them needs "
                            f"h5py: pip install 'cs-emulator[hdf5]'") from None
    return h5py


def _dataset(f, path: Path, key: str, rows: int | None, seq: int | None):
    """f[key], checked: integers, 3-D, `rows` rows of `seq` wide (None: any)."""
    if key not in f:
        raise TextDataError(f"{path}: no dataset {key!r} (the model zoo's HDF5 layout: {', '.join(sorted(f))})")
    ds = f[key]
    if ds.ndim != 3 or ds.dtype.kind not in "iu":
        raise TextDataError(f"{path}: {key} is {ds.dtype} of shape {ds.shape}; expected integers [n, k, length]")
    if rows is not None and ds.shape[1] != rows:
        raise TextDataError(f"{path}: {key} has {ds.shape[1]} rows a sample, expected {rows}")
    if seq is not None and ds.shape[2] != seq:
        raise TextDataError(f"{path}: samples of length {ds.shape[2]}, but the run's max_sequence_length is {seq}")
    return ds


def _check_ids(path: Path, what: str, ids: np.ndarray, vocab_size: int) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise TextDataError(f"{path}: {what} outside [0, {vocab_size}) (model.vocab_size {vocab_size}): "
                            f"{int(ids.min())}..{int(ids.max())}; the data and the model's vocabulary disagree")


class _Hdf5Files:
    """Samples numbered across the files in name order; each batch read from the files it needs."""

    def __init__(self, data_dir, seq_len: int, vocab_size: int):
        self.data_dir, self.seq_len, self.vocab_size = data_dir, seq_len, vocab_size
        self.files = h5_files(data_dir)
        if not self.files:
            raise TextDataError(f"data_dir {data_dir}: no *.h5 files")
        self.h5py = _h5py(data_dir)
        counts = []
        for path in self.files:
            try:
                with self.h5py.File(path, "r") as f:
                    counts.append(self.check_file(f, path))
            except OSError as exc:
                raise TextDataError(f"{path}: not a readable HDF5 file ({exc})") from None
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if self.starts[-1] == 0:
            raise TextDataError(f"data_dir {data_dir}: the *.h5 files hold no samples")

    def check_file(self, f, path: Path) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, indices: np.ndarray, keys: tuple[str, ...]) -> list[np.ndarray]:
        """f[key][sample] for each key, in the order of `indices`."""
        indices = np.asarray(indices, dtype=np.int64)
        file_of = np.searchsorted(self.starts, indices, side="right") - 1
        out: list[np.ndarray | None] = [None] * len(keys)
        for file_index in np.unique(file_of):
            here = np.flatnonzero(file_of == file_index)
            local = indices[here] - self.starts[file_index]
            wanted, inverse = np.unique(local, return_inverse=True)   # h5py reads increasing indices
            with self.h5py.File(self.files[file_index], "r") as f:
                for k, key in enumerate(keys):
                    block = f[key][wanted][inverse]
                    if out[k] is None:
                        out[k] = np.empty((len(indices),) + block.shape[1:], dtype=np.int64)
                    out[k][here] = block
        return out


class GptHdf5Dataset(_Hdf5Files):
    """Next-token samples: x the input_ids, y the labels (IGNORE_INDEX where attention_mask is 0)."""

    def check_file(self, f, path: Path) -> int:
        data = _dataset(f, path, "data", 3, self.seq_len)
        n = data.shape[0]
        if "n_examples" in f.attrs and int(f.attrs["n_examples"]) != n:
            raise TextDataError(f"{path}: attribute n_examples {int(f.attrs['n_examples'])} but data holds {n}")
        for start in range(0, n, SCAN_ROWS):
            block = data[start:start + SCAN_ROWS]
            _check_ids(path, "input_ids", block[:, 0], self.vocab_size)
            _check_ids(path, "labels", block[:, 2][block[:, 1] != 0], self.vocab_size)
        return n

    def get(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        (data,) = self.read(indices, ("data",))
        y = np.where(data[:, 1] != 0, data[:, 2], IGNORE_INDEX)
        return data[:, 0].astype(np.int32), y.astype(np.int64)


class BertHdf5Dataset(_Hdf5Files):
    """Masked-LM samples: x the (already masked) input_ids, y the original ids at the masked positions.
    With `nsp` (the next-sentence head) `data` has a third row, the segment_ids, and
    `next_sentence_labels` ([n] or [n, 1]) each sample's label; x is then a dict of the three."""

    def __init__(self, data_dir, seq_len: int, vocab_size: int, nsp: bool = False, num_segments: int = 2):
        self.nsp, self.num_segments = nsp, num_segments
        super().__init__(data_dir, seq_len, vocab_size)

    def check_file(self, f, path: Path) -> int:
        if self.nsp and NSP_KEY not in f:   # first: a model zoo file is masked-LM only (2 data rows)
            raise TextDataError(f"{path}: no dataset {NSP_KEY!r}: the next-sentence head needs each sample's "
                                f"label and segment_ids (the model zoo's BERT files are masked-LM only: set "
                                f"model.disable_nsp: true)")
        data = _dataset(f, path, "data", 3 if self.nsp else 2, self.seq_len)
        labels = _dataset(f, path, "labels", None, None)
        n = data.shape[0]
        if self.nsp:
            self._check_nsp(f, path, data, n)
        if labels.shape[0] != n or labels.shape[1] not in (1, 3) or (
                labels.shape[1] == 1 and labels.shape[2] != self.seq_len):
            raise TextDataError(f"{path}: labels of shape {labels.shape} do not fit data {data.shape}: expected "
                                f"[n, 3, max_predictions] or [n, 1, {self.seq_len}]")
        for start in range(0, n, SCAN_ROWS):
            block, lab = data[start:start + SCAN_ROWS], labels[start:start + SCAN_ROWS]
            _check_ids(path, "input_ids", block[:, 0], self.vocab_size)
            if np.any((block[:, 0] == PAD_ID) != (block[:, 1] == 0)):
                raise TextDataError(f"{path}: attention_mask is 0 where input_ids is not the padding id {PAD_ID} "
                                    f"(or 1 where it is); padding is read from the ids here")
            y = self.labels_of(lab, path)
            _check_ids(path, "labels", y[y != IGNORE_INDEX], self.vocab_size)
        return n

    def _check_nsp(self, f, path: Path, data, n: int) -> None:
        nsp = f[NSP_KEY][()].reshape(-1) if f[NSP_KEY].ndim else None
        if nsp is None or len(nsp) != n or nsp.dtype.kind not in "iu" or np.any((nsp < 0) | (nsp > 1)):
            raise TextDataError(f"{path}: {NSP_KEY} must be n = {n} integers 0 or 1 ([n] or [n, 1])")
        for start in range(0, n, SCAN_ROWS):
            segments = data[start:start + SCAN_ROWS, 2]
            if segments.size and (segments.min() < 0 or segments.max() >= self.num_segments):
                raise TextDataError(f"{path}: segment_ids outside [0, {self.num_segments}) (model.num_segments)")

    def labels_of(self, lab: np.ndarray, path) -> np.ndarray:
        """[n, seq_len] labels, IGNORE_INDEX where nothing is predicted."""
        if lab.shape[1] == 1:
            return np.where(lab[:, 0] < 0, IGNORE_INDEX, lab[:, 0])
        ids, positions, mask = lab[:, 0], lab[:, 1], lab[:, 2] != 0
        if np.any(mask & ((positions < 0) | (positions >= self.seq_len))):
            raise TextDataError(f"{path}: masked_lm_positions outside [0, {self.seq_len})")
        y = np.full((len(lab), self.seq_len), IGNORE_INDEX, dtype=np.int64)
        rows = np.broadcast_to(np.arange(len(lab))[:, None], positions.shape)
        y[rows[mask], positions[mask]] = ids[mask]
        return y

    def get(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not self.nsp:
            data, lab = self.read(indices, ("data", "labels"))
            return data[:, 0].astype(np.int32), self.labels_of(lab, self.data_dir).astype(np.int64)
        data, lab, nsp = self.read(indices, ("data", "labels", NSP_KEY))
        features = (data[:, 0].astype(np.int32), data[:, 2].astype(np.int32), nsp.reshape(len(nsp)))
        return dict(zip(NSP_FEATURES, features)), self.labels_of(lab, self.data_dir).astype(np.int64)
