"""cs_convert_checkpoint: a checkpoint in another format: this project's .npz, the model zoo's .mdl, a PyTorch state_dict.

    cs_convert_checkpoint model_dir/checkpoint_200.npz model.pt           # torch.load(..., weights_only=True)
    cs_convert_checkpoint model_dir/checkpoint_200.npz model.mdl          # the model zoo's HDF5 layout (h5py)
    cs_convert_checkpoint model.mdl model_dir/checkpoint_200.npz          # and back
    cs_convert_checkpoint model.pt back.npz --format npz

The source's format is read off its content; the destination's is --format,
else its suffix (.pt/.pth/.bin: torch, .mdl/.h5: mdl, .npz: npz). Weights
take the names and (out, in) layout of the model zoo's torch modules
(cs_runtime/torch_names.py); a PyTorch file holds the model's state_dict
alone, an .mdl also the optimizer state and the global step. Writing or
reading a PyTorch file needs torch, an .mdl h5py. Errors are one line, exit 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from cs_runtime.errors import UserInputError
from cs_runtime import checkpoint as ckpt
from cs_runtime import checkpoint_mdl, torch_names
from cs_runtime.version import version_line

FORMATS = ("npz", "mdl", "torch")
SUFFIXES = {".npz": "npz", ".mdl": "mdl", ".h5": "mdl", ".hdf5": "mdl", ".pt": "torch", ".pth": "torch",
            ".bin": "torch"}


class ConvertError(UserInputError):
    pass


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cs_convert_checkpoint", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=version_line("cs_convert_checkpoint"))
    parser.add_argument("source", help="a checkpoint: .npz of this project, .mdl of the model zoo, or a torch file")
    parser.add_argument("dest", help="the file to write")
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="of the destination (default: from its suffix)")
    return parser.parse_args(argv)


def require_torch(what: str):
    try:
        import torch
    except ImportError:
        raise ConvertError(f"{what} needs torch: pip install 'cs-emulator[torch]'") from None
    return torch


# ---------------------------------------------------------------- reading

def read(path: Path) -> ckpt.Checkpoint:
    if not path.is_file():
        raise ConvertError(f"checkpoint {path} does not exist")
    if not checkpoint_mdl.is_hdf5(path) and ckpt.is_torch_file(path):
        return read_torch(path)
    try:
        return ckpt.load(path)
    except ckpt.CheckpointError as exc:
        raise ConvertError(str(exc)) from None


def read_torch(path: Path) -> ckpt.Checkpoint:
    """A state_dict (or {"model": state_dict, "global_step": N}), tensors only (weights_only)."""
    torch = require_torch(f"reading the PyTorch file {path}")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:   # torch raises many kinds for a file it refuses (pickle.UnpicklingError, ...)
        raise ConvertError(f"{path}: not a tensors-only torch file ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    state = loaded.get("model", loaded) if isinstance(loaded, dict) else None
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise ConvertError(f"{path}: expected a state_dict (names -> tensors)")
    tensors = {k: v.detach().cpu().numpy() for k, v in state.items()}
    step = loaded.get("global_step", 0) if state is not loaded else 0
    try:
        table, aliases = torch_names.table_for(None, tensors)
        weights = torch_names.from_torch(table, aliases, tensors, f"{path}")
    except torch_names.NameMapError as exc:
        raise ConvertError(str(exc)) from None
    weights = {l: {p: a.astype(np.float32) for p, a in ps.items()} for l, ps in weights.items()}
    return ckpt.Checkpoint(int(step), int(step), weights, {}, {})


# ---------------------------------------------------------------- writing

def write(state: ckpt.Checkpoint, dest: Path, fmt: str) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "npz":
        ckpt.write_file(dest, state)
    elif fmt == "mdl":
        checkpoint_mdl.write(dest, state.global_step, state.weights, state.opt_state, state.meta)
    else:
        write_torch(state, dest)


def write_torch(state: ckpt.Checkpoint, dest: Path) -> None:
    torch = require_torch(f"writing the PyTorch file {dest}")
    table, aliases = torch_names.table_for(state.meta.get("model"), weights=state.weights)
    arrays = torch_names.to_torch(table, aliases, state.weights)
    tensors = {}
    for name, array in arrays.items():   # an alias shares its tensor, as in the module
        same = next((t for n, t in tensors.items() if arrays[n] is array), None)
        tensors[name] = same if same is not None else torch.from_numpy(np.ascontiguousarray(array))
    torch.save(tensors, dest)


def dest_format(dest: Path, given: str | None) -> str:
    if given:
        return given
    fmt = SUFFIXES.get(dest.suffix.lower())
    if fmt is None:
        raise ConvertError(f"cannot tell the format of {dest} from its suffix; give --format {{{','.join(FORMATS)}}}")
    return fmt


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    source, dest = Path(ns.source), Path(ns.dest)
    try:
        fmt = dest_format(dest, ns.format)
        if source.resolve() == dest.resolve():
            raise ConvertError(f"{dest} is the source; write the conversion elsewhere")
        state = read(source)
        write(state, dest, fmt)
    except (ConvertError, checkpoint_mdl.MdlError, torch_names.NameMapError, ckpt.CheckpointError) as exc:
        print(f"cs_convert_checkpoint: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as exc:
        print(f"cs_convert_checkpoint: cannot write {dest}: {exc.strerror or exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {dest} ({fmt}, global step {state.global_step})")


if __name__ == "__main__":
    main()
