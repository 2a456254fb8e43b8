"""A torch DataLoader's batches, epoch after epoch, as a CSX run's input workers and its loop take them.

The user's process and every input worker build the same loader (input_fn)
and replay its draws one epoch at a time, as iterating it draws them: a
torch sampler's random numbers come from the generators' states the user's
process saw when the run started (saved for the workers as arrays, never
pickled), drawn in a private copy so that both sides see the same order
whatever else uses the generators meanwhile. Nothing is drawn up front:
memory is one epoch's order plus a window of recent batches, and the start
does not grow with the run's length. An IterableDataset is read in its own
order, a fresh pass each epoch, as iterating the loader reads it.

`RunSamples` is the `get(indices)` data set of the workers' batch plan: its
samples are the run's, in sequence (sample i of batch b is run position
b * batch_size + i), so the plan reads them without shuffling.
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict

import numpy as np
import torch

from cs_runtime.data.inputs import take_rows

from .nn import CsTorchError

WINDOW_BATCHES = 256    # batches kept for the workers' prefetch, which asks a little out of order
_TORCH_SAMPLERS = (torch.utils.data.SequentialSampler, torch.utils.data.RandomSampler,
                   torch.utils.data.SubsetRandomSampler, torch.utils.data.WeightedRandomSampler)
GLOBAL = "global"     # the key of torch's default generator among the saved states
ORDER = "order"       # the key of a sampler's own place in its order (int64), for one that keeps it


def _own_order(loader):
    """The loader's sampler that keeps its order's state itself (cstorch's DistributedSampler, as the
    batch sampler or under torch's), or None."""
    candidates = (loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None))
    return next((s for s in candidates if hasattr(s, "replay_state")), None)


def _generators(loader) -> dict[str, torch.Generator]:
    """The torch generators a loader's iteration draws from, by their role (torch's own uses the global one)."""
    sampler = getattr(loader.batch_sampler, "sampler", None) if loader.batch_sampler is not None else None
    if _own_order(loader) is not None:   # it seeds its own generator each epoch: its state is its place
        return {"loader": loader.generator} if loader.generator is not None else {}
    if type(loader.batch_sampler) is not torch.utils.data.BatchSampler or type(sampler) not in _TORCH_SAMPLERS:
        odd = sampler if type(loader.batch_sampler) is torch.utils.data.BatchSampler else loader.batch_sampler
        raise CsTorchError(f"CSX backend: the DataLoader's sampler {type(odd).__name__} "
                           "is not one of torch's; the input workers replay torch's samplers' draws only "
                           "(use backend('CPU') for it)")
    found = {"loader": loader.generator, "sampler": getattr(sampler, "generator", None)}
    return {role: g for role, g in found.items() if g is not None}


def start_states(loader) -> dict[str, np.ndarray]:
    """The states (uint8 arrays) of the generators a map-style loader's next epochs draw from."""
    states = {GLOBAL: torch.get_rng_state()}
    states.update({role: g.get_state() for role, g in _generators(loader).items()})
    states = {role: s.numpy().copy() for role, s in states.items()}
    own = _own_order(loader)
    if own is not None:
        states[ORDER] = own.replay_state()
    return states


def is_iterable(loader) -> bool:
    return isinstance(loader.dataset, torch.utils.data.IterableDataset)


class _EpochDraws:
    """A map-style loader's epochs of batch indices, drawn in a private copy of the generators' states."""

    def __init__(self, loader, states: dict[str, np.ndarray]):
        self.loader, self.generators, self.own = loader, _generators(loader), _own_order(loader)
        roles = {GLOBAL, *self.generators, *([ORDER] if self.own is not None else [])}
        if set(states) != roles:
            raise CsTorchError(f"CSX backend: saved generator states {sorted(states)} do not fit the loader's "
                               f"({sorted(roles)})")
        self.order = np.array(states[ORDER], dtype=np.int64) if self.own is not None else None
        self.states = {role: torch.from_numpy(np.array(s, dtype=np.uint8)) for role, s in states.items()
                       if role != ORDER}
        self.iterator = None

    @contextlib.contextmanager
    def _private(self):
        """The generators in this replay's states while drawing; theirs again after."""
        theirs = {role: g.get_state() for role, g in self.generators.items()}
        their_order = self.own.replay_state() if self.own is not None else None
        with torch.random.fork_rng(devices=[]):   # the global generator comes back on leaving
            torch.set_rng_state(self.states[GLOBAL])
            for role, g in self.generators.items():
                g.set_state(self.states[role])
            if self.own is not None:
                self.own.restore_replay_state(self.order)
            try:
                yield
            finally:
                self.states = {GLOBAL: torch.get_rng_state(),
                               **{role: g.get_state() for role, g in self.generators.items()}}
                for role, g in self.generators.items():
                    g.set_state(theirs[role])
                if self.own is not None:
                    self.order = self.own.replay_state()
                    self.own.restore_replay_state(their_order)

    def next_epoch(self) -> list[list[int]]:
        from torch.utils.data.dataloader import _BaseDataLoaderIter
        loader = self.loader
        with self._private():
            # A new iterator each epoch draws as iter(loader) does (persistent workers: one, reset); reads no sample.
            if self.iterator is not None and loader.persistent_workers and loader.num_workers > 0:
                self.iterator._reset(loader)
            else:
                self.iterator = _BaseDataLoaderIter(loader)   # what every loader iterator does first; no process
            return _all_batches(self.iterator)

    def hand_back(self) -> None:
        """The user's generators as iterating the loader for the epochs drawn would have left them."""
        torch.set_rng_state(self.states[GLOBAL])
        for role, g in self.generators.items():
            g.set_state(self.states[role])
        if self.own is not None:
            self.own.restore_replay_state(self.order)


def _all_batches(iterator) -> list[list[int]]:
    batches = []
    while True:
        try:
            batches.append(list(iterator._next_index()))
        except StopIteration:
            return batches


def batch_size_of(loader) -> int | None:
    """The loader's batch size; for an IterableDataset that yields whole batches (batch_size=None, as the
    model zoo's BERT processor), the rows of its first batch; None when there is none to read."""
    own = _own_order(loader)
    if loader.batch_size is None and getattr(own, "batch_size", None):   # a batch sampler of its own order
        return own.batch_size
    if isinstance(loader.batch_size, int) or not is_iterable(loader):
        return loader.batch_size
    # Through the loader: with worker processes the data set may be readable only in them (BERT's CSV
    # processor shards its files in the loader's worker_init_fn).
    first = next(iter(loader), None)
    if first is None:
        return None
    rows = first[LABELS] if isinstance(first, dict) and LABELS in first else \
        first[0] if isinstance(first, (tuple, list)) else first
    return len(rows) if hasattr(rows, "__len__") else None


def _batches_of(loader, draws: _EpochDraws | None):
    """The run's batches in order, endlessly: index arrays (map-style, `draws` its epochs) or (x, y) arrays
    (an IterableDataset, a fresh pass each epoch)."""
    size = batch_size_of(loader)
    whole = loader.batch_size is None   # the data set yields whole batches
    while True:
        produced = 0
        for batch in (_read_batches(loader, size, whole) if draws is None else draws.next_epoch()):
            if draws is not None and len(batch) != size:
                raise CsTorchError(f"CSX backend: the torch DataLoader's batch {produced} has {len(batch)} "
                                   f"samples, not {size} (a traced step takes one input shape: drop_last=True)")
            produced += 1
            yield batch if draws is None else np.asarray(batch, dtype=np.int64)
        if produced == 0:
            raise CsTorchError("CSX backend: the torch DataLoader produced no batch"
                               + (f" (its IterableDataset holds fewer than {size} samples)" if draws is None else ""))


def _read_batches(loader, size: int, whole: bool = False):
    """An IterableDataset's full batches of one pass, as (inputs, labels) arrays, read through its torch
    DataLoader as iterating it does (its worker processes, each with its share of the data set, their
    batches interleaved, and its collate_fn); a short tail is dropped. `whole`: the data set yields
    batches (batch_size=None), each of which must have the first one's size."""
    for batch in loader:
        x, y = stacked_pairs(_rows(batch))
        if len(y) != size:
            if not whole:
                return   # the tail of a pass (drop_last=False)
            raise CsTorchError(f"CSX backend: the data set's batches have {len(y)} and {size} samples (a traced "
                               "step takes one input shape)")
        yield x, y


LABELS = "labels"   # a dict sample's entry that is the program's target; its other tensors are the inputs


def stacked_pairs(samples: list):
    """(input, label) samples as an inputs array and a labels array; dict samples (the model
    zoo's: input_ids, attention_mask, labels, ...) as a dict of input arrays by name and the
    labels array."""
    if samples and isinstance(samples[0], dict):
        return _stacked_dicts(samples)
    if not samples or len(samples[0]) != 2:
        raise CsTorchError("CSX backend: the data set's samples must be (input, label) pairs or dicts of named "
                           f"tensors with {LABELS!r}")
    return tuple(_stacked([p[k] for p in samples]) for k in (0, 1))


def _rows(batch) -> list:
    """A whole batch (a dict of arrays, or a pair) as its samples."""
    if isinstance(batch, dict):
        return [{k: v[i] for k, v in batch.items()} for i in range(len(batch[next(iter(batch))]))]
    return list(zip(*batch))


def _stacked(values: list) -> np.ndarray:
    return host_array(torch.stack([torch.as_tensor(v) for v in values]))


def host_array(tensor) -> np.ndarray:
    """A tensor as a numpy array; bfloat16 (numpy has none; the model zoo's data under mixed precision on
    CSX) as float32, which holds each of its values exactly."""
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def _stacked_dicts(samples: list) -> tuple[dict, np.ndarray]:
    names = list(samples[0])
    if LABELS not in names:
        raise CsTorchError(f"CSX backend: a dict sample needs a {LABELS!r} entry (the program's target); it has "
                           f"{', '.join(map(str, names))}")
    if any(list(s) != names for s in samples):
        raise CsTorchError("CSX backend: the data set's dict samples do not all have the same entries")
    features = {name: _stacked([s[name] for s in samples]) for name in names if name != LABELS}
    return features, _stacked([s[LABELS] for s in samples])


def arrays_of(loader) -> tuple[np.ndarray | dict, np.ndarray]:
    """A torch DataLoader's data set as (inputs, labels) arrays (what the input workers stream). An
    IterableDataset is read in its own order to its end."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        raise CsTorchError(f"CSX backend: input_fn returned {type(loader).__name__}; the input workers need a "
                           "torch DataLoader over a data set of (input, label) pairs")
    if isinstance(dataset, torch.utils.data.TensorDataset) and len(dataset.tensors) == 2:
        x, y = dataset.tensors
    else:
        pairs = list(dataset) if is_iterable(loader) else [dataset[i] for i in range(len(dataset))]
        return stacked_pairs(pairs)
    return host_array(x), host_array(y)


class RunSamples:
    """The samples of a run of `steps` batches of a torch DataLoader, in the order iterating it yields them."""

    def __init__(self, loader, steps: int, states: dict[str, np.ndarray] | None):
        """`states`: the generators' states the run starts from (start_states; None for an IterableDataset)."""
        self.loader, self.steps, self.states = loader, steps, states
        self.arrays = None if is_iterable(loader) else arrays_of(loader)   # a map-style data set, read once
        self.batch_size = batch_size_of(loader)
        self._lock = threading.Lock()
        self._restart()

    def _restart(self) -> None:
        """From the run's first batch (a batch asked for after it left the window: slow, still right)."""
        self._draws = None if is_iterable(self.loader) else _EpochDraws(self.loader, self.states)
        self._source = _batches_of(self.loader, self._draws)
        self._kept: OrderedDict[int, object] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return self.steps * self.batch_size

    def batch(self, b: int):
        with self._lock:
            if b not in self._kept:
                if b < self._next:
                    self._restart()
                while self._next <= b:
                    self._kept[self._next] = next(self._source)
                    self._next += 1
                    if len(self._kept) > WINDOW_BATCHES:
                        self._kept.popitem(last=False)
            return self._kept[b]

    def get(self, indices: np.ndarray):
        b, size = int(indices[0]) // self.batch_size, self.batch_size
        if not np.array_equal(indices, np.arange(b * size, (b + 1) * size)):
            raise CsTorchError("CSX backend: the run's samples are read a whole batch at a time, in sequence")
        item = self.batch(b)
        if isinstance(item, tuple):
            return item
        x, y = self.arrays
        return take_rows(x, item), y[item]

    def hand_back(self) -> None:
        """At the run's end: the user's generators left as iterating the loader for the epochs reached would
        leave them, and the pass in progress closed (a loader's worker processes stop with it)."""
        self._source.close()
        if self._draws is not None:
            self._draws.hand_back()
