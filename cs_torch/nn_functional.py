"""cstorch.nn.functional: the real API's functional ops the model zoo imports (one_hot, and the sparse
matmuls of its mixture-of-experts layers, sparse_matmul and sparse_act_matmul).

Tensors live on the host here, so each is torch's op, with the real API's checks.
"""
from __future__ import annotations

import torch


def one_hot(array: torch.Tensor, num_classes: int) -> torch.Tensor:
    """torch.nn.functional.one_hot with num_classes given (the real API refuses -1: the shape must be known)."""
    if num_classes == -1:
        raise ValueError("one_hot: num_classes cannot be -1 (the number of classes must be given)")
    return torch.nn.functional.one_hot(array, num_classes)


def sparse_matmul(input_values: torch.Tensor, input_indices: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The chosen experts' matmuls: input_values (..., M, C, N), input_indices (..., M, C) choosing C of the
    weight's E experts, weight (K, E, N) -> (..., M, C, K), out[..., m, c, :] = weight[:, idx, :] @ x.

    The real API's meaning, which its CPU path computes densely: the values scattered into all E
    experts (zeros elsewhere), one batched matmul, the chosen experts' outputs gathered back. The CS
    system runs a sparse kernel with those values; here the dense ops are the step's ops everywhere."""
    if weight.size(1) >= 2 ** 16:
        raise ValueError(f"sparse_matmul: {weight.size(1)} experts; the indices must fit in uint16")
    experts = (*input_values.shape[:-2], weight.shape[1], input_values.shape[-1])
    where = input_indices[..., None]
    dense = torch.zeros(experts, dtype=input_values.dtype).scatter(-2, where.expand(input_values.shape),
                                                                     input_values)
    output = torch.einsum("...men,ken->...mek", dense, weight)
    return torch.gather(output, -2, where.expand(*input_values.shape[:-1], weight.shape[0]))


def sparse_act_matmul(input_value: torch.Tensor, input_mask: torch.Tensor, weight: torch.Tensor,
                      dense_capacity: int | None = None) -> torch.Tensor:
    """x (..., M, N) @ weight (K, N)ᵀ with the rows whose mask (..., M) is 0 zeroed: (..., M, K).

    The real API's meaning (its CPU path; the CS system skips the masked rows, and `dense_capacity`
    bounds how many rows it keeps, a hint for its kernel that does not change the values)."""
    if tuple(input_value.shape[:-1]) != tuple(input_mask.shape):
        raise ValueError(f"sparse_act_matmul: input {tuple(input_value.shape)} and mask {tuple(input_mask.shape)} "
                         "must agree but for the input's last dimension")
    output = torch.einsum("...mn,kn->...mk", input_value, weight)
    return output * input_mask.unsqueeze(-1).to(output.dtype)
