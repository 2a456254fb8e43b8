"""cstorch.experimental's implicit autoregressive loops (inference: the CS system runs the model again
and again within one step, feeding each output token back in until a stop token).

    index = cstorch.experimental.start_implicit_loop(input_ids, loop_dim=1)
    hidden = cstorch.experimental.get_loop_iteration_slice(hidden_states, index)
    tokens = cstorch.experimental.update_implicit_loop(input_ids, index, next_token, stop_sequences, start_token)

get_loop_iteration_slice is the real API's gather of the slice at the loop's index, on any
backend. The loop itself is the CS system runtime's: the real API refuses it on the CPU backend
(NotImplementedError), as here after the same argument checks; the emulated CS system has no
inner loop either, so a CSX run refuses it in one line too. The 2.0/2.1 spelling,
run_implicit_autoregressive_loop, likewise.
"""
from __future__ import annotations

import torch

from ..backends import use_cs


def _refused(name: str):
    where = "CSX" if use_cs() else "CPU"
    why = ("the emulated CS system has no inner loop" if where == "CSX"
           else "the real API runs these loops on a CS system only")
    return NotImplementedError(f"cstorch.experimental.{name}: implicit autoregressive loops are not supported on "
                               f"the {where} backend ({why})")


def _loop_dim(input_tensor: torch.Tensor, loop_dim) -> int:
    rank = input_tensor.dim()
    if isinstance(loop_dim, bool) or not isinstance(loop_dim, int):
        raise TypeError(f"loop_dim must be an integer, got {type(loop_dim).__name__}")
    if not 1 - rank <= loop_dim < rank:
        raise ValueError(f"expected {1 - rank} <= loop_dim < {rank}, got {loop_dim}")
    return loop_dim % rank


def start_implicit_loop(input_tensor: torch.Tensor, loop_dim: int) -> torch.Tensor:
    _loop_dim(input_tensor, loop_dim)
    raise _refused("start_implicit_loop")


def get_loop_iteration_slice(input_tensor: torch.Tensor, index_tensor: torch.Tensor) -> torch.Tensor:
    """input_tensor's slice at index_tensor along the loop's dimension (the index's last one):
    index (..., 1) picks one position per row; the input's dimensions after it are kept whole."""
    index_shape, input_shape = list(index_tensor.shape), list(input_tensor.shape)
    extra = input_shape[len(index_shape):]
    index = index_tensor.reshape(index_shape + [1] * len(extra)).expand(index_shape + extra).long()
    return input_tensor.gather(len(index_shape) - 1, index)


def update_implicit_loop(input_tensor, index_tensor, update_tensor, stop_sequences_tensor, start_token,
                         max_tokens=None) -> torch.Tensor:
    for name, value in (("input_tensor", input_tensor), ("index_tensor", index_tensor),
                        ("update_tensor", update_tensor), ("stop_sequences_tensor", stop_sequences_tensor)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"update_implicit_loop: {name} must be a tensor, got {type(value).__name__}")
    raise _refused("update_implicit_loop")


def run_implicit_autoregressive_loop(input_tensor, output_tensor, loop_dim=1, start_token=None, stop_token=None,
                                     max_tokens=None):
    _loop_dim(input_tensor, loop_dim)
    raise _refused("run_implicit_autoregressive_loop")
