"""Another import name for a package of this project.

The Cerebras model zoo imports the vendor's names (`cerebras_pytorch`,
`cerebras.pytorch`, `cerebras_appliance`, `cerebras.appliance`); the emulator
serves them from its own packages. `alias("cerebras_pytorch", "cs_torch")`
makes the name and every dotted name under it the very module objects of the
target, so `cerebras_pytorch.utils.data is cs_torch.utils.data` and a class
seen through either name is one class (a second copy of a module would make
two, and isinstance would disagree).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        if not hasattr(module, "__path__"):
            # A module (not a package) whose module attributes are imported by dotted name under the
            # alias (cerebras_pytorch.optim.lr_scheduler): the import system looks for a parent's __path__.
            module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        """The target ran when it was imported; nothing more to run."""


class _AliasFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, target: str):
        self.name, self.target = name, target

    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith(self.name + "."):
            return None
        real = _module_name(self.target + fullname[len(self.name):])
        if real is None:
            return None   # the usual "No module named ..." names what the user wrote
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real))


def _module_name(name: str) -> str | None:
    """`name` if it is a module, or the module a module attribute of that name is (`cs_torch.optim`
    is a module, not a package, but `cs_torch.optim.lr_scheduler` is the module cs_torch.lr_scheduler)."""
    try:
        if importlib.util.find_spec(name) is not None:
            return name
    except ImportError:   # the parent is a module, not a package
        pass
    parent, _, last = name.rpartition(".")
    try:
        attribute = getattr(importlib.import_module(parent), last, None)
    except ImportError:
        return None
    return attribute.__name__ if isinstance(attribute, types.ModuleType) else None


def alias(name: str, target: str):
    """Make `name` (being imported now) and its submodules the modules of `target`; returns target."""
    module = importlib.import_module(target)
    if not any(isinstance(f, _AliasFinder) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder(name, target))
    sys.modules[name] = module
    return module
