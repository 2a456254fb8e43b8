"""Debug args and ini settings (`--debug_args_path`). The emulated cluster's
settings come from run.py's flags and the params file; debug args are read,
kept and written back so the model zoo's flow runs, and change nothing."""
from __future__ import annotations

import json
import os


class DebugArgs:
    """Nested settings: any attribute path can be read or set (debug_args.debug_usr.x = 1)."""

    def __init__(self, values: dict | None = None):
        object.__setattr__(self, "_values", {})
        for key, value in (values or {}).items():
            setattr(self, key, DebugArgs(value) if isinstance(value, dict) else value)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._values.setdefault(name, DebugArgs())

    def __setattr__(self, name: str, value) -> None:
        self._values[name] = value

    def to_dict(self) -> dict:
        return {k: v.to_dict() if isinstance(v, DebugArgs) else v for k, v in self._values.items()
                if not (isinstance(v, DebugArgs) and not v.to_dict())}


def get_debug_args(path: str | None) -> DebugArgs:
    """The debug args in `path` (a JSON file this module wrote), or empty ones."""
    if not path:
        return DebugArgs()
    try:
        with open(path, encoding="utf-8") as f:
            return DebugArgs(json.load(f))
    except FileNotFoundError:
        raise ValueError(f"--debug_args_path {path}: no such file") from None
    except json.JSONDecodeError:
        raise ValueError(f"--debug_args_path {path}: not a debug args file written by the emulator "
                         "(the real cluster's protobuf text is not read here)") from None


def write_debug_args(debug_args: DebugArgs, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(debug_args.to_dict(), f, indent=2, sort_keys=True)


def set_ini(debug_args: DebugArgs, **kwargs) -> None:
    """Set ini values (kept in debug_args.ini; nothing here reads them)."""
    for key, value in kwargs.items():
        setattr(debug_args.ini, key, value)


def set_default_ini(debug_args: DebugArgs, **kwargs) -> None:
    """Set ini values not set yet."""
    for key, value in kwargs.items():
        if key not in debug_args.ini._values:
            setattr(debug_args.ini, key, value)
