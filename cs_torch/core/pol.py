"""cstorch.pol: the precision optimisation level of the kernels a function or module runs.

On the CS system POL 0, 1 or 2 trades the precision of some kernels'
intermediate sums for speed; the model zoo sets `pol(bwd_level=0)` (the
most precise) for its language models' heads. The emulator's kernels
always compute in float32, as level 0 does, so the levels are checked and
kept (current_pol gives them inside) and change no number.
"""
from __future__ import annotations

import contextlib
import functools

from ..csx_settings import csx

_levels: list[tuple[int | None, int | None]] = []


def _check(name: str, value) -> None:
    if value is not None and value not in range(0, 3):
        raise ValueError(f"POL must be None or an integer in range [0, 3) but got {name} level {value}.")


class pol(contextlib.ContextDecorator):  # noqa: N801 (the real API's name)
    """Use as a context manager, a function's decorator, or around a module: pol(bwd_level=0)(module)(x)."""

    def __init__(self, level: int | None = None, bwd_level: int | None = None, enable_fwd: bool = True,
                 enable_bwd: bool = True):
        _check("forward", level)
        _check("backward", bwd_level)
        self.level, self.bwd_level = (level if enable_fwd else None), (bwd_level if enable_bwd else None)

    def __enter__(self):
        _levels.append((self.level, self.bwd_level))
        return self

    def __exit__(self, *exc):
        _levels.pop()
        return False

    def __call__(self, fn):
        wrapped = super().__call__(fn)
        return functools.update_wrapper(wrapped, fn) if not isinstance(fn, type) else wrapped


def current_pol() -> int:
    """The forward level of the innermost pol in force (outside any, the backend's setting:
    cstorch.backends.csx.precision.optimization_level)."""
    for level, _ in reversed(_levels):
        if level is not None:
            return level
    return csx.precision.optimization_level
