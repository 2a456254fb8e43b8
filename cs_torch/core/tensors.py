"""Tensors on the host (cstorch.make_constant, to_numpy, from_numpy).

The emulator's tensors live on the host: a traced step's tensors are torch
tensors, so a constant is the tensor itself and a conversion is torch's.
"""
from __future__ import annotations


def make_constant(tensor):
    """A constant of the graph: here the tensor itself (a captured program keeps it as a constant)."""
    return tensor


def to_numpy(tensor):
    """The tensor's values as a numpy array (a copy off any autograd graph)."""
    return tensor.detach().cpu().numpy()


def from_numpy(array):
    """A torch tensor of the array's values."""
    import torch
    return torch.from_numpy(array)
