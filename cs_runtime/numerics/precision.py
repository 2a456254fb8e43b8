"""Mixed precision: 16-bit number formats emulated in numpy, and loss scaling.

Every format is held on the wire as 16-bit patterns and computed with in
float32, as a 16-bit matmul on the wafer does: inputs are rounded to the
format, products are accumulated in float32.

Formats (`FORMATS`), all with 1 sign bit, then exponent field E, then mantissa
field m, IEEE-style (E == 0: zero and subnormals; E all ones: inf when m == 0,
nan otherwise):

| format    | E bits | m bits | bias | max finite          | min normal | min subnormal |
|-----------|--------|--------|------|---------------------|------------|---------------|
| float16   | 5      | 10     | 15   | 65504               | 2**-14     | 2**-24        |
| bfloat16  | 8      | 7      | 127  | (2 - 2**-7) * 2**127 | 2**-126    | 2**-133       |
| cbfloat16 | 6      | 9      | 31   | (2 - 2**-9) * 2**31 | 2**-30     | 2**-39        |
| float32   | (the reference: no rounding)                                             |

cbfloat16 is the Cerebras 16-bit format; this module defines it as:

    bit 15       sign s
    bits 14..9   exponent field E (6 bits), bias 31 = 2**(6-1) - 1
    bits 8..0    mantissa field m (9 bits)

    E == 0          value = (-1)**s * 2**(1 - 31) * m / 512     (zero, subnormals)
    1 <= E <= 62    value = (-1)**s * 2**(E - 31) * (1 + m / 512)
    E == 63, m == 0 value = (-1)**s * inf
    E == 63, m != 0 nan

so the largest finite value is (2 - 2**-9) * 2**31 (pattern 0x7DFF), the
smallest normal 2**-30 (0x0200), the smallest subnormal 2**-39 (0x0001).
Compared with float16 it trades one mantissa bit for a range wide enough that
gradients rarely need loss scaling; compared with bfloat16 it keeps two more
mantissa bits.

float32 -> 16 bits rounds to nearest, ties to even (also in the subnormal
range); a value whose rounded magnitude does not fit becomes ±inf; nan stays
nan (canonical quiet nan, sign kept). The conversion is integer arithmetic on
float32 bit patterns, vectorised, in chunks that stay in cache. 16 bits -> float32 is exact.
float16's storage dtype is numpy's half type: both directions give numpy's
own conversion's results bit for bit (nan payloads too), in fewer passes and
without its per-element branches.

Loss scaling (`LossScaler`) follows PyTorch's GradScaler: multiply the loss
by `scale` before backward, then `unscale_and_check` the gradients and
`update` the scale; a step whose gradients hold inf/nan is skipped.

    python -m pytest tests/test_precision.py -q
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cs_runtime.numerics import compiled, parallel

try:   # optional: a one-pass bfloat16 encoder in C++ (the same patterns: tests/test_precision_chunks.py)
    from ml_dtypes import bfloat16 as _ML_BFLOAT16
except ImportError:    # pragma: no cover - the numpy path below
    _ML_BFLOAT16 = None

# optional: the conversions as C loops (_convert.c), where setup.py could build them
_compiled = compiled.load("_convert", api=1)

FORMATS = frozenset({"float32", "float16", "bfloat16", "cbfloat16"})


@dataclass(frozen=True)
class _Spec:
    """An IEEE-style binary format of 1 + exp_bits + man_bits <= 16 bits."""
    exp_bits: int
    man_bits: int
    numpy_half: bool = False           # numpy's float16: its inf / nan patterns are numpy's own

    @property
    def bias(self) -> int:
        return (1 << (self.exp_bits - 1)) - 1

    @property
    def exp_max(self) -> int:          # the all-ones exponent field: inf / nan
        return (1 << self.exp_bits) - 1

    @property
    def inf_bits(self) -> int:
        return self.exp_max << self.man_bits

    @property
    def nan_bits(self) -> int:         # canonical quiet nan: top mantissa bit set
        return self.inf_bits | (1 << (self.man_bits - 1))

    @property
    def sign_shift(self) -> int:
        return self.exp_bits + self.man_bits


_SPECS = {"float16": _Spec(5, 10, numpy_half=True), "bfloat16": _Spec(8, 7), "cbfloat16": _Spec(6, 9)}
_F32_INF = 0x7F800000


def _check(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown precision format {fmt!r}; expected one of {sorted(FORMATS)}")


# Elements per pass of the conversions (parallel.in_chunks): each pass over a chunk stays
# in the core's cache, so the dozen integer passes of a conversion cost about one pass over memory.
_CHUNK = parallel.CHUNK


def conversion_path() -> str:
    """How this install converts to and from the 16-bit formats: "C loops" (_convert.c,
    built by setup.py where a C compiler was found) or "numpy" (the same bits, slower)."""
    return "numpy" if _compiled is None else "C loops"


def _by_loops(conversion: str, source: np.ndarray, target: np.ndarray, spec: _Spec) -> bool:
    """`source` converted into `target` (both flat and contiguous) by the C loop named
    `conversion` (encode, round or decode), in pieces side by side. False when there are
    no C loops, or the source held inf or nan: the caller's numpy path then converts the
    whole array, as that path alone decides those values (numpy's nan payloads)."""
    if _compiled is None:
        return False
    loop, held_special = getattr(_compiled, conversion), []

    def piece(begin: int, end: int) -> None:
        if loop(source[begin:end], target[begin:end], spec.exp_bits, spec.man_bits):
            held_special.append(True)
    parallel.in_pieces(source.size, piece, align=_CHUNK)
    return not held_special


@dataclass(frozen=True)
class _Magic:
    """Round to nearest even onto a narrow format's grid, its subnormals included, by one
    float32 addition (float16 and cbfloat16; bfloat16 has float32's exponent, and its
    own paths).

    For |x| in [2**E, 2**(E+1)), E clamped below to the format's least normal exponent
    emin, M = 1.5 * 2**(E + 23 - man_bits) lies in a binade whose float32 ulp is the
    format's spacing at E (2**(E - man_bits); at emin, the subnormals' too), and |x| + M
    stays in it. So the float32 sum rounds |x| onto the grid, ties to even (M is an even
    number of those ulps), and subtracting M leaves the rounded magnitude exactly; zeros
    and anything far below the grid come out 0. The sum's bits less M's count the ulps:
    2**man_bits + the mantissa field for a normal result, the field alone at emin, a carry
    into the next binade included; ((E + bias - 1) << man_bits) more is the pattern. No
    branch, and no second path for zeros or subnormals.

    _encode and _round send it the chunks that hold a magnitude below the smallest normal
    (where the integer path adds its subnormal select) and none that could round past the
    largest finite value or is inf or nan (from `rare_from` up: the integer path's)."""
    emin: np.uint32        # float32 exponent bits of the format's least normal exponent
    offset: np.uint32      # added to clamped exponent bits: M's bits
    shift: np.uint32       # 23 - man_bits: M's bits >> shift = ((E + 150 - man_bits) << man_bits) | half
    pattern_base: np.uint32   # what (M's bits >> shift) holds beyond (E + bias - 1) << man_bits
    rare_from: int         # float32 bits of 2**(the largest finite binade's exponent)

    @classmethod
    def of(cls, spec: _Spec) -> "_Magic":
        shift = 23 - spec.man_bits
        emin = 1 - spec.bias
        base = ((shift + 127 - spec.bias + 1) << spec.man_bits) + (0x400000 >> shift)
        return cls(np.uint32((127 + emin) << 23), np.uint32((shift << 23) | 0x400000), np.uint32(shift),
                   np.uint32(base), (127 + spec.exp_max - 1 - spec.bias) << 23)

    def _sum(self, magnitude, m) -> None:
        """m = M's bits; magnitude (|x|'s float32 bits, in place) = |x| + M, rounded onto the
        grid by the addition."""
        np.bitwise_and(magnitude, np.uint32(_F32_INF), out=m)
        np.maximum(m, self.emin, out=m)
        m += self.offset
        np.add(magnitude.view(np.float32), m.view(np.float32), out=magnitude.view(np.float32))

    def round(self, magnitude, bits, out, m, sign) -> None:
        """out (float32 bits) = x rounded onto the grid, its sign kept (zeros' too)."""
        self._sum(magnitude, m)
        values = magnitude.view(np.float32)
        values -= m.view(np.float32)            # exact: the rounded magnitude
        np.bitwise_and(bits, np.uint32(0x80000000), out=sign)
        np.bitwise_or(magnitude, sign, out=out)

    def encode(self, magnitude, bits, out, m, sign) -> None:
        """out (uint16) = the format's patterns of x."""
        self._sum(magnitude, m)
        magnitude -= m                          # the sum's bits less M's: the ulps, as an integer
        m >>= self.shift
        magnitude += m
        magnitude -= self.pattern_base
        np.right_shift(bits, np.uint32(16), out=sign)
        sign &= np.uint32(0x8000)
        magnitude |= sign
        np.copyto(out, magnitude, casting="unsafe")


_MAGIC = {spec: _Magic.of(spec) for spec in _SPECS.values() if spec.exp_bits < 8}


def _encode(x: np.ndarray, spec: _Spec, out: np.ndarray | None = None) -> np.ndarray:
    """float32 -> bit patterns of `spec` (uint16), round to nearest even; into `out` when given.

    Integer arithmetic on the float32 bit pattern, chunk by chunk:
    - normal results: rebias the exponent, add the RNE rounding increment to
      the bits dropped from the mantissa; a carry runs into the exponent as it
      should (1.11..1 rounds up to the next power of two, or to inf). uint32
      cannot overflow here: the largest sum is 0x7FFFFFFF + 2**drop;
    - zeros and subnormal results by a float32 addition (`_encode_small`), and
      inf and nan, each only in a chunk that holds some (its min or max
      magnitude says so).
    """
    x = np.asarray(x, dtype=np.float32)
    flat = np.ascontiguousarray(x).reshape(-1).view(np.uint32)
    result = _output(out, x.shape, np.uint16)
    out = result.reshape(-1)
    if _by_loops("encode", flat, out, spec):
        return result
    drop = np.uint32(23 - spec.man_bits)                     # mantissa bits dropped
    rebias = np.uint32((127 - spec.bias) << 23)              # float32 biased exponent of target field 0
    increment = np.uint32((1 << (drop - 1)) - 1)
    smallest_normal = np.uint32((127 - spec.bias + 1) << 23)
    inf_bits = np.uint32(spec.inf_bits)
    # the least magnitude (float32 bits) that could round to inf, less one unit of the dropped bits
    may_overflow = (spec.inf_bits << int(drop)) + int(rebias) - (1 << int(drop))

    magic = _MAGIC.get(spec)

    def chunk(start: int, stop: int, mag, shifted, rounded, mask) -> None:
        bits = flat[start:stop]
        np.bitwise_and(bits, np.uint32(0x7FFFFFFF), out=mag)
        top, low = int(mag.max()), int(mag.min())
        if magic is not None and low < smallest_normal and top < magic.rare_from:
            magic.encode(mag, bits, out[start:stop], shifted, rounded)   # zeros, subnormals: one path
            return
        np.subtract(mag, rebias, out=shifted)                # wraps below the normal range: fixed below
        np.right_shift(shifted, drop, out=rounded)
        rounded &= np.uint32(1)                              # ties go to the even neighbour
        rounded += shifted
        rounded += increment
        rounded >>= drop
        if top >= may_overflow:
            np.minimum(rounded, inf_bits, out=rounded)       # overflow after rounding -> inf
        if low < smallest_normal:                            # zeros (half of a relu's outputs), subnormals
            _encode_below_normal(mag, rounded, shifted, mask, spec, smallest_normal)
        if top >= _F32_INF:
            _encode_special(mag, rounded, spec)
        np.right_shift(bits, np.uint32(16), out=shifted)     # every format here is 16 bits wide
        shifted &= np.uint32(0x8000)
        rounded |= shifted
        np.copyto(out[start:stop], rounded, casting="unsafe")
    parallel.in_chunks(flat.size, chunk, _uint32_buffers(4))
    return result


def _uint32_buffers(count: int):
    """parallel.in_chunks' scratch: `count` uint32 working arrays of a chunk."""
    return lambda size: tuple(np.empty(size, np.uint32) for _ in range(count))


def _output(out: np.ndarray | None, shape: tuple, dtype) -> np.ndarray:
    """`out` checked to take a result of `shape` and `dtype` (a fresh array when None)."""
    if out is None:
        return np.empty(shape, dtype)
    if out.shape != tuple(shape) or out.dtype != dtype or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous {np.dtype(dtype).name} array of shape {tuple(shape)}, "
                         f"got {out.dtype.name} {out.shape}")
    return out


def _encode_bfloat16(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 -> bfloat16 patterns (into `out` when given): (bits + 0x7FFF + lsb) >> 16, on the signed bits.

    bfloat16 keeps float32's exponent, so this one rounding is the whole
    conversion, in about half the passes of the general path: float32
    subnormals land on bfloat16's subnormal grid, zeros stay signed zeros, a
    carry out of the largest finite value gives inf, and inf stays inf. Only
    nans need more (their low bits could carry into the sign): a chunk whose
    max is nan (max propagates nan) gets the canonical quiet nan, sign kept.
    The same patterns as `_encode` with bfloat16's spec (tests/test_precision_chunks.py)."""
    x = np.asarray(x, dtype=np.float32)
    flat = np.ascontiguousarray(x).reshape(-1).view(np.uint32)
    result = _output(out, x.shape, np.uint16)
    out = result.reshape(-1)

    def chunk(start: int, stop: int, lsb, rounded) -> None:
        bits = flat[start:stop]
        np.right_shift(bits, np.uint32(16), out=lsb)
        lsb &= np.uint32(1)                                  # ties go to the even neighbour
        lsb += np.uint32(0x7FFF)
        np.add(bits, lsb, out=rounded)
        rounded >>= np.uint32(16)
        patterns = out[start:stop]
        np.copyto(patterns, rounded, casting="unsafe")
        if np.isnan(bits.view(np.float32).max()):
            nans = np.flatnonzero(np.isnan(bits.view(np.float32)))
            patterns[nans] = (bits[nans] >> np.uint32(16)).astype(np.uint16) & np.uint16(0x8000) | np.uint16(0x7FC0)
    parallel.in_chunks(flat.size, chunk, _uint32_buffers(2))
    return result


def _encode_below_normal(mag: np.ndarray, rounded: np.ndarray, work: np.ndarray, mask: np.ndarray, spec: _Spec,
                         smallest_normal: np.uint32) -> None:
    """Patterns in `rounded` for the magnitudes below the smallest normal. Where those are
    all zeros (a relu's outputs, a dead unit's weight gradients), only the zeros are patched
    (to pattern 0): (mag - 1) wraps to >= 2**31 exactly at zero, so >> 31, less 1, is a mask
    that clears them; otherwise every small magnitude takes the subnormal rounding."""
    np.subtract(mag, np.uint32(1), out=mask)
    if mask.min() < smallest_normal - 1:
        _select_small(mag, rounded, _encode_small(mag, work, spec), smallest_normal, mask)
        return
    mask >>= np.uint32(31)
    mask -= np.uint32(1)
    rounded &= mask


def _select_small(mag: np.ndarray, rounded: np.ndarray, small: np.ndarray, smallest_normal: np.uint32,
                  mask: np.ndarray) -> None:
    """rounded[i] = small[i] where mag[i] < smallest_normal, without branches.

    A masked copy (copyto where=) branches on every element, and where small and
    normal values mix (a relu's zeros, gradients near the subnormal range) it
    mispredicts half the time: measured 3x the cost of the whole conversion.
    Here the mask is arithmetic: mag - smallest_normal wraps to >= 2**31 exactly
    where mag is below it (mag < 2**31), so >> 31 gives 1 there, and 1 * 0xFFFFFFFF
    all ones; then rounded ^= (rounded ^ small) & mask. `small` is clobbered."""
    np.subtract(mag, smallest_normal, out=mask)
    mask >>= np.uint32(31)
    mask *= np.uint32(0xFFFFFFFF)
    small ^= rounded
    small &= mask
    rounded ^= small


def _encode_small(mag: np.ndarray, work: np.ndarray, spec: _Spec) -> np.ndarray:
    """Patterns (in `work`) of the magnitudes `mag` (float32 bits) that are below the
    target's smallest normal, rounded to its subnormal grid, nearest even.

    The hardware does the rounding: adding C = 2**23 units of the smallest
    subnormal makes one float32 ulp exactly one unit, so the sum is rounded
    once, to nearest even, onto the grid, and its bits less C's bits count the
    units: the target's pattern (2**man_bits of them, a carry to the smallest
    normal, gives that normal's pattern, as it should). Entries of larger
    magnitudes come out meaningless: the caller keeps only the small ones."""
    unit_exp = 1 - spec.bias - spec.man_bits
    carrier = np.float32(2.0 ** (unit_exp + 23))
    values = work.view(np.float32)
    with np.errstate(invalid="ignore"):        # signalling nans in the chunk: patched by _encode_special
        np.add(mag.view(np.float32), carrier, out=values)
    work -= carrier.view(np.uint32)
    return work


def _encode_special(mag: np.ndarray, out: np.ndarray, spec: _Spec) -> None:
    """Patterns in `out` for the infs and nans among `mag` (float32 bits)."""
    special = np.flatnonzero(mag >= _F32_INF)
    if spec.numpy_half:                          # nan payloads exactly as numpy's conversion keeps them
        out[special] = mag[special].view(np.float32).astype(np.float16).view(np.uint16)
    else:
        out[special] = np.where(mag[special] == _F32_INF, spec.inf_bits, spec.nan_bits)


def _decode(b: np.ndarray, spec: _Spec, out: np.ndarray | None = None) -> np.ndarray:
    """Bit patterns of `spec` -> float32, exactly, chunk by chunk; into `out` when given.

    The patterns read as int16 and widened to int32 sign-extend: the sign lands in
    bit 31 (and in every bit above the pattern's 15 field bits). Shifted left into
    float32's field positions, with the copies of the sign between cleared, they read
    as a float32 of the right sign whose exponent is `127 - bias` too small;
    multiplying by 2**(127 - bias) is exact, for zeros and subnormals too (those read
    as float32 subnormals). Four passes where splitting off the sign took seven.
    bfloat16 is float32's upper half: the shift is the whole conversion. Inf and nan
    (rare) are computed on their own, in a chunk that holds some (its max or min says so)."""
    b = np.asarray(b)
    flat = b.reshape(-1).view(np.int16)
    result = _output(out, b.shape, np.float32)
    out = result.reshape(-1).view(np.int32)
    if _by_loops("decode", flat, out, spec):
        return result
    shift = np.int32(23 - spec.man_bits)
    keep = np.int32(np.uint32(0x80000000 | ((1 << (15 + int(shift))) - 1)).view(np.int32))   # sign, fields
    scale = np.float32(2.0 ** (127 - spec.bias))
    # inf and nan patterns read as magnitudes from 2**(exp_max - bias) (inf in float32 for bfloat16)
    special = np.float32(np.inf) if spec.exp_max - spec.bias > 127 else np.float32(2.0 ** (spec.exp_max - spec.bias))

    def chunk(start: int, stop: int) -> None:
        patterns, value = flat[start:stop], out[start:stop]
        np.copyto(value, patterns)                           # sign-extending
        value <<= shift
        if keep != -1:                                       # bfloat16: no copies of the sign below bit 31
            value &= keep
        if scale != 1:                                       # bfloat16 has float32's exponent already
            np.multiply(value.view(np.float32), scale, out=value.view(np.float32))
        floats = value.view(np.float32)
        if not (floats.max() < special and floats.min() > -special):   # nan fails both: max propagates it
            _decode_special(patterns, value, spec)
    parallel.in_chunks(flat.size, chunk)
    return result


def _decode_special(patterns: np.ndarray, value: np.ndarray, spec: _Spec) -> None:
    """The float32 bits (in `value`) of the inf and nan patterns among `patterns` (int16)."""
    mag = patterns.view(np.uint16) & np.uint16(0x7FFF)
    rare = np.flatnonzero(mag >= spec.inf_bits)
    if spec.numpy_half:                                      # nan payloads as numpy's conversion keeps them
        widened = patterns[rare].view(np.float16).astype(np.float32).view(np.int32)
    else:
        sign = (patterns[rare].view(np.uint16).astype(np.uint32) & np.uint32(0x8000)) << np.uint32(16)
        widened = (_decode_rare(mag[rare].astype(np.int64), spec) | sign).view(np.int32)
    value[rare] = widened


def _decode_rare(b: np.ndarray, spec: _Spec) -> np.ndarray:
    """Magnitude bit patterns (as float32 bits) of subnormal, inf and nan values of `spec`."""
    e = (b >> spec.man_bits) & spec.exp_max
    m = b & ((1 << spec.man_bits) - 1)
    special = np.where(m == 0, _F32_INF, 0x7FC00000)
    # Subnormals: m * 2**(1 - bias - man_bits), exact in float32 for every spec here.
    sub = np.ldexp(m.astype(np.float32), np.int32(1 - spec.bias - spec.man_bits)).astype(np.float32)
    return np.where(e == spec.exp_max, special, sub.view(np.uint32).astype(np.int64)).astype(np.uint32)


def wire_dtype(fmt: str) -> np.dtype:
    """The dtype a tensor of `fmt` has on the wire: float32, float16, or uint16 bit patterns."""
    _check(fmt)
    return np.dtype({"float32": np.float32, "float16": np.float16}.get(fmt, np.uint16))


def to_bits(x: np.ndarray, fmt: str, out: np.ndarray | None = None) -> np.ndarray:
    """x (cast to float32 first) in the storage of `fmt`, of dtype `wire_dtype(fmt)`.

    `out`: a contiguous array of that dtype and x's shape to write into (a
    buffer the result is sent from), returned; no temporary is made."""
    _check(fmt)
    x = np.asarray(x, dtype=np.float32)
    if fmt == "float32":
        if out is None:
            return x.copy()
        np.copyto(_output(out, x.shape, np.float32), x)
        return out
    if fmt == "float16":
        # numpy's own conversion gives the same patterns (tests/test_precision_chunks.py) but
        # runs element by element: 1.2x the integer path on weights, 10x to 20x on gradients
        # near float16's subnormal range (branches in its subnormal rounding).
        if out is None:
            return _encode(x, _SPECS[fmt]).view(np.float16)
        _encode(x, _SPECS[fmt], _output(out, x.shape, np.float16).view(np.uint16))
        return out
    if fmt == "bfloat16":
        if _compiled is not None:      # the C loop: quicker still (inf and nan by _encode's numpy path)
            return _encode(x, _SPECS[fmt], out)
        if _ML_BFLOAT16 is None:
            return _encode_bfloat16(x, out)
        return _encode_bfloat16_ml(x, out)
    return _encode(x, _SPECS[fmt], out)


def _encode_bfloat16_ml(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`_encode_bfloat16` by ml_dtypes' cast: the same rounding (nearest even on the bits,
    canonical quiet nan with its sign) in one pass, half the time of the numpy passes."""
    result = _output(out, x.shape, np.uint16)
    source, target = np.ascontiguousarray(x).reshape(-1), result.reshape(-1).view(_ML_BFLOAT16)

    def fill(begin: int, end: int) -> None:
        with np.errstate(invalid="ignore"):     # nans: encoded, not an error
            np.copyto(target[begin:end], source[begin:end], casting="unsafe")
    parallel.in_pieces(source.size, fill, align=_CHUNK)
    return result


def from_bits(b: np.ndarray, fmt: str, out: np.ndarray | None = None) -> np.ndarray:
    """The float32 values held by storage `b` of `fmt` (exact). float16 also takes uint16 patterns.
    `out`: a contiguous float32 array of b's shape to write into, returned."""
    _check(fmt)
    b = np.asarray(b)
    if fmt == "float32" or (fmt == "float16" and b.dtype not in (np.float16, np.uint16)):
        if out is None:
            return b.astype(np.float32)
        np.copyto(_output(out, b.shape, np.float32), b, casting="same_kind")
        return out
    if fmt == "float16":
        return _decode(b.view(np.uint16), _SPECS[fmt], out)
    if b.dtype != np.uint16:
        raise TypeError(f"{fmt} storage must be uint16 bit patterns, got {b.dtype}")
    return _decode(b, _SPECS[fmt], out)


# Elements per block of add_from_bits: its float32 scratch (2 MB) stays in cache.
_ADD_BLOCK = 1 << 19


def add_from_bits(total: np.ndarray, b: np.ndarray, fmt: str) -> np.ndarray:
    """total += from_bits(b, fmt), block by block, with no float32 copy of b: the
    same sums (each element widened exactly, then one float32 addition)."""
    _check(fmt)
    if fmt == "float32" or b.dtype not in (np.uint16, np.float16):
        total += from_bits(b, fmt)
        return total
    if total.shape != b.shape or total.dtype != np.float32 or not total.flags.c_contiguous:
        raise ValueError(f"total must be a contiguous float32 array of shape {b.shape}")
    patterns, sums = np.ascontiguousarray(b).reshape(-1).view(np.uint16), total.reshape(-1)
    scratch = np.empty(min(_ADD_BLOCK, patterns.size), np.float32)
    for start in range(0, patterns.size, _ADD_BLOCK):
        block = patterns[start:start + _ADD_BLOCK]
        widened = _decode(block, _SPECS[fmt], scratch[:block.size])
        sums[start:start + block.size] += widened
    return total


def quantize(x: np.ndarray, fmt: str) -> np.ndarray:
    """The float32 value nearest to x (RNE) among the values of `fmt`: what a 16-bit input holds.
    The same bits as from_bits(to_bits(x, fmt), fmt), in one pass over memory (`_round`)."""
    if fmt == "float32":
        return np.asarray(x, dtype=np.float32)   # no rounding, no copy
    _check(fmt)
    return _round(x, fmt)


def _round(x: np.ndarray, fmt: str) -> np.ndarray:
    """float32 -> float32 rounded to `spec`'s values (nearest even), without the 16-bit
    patterns in between: the encoder's integer rounding done on the float32 bit pattern.

    Per chunk: the dropped mantissa bits rounded off in place (a carry runs into the
    exponent, as in `_encode`); a result at or past the format's overflow threshold
    becomes inf (checked only where the chunk's largest magnitude could get there);
    magnitudes below the format's smallest normal (not zeros: rounding leaves those zero)
    rounded onto its subnormal grid by a float32 addition (`_encode_small`'s carrier),
    except in bfloat16, whose subnormals are float32's own, cut by the same rounding;
    the sign put back. A chunk holding inf or nan takes the encoder and decoder (rare),
    so nan payloads and signs come out as they do there."""
    spec = _SPECS[fmt]
    x = np.asarray(x, dtype=np.float32)
    flat = np.ascontiguousarray(x).reshape(-1).view(np.uint32)
    result = np.empty(x.shape, np.float32)
    out = result.reshape(-1).view(np.uint32)
    if _by_loops("round", flat, out, spec):
        return result
    drop = np.uint32(23 - spec.man_bits)
    keep = np.uint32(~((1 << int(drop)) - 1) & 0xFFFFFFFF)
    increment = np.uint32((1 << (drop - 1)) - 1)
    smallest_normal = np.uint32((127 - spec.bias + 1) << 23)
    overflow = (spec.exp_max - spec.bias + 127) << 23          # float32 bits of 2**(emax + 1): inf from here
    carrier = np.float32(2.0 ** (1 - spec.bias - spec.man_bits + 23))
    full_range = spec.exp_bits == 8                               # bfloat16: float32's exponent and subnormals

    magic = _MAGIC.get(spec)

    def chunk(start: int, stop: int, mag, work, mask) -> None:
        bits, rounded = flat[start:stop], out[start:stop]
        np.bitwise_and(bits, np.uint32(0x7FFFFFFF), out=mag)
        top = int(mag.max())
        if top >= _F32_INF:
            rounded[:] = from_bits(to_bits(bits.view(np.float32), fmt), fmt).view(np.uint32)
            return
        if not full_range:
            np.subtract(mag, np.uint32(1), out=work)             # zeros wrap to the top: left out
            small = int(work.min()) < smallest_normal - 1        # nonzero magnitudes below the smallest normal
            if small and magic is not None and top < magic.rare_from:
                magic.round(mag, bits, rounded, work, mask)      # them and the rest: one path
                return
        np.right_shift(mag, drop, out=rounded)
        rounded &= np.uint32(1)                                  # ties go to the even neighbour
        rounded += mag
        rounded += increment
        rounded &= keep
        if not full_range:
            if top + (1 << int(drop)) >= overflow and rounded.max() >= overflow:
                rounded[rounded >= overflow] = _F32_INF
            if small:
                _round_small(mag, rounded, work, carrier, smallest_normal, mask)
        np.bitwise_and(bits, np.uint32(0x80000000), out=work)
        rounded |= work
    parallel.in_chunks(flat.size, chunk, _uint32_buffers(3))
    return result


def _round_small(mag: np.ndarray, rounded: np.ndarray, work: np.ndarray, carrier: np.float32,
                 smallest_normal: np.uint32, mask: np.ndarray) -> None:
    """rounded[i] = the float32 bits of mag[i] rounded onto the subnormal grid whose unit
    `carrier` has as its ulp, where mag[i] < smallest_normal (branch-free, as _select_small)."""
    values = work.view(np.float32)
    np.add(mag.view(np.float32), carrier, out=values)
    values -= carrier
    _select_small(mag, rounded, work, smallest_normal, mask)


def encode_arrays(arrays: dict[str, np.ndarray], fmt: str) -> dict[str, np.ndarray]:
    """Float tensors as they cross a socket in `fmt`; other arrays (labels, tensors
    already in `fmt`'s storage) as they are."""
    if fmt == "float32":
        return arrays
    stored = wire_dtype(fmt)
    return {name: to_bits(a, fmt) if np.issubdtype(a.dtype, np.floating) and a.dtype != stored else a
            for name, a in arrays.items()}


def decode_arrays(arrays: dict[str, np.ndarray], fmt: str) -> dict[str, np.ndarray]:
    """Inverse of encode_arrays: float32 values, exactly; other arrays as they are."""
    if fmt == "float32":
        return arrays
    stored = wire_dtype(fmt)
    return {name: from_bits(a, fmt) if a.dtype == stored else a for name, a in arrays.items()}


def scaled(x, scale: float):
    """x * scale in float32 (x itself when scale is 1): the loss gradient that starts backward.
    A compiled program's delta is a dict of named gradients: each is scaled."""
    if scale == 1.0:
        return x
    if isinstance(x, dict):
        return {name: scaled(v, scale) for name, v in x.items()}
    return x * np.float32(scale)


def unscale_and_check(grads: list[dict[str, np.ndarray]], scale: float) -> bool:
    """Each gradient divided by `scale` in place, then True when every one is finite.

    Overflowed or not, every gradient is unscaled, as torch's GradScaler.unscale_ does,
    so layer by layer this gives what it gives for all layers at once (MemoryX unscales
    each layer as it lands) and a skipped step's norms are those of the unscaled
    gradients. A read-only array (e.g. straight off a socket) is replaced in its dict
    by the unscaled copy instead.
    """
    if scale != 1.0:
        divisor = np.float32(scale)
        for layer in grads:
            for name, g in layer.items():
                if g.flags.writeable:
                    g /= divisor
                else:
                    layer[name] = g / divisor
    return all(bool(np.isfinite(g).all()) for layer in grads for g in layer.values())


def matmul(a: np.ndarray, b: np.ndarray, fmt: str) -> np.ndarray:
    """a @ b with both inputs rounded to `fmt` and float32 accumulation."""
    _check(fmt)
    if fmt == "float32":
        return np.asarray(a, dtype=np.float32) @ np.asarray(b, dtype=np.float32)
    return quantize(a, fmt) @ quantize(b, fmt)


def max_finite(fmt: str) -> float:
    _check(fmt)
    if fmt == "float32":
        return float(np.finfo(np.float32).max)
    s = _SPECS[fmt]
    return math.ldexp(2.0 - 2.0 ** -s.man_bits, s.exp_max - 1 - s.bias)


def min_normal(fmt: str) -> float:
    _check(fmt)
    if fmt == "float32":
        return 2.0 ** -126
    return 2.0 ** (1 - _SPECS[fmt].bias)


def min_subnormal(fmt: str) -> float:
    _check(fmt)
    if fmt == "float32":
        return 2.0 ** -149
    s = _SPECS[fmt]
    return 2.0 ** (1 - s.bias - s.man_bits)


# --------------------------------------------------------------------------- loss scaling

LOSS_SCALING_MODES = ("none", "static", "dynamic")


class LossScaler:
    """Loss scaling for 16-bit gradients, with PyTorch GradScaler semantics.

    - none:    scale 1; every step is applied (plain float32 training, the oracle);
    - static:  scale fixed at `static_scale`; a step with inf/nan gradients is skipped;
    - dynamic: start at `initial_scale`; a step with inf/nan is skipped and the
      scale halved (not below `min_scale`); after `steps_per_increase`
      consecutive clean steps the scale doubles (not above `max_scale`).

    Per step: multiply the loss (the output delta) by `scale`, run backward,
    then `ok = unscale_and_check(grads)`; `if update(ok): apply the step`.
    """

    def __init__(self, mode: str = "none", initial_scale: float = 2.0 ** 15,
                 steps_per_increase: int = 2000, min_scale: float = 1.0,
                 max_scale: float = 2.0 ** 24, static_scale: float = 1.0):
        if mode not in LOSS_SCALING_MODES:
            raise ValueError(f"unknown loss scaling mode {mode!r}; expected one of {LOSS_SCALING_MODES}")
        if steps_per_increase < 1:
            raise ValueError(f"steps_per_increase must be >= 1, got {steps_per_increase}")
        if not 0 < min_scale <= max_scale:
            raise ValueError(f"need 0 < min_scale <= max_scale, got {min_scale}, {max_scale}")
        if mode == "dynamic" and not min_scale <= initial_scale <= max_scale:
            raise ValueError(f"initial_scale {initial_scale} outside [{min_scale}, {max_scale}]")
        if mode == "static" and not (static_scale > 0 and math.isfinite(static_scale)):
            raise ValueError(f"static_scale must be positive and finite, got {static_scale}")
        self.mode = mode
        self.steps_per_increase = int(steps_per_increase)
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self._scale = {"none": 1.0, "static": float(static_scale), "dynamic": float(initial_scale)}[mode]
        self._good_steps = 0             # consecutive clean steps since the last change

    @property
    def scale(self) -> float:
        return self._scale

    def scale_loss(self, x):
        """x * scale (the loss, or the loss gradient that starts backward)."""
        return scaled(x, self._scale)

    def unscale_and_check(self, grads: list[dict[str, np.ndarray]]) -> bool:
        """Each gradient divided by scale in place; True when every one is finite."""
        return unscale_and_check(grads, self._scale)

    @property
    def skips_nonfinite(self) -> bool:
        """Whether a step with inf/nan gradients is skipped (any mode but none)."""
        return self.mode != "none"

    def update(self, found_finite: bool) -> bool:
        """Advance the scale after one step; True when that step should be applied."""
        if self.mode == "none":
            return True
        if not found_finite:
            if self.mode == "dynamic":
                self._scale = max(self._scale * 0.5, self.min_scale)
            self._good_steps = 0
            return False
        self._good_steps += 1
        if self.mode == "dynamic" and self._good_steps >= self.steps_per_increase:
            self._scale = min(self._scale * 2.0, self.max_scale)
            self._good_steps = 0
        return True

    def state_dict(self) -> dict:
        return {"scale": float(self._scale), "good_steps": int(self._good_steps)}

    def load_state_dict(self, state: dict) -> None:
        """Restore from `state_dict()` (numpy scalars from a checkpoint are fine).

        Only dynamic mode takes the saved scale: in none/static mode the scale is
        configuration, so resuming a run with a changed mode does what the params say.
        """
        if self.mode == "dynamic":
            scale = float(state["scale"])
            if not (math.isfinite(scale) and scale > 0):
                raise ValueError(f"bad loss scale in state: {scale}")
            self._scale = scale
        self._good_steps = int(state["good_steps"])
