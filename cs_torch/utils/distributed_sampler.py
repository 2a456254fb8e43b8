"""cstorch.utils.data.DistributedSampler: the real API's sampler for map-style data sets.

    dataset.sampler = cstorch.utils.data.DistributedSampler(dataset, shuffle=True, seed=1, batch_size=64)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=dataset.sampler)

Its order is the real sampler's, whatever the number of systems and workers:
- each epoch (of `num_samples`, the data set's length by default) is a permutation drawn from a torch
  generator seeded `seed + epoch` (shuffle), or the indices in order, the data set repeated or cut
  to `num_samples`;
- `start_index` (a restart's samples already streamed) skips into the epoch it falls in;
- with a batch size, a batch is the next `batch_size` indices; with drop_last the ones an epoch
  leaves over open the next epoch's first batch; pad_last fills the last batch with `pad_index`.
Sharding by streaming rank happens on the real workers; here the user's process is not a streamer
and the input workers take their share of each global batch themselves, so `shard` leaves the
global batches as they are (the real sampler's behaviour on the user's node). A CSX run replays
its order as it replays torch's samplers: its state (epoch, place, leftovers) is the replay's.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from ..backends import use_cs
from .data_sampler import pad_index


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"DistributedSampler: {name} must be a positive integer, got {value!r}")
    return value


class ShuffleSampler(torch.utils.data.Sampler):
    """Indices epoch by epoch: a seeded permutation per epoch, or in order; a restart skips in."""

    def __init__(self, data_source, num_samples: int | None = None, shuffle: bool = True, seed: int | None = None,
                 start_index: int = 0):
        self.data_source, self._num_samples = data_source, num_samples
        self.frozen = _positive_int("num_samples", self.num_samples)
        if shuffle and not isinstance(seed, int):
            raise ValueError(f"DistributedSampler: shuffling needs an integer seed, got {seed!r}")
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.start_index = divmod(start_index, self.frozen)

    @property
    def num_samples(self) -> int:
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def __iter__(self):
        if self.num_samples != self.frozen:
            raise RuntimeError(f"DistributedSampler: the data set's length changed from {self.frozen} to "
                               f"{self.num_samples}; it must be the same every epoch")
        yield from self._epoch_order()[self.start_index:]
        self.epoch, self.start_index = self.epoch + 1, 0

    def _epoch_order(self) -> list[int]:
        length, wanted = len(self.data_source), self.num_samples
        if not self.shuffle:
            return [i % length for i in range(wanted)]
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        if wanted <= length:
            return torch.randperm(length, generator=generator)[:wanted].tolist()
        # More samples than the data set: whole copies in order, one shuffled copy, cut and shuffled again.
        copies = -(-wanted // length)
        pool = torch.cat([torch.arange(length)] * (copies - 1) + [torch.randperm(length, generator=generator)])
        return pool[:wanted][torch.randperm(wanted, generator=generator)].tolist()

    def __len__(self) -> int:
        return self.num_samples - self.start_index


class BatchSampler(torch.utils.data.Sampler):
    """Batches of indices; with drop_last an epoch's leftovers open the next epoch's first batch."""

    def __init__(self, sampler, batch_size: int, drop_last: bool, pad_last: bool):
        self.batch_size = _positive_int("batch_size", batch_size)
        if not isinstance(drop_last, bool):
            raise ValueError(f"DistributedSampler: drop_last must be True or False, got {drop_last!r}")
        self.sampler, self.drop_last, self.pad_last = sampler, drop_last, pad_last
        self.leftover = list(sampler) if len(sampler) < batch_size else []

    def __iter__(self):
        indices = itertools.chain(self.leftover, self.sampler) if self.drop_last else iter(self.sampler)
        batch: list[int] = []
        for index in indices:
            batch.append(index)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if self.drop_last:
            self.leftover = batch
        elif batch:
            yield batch + [pad_index] * (self.batch_size - len(batch)) if self.pad_last else batch

    def __len__(self) -> int:
        if self.drop_last:
            return (len(self.sampler) + len(self.leftover)) // self.batch_size
        return -(-len(self.sampler) // self.batch_size)


class DistributedSampler(torch.utils.data.Sampler):
    """Shuffling, skipping and batching of a map-style data set (see the module's docstring)."""

    def __init__(self, data_source, shuffle: bool = True, seed: int | None = None, start_index: int = 0,
                 shard: bool = True, batch_size: int | None = None, drop_last: bool = True,
                 num_samples: int | None = None, pad_last: bool = False):
        if use_cs() and not drop_last and not pad_last:
            raise ValueError("DistributedSampler: a CSX run needs batches of one size: set drop_last=True or "
                             "pad_last=True")
        if use_cs() and batch_size is None and shard:
            raise ValueError("DistributedSampler: a CSX run with shard=True needs batch_size (the global batch)")
        self.kwargs = {"data_source": data_source, "shuffle": shuffle, "seed": seed, "shard": shard,
                       "batch_size": batch_size, "drop_last": drop_last, "num_samples": num_samples,
                       "pad_last": pad_last}
        self.batch_size = batch_size   # the global batch (None: the sampler yields indices)
        self.sampler = ShuffleSampler(data_source, num_samples, shuffle, seed, start_index)
        if batch_size is not None:
            self.sampler = BatchSampler(self.sampler, batch_size, drop_last, pad_last)

    def __iter__(self):
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_state(self, start_index: int) -> None:
        """Continue from a prior run that streamed start_index samples in all."""
        self.__init__(**self.kwargs, start_index=start_index)

    # ------------------------------------------------------------ a CSX run's replay (cs_torch/loader_replay.py)
    def replay_state(self) -> np.ndarray:
        """Where the order stands, as integers: [epoch, index into it, the leftover indices...]."""
        shuffle = self.sampler.sampler if isinstance(self.sampler, BatchSampler) else self.sampler
        leftover = self.sampler.leftover if isinstance(self.sampler, BatchSampler) else []
        return np.array([shuffle.epoch, shuffle.start_index, *leftover], dtype=np.int64)

    def restore_replay_state(self, state) -> None:
        shuffle = self.sampler.sampler if isinstance(self.sampler, BatchSampler) else self.sampler
        shuffle.epoch, shuffle.start_index = int(state[0]), int(state[1])
        if isinstance(self.sampler, BatchSampler):
            self.sampler.leftover = [int(i) for i in state[2:]]
