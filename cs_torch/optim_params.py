"""cstorch.optim.optimizer (the real package's module of that name): ParamsT, what an optimizer
takes as its parameters: tensors, or param-group dicts."""
from __future__ import annotations

from typing import Any, Dict, Iterable, Union

ParamsT = Union[Iterable["torch.Tensor"], Iterable[Dict[str, Any]]]  # noqa: F821 (torch: only named)
