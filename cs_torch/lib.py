"""cstorch.lib: the real package's compiled extension, as far as the model zoo calls it:
`cerebras_pytorch_lib.set_attribute(tensor, key, value)` attaches a compiler attribute to a
traced tensor. The emulator's compiler reads no such attribute, so it is checked and dropped."""
from __future__ import annotations

import types


def _set_attribute(tensor, key: str, value) -> None:
    if not isinstance(key, str):
        raise TypeError(f"set_attribute: the attribute's key must be a string, got {type(key).__name__}")
    if not hasattr(tensor, "shape"):
        raise TypeError(f"set_attribute: expected a tensor, got {type(tensor).__name__}")


cerebras_pytorch_lib = types.SimpleNamespace(set_attribute=_set_attribute)
