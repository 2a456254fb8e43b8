"""cstorch.cirh: the CS system's own ops that the model zoo calls by name (its sampling kernels).

    fused = cstorch.cirh.FusedTopK(probs, k=k, dimension=1)              # probs (B, V)
    token = cstorch.cirh.FusedTopP(fused, p=p, u=u, k=k_per_row)        # p, u, k: (B, 1) -> token (B, 1)

Top-k then top-p (nucleus) sampling of next tokens, without gradients (the model zoo samples under
torch.no_grad, as these kernels require). FusedTopK keeps the k largest probabilities along
`dimension` with their indices, largest first; the fused tensor is (..., k, 2): value and index
pairs, a layout of the emulator's own, read only by FusedTopP. FusedTopP keeps, per row, the
leading candidates (at most that row's k) whose probabilities before them sum to less than p
(the first is always kept), and picks among the kept ones by inverse transform sampling with
the row's uniform u: the first whose running sum exceeds u times their total.
"""
from __future__ import annotations

import torch


def FusedTopK(input: torch.Tensor, *, k: int, dimension: int, spread: int | None = None) -> torch.Tensor:  # noqa: N802
    """The k largest values along `dimension` and their indices, as (value, index) pairs: (..., k, 2)."""
    if input.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("cirh.FusedTopK has no gradient: call it under torch.no_grad()")
    values, indices = torch.topk(input, k, dim=dimension, largest=True, sorted=True)
    return torch.stack((values.movedim(dimension, -1), indices.movedim(dimension, -1).to(values.dtype)), dim=-1)


def FusedTopP(input: torch.Tensor, p: torch.Tensor, u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # noqa: N802
    """One index per row of FusedTopK's pairs (B, K, 2), sampled from the row's nucleus: (B, 1)."""
    values, indices = input[..., 0], input[..., 1]
    before = torch.cumsum(values, dim=-1) - values                 # the probability ahead of each candidate
    rank = torch.arange(values.shape[-1])
    kept = (rank < k.to(torch.int64)) & ((before < p) | (rank == 0))
    weights = torch.where(kept, values, torch.zeros_like(values))
    running = torch.cumsum(weights, dim=-1)
    threshold = u * running[..., -1:]
    pick = torch.sum((running <= threshold) & kept, dim=-1, keepdim=True)   # kept candidates passed
    pick = torch.minimum(pick, kept.sum(dim=-1, keepdim=True) - 1)           # u = 1 takes the last kept
    return torch.gather(indices, -1, pick).to(torch.int64)
