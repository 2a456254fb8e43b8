"""cstorch.storage (and the 2.0/2.1 `cstorch.saver`): the model zoo's HDF5 checkpoints.

    cstorch.storage.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "global_step": 10},
                         "checkpoint_10.mdl")
    state = cstorch.storage.load("checkpoint_10.mdl")        # cstorch.load reads these files too

The layout is the model zoo's: one HDF5 dataset per tensor or number of
the state dict, named by its dotted path ("model.fc1.weight",
"optimizer.state.0.exp_avg"), the file's `__version__` and
`__cstorch_version__` attributes; a bfloat16 tensor is kept as float32
values marked `is_bfloat16`, a string or None as the real files mark them.
The real API keeps the tree of containers as a pickled attribute
(`__spec__`); nothing here unpickles it, nor writes one: the tree is kept
as JSON text (`cs_emulator_spec`), and a file without it (the vendor's) is
rebuilt from its dotted names alone: under "model" the rest of the name is
the state dict's key, elsewhere each part is a level (digit parts integer
keys, "param_groups" a list), as the model zoo's checkpoints hold them.
Only numeric datasets and plain attributes are read.

    pip install 'cs-emulator[hdf5]'      # h5py

    constants.py    the checkpoint's attribute names and format version
    serializers.py  use_external_link, cache_deferred_tensors: the real API's switches for deferred tensors
    pt_h5_saver.py  cstorch.saver.pt_h5_saver (2.0/2.1): PyTorchH5Saver by its module's name
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cs_runtime.checkpoint_mdl import is_hdf5, require_h5py, written_atomically

from ..nn import CsTorchError
from . import constants, serializers  # noqa: F401 (cstorch.storage.constants, .serializers)
from .constants import __CSTORCH_VERSION__, __VERSION__, CURRENT_CKPT_FORMAT_VERSION as CKPT_VERSION

SPEC_ATTR = "cs_emulator_spec"


@dataclass(frozen=True)
class CkptVersion:
    """A checkpoint's format version and the cstorch release that wrote it."""
    ckpt_version: float
    cstorch_version: str | None = None


def _flatten(obj, scope: tuple, leaves: dict):
    """(the JSON tree of obj's containers, with each leaf's dotted name in its place); leaves filled."""
    if isinstance(obj, dict):
        keys = list(obj)
        return {"dict": [[k, type(k).__name__, _flatten(obj[k], scope + (str(k),), leaves)] for k in keys]}
    if isinstance(obj, (list, tuple)):
        return {type(obj).__name__: [_flatten(v, scope + (str(i),), leaves) for i, v in enumerate(obj)]}
    name = ".".join(scope)
    if not name:
        raise CsTorchError("storage.save: the state to save must be a dict or a list, not one value")
    leaves[name] = obj
    return {"leaf": name}


def _unflatten(spec, values: dict):
    if "leaf" in spec:
        return values[spec["leaf"]]
    if "dict" in spec:
        return {(int(k) if kind == "int" else k): _unflatten(v, values) for k, kind, v in spec["dict"]}
    kind = "list" if "list" in spec else "tuple"
    items = [_unflatten(v, values) for v in spec[kind]]
    return items if kind == "list" else tuple(items)


def _write_leaf(f, name: str, value) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        bf16 = tensor.dtype == torch.bfloat16
        dset = f.create_dataset(name, data=(tensor.float() if bf16 else tensor).numpy())
        if bf16:
            dset.attrs["is_bfloat16"] = True
    elif isinstance(value, np.ndarray):
        f.create_dataset(name, data=value)
    elif isinstance(value, (bool, int, float, np.number)):
        f.create_dataset(name, data=np.asarray(value)).attrs["is_scalar"] = True
    elif isinstance(value, str):
        f.create_dataset(name, data=np.zeros(0)).attrs.update({"is_string": True, "string_val": value})
    elif value is None:
        f.create_dataset(name, data=np.zeros(0)).attrs["is_none"] = True
    else:
        raise CsTorchError(f"storage.save: {name} is a {type(value).__name__}; a checkpoint holds tensors, "
                           "numbers, strings and None")


def save(state_dict, checkpoint_file) -> None:
    """Write state_dict to an HDF5 checkpoint in the model zoo's layout (atomically: a crash leaves none)."""
    path = Path(os.fspath(checkpoint_file))
    h5py = require_h5py(path, "writing")
    leaves: dict = {}
    spec = _flatten(state_dict, (), leaves)
    with written_atomically(path, h5py) as f:
        for name, value in leaves.items():
            _write_leaf(f, name, value)
        f.attrs.update({SPEC_ATTR: json.dumps(spec), __VERSION__: CKPT_VERSION,
                        __CSTORCH_VERSION__: _release()})


def _release() -> str:
    from .. import __version__
    return __version__


def _read_leaf(dset):
    attrs = dset.attrs
    if attrs.get("is_none", False):
        return None
    if attrs.get("is_string", False):
        return str(attrs.get("string_val"))
    if dset.dtype.kind not in "biuf":
        raise CsTorchError(f"storage.load: dataset {dset.name} is of type {dset.dtype}, not numbers")
    array = np.asarray(dset[()])
    if attrs.get("is_scalar", False):
        return array.item()
    tensor = torch.from_numpy(np.array(array))
    return tensor.to(torch.bfloat16) if attrs.get("is_bfloat16", False) else tensor


def _by_names(values: dict) -> dict:
    """The model zoo's checkpoint the dotted names spell: the first part a top-level key; under "model"
    (a module's state dict, whose own keys hold dots) the rest is the key; elsewhere each part a level,
    a digit part an integer key, and "param_groups" a list, as torch's optimizer state dict has them."""
    root: dict = {}
    for name, value in values.items():
        top, _, rest = name.partition(".")
        parts = [top] + ([rest] if top == "model" and rest else
                         [int(p) if p.isdigit() else p for p in rest.split(".") if rest])
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise CsTorchError(f"storage.load: {name} lies under a value, not a container")
        node[parts[-1]] = value
    return _lists(root)


def _lists(node, key=None):
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v, k) for k, v in node.items()}
    if key == "param_groups" and sorted(node) == list(range(len(node))):
        return [node[i] for i in range(len(node))]
    return node


def load(checkpoint_file, map_location=None):
    """The state dict of an HDF5 checkpoint (tensors on the host)."""
    path = os.fspath(checkpoint_file)
    if not is_hdf5(path):
        raise CsTorchError(f"storage.load: {path} is not an HDF5 checkpoint")
    h5py = require_h5py(path, "reading")
    values: dict = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: values.__setitem__(name.replace("/", "."), _read_leaf(obj))
                     if isinstance(obj, h5py.Dataset) else None)
        raw_spec = f.attrs.get(SPEC_ATTR)
    if raw_spec is None:
        return _by_names(values)
    try:
        return _unflatten(json.loads(raw_spec), values)
    except (ValueError, KeyError, TypeError) as exc:
        raise CsTorchError(f"storage.load: {path}: attribute {SPEC_ATTR} does not describe its datasets "
                           f"({type(exc).__name__}: {exc})") from None


class PyTorchH5Saver:
    """The 2.0/2.1 name of the saver (cstorch.saver.PyTorchH5Saver): save, load and the file's version."""

    @staticmethod
    def extract_version(checkpoint_file) -> CkptVersion | None:
        """The HDF5 checkpoint's version; None for a file of cstorch.save (torch's zip format), which has none."""
        path = os.fspath(checkpoint_file)
        if not is_hdf5(path):
            return None
        h5py = require_h5py(path, "reading")
        with h5py.File(path, "r") as f:
            version = f.attrs.get(__VERSION__, 0.1)
            release = f.attrs.get(__CSTORCH_VERSION__)
        return CkptVersion(float(version), None if release is None else str(release))

    def save(self, ckpt_file, state_dict) -> None:
        save(state_dict, ckpt_file)

    def load(self, ckpt_file, map_location=None):
        return load(ckpt_file, map_location)


def __getattr__(name: str):
    # cstorch.saver.pt_h5_saver (2.0/2.1): it imports PyTorchH5Saver from here, so it is loaded when asked for.
    if name == "pt_h5_saver":
        import importlib
        return importlib.import_module(".pt_h5_saver", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
