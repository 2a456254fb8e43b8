"""The optional C loops (setup.py builds them where a C compiler is found): each module,
or None where it is not built, so that its caller takes its numpy path (the same bits).

An editable install builds them once, into the source tree; a checkout updated since
may hold a C file whose functions differ from the built ones. So each module carries
the version of its interface (`API`), and one built from another version is left
alone, with a warning that says how to rebuild it.
"""
from __future__ import annotations

import importlib
import warnings
from types import ModuleType


def load(name: str, api: int) -> ModuleType | None:
    """cs_runtime.numerics.<name> when it is built, of interface version `api`; else None."""
    try:
        module = importlib.import_module(f"cs_runtime.numerics.{name}")
    except ImportError:
        return None
    if getattr(module, "API", None) != api:
        warnings.warn(f"{module.__file__} was built from another version of {name}.c: using the numpy path "
                      f"instead (`pip install -e .` rebuilds it)", RuntimeWarning, stacklevel=2)
        return None
    return module
