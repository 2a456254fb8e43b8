"""Counter-based random numbers: the same draw for (key, row, element) in any process, on any
shard. Dropout's masks (kernels.keep_mask), a captured model's draws (kernels.sample_draws) and
the language models' token masking (data/text.py) draw from here.
"""
from __future__ import annotations

import numpy as np


_M1, _M2, GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, elementwise on uint64 (wraps mod 2**64 by design)."""
    z = x + GOLDEN
    splitmix64_rounds(z, np.empty_like(z))
    return z


def splitmix64_rounds(z: np.ndarray, t: np.ndarray, top_bits_only: bool = False) -> None:
    """splitmix64's shift-xor-multiply rounds on z (already + GOLDEN), in place; t: scratch
    of z's shape. keep_mask runs them on cache-sized pieces, splitmix64 on whole arrays.
    top_bits_only: z's top 33 bits are right, the rest not (the last round, z ^= z >> 31,
    leaves them as they are: it is skipped)."""
    np.right_shift(z, np.uint64(30), out=t)
    z ^= t
    z *= _M1
    np.right_shift(z, np.uint64(27), out=t)
    z ^= t
    z *= _M2
    if not top_bits_only:
        np.right_shift(z, np.uint64(31), out=t)
        z ^= t


_MASK64 = (1 << 64) - 1


def _splitmix64_int(z: int) -> int:
    """splitmix64 on a Python int (numpy scalars would warn on the intended wrap-around)."""
    z = (z + int(GOLDEN)) & _MASK64
    z = ((z ^ (z >> 30)) * int(_M1)) & _MASK64
    z = ((z ^ (z >> 27)) * int(_M2)) & _MASK64
    return z ^ (z >> 31)


def hash_key(*parts: int) -> np.uint64:
    """One 64-bit key from several small ints (seed, step, layer, site...)."""
    key = 0
    for part in parts:
        key = _splitmix64_int(key ^ (int(part) & _MASK64))
    return np.uint64(key)


def hash_uniform(key: np.uint64, rows: slice | np.ndarray, per_sample: tuple[int, ...]) -> np.ndarray:
    """Uniform [0, 1) float32 of shape (rows, *per_sample), element (r, j) a function of (key, r, j).
    `rows`: a slice of the global batch, or the row ids themselves."""
    n = int(np.prod(per_sample))
    ids = np.arange(rows.start, rows.stop) if isinstance(rows, slice) else np.asarray(rows)
    row_ids = ids.astype(np.uint64)[:, None]
    counters = row_ids * np.uint64(n) + np.arange(n, dtype=np.uint64)[None, :]
    bits = splitmix64(counters ^ key) >> np.uint64(40)          # 24 random bits
    return (bits.astype(np.float32) * np.float32(2.0 ** -24)).reshape((-1, *per_sample))
