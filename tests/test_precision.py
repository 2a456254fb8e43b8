"""16-bit formats (exhaustive over every bit pattern) and loss scaling.

    python -m pytest tests/test_precision.py -q
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cs_runtime.numerics import precision as P

ALL16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
MAN_BITS = {"bfloat16": 7, "cbfloat16": 9}
MAX_PATTERN = {"bfloat16": 0x7F7F, "cbfloat16": 0x7DFF}   # largest finite positive pattern
INF_PATTERN = {"bfloat16": 0x7F80, "cbfloat16": 0x7E00}
F32 = st.floats(width=32, allow_nan=False, allow_infinity=True)
# Each test runs on both paths of the conversions: the C loops and the numpy passes (conftest.py).
pytestmark = pytest.mark.usefixtures("conversion_path")


def positive_table(fmt):
    """Patterns 0..max finite and their values (increasing, as the tests check)."""
    pats = np.arange(MAX_PATTERN[fmt] + 1, dtype=np.uint16)
    return pats, P.from_bits(pats, fmt)


def finite_table(fmt):
    """Every finite value of fmt with its pattern, sorted by value (-0 left out)."""
    pats, vals = positive_table(fmt)
    neg_pats = (pats[1:][::-1] | 0x8000).astype(np.uint16)
    return np.concatenate([neg_pats, pats]), np.concatenate([-vals[1:][::-1], vals])


def brute_force_nearest(x, fmt):
    """Pattern of the table entry nearest to x (ties: even mantissa), by search, no bit tricks."""
    pats, vals = finite_table(fmt)
    vals64 = vals.astype(np.float64)
    x64 = x.astype(np.float64)
    hi = np.clip(np.searchsorted(vals64, x64), 1, len(vals64) - 1)
    lo = hi - 1
    d_lo, d_hi = np.abs(x64 - vals64[lo]), np.abs(vals64[hi] - x64)
    tie_even_hi = (d_lo == d_hi) & ((pats[hi] & 1) == 0)
    pick = np.where((d_hi < d_lo) | tie_even_hi, hi, lo)
    return pats[pick]


# --------------------------------------------------------------------------- definition


def test_cbfloat16_definition_points():
    v = P.from_bits(np.array([0x0000, 0x8000, 0x0001, 0x01FF, 0x0200, 0x3E00, 0xBE00, 0x3E01,
                              0x7DFF, 0x7E00, 0xFE00], dtype=np.uint16), "cbfloat16")
    expected = [0.0, -0.0, 2.0 ** -39, 511 * 2.0 ** -39, 2.0 ** -30, 1.0, -1.0, 1 + 2.0 ** -9,
                (2 - 2.0 ** -9) * 2.0 ** 31, np.inf, -np.inf]
    np.testing.assert_array_equal(v, np.array(expected, dtype=np.float32))
    assert np.signbit(v[1])
    assert P.max_finite("cbfloat16") == (2 - 2.0 ** -9) * 2.0 ** 31
    assert P.min_subnormal("cbfloat16") == 2.0 ** -39
    assert P.min_normal("cbfloat16") == 2.0 ** -30


@pytest.mark.parametrize("fmt", ["float32", "float16", "bfloat16", "cbfloat16"])
def test_limits_are_values_of_the_format(fmt):
    for v in (P.max_finite(fmt), P.min_subnormal(fmt), P.min_normal(fmt)):
        assert float(P.quantize(np.array([v], np.float32), fmt)[0]) == v
    assert np.isinf(P.quantize(np.array([np.inf], np.float32), fmt)[0])


def test_known_limits():
    assert P.max_finite("float16") == 65504.0 and P.min_subnormal("float16") == 2.0 ** -24
    assert P.max_finite("bfloat16") == (2 - 2.0 ** -7) * 2.0 ** 127
    assert P.min_subnormal("bfloat16") == 2.0 ** -133
    assert P.FORMATS == {"float32", "float16", "bfloat16", "cbfloat16"}


def test_api_dtypes_and_errors():
    x = np.linspace(-3, 3, 7, dtype=np.float32)
    for fmt in P.FORMATS:
        b = P.to_bits(x, fmt)
        assert b.dtype == P.wire_dtype(fmt) and b.shape == x.shape
        assert P.from_bits(b, fmt).dtype == np.float32
        assert P.quantize(x, fmt).dtype == np.float32
    assert P.wire_dtype("bfloat16") == np.uint16 and P.wire_dtype("float16") == np.float16
    np.testing.assert_array_equal(P.from_bits(P.to_bits(x, "float16").view(np.uint16), "float16"),
                                  P.quantize(x, "float16"))
    for fmt in P.FORMATS:                                  # shapes: scalars, views, empty
        assert P.quantize(np.float32(3.3), fmt).shape == ()
        assert P.quantize(np.ones((3, 4), np.float64)[:, ::2], fmt).shape == (3, 2)
        assert P.to_bits(np.zeros((2, 0, 3)), fmt).shape == (2, 0, 3)
    with pytest.raises(ValueError):
        P.quantize(x, "float8")
    with pytest.raises(TypeError):
        P.from_bits(x, "cbfloat16")


# --------------------------------------------------------------------------- exhaustive


@pytest.mark.parametrize("fmt", ["bfloat16", "cbfloat16"])
def test_exhaustive_round_trip(fmt):
    v = P.from_bits(ALL16, fmt)
    nan = np.isnan(v)
    assert nan.sum() == 2 * ((1 << MAN_BITS[fmt]) - 1)       # exponent all ones, mantissa != 0
    np.testing.assert_array_equal(P.to_bits(v[~nan], fmt), ALL16[~nan])
    assert np.isnan(P.from_bits(P.to_bits(v[nan], fmt), fmt)).all()
    # the sign bit is the sign, also for the zeros and the infinities
    np.testing.assert_array_equal(np.signbit(v[~nan]), (ALL16[~nan] >> 15) == 1)


@pytest.mark.parametrize("fmt", ["bfloat16", "cbfloat16"])
def test_encoding_is_monotone(fmt):
    pats, vals = positive_table(fmt)
    assert (np.diff(vals.astype(np.float64)) > 0).all()
    assert vals[0] == 0 and vals[-1] == P.max_finite(fmt)
    assert P.from_bits(np.array([INF_PATTERN[fmt]], np.uint16), fmt)[0] == np.inf
    np.testing.assert_array_equal(P.from_bits(pats | np.uint16(0x8000), fmt), -vals)


@pytest.mark.parametrize("fmt", ["bfloat16", "cbfloat16"])
def test_exhaustive_halfway_cases_go_to_even(fmt):
    """Every midpoint between adjacent positive values (subnormal and normal) and its neighbours."""
    pats, vals = positive_table(fmt)
    lo, hi = vals[:-1].astype(np.float64), vals[1:].astype(np.float64)
    mid = ((lo + hi) / 2).astype(np.float32)
    assert (mid.astype(np.float64) == (lo + hi) / 2).all()          # exact in float32
    even = np.where(pats[:-1] % 2 == 0, pats[:-1], pats[1:])
    for sign in (1, -1):
        s = np.uint16(0x8000 if sign < 0 else 0)
        np.testing.assert_array_equal(P.to_bits(sign * mid, fmt), even | s)
        below = np.nextafter(mid, np.float32(0)) * sign
        above = np.nextafter(mid, np.float32(np.inf)) * sign
        np.testing.assert_array_equal(P.to_bits(below, fmt), pats[:-1] | s)
        np.testing.assert_array_equal(P.to_bits(above, fmt), pats[1:] | s)
    # the subnormal range is part of this sweep: check that it was covered
    assert (mid < P.min_normal(fmt)).sum() >= (1 << MAN_BITS[fmt]) - 1


@pytest.mark.parametrize("fmt", ["bfloat16", "cbfloat16"])
def test_overflow_to_inf(fmt):
    top = P.max_finite(fmt)
    half_ulp = 2.0 ** (np.floor(np.log2(top)) - MAN_BITS[fmt] - 1)
    tie = np.float32(top + half_ulp)                      # odd max mantissa: the tie rounds up
    for sign in (1.0, -1.0):
        x = np.array([np.nextafter(tie, np.float32(0)), tie, np.nextafter(tie, np.float32(np.inf)),
                      np.float32(np.finfo(np.float32).max)], dtype=np.float32) * np.float32(sign)
        q = P.quantize(x, fmt)
        assert q[0] == sign * top
        assert (q[1:] == sign * np.inf).all()


@pytest.mark.parametrize("fmt", ["bfloat16", "cbfloat16", "float16"])
def test_tiny_values_flush_to_signed_zero(fmt):
    half = np.float32(P.min_subnormal(fmt) / 2)
    x = np.array([half, np.nextafter(half, np.float32(0)), np.float32(2.0 ** -149), np.float32(1e-45),
                  np.nextafter(half, np.float32(1))], dtype=np.float32)
    for sign in (1.0, -1.0):
        q = P.quantize(x * np.float32(sign), fmt)
        assert (q[:4] == 0).all() and (np.signbit(q[:4]) == (sign < 0)).all()
        assert q[4] == sign * P.min_subnormal(fmt)


def test_cbfloat16_nan_and_inf_inputs():
    x = np.array([np.nan, -np.nan, np.inf, -np.inf], dtype=np.float32)
    b = P.to_bits(x, "cbfloat16")
    assert np.isnan(P.from_bits(b[:2], "cbfloat16")).all()
    assert b[2] == 0x7E00 and b[3] == 0xFE00
    # a nan whose payload lives only in the bits that are dropped stays a nan
    quiet_less = np.array([0x7F800001, 0xFF800001], dtype=np.uint32).view(np.float32)
    for fmt in ("bfloat16", "cbfloat16"):
        assert np.isnan(P.quantize(quiet_less, fmt)).all()


# --------------------------------------------------------------------------- rounding


@pytest.mark.parametrize("fmt", ["bfloat16", "cbfloat16"])
def test_quantize_is_the_nearest_value(fmt):
    rng = np.random.default_rng(7)
    n = 200_000
    mag = np.exp2(rng.uniform(np.log2(P.min_subnormal(fmt)) - 2, np.log2(P.max_finite(fmt)), n))
    x = (mag * rng.choice([-1.0, 1.0], n)).astype(np.float32)
    # add random float32 bit patterns in the format's range, and exact table values
    _, vals = finite_table(fmt)
    x = np.concatenate([x, rng.choice(vals, 5000)])
    np.testing.assert_array_equal(P.to_bits(x, fmt) & 0x7FFF, brute_force_nearest(x, fmt) & 0x7FFF)
    # signs: zero keeps the sign of its input
    np.testing.assert_array_equal(np.signbit(P.quantize(x, fmt)), np.signbit(x))


@pytest.mark.parametrize("fmt", ["bfloat16", "cbfloat16", "float16"])
def test_rounding_is_monotone_dense_sweep(fmt):
    # every 16381st positive float32 pattern up to inf, plus every pattern around 1.0
    # and around the smallest normal of the format
    near_normal = int(np.array(P.min_normal(fmt), np.float32).view(np.uint32))
    pats = np.concatenate([np.arange(0, 0x7F800001, 16381, dtype=np.int64),
                           np.arange(0x3F7F8000, 0x3F808000, dtype=np.int64),
                           np.arange(near_normal - 0x8000, near_normal + 0x8000, dtype=np.int64), [0x7F800000]])
    pats = np.unique(pats).astype(np.uint32)
    x = pats.view(np.float32)                            # ascending for positive patterns
    q = P.quantize(x, fmt)
    assert (q[1:] >= q[:-1]).all() and q[-1] == np.inf
    q_neg = P.quantize(-x, fmt)
    assert (q_neg[1:] <= q_neg[:-1]).all() and q_neg[-1] == -np.inf


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(F32, min_size=2, max_size=200))
def test_rounding_is_monotone_property(values):
    x = np.sort(np.array(values, dtype=np.float32))
    for fmt in ("bfloat16", "cbfloat16", "float16"):
        q = P.quantize(x, fmt)
        assert (q[1:] >= q[:-1]).all()


@settings(max_examples=200, deadline=None, database=None)
@given(F32)
def test_quantize_is_idempotent_and_bracketing(v):
    x = np.array([v], dtype=np.float32)
    for fmt in ("bfloat16", "cbfloat16"):
        q = P.quantize(x, fmt)
        np.testing.assert_array_equal(P.quantize(q, fmt), q)
        if abs(v) < P.max_finite(fmt):                   # within range: error at most half an ulp
            ulp = max(2.0 ** (np.floor(np.log2(abs(v))) - MAN_BITS[fmt]) if v else 0.0,
                      P.min_subnormal(fmt))
            assert abs(float(q[0]) - float(v)) <= ulp / 2


def test_generic_encoder_matches_numpy_half():
    """The bit-manipulation encoder, instantiated as IEEE half, agrees with numpy's float16."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 1 << 32, size=300_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    y = (rng.standard_normal(300_000) * np.exp2(rng.uniform(-30, 17, 300_000))).astype(np.float32)
    x = np.concatenate([x[~np.isnan(x)], y])
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(P._encode(x, P._SPECS["float16"]), ref)


def test_bfloat16_matches_the_classic_bit_trick():
    """bf16 RNE is the well-known (bits + 0x7FFF + lsb) >> 16 on non-nan inputs."""
    rng = np.random.default_rng(4)
    bits = rng.integers(0, 1 << 32, size=300_000, dtype=np.uint64)
    x = bits.astype(np.uint32).view(np.float32)
    keep = ~np.isnan(x)
    bits = bits[keep]
    ref = np.minimum(((bits & 0x7FFFFFFF) + 0x7FFF + ((bits >> 16) & 1)) >> 16, 0x7F80)
    ref = (ref | ((bits >> 16) & 0x8000)).astype(np.uint16)
    np.testing.assert_array_equal(P.to_bits(x[keep], "bfloat16"), ref)


def test_float16_is_numpy_half():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(100_000) * np.exp2(rng.uniform(-30, 20, 100_000))).astype(np.float32)
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(P.quantize(x, "float16"), ref)
    np.testing.assert_array_equal(P.quantize(x, "float32"), x)


def test_matmul_rounds_inputs_and_accumulates_in_float32():
    rng = np.random.default_rng(6)
    a = rng.standard_normal((16, 32)).astype(np.float32)
    b = rng.standard_normal((32, 8)).astype(np.float32)
    np.testing.assert_array_equal(P.matmul(a, b, "float32"), a @ b)
    for fmt in ("float16", "bfloat16", "cbfloat16"):
        c = P.matmul(a, b, fmt)
        assert c.dtype == np.float32
        np.testing.assert_array_equal(c, P.quantize(a, fmt) @ P.quantize(b, fmt))
        assert not np.array_equal(c, a @ b)
        np.testing.assert_allclose(c, a @ b, rtol=0, atol=0.1)


# --------------------------------------------------------------------------- loss scaling


def test_why_loss_scaling_matters():
    """Gradients ~1e-8 vanish in float16, survive when scaled by 2**15, and survive in cbfloat16."""
    rng = np.random.default_rng(8)
    g = (1e-8 * np.exp(0.5 * rng.standard_normal(10_000)) * rng.choice([-1, 1], 10_000)).astype(np.float32)
    plain = P.quantize(g, "float16")
    assert (plain == 0).mean() > 0.9
    scale = np.float32(2.0 ** 15)
    scaled = P.quantize(g * scale, "float16") / scale
    assert (scaled == 0).mean() < 0.01
    np.testing.assert_allclose(scaled, g, rtol=2.0 ** -10)
    cb = P.quantize(g, "cbfloat16")
    assert (cb == 0).sum() == 0
    np.testing.assert_allclose(cb, g, rtol=2.0 ** -9)
    assert (P.quantize(g, "bfloat16") == 0).sum() == 0        # bf16's range too, at lower precision


def dynamic(**kwargs) -> P.LossScaler:
    return P.LossScaler("dynamic", **kwargs)


def grads(*values):
    return [{"weight": np.full((2, 2), v, np.float32), "bias": np.full(2, v, np.float32)} for v in values]


def test_scaler_skips_and_halves_on_nonfinite():
    s = dynamic(initial_scale=1024.0)
    for bad in (np.inf, -np.inf, np.nan):
        g = grads(2048.0, bad)
        before = s.scale
        assert s.unscale_and_check(g) is False
        assert g[0]["weight"][0, 0] == 2048.0 / before       # unscaled all the same, as torch's unscale_
        assert s.update(False) is False
        assert s.scale == before / 2
    g = grads(256.0, 128.0)
    assert s.unscale_and_check(g) is True
    assert g[0]["weight"][0, 0] == 2.0 and g[1]["bias"][0] == 1.0
    assert s.update(True) is True


def test_scaler_doubles_after_clean_steps_and_resets_on_overflow():
    s = dynamic(initial_scale=8.0, steps_per_increase=3)
    seen = []
    for ok in [True, True, True, True, True, False, True, True, True]:
        s.update(ok)
        seen.append(s.scale)
    assert seen == [8, 8, 16, 16, 16, 8, 8, 8, 16]


def test_scaler_clamps_to_min_and_max():
    s = dynamic(initial_scale=4.0, min_scale=1.0, max_scale=16.0, steps_per_increase=1)
    for _ in range(5):
        s.update(False)
    assert s.scale == 1.0
    for _ in range(10):
        s.update(True)
    assert s.scale == 16.0


def test_scaler_state_round_trip():
    s = dynamic(initial_scale=2.0 ** 15, steps_per_increase=5)
    for ok in [True, False, True, True]:
        s.update(ok)
    state = s.state_dict()
    assert state == {"scale": 2.0 ** 14, "good_steps": 2}
    assert all(type(v) in (int, float) for v in state.values())
    t = dynamic(initial_scale=2.0 ** 15, steps_per_increase=5)
    t.load_state_dict({k: np.asarray(v) for k, v in state.items()})   # as read back from an npz
    assert t.state_dict() == state
    for _ in range(3):
        s.update(True)
        t.update(True)
    assert s.scale == t.scale == 2.0 ** 15


def test_scaler_none_and_static_modes():
    none = P.LossScaler("none")
    assert none.scale == 1.0
    g = grads(3.0, np.nan)
    assert none.unscale_and_check(g) is False
    assert none.update(False) is True                        # plain float32 training applies every step
    assert g[0]["weight"][0, 0] == 3.0
    static = P.LossScaler("static", static_scale=128.0)
    g = grads(256.0)
    assert static.unscale_and_check(g) and g[0]["bias"][0] == 2.0
    assert static.update(False) is False and static.scale == 128.0
    for _ in range(5000):
        static.update(True)
    assert static.scale == 128.0
    assert static.scale_loss(np.float32(0.5)) == 64.0


def test_scaler_unscales_read_only_arrays_by_replacing_them():
    s = dynamic(initial_scale=4.0)
    ro = np.frombuffer(np.full(3, 8.0, np.float32).tobytes(), dtype=np.float32)
    g = [{"w": ro}]
    assert s.unscale_and_check(g)
    np.testing.assert_array_equal(g[0]["w"], [2.0, 2.0, 2.0])


def test_scaler_rejects_bad_config():
    for kwargs in ({"mode": "auto"}, {"mode": "dynamic", "steps_per_increase": 0},
                   {"mode": "dynamic", "min_scale": 4.0, "max_scale": 2.0},
                   {"mode": "dynamic", "initial_scale": 2.0 ** 30},
                   {"mode": "static", "static_scale": 0.0}):
        with pytest.raises(ValueError):
            P.LossScaler(**kwargs)

