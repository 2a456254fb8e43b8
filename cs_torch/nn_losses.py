"""cstorch.nn's losses for torch modules beyond the CS system's own cross entropy: SmoothL1Loss.

The real API writes each loss in elementwise torch ops, so that it lowers to the CS system's kernels;
these do too (a captured step records abs, where, mul and the reduction), with torch's meaning.
"""
from __future__ import annotations

import torch

REDUCTIONS = ("mean", "sum", "none")


def _reduced(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return loss.mean()
    return loss.sum() if reduction == "sum" else loss


class SmoothL1Loss(torch.nn.Module):
    """0.5 z² / beta where z = |input - target| < beta, else z - 0.5 beta (beta 0: |input - target|)."""

    def __init__(self, reduction: str = "mean", beta: float = 1.0):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"SmoothL1Loss: reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if beta < 0:
            raise ValueError(f"SmoothL1Loss: beta must be non-negative, got {beta}")
        self.reduction, self.beta = reduction, beta

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        z = torch.abs(input - target)
        if self.beta == 0:   # the quadratic piece is empty (and 1/beta would make its gradient nan)
            return _reduced(z, self.reduction)
        loss = torch.where(z < self.beta, 0.5 * z * z / self.beta, z - 0.5 * self.beta)
        return _reduced(loss, self.reduction)
