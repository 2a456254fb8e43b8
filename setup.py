"""Build: everything is in setup.cfg, but for the optional C extensions.

cs_runtime/numerics/_convert.c holds the 16-bit conversions' loops,
_gelu.c the exact GELU's float64 loops, _optim.c SGD with momentum's update,
_masks.c a dense layer's dropout mask, _windows.c the depthwise convolution's and
_norms.c layer norm's row passes (each includes _loops.h). Each is optional: where no C compiler is found the build
warns and goes on, and precision.py, kernels.py, optim.py, windows.py and ops.py use their
numpy paths, which give the same bits (only slower). -ffp-contract=off: no fused
multiply-adds, so each operation rounds as numpy's does."""
from setuptools import Extension, setup

FLAGS = ["-O3", "-ffp-contract=off"]
SHARED = ["cs_runtime/numerics/_loops.h"]     # what each includes: a change to it rebuilds them

setup(ext_modules=[
    Extension(f"cs_runtime.numerics.{name}", [f"cs_runtime/numerics/{name}.c"], depends=SHARED,
              extra_compile_args=FLAGS, optional=True)
    for name in ("_convert", "_gelu", "_optim", "_masks", "_windows", "_norms")
])
