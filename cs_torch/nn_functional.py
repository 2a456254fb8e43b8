"""cstorch.nn.functional: the real API's functional ops the model zoo imports (one_hot).

Tensors live on the host here, so each is torch's op, with the real API's checks.
"""
from __future__ import annotations

import torch


def one_hot(array: torch.Tensor, num_classes: int) -> torch.Tensor:
    """torch.nn.functional.one_hot with num_classes given (the real API refuses -1: the shape must be known)."""
    if num_classes == -1:
        raise ValueError("one_hot: num_classes cannot be -1 (the number of classes must be given)")
    return torch.nn.functional.one_hot(array, num_classes)
