"""Text data for the language models: corpus, tokenizer, GPT and BERT samples.

The default corpus ships with every CPython install: `pydoc_data.topics`,
the Python language reference and library topics as plain English text
(~470 KB, 79 topics in 3.11; what `help("if")` prints). It is real,
sizeable prose, present offline, and needs no download. Its exact contents
follow the Python version, so runs are reproducible on one install.

With `data_dir` set, the corpus is read from there instead:
- `*.npy` files: pre-tokenised 1-D integer arrays (ids of this tokenizer),
  concatenated in file-name order; or else
- `*.txt` files: UTF-8 text, concatenated in file-name order.

The tokenizer is byte-level (GPT-2's base alphabet without the merges): id
0..3 are [PAD] [CLS] [SEP] [MASK], then the 256 byte values, so any text
round-trips and the vocabulary is 260.

Split: the first 95% of the tokens train, the last 5% evaluate.

    tokens = load_corpus(None, "train")
    GptDataset(tokens, seq_len=64).get(np.arange(4))        # x [4, 64] ids, y next ids
    BertDataset(tokens, 64, 0.15, seed=1).get(np.arange(4))  # x masked ids, y labels or -100
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from cs_runtime.errors import UserInputError
from cs_runtime.numerics.batch_check import IGNORE_INDEX
from cs_runtime.numerics.hashing import hash_key, hash_uniform
from cs_runtime.numerics.transformer_params import NSP_FEATURES   # a pair sample's features by name

PAD, CLS, SEP, MASK = 0, 1, 2, 3
SPECIALS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]")
OFFSET = len(SPECIALS)
VOCAB_SIZE = OFFSET + 256
EVAL_FRACTION = 0.05
NEWLINE = OFFSET + ord("\n")


class TextDataError(UserInputError):
    """A corpus that cannot be used; the message names the file."""


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + OFFSET


def decode(ids) -> str:
    data = bytes(int(i) - OFFSET for i in np.asarray(ids).reshape(-1) if int(i) >= OFFSET)
    return data.decode("utf-8", errors="replace")


def builtin_text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[name] for name in sorted(topics))


def _read_dir(data_dir: str, vocab_size: int, lower: bool) -> np.ndarray:
    folder = Path(data_dir)
    if not folder.is_dir():
        raise TextDataError(f"data_dir {data_dir}: no such folder")
    shards = sorted(folder.glob("*.npy"))
    if shards:
        parts = []
        for path in shards:
            arr = np.load(path, allow_pickle=False)
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise TextDataError(f"{path}: expected a 1-D integer array of token ids, got {arr.dtype} "
                                    f"{arr.shape}")
            if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
                raise TextDataError(f"{path}: token ids outside [0, {vocab_size}) (model.vocab_size "
                                    f"{vocab_size}); the data and the model's vocabulary disagree")
            parts.append(arr.astype(np.int32))
        return np.concatenate(parts)
    texts = sorted(folder.glob("*.txt"))
    if not texts:
        raise TextDataError(f"data_dir {data_dir}: no *.npy or *.txt files")
    _byte_vocab(vocab_size, f"data_dir {data_dir} holds text")
    try:
        text = "\n\n".join(p.read_text(encoding="utf-8") for p in texts)
        return encode(text.lower() if lower else text)
    except UnicodeDecodeError as exc:
        raise TextDataError(f"data_dir {data_dir}: a .txt file is not UTF-8 ({exc})") from None


def _byte_vocab(vocab_size: int, what: str) -> None:
    if vocab_size != VOCAB_SIZE:
        raise TextDataError(f"model.vocab_size {vocab_size} does not match the data: {what}, byte-tokenised "
                            f"here ({VOCAB_SIZE} ids); set vocab_size: {VOCAB_SIZE}, or give pre-tokenised *.npy "
                            f"ids below vocab_size")


def load_corpus(data_dir: str | None, split: str, vocab_size: int = VOCAB_SIZE, lower: bool = False) -> np.ndarray:
    """The token ids of `split` ("train" or "eval") of the corpus; the data and
    `vocab_size` must agree (text is byte-tokenised: 260 ids; *.npy ids must lie
    below vocab_size). `lower`: lower-case text first (the model zoo's do_lower)."""
    if data_dir is None:
        _byte_vocab(vocab_size, "the built-in text")
        text = builtin_text()
        tokens = encode(text.lower() if lower else text)
    else:
        tokens = _read_dir(data_dir, vocab_size, lower)
    cut = int(len(tokens) * (1 - EVAL_FRACTION))
    if split not in ("train", "eval"):
        raise TextDataError(f"unknown split {split!r}")
    part = tokens[:cut] if split == "train" else tokens[cut:]
    part.flags.writeable = False
    return part


class GptDataset:
    """Next-token prediction on non-overlapping windows of seq_len + 1 tokens."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        if len(self) == 0:
            raise TextDataError(f"corpus of {len(tokens)} tokens is shorter than one sequence of {seq_len + 1}")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def get(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        starts = np.asarray(indices)[:, None] * self.seq_len + np.arange(self.seq_len + 1)[None, :]
        window = self.tokens[starts]
        return window[:, :-1].astype(np.int32), window[:, 1:].astype(np.int64)


def pack_lines(tokens: np.ndarray, room: int) -> list[tuple[int, int]]:
    """(start, stop) spans of whole lines, greedily packed up to `room` tokens; a longer line is cut."""
    ends = (np.flatnonzero(tokens == NEWLINE) + 1).tolist()
    if not ends or ends[-1] != len(tokens):
        ends.append(len(tokens))
    spans, start, end = [], 0, 0
    for line_end in ends:
        if line_end - start > room and end > start:
            spans.append((start, end))
            start = end
        while line_end - start > room:
            spans.append((start, start + room))
            start += room
        end = line_end
    if end > start:
        spans.append((start, end))
    return spans


class BertDataset:
    """Masked-LM samples: [CLS] whole lines [SEP] [PAD]..., of seq_len tokens.

    Static masking, as in the original BERT data: which tokens are masked is
    a function of (seed, sample index, position), so every worker and every
    epoch sees the same sample. Of the chosen tokens (masked_lm_prob of the
    text tokens, at least one per sample) 80% become [MASK], 10% a random
    byte, 10% stay; the label is the original id there and IGNORE_INDEX
    elsewhere.

    With `nsp` (the next-sentence head), a sample is a pair, as BERT's
    pre-training data: [CLS] A [SEP] B [SEP], each segment whole lines packed
    into half the room; A is span i, B the span after it (next_sentence_label
    0, "is next") or, for about half the samples by a hash of (seed, i), a
    random other span (label 1). segment_ids are 0 over [CLS] A [SEP] (and the
    padding), 1 over B [SEP]. Features then come as a dict (NSP_FEATURES).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, masked_lm_prob: float, seed: int,
                 max_predictions: int | None = None, vocab_size: int = VOCAB_SIZE, nsp: bool = False):
        if seq_len < (5 if nsp else 3):
            raise TextDataError(f"BERT samples need seq_len >= {5 if nsp else 3}, got {seq_len}")
        self.tokens, self.seq_len, self.prob, self.seed = tokens, seq_len, masked_lm_prob, seed
        self.max_predictions, self.vocab_size, self.nsp = max_predictions, vocab_size, nsp
        room = (seq_len - 3) // 2 if nsp else seq_len - 2
        self.spans = np.array(pack_lines(tokens, room), dtype=np.int64).reshape(-1, 2)
        if len(self.spans) < (3 if nsp else 1):
            raise TextDataError("the corpus is empty" if len(self.spans) == 0 else
                                f"the corpus makes {len(self.spans)} segments; sentence pairs need 3")

    def __len__(self) -> int:
        return len(self.spans) - 1 if self.nsp else len(self.spans)   # a pair's A has a span after it

    def pairs(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(B's span index, next_sentence_label) of each sample: the next span (0) or, drawn
        from (seed, sample), a random span other than A's and the next (1)."""
        u = hash_uniform(hash_key(self.seed, 7411), indices, (2,))
        random = u[:, 0] < 0.5
        n = len(self.spans)
        other = (indices + 2 + (u[:, 1] * (n - 2)).astype(np.int64)) % n   # i + 2 .. i + n - 1: never i, i + 1
        return np.where(random, other, indices + 1), random.astype(np.int64)

    def _layout(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(token ids [n, t] before masking, segment ids or None, next-sentence labels or None)."""
        n, t = len(indices), self.seq_len
        ids = np.full((n, t), PAD, dtype=np.int32)
        if not self.nsp:
            for row, (start, stop) in enumerate(self.spans[indices]):
                ids[row, 0], ids[row, 1:stop - start + 1], ids[row, stop - start + 1] = \
                    CLS, self.tokens[start:stop], SEP
            return ids, None, None
        second, labels = self.pairs(indices)
        segments = np.zeros((n, t), dtype=np.int32)
        for row, ((a0, a1), (b0, b1)) in enumerate(zip(self.spans[indices], self.spans[second])):
            a, b = a1 - a0, b1 - b0
            ids[row, :a + 2] = [CLS, *self.tokens[a0:a1], SEP]
            ids[row, a + 2:a + b + 3] = [*self.tokens[b0:b1], SEP]
            segments[row, a + 2:a + b + 3] = 1
        return ids, segments, labels

    def get(self, indices: np.ndarray):
        indices = np.asarray(indices)
        ids, segments, nsp_labels = self._layout(indices)
        n, t = ids.shape
        u = hash_uniform(hash_key(self.seed, 31337), indices, (3, t))
        text = ids >= OFFSET
        chosen = text & (u[:, 0] < self.prob)
        for row in np.flatnonzero(~chosen.any(axis=1)):  # every sample teaches something
            candidates = np.flatnonzero(text[row])
            chosen[row, candidates[int(u[row, 1, 0] * len(candidates))]] = True
        if self.max_predictions is not None:   # the model zoo's max_predictions_per_seq
            chosen &= self._first_chosen(chosen, u[:, 0])
        x, y = ids.copy(), np.full((n, t), IGNORE_INDEX, dtype=np.int64)
        y[chosen] = ids[chosen]
        x[chosen & (u[:, 1] < 0.8)] = MASK
        swap = chosen & (u[:, 1] >= 0.8) & (u[:, 1] < 0.9)
        x[swap] = OFFSET + (u[:, 2][swap] * (self.vocab_size - OFFSET)).astype(np.int32)
        if self.nsp:
            return dict(zip(NSP_FEATURES, (x, segments, nsp_labels))), y
        return x, y

    def _first_chosen(self, chosen: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Of each row's chosen positions, the max_predictions with the smallest draw."""
        order = np.argsort(np.where(chosen, u, 2.0), axis=1, kind="stable")[:, :self.max_predictions]
        keep = np.zeros_like(chosen)
        np.put_along_axis(keep, order, True, axis=1)
        return keep
