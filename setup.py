"""Build: everything is in setup.cfg, but for the one optional C extension.

cs_runtime/numerics/_convert.c holds the 16-bit conversions' loops. It is
optional: where no C compiler is found the build warns and goes on, and
cs_runtime/numerics/precision.py uses its numpy path, which gives the same bits
(only slower)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("cs_runtime.numerics._convert", ["cs_runtime/numerics/_convert.c"],
                             extra_compile_args=["-O3"], optional=True)])
