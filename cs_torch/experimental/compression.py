"""cstorch.experimental.Compression: chosen weights marked to be kept in an MX format on the CS system.

    model.apply(cstorch.experimental.Compression("mx8-e4m3", ["fc1.weight", "fc2.*"]))   # a compiled model

As the real API: the format is one of the MX formats, the filter globs match whole parameter and
buffer names, each matching tensor is marked with the format before every forward (a compiler
attribute, not saved in checkpoints). The real CPU backend drops the mark, so the values are
float32's, as here. On the CS system the marked weights are stored in that block format (lossy);
the emulated one stores float32 weights only, so a CSX run with marked weights refuses in one
line rather than train with other numbers.
"""
from __future__ import annotations

from itertools import chain

import torch

from ..utils.param_filter import convert_glob_to_regex

FORMATS = ("mx8", "mx8-e3m4", "mx8-e4m3", "mx9", "mx10", "mx10-e2m7")
MARK = "_cs_compression"   # the format a tensor is marked with, read by a CSX run's checks


class Compression:
    def __init__(self, format: str, param_filter):
        if not isinstance(format, str):
            raise TypeError(f"Compression: format must be a string, got {type(format).__name__}")
        if format not in FORMATS:
            raise ValueError(f"Compression: format must be one of {FORMATS}, got {format!r}")
        self.format = format
        patterns = [param_filter] if isinstance(param_filter, str) else list(param_filter)
        self.param_filter = [convert_glob_to_regex(p) for p in patterns]
        self.compress_tensors = torch.utils.weak.WeakTensorKeyDictionary()

    def apply(self, module: torch.nn.Module) -> None:
        """Mark the module's matching parameters and buffers before each of its forwards."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"Compression.apply: expected a torch.nn.Module, got {type(module).__name__}")
        for name, tensor in chain(module.named_parameters(), module.named_buffers()):
            if any(f.fullmatch(name) for f in self.param_filter):
                self.compress_tensors[tensor] = name
        module.register_forward_pre_hook(self._forward_pre_hook)


    def _forward_pre_hook(self, module, args) -> None:
        for tensor in self.compress_tensors:
            self.annotate(tensor)

    def annotate(self, tensor: torch.Tensor) -> None:
        setattr(tensor, MARK, self.format)

    def __repr__(self) -> str:
        return f"Compression(format={self.format}, param_filter: {self.param_filter})"


def compressed(tensors) -> dict[str, str]:
    """{name: format} of the (name, tensor) pairs marked by a Compression."""
    return {name: getattr(t, MARK) for name, t in tensors if getattr(t, MARK, None)}
