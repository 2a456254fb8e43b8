"""How many threads numpy's BLAS gives a matrix product: one for a small one.

The rule, in one place for every path (the CPU path, a WSE in weight
streaming or pipelined, and numerics run in any other process): a dense
layer whose products are under SMALL_PRODUCT_FLOPS runs them on one thread,
a larger one on the thread count its process started with (the launcher's
share of the cores, or OPENBLAS_NUM_THREADS); every other layer (transformer
layers, captured units) runs its products on one thread (unit_threads says why),
and numerics/parallel.py cuts the large ones into pieces that run side by side on
Python threads, each on one BLAS thread.

Why one thread: OpenBLAS splits a product of more than about 13M
multiply-adds over its threads, and the product ends only when every thread
has had a core. A WSE shares its host's cores with MemoryX, SwarmX, the chief
and the input workers (and, on a shared machine, with everything else), so a
second thread often waits for a core far longer than a small product takes:
on a 2-core machine under load, the `small` preset's 128 x 784 x 256 product
took 0.5 ms on one thread and a median of 7 to 50 ms on two. Large products
are worth the wait.

Why the same rule everywhere: OpenBLAS's one-thread path picks other kernels
than its threaded one for some shapes (128 x 784 x 256 is one), and those
differ in float32's last bit. One WSE reproduces the CPU path bit for bit
because both run the same layer's products on the same thread count; that
holds as long as both go through `dense_layer_threads` (model.layer_forward
and model.layer_backward do) and start with the same count (csrun_cpu and a
single WSE both get the host's cores). Checks: tests/test_blas.py.

Where numpy's BLAS is not an OpenBLAS that exposes its thread setter (MKL,
Accelerate), nothing changes. The count is per process, so numerics running
on several Python threads of one process would share it: none do.
"""
from __future__ import annotations

import ctypes
from contextlib import nullcontext
from typing import ContextManager

# 2 * rows * in * out under this (about 5 ms on one core) runs on one thread.
SMALL_PRODUCT_FLOPS = 1 << 28

# numpy's wheels name OpenBLAS's functions with a prefix and, for 64-bit indices, a suffix.
_NAMES = ("scipy_openblas_{}64_", "scipy_openblas_{}", "openblas_{}64_", "openblas_{}")


class _OpenBlas:
    """The thread setter of the OpenBLAS numpy calls, or nothing."""

    def __init__(self):
        self.set_threads = None
        self.started_with = 0        # the process's own count, before any change
        self.current = 0
        lib = _numpy_blas()
        for name in _NAMES if lib is not None else ():
            setter, getter = name.format("set_num_threads"), name.format("get_num_threads")
            if hasattr(lib, setter) and hasattr(lib, getter):
                self.set_threads = getattr(lib, setter)
                get = getattr(lib, getter)
                get.restype = ctypes.c_int
                self.started_with = self.current = int(get())
                return

    def use(self, threads: int) -> None:
        if self.set_threads is None or threads == self.current:
            return
        self.set_threads(ctypes.c_int(threads))
        self.current = threads


def _numpy_blas() -> ctypes.CDLL | None:
    """numpy's core extension: looking a name up in it searches what it links, so its BLAS
    (and not another library's OpenBLAS loaded beside it, such as scipy's)."""
    try:
        from numpy._core import _multiarray_umath as core
    except ImportError:          # numpy 1.x
        from numpy.core import _multiarray_umath as core
    try:
        return ctypes.CDLL(core.__file__)
    except OSError:
        return None


_blas: _OpenBlas | None = None


def _openblas() -> _OpenBlas:
    global _blas
    if _blas is None:
        _blas = _OpenBlas()
    return _blas


def threads_for(flops: int) -> int:
    """The rule: the thread count for a product of `flops` (0 when this BLAS cannot be told)."""
    blas = _openblas()
    if blas.set_threads is None:
        return 0
    return 1 if flops < SMALL_PRODUCT_FLOPS else blas.started_with


def dense_layer_threads(rows: int, in_features: int, out_features: int) -> ContextManager[None]:
    """A dense layer's products (forward, weight gradient and input gradient, each
    2 * rows * in * out FLOPs) on the count the rule gives them; the process's count after."""
    return _threads(threads_for(2 * rows * in_features * out_features))


def unit_threads() -> ContextManager[None]:
    """Every other layer (a transformer's embedding, blocks and heads; a captured model's
    units): its products on one thread, whatever their size; the process's count after.

    Why: between its products such a unit runs attention and elementwise work on one core
    for as long again, during which OpenBLAS's second thread spins for its next job (about
    0.1 s before it sleeps), and its weight-gradient products (inner dimension: every token
    of the batch) split badly over two threads. On the shared 2-core machine, GPT-2 of the
    transformer preset (32 x 128 tokens, width 256) took 1.4 s of CPU per step on one
    thread and 3 to 8.6 s on two, whose wall time was no shorter (CHANGELOG.md);
    a 4096 x 256 x 1024 weight gradient took 23 ms on one thread, 50 to 72 ms of CPU and
    70 to 140 ms of wall time on two."""
    return _threads(1 if _openblas().set_threads is not None else 0)


# Entered once per layer and pass: where the count stays as it is (most layers), a shared
# do-nothing context, not a generator made and run each time.
_UNCHANGED = nullcontext()


class _Switched:
    """The count `threads` inside, the count before it after."""

    def __init__(self, blas: _OpenBlas, threads: int):
        self.blas, self.threads, self.before = blas, threads, blas.current

    def __enter__(self) -> None:
        self.before = self.blas.current
        self.blas.use(self.threads)

    def __exit__(self, *exc) -> None:
        self.blas.use(self.before)


def _threads(threads: int) -> ContextManager[None]:
    """`threads` (0: leave the count alone) inside, the process's count after."""
    blas = _openblas()
    if threads == 0 or threads == blas.current:
        return _UNCHANGED
    return _Switched(blas, threads)


def started_with() -> int:
    """The thread count this process's BLAS started with (0 when it cannot be told)."""
    return _openblas().started_with


def current() -> int:
    """The thread count in use now (0 when it cannot be told)."""
    return _openblas().current
