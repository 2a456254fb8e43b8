"""cstorch.save / cstorch.load: checkpoints a torch user opens with torch.load.

    cstorch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                 "checkpoint_100.mdl")
    state = cstorch.load("checkpoint_100.mdl")      # or torch.load(path, weights_only=True)

The format is torch.save's zip file, because that is what a torch user
expects a checkpoint to be (torch.load opens it, nothing to install).
Loading always passes weights_only=True: torch's restricted unpickler then
rebuilds only tensors and plain containers and numbers, and refuses any
other object, so a checkpoint from elsewhere cannot run code here. What is
saved must be such plain data (state_dicts are). `load` also reads the
model zoo's HDF5 checkpoints (cs_torch/storage.py, which writes them).
"""
from __future__ import annotations

import os

import torch

from cs_runtime.checkpoint_mdl import is_hdf5

from .nn import CsTorchError


def save(obj, checkpoint_file) -> None:
    path = os.fspath(checkpoint_file)
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)   # written whole, then renamed: a crash never leaves half a checkpoint
    os.replace(tmp, path)


def load(checkpoint_file, map_location=None, **kwargs):
    path = os.fspath(checkpoint_file)
    if kwargs.pop("weights_only", True) is not True:
        raise CsTorchError("load: checkpoints are always loaded with weights_only=True (no arbitrary pickle)")
    if kwargs:
        raise CsTorchError(f"load: unexpected argument {sorted(kwargs)[0]!r}")
    if not os.path.isfile(path):
        raise CsTorchError(f"load: no checkpoint file {path}")
    if is_hdf5(path):   # the model zoo's HDF5 checkpoints (cstorch.storage)
        from .storage import load as load_h5
        return load_h5(path, map_location)
    try:
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a bad file; the user needs one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CsTorchError(f"load: {path} is not a checkpoint this can load safely: {first}") from None
