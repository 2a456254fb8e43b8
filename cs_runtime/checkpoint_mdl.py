"""The model zoo's HDF5 checkpoint layout (`.mdl`), read and written with h5py (optional extra).

The model zoo saves `{"model": module.state_dict(), "optimizer": ..., "global_step": N}`
flattened into one HDF5 file, a dataset per leaf named by the dotted path:

    model.transformer_decoder.layers.0.self_attn.proj_q_dense_layer.weight   (out, in) float32
    optimizer.state.0.exp_avg                                                  state of parameter 0
    global_step                                                                int64 scalar

Model weights use the torch names and layout of cs_runtime/torch_names.py;
optimizer state is indexed by the parameter's position in the module's
parameters() order, as torch's optimizer state_dict does (SGD's momentum is
torch's `momentum_buffer`). This project's own model description and params
ride along as the JSON text attribute `cs_emulator_meta`, so a file written
here converts back exactly; a file without it is read by its names alone.

Only numeric datasets are read: no pickle, no object arrays.

    pip install 'cs-emulator[hdf5]'      # h5py
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from cs_runtime.errors import UserInputError
from cs_runtime import torch_names as names

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
META_ATTR = "cs_emulator_meta"
TORCH_SLOTS = {"momentum": "momentum_buffer"}          # this project's slot -> torch's
PROJECT_SLOTS = {v: k for k, v in TORCH_SLOTS.items()}


class MdlError(UserInputError):
    """An .mdl file that cannot be read or written; one line naming the file."""


def is_hdf5(path: str | Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(HDF5_MAGIC)) == HDF5_MAGIC
    except OSError:
        return False


def require_h5py(path, doing: str):
    try:
        import h5py
    except ImportError:
        raise MdlError(f"{doing} {path} (the model zoo's HDF5 .mdl layout) needs h5py: "
                       f"pip install 'cs-emulator[hdf5]'") from None
    return h5py


def write(path: str | Path, global_step: int, weights: dict, opt_state: dict, meta: dict) -> Path:
    """Write an .mdl atomically (a temporary file in the same folder, then renamed)."""
    path = Path(path)
    h5py = require_h5py(path, "writing")
    table, aliases = names.table_for(meta.get("model"), weights=weights)
    datasets = {f"model.{n}": a for n, a in names.to_torch(table, aliases, weights).items()}
    order = {n: i for i, n in enumerate(names.parameter_order(table))}
    slots = sorted({s for layer in opt_state.values() for p in layer.values() for s in p})
    for slot in slots:
        per_slot = {layer: {p: s[slot] for p, s in params.items() if slot in s} for layer, params in opt_state.items()}
        for n, a in names.to_torch(table, {}, per_slot, missing_ok=True).items():
            datasets[f"optimizer.state.{order[n]}.{TORCH_SLOTS.get(slot, slot)}"] = a
    datasets["global_step"] = np.int64(global_step)
    with written_atomically(path, h5py) as f:
        for key, value in datasets.items():
            f.create_dataset(key, data=value)
        f.attrs[META_ATTR] = json.dumps(meta)
    return path


@contextlib.contextmanager
def written_atomically(path: Path, h5py):
    """An HDF5 file to write at `path`: a temporary file in its folder, renamed to `path` once
    written, removed if writing fails (a crash leaves no half file under the name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _datasets(f) -> dict[str, np.ndarray]:
    """Every numeric dataset, by its dotted name (a group path's / read as .)."""
    found: dict[str, np.ndarray] = {}

    def visit(name, obj):
        if hasattr(obj, "dtype") and obj.dtype.kind in "biuf":
            found[name.replace("/", ".")] = np.asarray(obj[()])
    f.visititems(visit)
    return found


def read(path: str | Path) -> tuple[int, dict, dict, dict]:
    """(global_step, weights, opt_state, meta) of an .mdl; MdlError naming the file otherwise."""
    h5py = require_h5py(path, "reading")
    try:
        with h5py.File(path, "r") as f:
            arrays = _datasets(f)
            raw_meta = f.attrs.get(META_ATTR)
            if "global_step" not in arrays and "global_step" in f.attrs:   # a scalar kept as an attribute
                arrays["global_step"] = np.asarray(f.attrs["global_step"])
    except OSError as exc:
        raise MdlError(f"checkpoint {path} is not a readable HDF5 file: {exc}") from None
    try:
        meta = json.loads(raw_meta) if raw_meta is not None else {}
    except (TypeError, ValueError):
        raise MdlError(f"checkpoint {path}: attribute {META_ATTR} is not JSON") from None
    model = {k[len("model."):]: a for k, a in arrays.items() if k.startswith("model.")}
    if not model:
        raise MdlError(f"checkpoint {path} holds no model.* weights (not a model-zoo checkpoint)")
    try:
        table, aliases = names.table_for(meta.get("model"), model)
        weights = names.from_torch(table, aliases, model, f"checkpoint {path}")
        opt_state = _opt_state(table, arrays, path)
    except names.NameMapError as exc:
        raise MdlError(str(exc)) from None
    weights = {layer: {p: a.astype(np.float32) for p, a in params.items()} for layer, params in weights.items()}
    step = arrays.get("global_step")
    numeric = step is not None and step.size == 1 and step.dtype.kind in "iuf"
    return (int(step) if numeric else 0), weights, opt_state, meta


def _opt_state(table, arrays: dict, path) -> dict:
    order = names.parameter_order(table)
    by_slot: dict[str, dict[str, np.ndarray]] = {}
    for key, value in arrays.items():
        parts = key.split(".")
        if len(parts) == 4 and parts[:2] == ["optimizer", "state"] and parts[2].isdigit():
            index = int(parts[2])
            if index >= len(order):
                raise MdlError(f"checkpoint {path}: {key} is for parameter {index}; the model has {len(order)}")
            by_slot.setdefault(parts[3], {})[order[index]] = value
    state: dict = {}
    for slot, tensors in by_slot.items():
        mapped = names.from_torch(table, {}, tensors, f"checkpoint {path} optimizer slot {slot}", missing_ok=True)
        for layer, params in mapped.items():
            for p, a in params.items():
                state.setdefault(layer, {}).setdefault(p, {})[PROJECT_SLOTS.get(slot, slot)] = a.astype(np.float32)
    return state
