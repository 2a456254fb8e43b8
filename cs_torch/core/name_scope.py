"""Debug names and name scopes (cstorch.name_scope, add_debug_name, get_debug_name).

On the real system they name the compiled graph's operations; here the
program is named by its modules' paths (cs_torch/capture.py), so a scope is
kept only for what the user reads back (`current_scope()`): no number changes.
"""
from __future__ import annotations

import contextlib

_scopes: list[str] = []


@contextlib.contextmanager
def name_scope(name: str, raw: bool = False):
    """Operations inside are named under `name` (here: recorded, no effect on the program)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name_scope: expected a non-empty name, got {name!r}")
    _scopes.append(name)
    try:
        yield
    finally:
        _scopes.pop()


def current_scope() -> str:
    """The '.'-joined names of the scopes entered, innermost last ('' outside any)."""
    return ".".join(_scopes)


def add_debug_name(module, root_name: str | None = None) -> None:
    """Give `module` and each of its children a `_debug_name`: its '.'-joined path from the root."""
    def add(mod, name: str) -> None:
        mod._debug_name = name
        for child_name, child in mod.named_children():
            add(child, ".".join(part for part in (name, child_name) if part))
    add(module, root_name or "")


def get_debug_name(module) -> str:
    """The module's `_debug_name`, else its class name and id (a module never named)."""
    name = getattr(module, "_debug_name", None)
    return name if name else f"{type(module).__name__.lower()}_{id(module)}"
