"""cstorch.utils.kernel.kernel_annotater: names the kernel the real compiler should use for an op
(`kernel_annotater("FLASH")(torch.matmul)(q, k)`). The emulator's compiler picks no kernel by
name, so the op is returned as it is: the numbers are the op's."""
from __future__ import annotations


def kernel_annotater(kernel_type):
    if kernel_type is not None and not isinstance(kernel_type, str):
        raise TypeError(f"kernel_annotater: the kernel must be a name or None, got {type(kernel_type).__name__}")
    return lambda fn: fn
