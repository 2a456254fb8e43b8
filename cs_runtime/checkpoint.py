"""Checkpoints: `model_dir/checkpoint_<step>.npz`, a plain NumPy archive.

Readable without this package:

    import numpy as np, json
    ck = np.load("model_dir/checkpoint_200.npz")          # allow_pickle stays False
    ck["model/fc0/weight"], ck["optimizer/fc0/weight/momentum"]
    int(ck["global_step"]), json.loads(str(ck["meta"]))  # meta: model spec, params, input position

Keys: `model/<layer>/<param>` (float32 weights), `optimizer/<layer>/<param>/<slot>`
(optimizer state; Adam's `step` slot is a float32 scalar, the updates applied,
which skipped loss-scaling steps do not advance; a checkpoint without it
resumes counting from its global step), `global_step` (int64: steps completed), `input_step` (int64:
the next global batch the input pipeline produces; batches are a pure function
of the step, so this is the whole input position), `meta` (JSON text).

`flatten` / `unflatten` are the one mapping between nested weights and
optimizer state and these flat keys: the checkpoint file and the wire
(LOAD_MODEL, STATE) use it alike.

Writes are atomic: the archive is written to a temporary file in the same
folder, fsynced, then renamed; a crash leaves at most a `.tmp` file, never a
broken `checkpoint_<step>.npz`, and the next save removes such leftovers (one
writer per model_dir: the chief). Only after the new checkpoint is complete
are the oldest beyond `max_checkpoints` deleted.

A disk that is full or read-only (ENOSPC, EDQUOT, EROFS, EACCES) fails the
save with one CheckpointError line naming the file and the cause; the
checkpoints already there are untouched. A resume (`load_newest`) takes the
newest checkpoint that loads, and says which newer ones it skipped and why
(cut short, bit-flipped): one bad file never stops a job that has a good one.

`load` also reads the model zoo's HDF5 `.mdl` checkpoints (cs_runtime/checkpoint_mdl.py,
with h5py); cs_runtime/cli/convert_checkpoint.py converts between this format, `.mdl`
and a PyTorch state_dict.
"""
from __future__ import annotations

import errno
import json
import os
import re
import stat
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cs_runtime.errors import UserInputError
from cs_runtime.numerics import program_layer
from cs_runtime.numerics.model import ModelSpec
from cs_runtime.numerics.optim import MASK_SLOT

CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)\.npz$")


class CheckpointError(UserInputError):
    pass


class UnreadableCheckpoint(CheckpointError):
    """The file is there but is not a checkpoint (truncated, corrupt): an older one may do."""


# Errors of the disk, not of this job: a restart would meet them again.
DISK_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
               errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied"}


@dataclass
class Checkpoint:
    global_step: int
    input_step: int
    weights: dict[str, dict[str, np.ndarray]]          # layer -> param -> array
    opt_state: dict[str, dict[str, dict[str, np.ndarray]]]  # layer -> param -> slot -> array
    meta: dict


def flatten(weights: dict, opt_state: dict) -> dict[str, np.ndarray]:
    """{model/<layer>/<param>: weight, optimizer/<layer>/<param>/<slot>: state}, layer by layer."""
    arrays = {}
    for layer, params in weights.items():
        for pname, w in params.items():
            arrays[f"model/{layer}/{pname}"] = w
            for slot, value in opt_state.get(layer, {}).get(pname, {}).items():
                arrays[f"optimizer/{layer}/{pname}/{slot}"] = value
    return arrays


def unflatten(arrays: dict) -> tuple[dict, dict]:
    """Inverse of flatten: (weights, opt_state); keys of another shape are ignored."""
    weights: dict = {}
    opt_state: dict = {}
    for key, value in arrays.items():
        parts = key.split("/")
        if parts[0] == "model" and len(parts) == 3:
            weights.setdefault(parts[1], {})[parts[2]] = value
        elif parts[0] == "optimizer" and len(parts) == 4:
            opt_state.setdefault(parts[1], {}).setdefault(parts[2], {})[parts[3]] = value
    return weights, opt_state


def unflatten_for(spec: ModelSpec, optimizer, arrays: dict) -> tuple[dict, dict]:
    """unflatten, checked against the model: every weight of `spec` with its shape (ValueError
    naming the first that is not), every slot of `optimizer` (numerics.optim.Optimizer; a new
    slot where absent). float32 copies, so the result is writable and owns its memory."""
    weights, opt_state = {}, {}
    if program_layer.has_tied(spec):   # a tied parameter stored once: each reader its copy
        stored, stored_opt = unflatten(arrays)
        with_tied_copies(spec, stored, stored_opt)
        arrays = flatten(stored, stored_opt)
    for layer in spec.layers:
        weights[layer.name], opt_state[layer.name] = {}, {}
        for pname, shape in layer.param_shapes().items():
            key = f"model/{layer.name}/{pname}"
            if key not in arrays or tuple(arrays[key].shape) != shape:
                raise CheckpointError(f"weights for {layer.name}/{pname} missing or not of shape {shape}")
            weights[layer.name][pname] = w = np.array(arrays[key], dtype=np.float32)
            slots = {f"optimizer/{layer.name}/{pname}/{slot}": slot for slot in optimizer.slot_names()}
            opt_state[layer.name][pname] = {
                slot: np.array(arrays[key], dtype=np.float32) if key in arrays else optimizer.new_slot(slot, w)
                for key, slot in slots.items()}
            mask = arrays.get(f"optimizer/{layer.name}/{pname}/{MASK_SLOT}")
            if mask is not None:   # the parameter trains the masked entries only (nn.SelectiveGrad)
                if tuple(mask.shape) != shape:
                    raise CheckpointError(f"the SelectiveGrad mask of {layer.name}/{pname} is not of shape {shape}")
                opt_state[layer.name][pname][MASK_SLOT] = np.array(mask, dtype=np.float32)
    return weights, opt_state


def stored_once(spec: ModelSpec, weights: dict, opt_state: dict) -> tuple[dict, dict]:
    """The state without the copies of a built-in model's tied parameter (a tied head's token
    table): a checkpoint holds it once, under its first reader (model/embed/tokens). A captured
    model's checkpoint keeps each unit's parameters, as cs_torch reads them back."""
    if spec.captured:
        return weights, opt_state
    copies = {(spec.layers[i].name, name) for i, name in program_layer.tied_sources(spec)}
    if not copies:
        return weights, opt_state
    drop = lambda state: {layer: {p: v for p, v in params.items() if (layer, p) not in copies}  # noqa: E731
                          for layer, params in state.items()}
    return drop(weights), drop(opt_state)


def with_tied_copies(spec: ModelSpec, weights: dict, opt_state: dict) -> None:
    """Give every layer that reads a tied parameter its copy (and its optimizer slots),
    from the first reader's, where a checkpoint stored it once. In place."""
    for (i, name), (j, source) in program_layer.tied_sources(spec).items():
        layer, owner = spec.layers[i].name, spec.layers[j].name
        if name not in weights.get(layer, {}) and source in weights.get(owner, {}):
            weights.setdefault(layer, {})[name] = np.array(weights[owner][source], dtype=np.float32)
            slots = opt_state.get(owner, {}).get(source)
            if slots is not None:
                opt_state.setdefault(layer, {})[name] = {k: np.array(v) for k, v in slots.items()}


def save(model_dir: str | Path, ck: Checkpoint, max_checkpoints: int | None = None) -> Path:
    """Write checkpoint_<step>.npz atomically; a full or read-only disk is one CheckpointError."""
    model_dir = Path(model_dir)
    final = model_dir / f"checkpoint_{ck.global_step}.npz"
    try:
        return _save(model_dir, final, ck, max_checkpoints)
    except OSError as exc:
        if exc.errno not in DISK_ERRNOS:
            raise
        kept = [path.name for _, path in list_checkpoints(model_dir)]
        raise CheckpointError(f"cannot write checkpoint {final}: {DISK_ERRNOS[exc.errno]} "
                              f"({errno.errorcode[exc.errno]}); checkpoints kept: {', '.join(kept) or 'none'}"
                              ) from None


def _save(model_dir: Path, final: Path, ck: Checkpoint, max_checkpoints: int | None) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    remove_leftovers(model_dir)
    write_file(final, ck, prefix=f".checkpoint_{ck.global_step}.")
    if max_checkpoints:
        prune(model_dir, max_checkpoints)
    return final


def write_file(final: Path, ck: Checkpoint, prefix: str | None = None) -> Path:
    """The archive at `final`, atomically (temporary file in its folder, fsync, rename)."""
    final = Path(final)
    arrays = {"global_step": np.int64(ck.global_step), "input_step": np.int64(ck.input_step),
              "meta": np.array(json.dumps(ck.meta)), **flatten(ck.weights, ck.opt_state)}
    fd, tmp = tempfile.mkstemp(prefix=prefix or f".{final.name}.", suffix=".tmp", dir=final.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(final.parent)
    return final


def remove_leftovers(model_dir: Path) -> None:
    """Temporary files of a writer that was killed mid-write (never a checkpoint)."""
    for leftover in model_dir.glob(".checkpoint_*.tmp"):
        leftover.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def named_checkpoints(model_dir: str | Path) -> list[tuple[int, Path]]:
    """Everything in model_dir named like a checkpoint, files or not, oldest first."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return []
    found = []
    for entry in model_dir.iterdir():
        m = CHECKPOINT_RE.match(entry.name)
        if m:
            found.append((int(m.group(1)), entry))
    return sorted(found)


def list_checkpoints(model_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in model_dir (regular files, or links to one), oldest first."""
    return [(step, path) for step, path in named_checkpoints(model_dir) if path.is_file()]


def latest(model_dir: str | Path) -> Path | None:
    found = list_checkpoints(model_dir)
    return found[-1][1] if found else None


def not_a_file(path: Path) -> str:
    """What stands at a checkpoint's name instead of a file (never opened: a FIFO would block)."""
    if path.is_symlink() and not path.exists():
        return f"a dangling symlink (to {os.readlink(path)})"
    mode = path.stat().st_mode
    return "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"


def load_newest(model_dir: str | Path, set_aside: bool = False
                ) -> tuple[Checkpoint | None, Path | None, list[str]] | None:
    """The newest checkpoint in model_dir that loads, its path, and one line for
    each newer entry skipped, with why: what is not a file at a checkpoint's name
    (a directory, a FIFO, a dangling symlink), a corrupt file (with `set_aside`,
    the writer's, renamed `<name>.corrupt` so that the step's next checkpoint does
    not overwrite it). None when nothing is named like a checkpoint; (None, None,
    lines) when only non-files are. All files corrupt: the CheckpointError lists
    them, and they stay as they are (starting afresh would train over them)."""
    skipped: list[tuple[Path | None, str]] = []   # (the corrupt file or None, why)
    for _, path in reversed(named_checkpoints(model_dir)):
        if not path.is_file():
            skipped.append((None, f"{path}: {not_a_file(path)}, not a checkpoint"))
            continue
        try:
            state = load(path)
        except UnreadableCheckpoint as exc:
            skipped.append((path, str(exc)))
            continue
        return state, path, [set_aside_corrupt(p, why) if p and set_aside else why for p, why in skipped]
    if any(p for p, _ in skipped):
        raise CheckpointError(f"no checkpoint in {model_dir} loads: {'; '.join(why for _, why in skipped)}")
    return (None, None, [why for _, why in skipped]) if skipped else None


def set_aside_corrupt(path: Path, why: str) -> str:
    """Rename a corrupt checkpoint out of the way (never overwritten, never deleted); the line that says so."""
    target = path.with_name(path.name + ".corrupt")
    n = 1
    while target.exists() or target.is_symlink():
        n += 1
        target = path.with_name(f"{path.name}.corrupt{n}")
    try:
        os.rename(path, target)
    except OSError as exc:
        return f"{why} (left in place: cannot rename it: {exc.strerror})"
    return f"{why}; set aside as {target.name}"


def prune(model_dir: str | Path, keep: int) -> None:
    for _, path in list_checkpoints(model_dir)[:-keep]:
        path.unlink(missing_ok=True)


def load(path: str | Path) -> Checkpoint:
    """A checkpoint of this project (.npz) or of the model zoo (.mdl, HDF5: needs h5py)."""
    path = Path(path)
    if not path.is_file():
        if path.exists() or path.is_symlink():
            raise CheckpointError(f"checkpoint {path} is {not_a_file(path)}, not a checkpoint file")
        raise CheckpointError(f"checkpoint {path} does not exist")
    from cs_runtime import checkpoint_mdl   # here: it imports the model tables, this module need not
    if checkpoint_mdl.is_hdf5(path):
        try:
            step, weights, opt_state, meta = checkpoint_mdl.read(path)
        except checkpoint_mdl.MdlError as exc:
            raise CheckpointError(str(exc)) from None
        return Checkpoint(step, step, weights, opt_state, meta)
    if is_torch_file(path):
        raise CheckpointError(f"checkpoint {path} is a PyTorch file (torch.save); convert it first: "
                              f"cs_convert_checkpoint {path} {path.with_suffix('.npz')}")
    try:
        with np.load(path, allow_pickle=False) as archive:
            data = {k: archive[k] for k in archive.files}
        meta = json.loads(str(data.pop("meta")))
        global_step = int(data.pop("global_step"))
        input_step = int(data.pop("input_step"))
    # A truncated or bit-flipped archive raises BadZipFile or EOFError, not OSError.
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as exc:
        raise UnreadableCheckpoint(f"checkpoint {path} is corrupt ({corruption(exc)})") from None
    weights, opt_state = unflatten(data)
    return Checkpoint(global_step, input_step, weights, opt_state, meta)


def corruption(exc: Exception) -> str:
    """What is wrong with an archive, in words: numpy calls a file that is no zip 'pickled data'
    and advises allow_pickle, which must stay off."""
    if isinstance(exc, ValueError) and "allow_pickle" in str(exc):
        return "not a NumPy archive"
    if isinstance(exc, KeyError):
        return f"no {exc} entry"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def is_torch_file(path: Path) -> bool:
    """torch.save's zip archive: a folder holding data.pkl (which is never loaded here)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


# A mismatch of more weights than this is listed by count: the first few say enough.
MISMATCHES_SHOWN = 4


def check_compatible(ck: Checkpoint, expected: dict[str, dict[str, tuple]], path, builds: str | None = None) -> None:
    """Every expected weight present with its shape, or one line: the checkpoint's model
    when it is another (`builds`: the model this run builds), else the first mismatches."""
    problems = []
    for layer, params in expected.items():
        for pname, shape in params.items():
            got = ck.weights.get(layer, {}).get(pname)
            if got is None:
                problems.append(f"{layer}/{pname} missing")
            elif tuple(got.shape) != tuple(shape):
                problems.append(f"{layer}/{pname} has shape {tuple(got.shape)}, model needs {tuple(shape)}")
    extra = [f"{l}/{p}" for l, ps in ck.weights.items() for p in ps if p not in expected.get(l, {})]
    if extra:
        problems.append(f"unexpected {', '.join(sorted(extra)[:MISMATCHES_SHOWN])}"
                        + (f" and {len(extra) - MISMATCHES_SHOWN} more" if len(extra) > MISMATCHES_SHOWN else ""))
    if not problems:
        return
    theirs = ck.meta.get("model", {}).get("name") if isinstance(ck.meta.get("model"), dict) else None
    if builds and theirs and theirs != builds:
        raise CheckpointError(f"checkpoint {path} is of model {theirs}; this run builds {builds} "
                              "(another --model_dir, or --checkpoint_path of a " + builds + " checkpoint)")
    shown = "; ".join(problems[:MISMATCHES_SHOWN])
    more = f"; and {len(problems) - MISMATCHES_SHOWN} more" if len(problems) > MISMATCHES_SHOWN else ""
    raise CheckpointError(f"checkpoint {path} does not match the model: {shown}{more}")
