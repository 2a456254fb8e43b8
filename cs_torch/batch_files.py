"""A 1.x loop's batches of an IterableDataset, handed to the input workers one file a step.

A 1.x loop's torch DataLoader cannot be imported by name by the input workers, so its data
set is written out for them. A map-style data set is written whole (cluster_step.saved_loader);
an IterableDataset may be endless, and the loop alone knows when it stops (it breaks out of
its `for`), so it is read as the loop iterates: the loop's batch i is written as the file of
step i just before the loop gets it, and the workers wait for that file. Nothing is read
ahead of the loop, and only the last WINDOW_STEPS files are kept on disk.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

import numpy as np

from .nn import CsTorchError

WINDOW_STEPS = 256       # files kept behind the newest: the workers are ahead of the loop, never this far behind
ENDLESS_STEPS = 1 << 40  # the steps the workers' plan may ask for: the loop decides when the run stops
POLL_S = 0.005           # how often a worker looks for the file of a step the loop has not reached


def _path(folder: str, step: int) -> str:
    return os.path.join(folder, f"step_{step}.npz")


class BatchWriter:
    """The user's side: writes the loop's batches, one file a step, in the loop's order."""

    def __init__(self, directory: str, batch_size: int):
        os.makedirs(directory, exist_ok=True)
        self.folder = tempfile.mkdtemp(prefix=f"batches_{os.getpid()}_", dir=os.path.abspath(directory))
        self.batch_size, self.steps = batch_size, 0

    def write(self, x, y) -> None:
        """The next step's batch (torch tensors) of the loader's batch size."""
        x, y = _array(x, "input"), _array(y, "label")
        if len(x) != self.batch_size or len(y) != self.batch_size:
            raise CsTorchError(f"cbtorch.Session (CSX): batch {self.steps} of the IterableDataset has "
                               f"{len(x)} samples, not the DataLoader's {self.batch_size}; give it "
                               "drop_last=True (a compiled program takes one batch shape)")
        partial = os.path.join(self.folder, f".step_{self.steps}.npz")
        np.savez(partial, x=x, y=y)
        os.replace(partial, _path(self.folder, self.steps))   # a worker never sees half a file
        old = _path(self.folder, self.steps - WINDOW_STEPS)
        if os.path.exists(old):
            os.remove(old)
        self.steps += 1

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _array(value, what: str) -> np.ndarray:
    if not hasattr(value, "detach"):
        raise CsTorchError(f"cbtorch.Session (CSX): the IterableDataset's batches must be (input, label) "
                           f"tensors; its {what} is {type(value).__name__}")
    return value.detach().cpu().numpy()


class BatchFiles:
    """The workers' side: the samples of step i are the rows of step i's file (what the input
    workers call by name builds this; see streamed_batches)."""

    def __init__(self, folder: str, batch_size: int):
        self.folder, self.batch_size = folder, batch_size
        self._lock = threading.Lock()
        self._cached: tuple[int, tuple[np.ndarray, np.ndarray]] | None = None

    def __len__(self) -> int:
        return ENDLESS_STEPS * self.batch_size

    def get(self, indices: np.ndarray):
        step, size = int(indices[0]) // self.batch_size, self.batch_size
        if not np.array_equal(indices, np.arange(step * size, (step + 1) * size)):
            raise CsTorchError("CSX backend: a 1.x loop's streamed samples are read a whole batch at a time")
        with self._lock:
            if self._cached is None or self._cached[0] != step:
                self._cached = (step, self._read(step))
            return self._cached[1]

    def _read(self, step: int):
        path = _path(self.folder, step)
        while not os.path.exists(path):   # the loop has not reached this step yet (or ends before it)
            time.sleep(POLL_S)
        with np.load(path, allow_pickle=False) as saved:
            return saved["x"], saved["y"]


def streamed_batches(folder: str, batch_size: int) -> BatchFiles:
    """What the input workers call (by name) for a 1.x loop over an IterableDataset."""
    return BatchFiles(folder, batch_size)
