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
float32 bit patterns, vectorised. 16 bits -> float32 is exact. float16 uses
numpy's own half type (same rounding rule), so its storage dtype is float16.

Loss scaling (`LossScaler`) follows PyTorch's GradScaler: multiply the loss
by `scale` before backward, then `unscale_and_check` the gradients and
`update` the scale; a step whose gradients hold inf/nan is skipped.

    python -m pytest tests/test_precision.py -q
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FORMATS = frozenset({"float32", "float16", "bfloat16", "cbfloat16"})


@dataclass(frozen=True)
class _Spec:
    """An IEEE-style binary format of 1 + exp_bits + man_bits <= 16 bits."""
    exp_bits: int
    man_bits: int

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


_SPECS = {"float16": _Spec(5, 10), "bfloat16": _Spec(8, 7), "cbfloat16": _Spec(6, 9)}
_F32_INF = 0x7F800000


def _check(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown precision format {fmt!r}; expected one of {sorted(FORMATS)}")


def _encode(x: np.ndarray, spec: _Spec) -> np.ndarray:
    """float32 -> bit patterns of `spec` (uint16), round to nearest even.

    Integer arithmetic on the float32 bit pattern:
    - normal results: rebias the exponent, add the RNE rounding increment to
      the bits dropped from the mantissa; a carry runs into the exponent as it
      should (1.11..1 rounds up to the next power of two, or to inf). uint32
      cannot overflow here: the largest sum is 0x7FFFFFFF + 2**drop;
    - subnormal results (rare, so computed only where needed, in int64): the
      integer significand, implicit bit included, is shifted right to units of
      the smallest subnormal, rounding to even; a carry out of the subnormal
      range gives the smallest normal pattern, which is again right.
    """
    x = np.asarray(x, dtype=np.float32)
    bits = np.ascontiguousarray(x).reshape(-1).view(np.uint32)
    sign = (bits >> 16) & 0x8000                     # every format here is 16 bits wide
    mag = bits & np.uint32(0x7FFFFFFF)
    drop = 23 - spec.man_bits                        # mantissa bits dropped
    rebias = 127 - spec.bias                         # float32 biased exponent of target field 0

    shifted = mag - np.uint32(rebias << 23)          # wraps below the normal range: replaced below
    out = (shifted + np.uint32((1 << (drop - 1)) - 1) + ((shifted >> drop) & 1)) >> drop
    np.minimum(out, np.uint32(spec.inf_bits), out=out)   # overflow after rounding -> inf

    small = mag < np.uint32((rebias + 1) << 23)      # zero, or subnormal in the target format
    np.putmask(out, small, np.uint32(0))             # zeros (half of a relu's outputs) are done
    sub = np.flatnonzero(small & (mag != 0))
    if sub.size:
        m = mag[sub].astype(np.int64)
        e32 = m >> 23
        sig = np.where(e32 > 0, (m & 0x7FFFFF) | (1 << 23), m)
        # value = sig * 2**(max(e32, 1) - 150); unit of the result 2**(1 - bias - man_bits)
        shift = np.clip(151 - spec.bias - spec.man_bits - np.maximum(e32, 1), 1, 40)
        q = sig >> shift                             # shift >= 25 gives 0, as it should
        rem = sig & ((np.int64(1) << shift) - 1)
        half = np.int64(1) << (shift - 1)
        q += (rem > half) | ((rem == half) & ((q & 1) == 1))
        out[sub] = q

    special = np.flatnonzero(mag >= _F32_INF)
    if special.size:
        out[special] = np.where(mag[special] == _F32_INF, spec.inf_bits, spec.nan_bits)
    return (out | sign).astype(np.uint16).reshape(x.shape)


def _decode(b: np.ndarray, spec: _Spec) -> np.ndarray:
    """Bit patterns of `spec` -> float32, exactly.

    Normal values move their fields into place in uint32 (the mantissa shifted
    up, the exponent rebiased); zeros stay zero; the rare subnormals, infs and
    nans are computed on their own (in int64)."""
    b = np.asarray(b)
    bits = b.reshape(-1).astype(np.uint32)
    mag = bits & np.uint32(0x7FFF)
    out = (mag << np.uint32(23 - spec.man_bits)) + np.uint32((127 - spec.bias) << 23)
    np.putmask(out, mag == 0, np.uint32(0))
    rare = np.flatnonzero((mag - np.uint32(1) < np.uint32((1 << spec.man_bits) - 1))   # subnormal (wraps at 0)
                          | (mag >= np.uint32(spec.inf_bits)))
    if rare.size:
        out[rare] = _decode_rare(bits[rare].astype(np.int64), spec)
    out |= (bits & np.uint32(0x8000)) << np.uint32(16)
    return out.view(np.float32).reshape(b.shape)


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


def to_bits(x: np.ndarray, fmt: str) -> np.ndarray:
    """x (cast to float32 first) in the storage of `fmt`, of dtype `wire_dtype(fmt)`."""
    _check(fmt)
    x = np.asarray(x, dtype=np.float32)
    if fmt == "float32":
        return x.copy()
    if fmt == "float16":
        with np.errstate(over="ignore"):            # overflow to inf is the defined result
            return x.astype(np.float16)
    return _encode(x, _SPECS[fmt])


def from_bits(b: np.ndarray, fmt: str) -> np.ndarray:
    """The float32 values held by storage `b` of `fmt` (exact). float16 also takes uint16 patterns."""
    _check(fmt)
    b = np.asarray(b)
    if fmt == "float32":
        return b.astype(np.float32)
    if fmt == "float16":
        if b.dtype == np.uint16:
            b = b.view(np.float16)
        return b.astype(np.float32)
    if b.dtype != np.uint16:
        raise TypeError(f"{fmt} storage must be uint16 bit patterns, got {b.dtype}")
    return _decode(b, _SPECS[fmt])


def quantize(x: np.ndarray, fmt: str) -> np.ndarray:
    """The float32 value nearest to x (RNE) among the values of `fmt`: what a 16-bit input holds."""
    if fmt == "float32":
        return np.asarray(x, dtype=np.float32)   # no rounding, no copy
    return from_bits(to_bits(x, fmt), fmt)


def encode_arrays(arrays: dict[str, np.ndarray], fmt: str) -> dict[str, np.ndarray]:
    """Float tensors as they cross a socket in `fmt`; other arrays (labels) as they are."""
    if fmt == "float32":
        return arrays
    return {name: to_bits(a, fmt) if np.issubdtype(a.dtype, np.floating) else a
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
    """True when every gradient is finite; then each is divided by `scale` in place.

    A read-only array (e.g. straight off a socket) is replaced in its dict by
    the unscaled copy instead. Non-finite gradients are left as they are: the
    step is skipped anyway.
    """
    finite = all(bool(np.isfinite(g).all()) for layer in grads for g in layer.values())
    if finite and scale != 1.0:
        inv = np.float32(scale)
        for layer in grads:
            for name, g in layer.items():
                if g.flags.writeable:
                    g /= inv
                else:
                    layer[name] = g / inv
    return finite


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
        """True when every gradient is finite; then each is divided by scale in place."""
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
