"""What a batch must be before a model computes on it.

Checked where a batch enters a WSE (wse/emulator.py, from any input worker)
and on the CPU path (chief/cpu_executor.py), so bad data stops the run with
one line naming the sample instead of training on it: numpy would read label
-3 as class 7 (negative indexing) and crash on label 12 deep in a kernel.

A classifier takes float features [B, in_features], all finite, and integer
labels [B] in [0, classes). A token model (first layer an embedding) takes
integer ids [B, T] with 1 <= T <= max_len and ids in [0, vocabulary), and
integer labels [B, T] in [0, classes) or the ignore index (no loss there);
BERT with its next-sentence head takes them as input_ids of a dict with
segment_ids ([B, T], below its segment count) and next_sentence_label ([B], 0 or 1).
A compiled program (a captured torch model) takes its inputs (one array, or
a dict of arrays by feature name for a model of several) and a target of the
ranks, trailing dimensions and kinds (integer or float) it was captured
with; integer targets of a classification loss are classes or its ignore index.
"""
from __future__ import annotations

import numpy as np

from cs_runtime.errors import UserInputError

IGNORE_INDEX = -100     # labels with this value take no part in the loss


class BadBatch(UserInputError):
    """A batch the model cannot take. `sample` is the row within the checked
    arrays (None when the batch as a whole is wrong: dtype, rank, row counts)."""

    def __init__(self, reason: str, sample: int | None = None):
        super().__init__(reason)
        self.reason, self.sample = reason, sample


def check_batch(spec, x, y: np.ndarray) -> None:
    """Raise BadBatch for the first thing wrong with (x, y) for model `spec`.
    x: one array, or (a model of several inputs) a dict of arrays by feature name."""
    if spec.program is not None and spec.program.get("values"):   # a captured model: against its capture
        return _check_program(spec.program, x, y)
    if spec.program is not None and spec.program.get("nsp_loss"):   # BERT with its next-sentence head
        x = _check_sentence_pairs(spec, x, y)
    if isinstance(x, dict):
        raise BadBatch(f"features {sorted(x)} by name, but model {spec.name} takes one feature array")
    if len(x) != len(y):
        raise BadBatch(f"{len(x)} feature rows but {len(y)} label rows")
    if not np.issubdtype(y.dtype, np.integer):
        raise BadBatch(f"labels are {y.dtype}, expected integers")
    if spec.token_model:
        _check_tokens(spec.layers[0], x, y)
    else:
        _check_features(spec.layers[0].in_features, x, y)
    _check_labels(spec, y)


def _named_inputs(shared: dict, x) -> list[tuple[str, np.ndarray, str]]:
    """(what to call it, array, program value) of each model input in the batch."""
    names = shared["inputs"][:-1]
    features = shared.get("features") or names
    if not isinstance(x, dict):
        if len(names) != 1:
            raise BadBatch(f"one feature array, but the model takes {len(names)} inputs ({', '.join(features)}): "
                           "the data set gives its features as a dict by those names")
        return [("input", x, names[0])]
    if set(x) != set(features):
        missing, extra = sorted(set(features) - set(x)), sorted(set(x) - set(features))
        raise BadBatch(f"features {sorted(x)}, the model takes {list(features)}"
                       + (f" (missing {', '.join(missing)})" if missing else "")
                       + (f" (unknown {', '.join(extra)})" if extra else ""))
    return [(f"feature {f}", x[f], name) for f, name in zip(features, names)]


def _check_program(shared: dict, x, y: np.ndarray) -> None:
    """Against the program's inputs as captured (their batch dimension is free)."""
    inputs = _named_inputs(shared, x)
    for what, a, _ in inputs:
        if a.ndim == 0 or len(a) != len(y):
            rows = len(a) if a.ndim else 0
            raise BadBatch(f"{rows} feature rows but {len(y)} label rows" if what == "input"
                           else f"{what} has {rows} rows but there are {len(y)} label rows")
    for what, a, name in (*inputs, ("target", y, shared["inputs"][-1])):
        shape, dtype = shared["values"][name]
        if a.ndim != len(shape) or tuple(a.shape[1:]) != tuple(shape[1:]):
            needs = ", ".join(["batch", *(str(d) for d in shape[1:])])
            raise BadBatch(f"{what} has shape {tuple(a.shape)}, the model needs [{needs}]")
        if np.issubdtype(np.dtype(dtype), np.floating) != np.issubdtype(a.dtype, np.floating):
            raise BadBatch(f"{what} is {a.dtype}, the model was captured with {dtype}")
        if np.issubdtype(a.dtype, np.floating):
            bad = ~np.isfinite(a).reshape(len(a), -1).all(axis=1)
            if bad.any():
                raise BadBatch(f"{what} value is not finite", int(np.argmax(bad)))
    logits = shared.get("logits", "")
    if logits and np.issubdtype(y.dtype, np.integer):
        classes, ignore = shared["values"][logits][0][-1], shared.get("ignore_index", -100)
        _first_outside(y, ((y < 0) | (y >= classes)) & (y != ignore),
                       f"label {{}} outside [0, {classes}) and not the ignore index {ignore}")


def _check_sentence_pairs(spec, x, y: np.ndarray) -> np.ndarray:
    """BERT's next-sentence features: token ids, segment ids of the same shape below the
    embedding's segment count, one next_sentence_label (0 or 1) a sample. Returns the ids."""
    ids_name, segments_name, labels_name = spec.program["features"]
    if not isinstance(x, dict) or set(x) != {ids_name, segments_name, labels_name}:
        got = sorted(x) if isinstance(x, dict) else "one array"
        raise BadBatch(f"features {got}, the model takes {ids_name}, {segments_name}, {labels_name} "
                       f"(BERT with its next-sentence head)")
    ids, segments, nsp = x[ids_name], x[segments_name], x[labels_name]
    count = spec.layers[0].segments
    if not np.issubdtype(segments.dtype, np.integer) or segments.shape != ids.shape:
        raise BadBatch(f"{segments_name} are {segments.dtype} {tuple(segments.shape)}, the token ids "
                       f"{tuple(ids.shape)}: expected integers of that shape")
    if not np.issubdtype(nsp.dtype, np.integer) or nsp.shape != (len(y),):
        raise BadBatch(f"{labels_name} are {nsp.dtype} {tuple(nsp.shape)}, expected integers [{len(y)}]")
    _first_outside(segments, (segments < 0) | (segments >= count), f"segment id {{}} outside [0, {count})")
    _first_outside(nsp, (nsp < 0) | (nsp > 1), f"{labels_name} {{}} is not 0 or 1")
    return ids


def _check_features(width: int, x: np.ndarray, y: np.ndarray) -> None:
    if not np.issubdtype(x.dtype, np.floating):
        raise BadBatch(f"features are {x.dtype}, expected floats")
    if x.ndim != 2 or x.shape[1] != width:
        raise BadBatch(f"features have shape {tuple(x.shape)}, the model needs [batch, {width}]")
    if y.ndim != 1:
        raise BadBatch(f"labels have shape {tuple(y.shape)}, expected [batch]")
    bad = ~np.isfinite(x).all(axis=1)
    if bad.any():
        row = int(np.argmax(bad))
        raise BadBatch(f"feature value {x[row][~np.isfinite(x[row])][0]} is not finite", row)


def _check_tokens(embedding, x: np.ndarray, y: np.ndarray) -> None:
    if not np.issubdtype(x.dtype, np.integer):
        raise BadBatch(f"token ids are {x.dtype}, expected integers")
    if x.ndim != 2 or not 1 <= x.shape[1] <= embedding.max_len:
        raise BadBatch(f"token ids have shape {tuple(x.shape)}, the model needs "
                       f"[batch, 1..{embedding.max_len}]")
    if y.shape != x.shape:
        raise BadBatch(f"labels have shape {tuple(y.shape)}, the token ids {tuple(x.shape)}")
    _first_outside(x, (x < 0) | (x >= embedding.in_features), f"token id {{}} outside [0, {embedding.in_features})")


def _check_labels(spec, y: np.ndarray) -> None:
    classes = spec.model_layers[-1].out_features   # the output head's classes (a masked-LM head's vocabulary)
    outside = (y < 0) | (y >= classes)
    if spec.token_model:
        outside &= y != IGNORE_INDEX
        what = f"label {{}} outside [0, {classes}) and not the ignore index {IGNORE_INDEX}"
    else:
        what = f"label {{}} outside [0, {classes})"
    _first_outside(y, outside, what)


def _first_outside(values: np.ndarray, outside: np.ndarray, what: str) -> None:
    if outside.any():
        row = int(np.argmax(outside.reshape(len(values), -1).any(axis=1)))
        value = values[row][outside[row]].flat[0] if values.ndim > 1 else values[row]
        raise BadBatch(what.format(int(value)), row)


def bad_input_line(exc: BadBatch, stream: str, step: int, first_row: int, source: str = "") -> str:
    """One line naming where the bad sample came from: its source (an input
    worker), the stream and step (counted from 1, as the progress lines do) and
    its row in the global batch (`first_row`: where the checked rows start)."""
    where = f"{stream} step {step + 1}"
    if exc.sample is not None:
        where += f", sample {first_row + exc.sample} of the global batch"
    return f"bad input{' from ' + source if source else ''}: {where}: {exc.reason}"
