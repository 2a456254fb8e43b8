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


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        """The target ran when it was imported; nothing more to run."""


class _AliasFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, target: str):
        self.name, self.target = name, target

    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith(self.name + "."):
            return None
        real = self.target + fullname[len(self.name):]
        if importlib.util.find_spec(real) is None:
            return None   # the usual "No module named ..." names what the user wrote
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real))


def alias(name: str, target: str):
    """Make `name` (being imported now) and its submodules the modules of `target`; returns target."""
    module = importlib.import_module(target)
    if not any(isinstance(f, _AliasFinder) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder(name, target))
    sys.modules[name] = module
    return module
