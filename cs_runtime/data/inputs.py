"""The input pipeline shared by the CPU path and the input workers.

A user's input function returns a data set: either a tuple `(features,
labels)` of arrays, or an object with `__len__` and `get(indices) -> (x, y)`
(where augmentation or decoding can happen). A model of several inputs
(a captured torch model's forward(input_ids, attention_mask, ...)) takes
its features as a dict of arrays by those names. The pipeline decides which
samples make global batch `step` (`BatchPlan`, a pure function of the step)
and which rows of it each WSE gets (`shard_rows`), so every execution path
feeds the model the same numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cs_runtime.data.batches import BatchPlan, shard_rows
from cs_runtime.data.mnist import DataError
from cs_runtime.numerics.batch_check import IGNORE_INDEX


def label_count(labels: np.ndarray) -> int:
    """Labelled targets: every label but IGNORE_INDEX (a classifier's: one per sample)."""
    return int(np.count_nonzero(labels != IGNORE_INDEX))


def dataset_len(dataset) -> int:
    if hasattr(dataset, "get"):
        return len(dataset)
    features = dataset[0]
    return len(next(iter(features.values()))) if isinstance(features, dict) else len(features)


def fetch(dataset, indices: np.ndarray):
    """(features, labels) of the samples at `indices`. Features are one array, or for a
    model of several inputs a dict of arrays by the model's feature names (its forward()'s
    argument names: input_ids, attention_mask, ...), every one with a row per sample."""
    if hasattr(dataset, "get"):
        x, y = dataset.get(indices)
    else:
        features = dataset[0]
        x = {k: v[indices] for k, v in features.items()} if isinstance(features, dict) else features[indices]
        y = dataset[1][indices]
    # Token ids stay integers (int32 on the wire), classes int64; features and
    # regression targets are float32, and a named feature of bools (a mask) stays
    # bool. Float labels are never cast to classes: a classifier given them stops at
    # the batch check with one line.
    if isinstance(x, dict):
        x = {str(k): _wire_array(v, np.int32, keep_bool=True) for k, v in x.items()}
    else:
        x = _wire_array(x, np.int32)
    return x, _wire_array(y, np.int64)


def _wire_array(values, integer_dtype, keep_bool: bool = False) -> np.ndarray:
    kind = np.asarray(values).dtype
    if np.issubdtype(kind, np.integer):
        dtype = integer_dtype
    else:
        dtype = bool if keep_bool and kind == np.bool_ else np.float32
    return np.ascontiguousarray(values, dtype=dtype)


def take_rows(x, rows):
    """Rows of a batch's features: one array, or each array of a dict of them."""
    return {k: v[rows] for k, v in x.items()} if isinstance(x, dict) else x[rows]


@dataclass
class Shard:
    x: np.ndarray | dict    # features: one array, or a dict of arrays by feature name
    y: np.ndarray
    global_batch: int
    rows: slice
    label_count: int    # labelled targets in the whole global batch (a token loss's normaliser)


@dataclass
class InputStream:
    """One split (train or eval) of one run: data set + batch plan."""
    name: str
    dataset: object
    plan: BatchPlan

    @classmethod
    def build(cls, name: str, dataset, section, run_seed: int) -> "InputStream":
        try:
            plan = BatchPlan(num_samples=dataset_len(dataset), batch_size=section.batch_size,
                             shuffle=section.shuffle, drop_last_batch=section.drop_last_batch,
                             seed=section.seed(run_seed))
        except DataError as exc:   # an empty file says nothing of itself: name where it came from
            where = getattr(section, "data_dir", None) or "the input function's data set"
            raise DataError(f"{name}_input.data_dir {where}: {exc}") from None
        return cls(name, dataset, plan)

    def shards(self, step: int, num_ranks: int) -> list[Shard]:
        """Global batch `step`, fetched once, split into each WSE's rows."""
        indices = self.plan.global_indices(step)
        x, y = fetch(self.dataset, indices)
        rows = [shard_rows(len(indices), rank, num_ranks) for rank in range(num_ranks)]
        count = label_count(y)
        return [Shard(take_rows(x, r), y[r], len(indices), r, count) for r in rows]

    def shard(self, step: int, rank: int = 0, num_ranks: int = 1) -> Shard:
        if num_ranks > 1:   # the label count needs the whole batch's labels
            return self.shards(step, num_ranks)[rank]
        indices = self.plan.global_indices(step)
        x, y = fetch(self.dataset, indices)
        return Shard(x, y, len(indices), slice(0, len(indices)), label_count(y))


def eval_steps(stream: InputStream, requested: int | None) -> int:
    """eval_steps from runconfig, else one pass over the eval set."""
    if requested:
        return requested
    plan = stream.plan
    return plan.steps_per_epoch if plan.drop_last_batch else math.ceil(plan.num_samples / plan.batch_size)
