"""Deciding which samples form which batch, the same on every execution path.

The CPU oracle and every input worker of a distributed run use the same
``BatchPlan``, ``shard_rows`` and ``worker_steps``, so the samples a step sees
-- and therefore the numbers a run produces -- never depend on how many
workers or WSEs take part.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from cs_runtime.data.mnist import DataError


@functools.lru_cache(maxsize=8)
def _epoch_order(num_samples: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """Sample order of one epoch; cached so consecutive steps reuse it."""
    if shuffle:
        # Seeding on [seed, epoch] makes each epoch's order a pure function of
        # (seed, epoch): any process can jump straight to any step.
        order = np.random.default_rng([seed, epoch]).permutation(num_samples)
    else:
        order = np.arange(num_samples)
    order = order.astype(np.int64)
    order.flags.writeable = False   # cached and shared between callers
    return order


@dataclass(frozen=True)
class BatchPlan:
    """Which samples make up global batch ``step``, for any step, anywhere.

    Steps run across epochs forever: epoch = step // steps_per_epoch.
    """

    num_samples: int
    batch_size: int
    shuffle: bool
    drop_last_batch: bool
    seed: int

    def __post_init__(self) -> None:
        if self.num_samples <= 0:
            raise DataError(f"data set is empty (num_samples={self.num_samples})")
        if self.batch_size <= 0:
            raise DataError(f"batch_size must be positive, got {self.batch_size}")
        if self.seed < 0:
            raise DataError(f"seed must be non-negative, got {self.seed}")
        if self.drop_last_batch and self.batch_size > self.num_samples:
            raise DataError(
                f"batch_size {self.batch_size} exceeds data set size {self.num_samples} "
                "with drop_last_batch=True: no batch would ever be produced"
            )

    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last_batch:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def global_indices(self, step: int) -> np.ndarray:
        """Sample indices (int64) of global batch ``step``; short at epoch end
        only when drop_last_batch is False."""
        if step < 0:
            raise DataError(f"step must be non-negative, got {step}")
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.batch_size
        if not self.shuffle:   # in file order: no epoch's order held (a streamed data set has no end)
            return np.arange(start, min(start + self.batch_size, self.num_samples), dtype=np.int64)
        order = _epoch_order(self.num_samples, self.shuffle, self.seed, epoch)
        return order[start:start + self.batch_size].copy()


def shard_rows(batch_len: int, rank: int, num_ranks: int) -> slice:
    """Rows of a global batch owned by data-parallel ``rank`` of ``num_ranks``.

    Contiguous, sizes differ by at most one, earlier ranks take the extra rows,
    and the slices over ranks 0..num_ranks-1 tile the batch in order.
    """
    if num_ranks <= 0 or not 0 <= rank < num_ranks:
        raise DataError(f"rank {rank} out of range for num_ranks={num_ranks}")
    if batch_len < 0:
        raise DataError(f"batch_len must be non-negative, got {batch_len}")
    base, extra = divmod(batch_len, num_ranks)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def worker_steps(start: int, stop: int, worker: int, num_workers: int) -> range:
    """Steps in [start, stop) produced by input ``worker`` of ``num_workers``:
    those with step % num_workers == worker (round-robin, so workers
    interleave and the WSE can consume them in step order)."""
    if num_workers <= 0 or not 0 <= worker < num_workers:
        raise DataError(f"worker {worker} out of range for num_workers={num_workers}")
    if start < 0:
        raise DataError(f"start must be non-negative, got {start}")
    first = start + (worker - start) % num_workers
    return range(first, max(first, stop), num_workers)
