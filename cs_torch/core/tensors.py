"""Tensors on the host (cstorch.make_constant, to_numpy, from_numpy, full, ones, zeros and their _like).

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


def _torch():
    import torch
    return torch


def full(shape, value: float, dtype=None):
    """A tensor of `shape` filled with `value` (the real API defers it to the device; here it is on the host)."""
    return _torch().full(shape, value, dtype=dtype)


def full_like(other, value: float, dtype=None):
    return _torch().full_like(other, value, dtype=dtype or other.dtype)


def ones(shape, dtype=None):
    return _torch().ones(shape, dtype=dtype)


def ones_like(other, dtype=None):
    return _torch().ones_like(other, dtype=dtype or other.dtype)


def zeros(shape, dtype=None):
    return _torch().zeros(shape, dtype=dtype)


def zeros_like(other, dtype=None):
    return _torch().zeros_like(other, dtype=dtype or other.dtype)


def from_numpy(array):
    """A torch tensor of the array's values."""
    import torch
    return torch.from_numpy(array)
