"""Large products and passes cut into pieces that run side by side, with the bits of one.

Why: the one-thread rule (blas.py) keeps a transformer's products off OpenBLAS's
threads, which spin while they wait and lose their work to every other process
on a shared host. On free cores that leaves one core idle. Here a large product
or pass is cut into PIECES by its shape alone, each piece computed on one BLAS
thread, and the pieces run on a small pool of Python threads (numpy lets go of
the GIL inside BLAS calls and ufunc loops). A waiting thread blocks: on a busy
host a piece that waits for a core costs time, never another process's CPU.

Why the bits stay the same: a piece is the same computation whether it runs
beside the others or after them, and the cuts depend on the shape only, so every
path (the CPU path, a WSE in weight streaming or pipelined) computes the same
pieces. A product cut by rows is also the same, bit for bit, as the uncut
product on one OpenBLAS thread (each output row comes from the same kernel with
the same inner loop; tests/test_parallel.py checks the shapes the models use),
so the cut changes nothing next to earlier runs either. Elementwise passes (and
row-by-row ones: attention per sample, layer norm per row) are cut by size alone;
products wherever the one-thread rule holds and the process has more than one thread.
With one thread a product is not cut: its pieces would run one after another, each
packing the right operand again (5 to 12% of a transformer's products, measured), and
cut or not its bits are the same.

How many threads: the count the process's BLAS started with, which the launcher
sets to a WSE's share of the host's cores and to 1 for every other role
(launch/launcher.py), and csrun_cpu leaves at the host's cores. With one thread
the pieces run one after another. Where BLAS runs its own threads (a dense
layer's large products) products are not cut.
"""
from __future__ import annotations

import collections
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from cs_runtime.numerics import blas

# Pieces a large product or pass is cut into: fixed (not the thread count), so the
# same shapes are cut the same way in every process. More pieces than threads, so a
# thread that gets no core holds up little; a product's pieces keep at least
# MIN_PIECE_ROWS rows, as each piece packs the whole right operand again.
PIECES = 4
MIN_PIECE_ROWS = 128

# Work under this many FLOPs (a multiply-add counts 2) or elements is not cut: a
# hand-off to a pool thread costs some tens of microseconds, and a cut product packs its
# right operand once per piece. The small preset's products (51M FLOPs at most) and
# updates (200K elements) ran slower cut (a step 1.98 ms uncut, 2.06 cut on two threads);
# every product of the transformer preset (from 268M) is cut.
MIN_FLOPS = 1 << 26
MIN_ELEMENTS = 1 << 18

# Elements per chunk of the chunked passes (conversions, dropout masks, GELUs, optimizer
# updates): each of a chunk's dozen or so numpy calls stays in the core's cache (2 MB of
# L2 here), and it is large enough that two threads running pieces side by side do not
# queue for the GIL between calls. Measured on the 2-core machine, ms for 4M elements on
# one / two threads: exact GELU 36.0/22.8 at 2**15 elements, 31.6/16.6 at 2**17; float16
# rounding 9.4/9.8 and 8.4/5.5; dropout masks 13.2/8.6 and 12.7/6.9. Any size gives the same bits.
CHUNK = 1 << 17

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads are not there; a new pool starts on demand."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def threads() -> int:
    """Threads this process runs pieces on: its BLAS's starting count, 1 when unknown."""
    return max(1, blas.started_with())


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=threads() - 1, thread_name_prefix="numerics")
        return _pool


def _cutting_products() -> bool:
    """Whether products may be cut now: where the one-thread rule holds (matmul cuts none
    on a process of one thread, where the pieces would only run one after another)."""
    return blas.current() == 1


def cuts(n: int, pieces: int = PIECES, align: int = 8) -> list[tuple[int, int]]:
    """range(n) in at most `pieces` contiguous parts, each start a multiple of `align`
    (fewer parts when n is small): the fixed cut every process makes of the same n."""
    per_piece = -(-n // pieces)                                   # ceil(n / pieces)
    step = max(align, -(-per_piece // align) * align)             # rounded up to a multiple of align
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def run(tasks: list[Callable[[], None]]) -> None:
    """Run every task (a piece of one computation) once, returning when all are done; then
    the first error, if any, is raised. This thread and, when the process has more than
    one, pool threads take the next task in turn until none is left: a pool thread that
    waits for a core leaves its share to this one, so a busy host costs at most the piece
    it holds."""
    pending, lock, errors = collections.deque(tasks), threading.Lock(), []

    def take_in_turn(from_front: bool) -> None:
        while True:
            with lock:
                if not pending:
                    return
                task = pending.popleft() if from_front else pending.pop()
            try:
                task()
            except BaseException as error:      # noqa: BLE001 - raised by run, after every piece
                errors.append(error)
    # This thread takes from the front, the pool from the back: with the cores free, each
    # thread then gets the same half of every cut, and the next pass over the values finds
    # its half in its own core's cache.
    helpers = [] if threads() < 2 else [_executor().submit(take_in_turn, False)
                                          for _ in range(min(threads(), len(tasks)) - 1)]
    take_in_turn(True)
    for helper in helpers:
        # A helper no pool thread has started has nothing left to do (and waiting for it
        # could wait for this very thread, when a piece runs pieces of its own): cancelled.
        # One that started finishes the piece it holds.
        if not helper.cancel():
            helper.result()
    if errors:
        raise errors[0]


def in_pieces(n: int, work: Callable[[int, int], None], elements: int | None = None, align: int = 8) -> None:
    """work(lo, hi) for the fixed cut of range(n) (starts a multiple of `align`), side by
    side, when `elements` (the whole pass's size; n when not given) makes cutting worth it;
    else one call over everything. `work` must compute each index the same way whatever
    lo and hi are: elementwise, or a row at a time."""
    if (n if elements is None else elements) < MIN_ELEMENTS or n < 2:
        work(0, n)
        return
    run([lambda lo=lo, hi=hi: work(lo, hi) for lo, hi in cuts(n, align=align)])


def in_chunks(n: int, work: Callable[..., None], scratch: Callable[[int], tuple] | None = None,
              chunk: int = CHUNK) -> None:
    """work(start, stop, *buffers) for every `chunk` of range(n) (the last one shorter), the
    chunks in pieces side by side (in_pieces). `scratch(size)`: a chunk's working arrays,
    made once per piece and handed to each of its chunks cut to the chunk's length (pieces
    side by side cannot share them)."""
    def piece(begin: int, end: int) -> None:
        buffers = scratch(min(chunk, end - begin)) if scratch is not None else ()
        for start in range(begin, end, chunk):
            stop = min(start + chunk, end)
            work(start, stop, *(buffer[:stop - start] for buffer in buffers))
    in_pieces(n, piece, align=chunk)


def map_chunks(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    """fn (elementwise, a fresh array out) over x a chunk at a time, in x's dtype and shape:
    each of fn's passes then reads and writes the cache, not memory. The values of fn(x)
    cast to x's dtype."""
    return _map_chunks(lambda chunk: (fn(chunk),), x, 1)[0]


def map_chunks_pair(fn: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
                    x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """map_chunks for an fn with two results (two fresh arrays, each of x's shape): a value
    and what its derivative needs, made from the same intermediates in one pass."""
    return _map_chunks(fn, x, 2)


def _map_chunks(fn, x: np.ndarray, results: int) -> tuple[np.ndarray, ...]:
    """fn's `results` arrays (a tuple) over x a chunk at a time, each in x's dtype and shape."""
    if x.size <= CHUNK:
        return tuple(r.astype(x.dtype, copy=False) for r in fn(x))
    flat = np.ascontiguousarray(x).reshape(-1)
    outs = tuple(np.empty(flat.shape, x.dtype) for _ in range(results))

    def work(start: int, stop: int) -> None:
        for out, got in zip(outs, fn(flat[start:stop])):
            out[start:stop] = got
    in_chunks(flat.size, work)
    return tuple(out.reshape(x.shape) for out in outs)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b, cut by the rows of a 2-d a, or by the leading index of stacked operands of
    the same leading shape; any other case, or a small product, is a plain a @ b."""
    if a.ndim < 2 or a.ndim != b.ndim or a.shape[:-2] != b.shape[:-2]:
        return a @ b
    stacked, rows = a.ndim > 2, a.shape[0]
    flops = 2 * math.prod(a.shape[:-1]) * a.shape[-1] * b.shape[-1]
    pieces = PIECES if stacked else min(PIECES, rows // MIN_PIECE_ROWS)
    if flops < MIN_FLOPS or pieces < 2 or not _cutting_products() or threads() == 1:
        return a @ b
    out = np.empty((*a.shape[:-1], b.shape[-1]), np.result_type(a, b))

    def piece(lo: int, hi: int) -> None:
        np.matmul(a[lo:hi], b[lo:hi] if stacked else b, out=out[lo:hi])
    run([lambda lo=lo, hi=hi: piece(lo, hi) for lo, hi in cuts(rows, pieces, align=1 if stacked else 8)])
    return out


def binary(ufunc: np.ufunc, a, b, commutative: bool = False) -> np.ndarray:
    """ufunc(a, b), a piece of the first axis at a time where the result has a's shape (or,
    with `commutative`, b's: the operands swapped, which changes no bit of an add or a
    multiply); anything else, or a small one, in one call."""
    if commutative and isinstance(b, np.ndarray) and isinstance(a, np.ndarray) and b.size > a.size:
        a, b = b, a
    if (not isinstance(a, np.ndarray) or a.ndim == 0 or a.size < MIN_ELEMENTS
            or np.broadcast_shapes(a.shape, np.shape(b)) != a.shape):
        return ufunc(a, b)
    out = np.empty(a.shape, np.result_type(a, b))
    per_row = np.ndim(b) == a.ndim and np.shape(b)[0] == a.shape[0]

    def piece(lo: int, hi: int) -> None:
        ufunc(a[lo:hi], b[lo:hi] if per_row else b, out=out[lo:hi])
    in_pieces(a.shape[0], piece, elements=a.size, align=1)
    return out
