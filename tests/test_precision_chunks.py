"""The chunked 16-bit conversions against numpy's own float16 conversion, an independent oracle.

float16 shares the integer rounding path of bfloat16 and cbfloat16 (_encode,
_decode), so numpy's half type checks that path bit for bit: normals, ties,
subnormals, zeros, overflow, inf and nan, in arrays spanning several chunks
whose rare values sit in some chunks and not others."""
import numpy as np
import pytest

from cs_runtime.numerics import precision
from cs_runtime.numerics.precision import _CHUNK, _SPECS, _decode, _encode, from_bits, to_bits

HALF = _SPECS["float16"]
# Each test runs on both paths of the conversions: the C loops and the numpy passes (conftest.py).
pytestmark = pytest.mark.usefixtures("conversion_path")


def _patterns() -> np.ndarray:
    rng = np.random.default_rng(7)
    sweep = np.arange(0, 2 ** 32, 65537, dtype=np.uint64).astype(np.uint32)   # every exponent, odd low bits
    k = rng.integers(0, 2 ** 31, 200_000, dtype=np.uint64).astype(np.uint32)
    ties = (k & ~np.uint32(0x1FFF)) | np.uint32(0x1000)                      # exactly halfway for float16
    chunk_of_normals = (rng.standard_normal(_CHUNK) + 3).astype(np.float32).view(np.uint32)
    bits = np.concatenate([chunk_of_normals, sweep, ties, ties + 1, ties - 1, chunk_of_normals])
    return bits.view(np.float32)


def test_encode_matches_numpy_float16_bit_for_bit():
    x = _patterns()
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    got = _encode(x, HALF)
    assert x.size > 3 * _CHUNK
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} differ, first {x[bad[:3]]}: {got[bad[:3]]} != {want[bad[:3]]}"


def test_decode_matches_numpy_float16_on_every_pattern_and_across_chunks():
    patterns = np.tile(np.arange(2 ** 16, dtype=np.uint16), 2)
    want = patterns.view(np.float16).astype(np.float32).view(np.uint32)
    assert np.array_equal(_decode(patterns, HALF).view(np.uint32), want)
    assert np.array_equal(from_bits(patterns.view(np.float16), "float16").view(np.uint32), want)


def test_odd_shapes_and_layouts_keep_their_shape_and_values():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3 * _CHUNK // 100 + 7, 100)).astype(np.float32).T   # not contiguous
    for fmt in ("float16", "bfloat16", "cbfloat16"):
        bits = to_bits(x, fmt)
        assert bits.shape == x.shape and bits.dtype == precision.wire_dtype(fmt)
        back = from_bits(bits, fmt)
        assert back.shape == x.shape
        assert np.array_equal(to_bits(back, fmt).view(np.uint16), bits.view(np.uint16))   # values of fmt: exact
        # half an ulp at most: relative for normal values, half the least subnormal below them
        ulp_bound = np.maximum(np.abs(x) * 2.0 ** -(_SPECS[fmt].man_bits), precision.min_subnormal(fmt) / 2)
        assert np.all(np.abs(back - x) <= ulp_bound)
    assert to_bits(np.float32(1.5), "cbfloat16").shape == ()
    assert to_bits(np.zeros((0, 4), np.float32), "bfloat16").shape == (0, 4)


def _with_nans(x: np.ndarray) -> np.ndarray:
    """x with nans of every kind (quiet, signalling, negative, all-ones) in some chunks only."""
    bits = x.view(np.uint32).copy()
    nans = np.array([0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF, 0xFF800001, 0x7FFF8000], np.uint32)
    bits[5:5 + nans.size] = nans
    bits[2 * _CHUNK + 3:2 * _CHUNK + 3 + nans.size] = nans
    return bits.view(np.float32)


def test_bfloat16_fast_path_matches_the_general_encoder():
    """to_bits(bfloat16) takes a shorter path than _encode: the same patterns, nans and all."""
    x = _with_nans(_patterns())
    with np.errstate(invalid="ignore"):
        want = _encode(x, _SPECS["bfloat16"])
    got = to_bits(x, "bfloat16")
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} differ, first bits {x.view(np.uint32)[bad[:3]]}: {got[bad[:3]]} != {want[bad[:3]]}"


def test_bfloat16_numpy_path_and_ml_dtypes_path_agree():
    """Both bfloat16 encoders (the numpy passes, and ml_dtypes' cast where it is installed)
    give the general encoder's patterns: ties with bfloat16's 16 dropped bits, subnormals,
    nans and all, into fresh arrays and into given buffers."""
    k = np.random.default_rng(3).integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)
    ties = (k & ~np.uint32(0xFFFF)) | np.uint32(0x8000)
    x = _with_nans(np.concatenate([_patterns().view(np.uint32), ties, ties + 1, ties - 1]).view(np.float32))
    with np.errstate(invalid="ignore"):
        want = _encode(x, _SPECS["bfloat16"])
    encoders = [precision._encode_bfloat16]
    if precision._ML_BFLOAT16 is not None:
        encoders.append(precision._encode_bfloat16_ml)
    for encode in encoders:
        assert np.array_equal(encode(x), want), encode.__name__
        out = np.empty(x.shape, np.uint16)
        assert encode(x, out) is out and np.array_equal(out, want), encode.__name__


def test_out_buffers_get_the_same_patterns_and_values():
    x = _with_nans(_patterns()).reshape(-1, 4)
    for fmt in ("float32", "float16", "bfloat16", "cbfloat16"):
        with np.errstate(invalid="ignore"):
            want = to_bits(x, fmt)
            out = np.empty(x.shape, precision.wire_dtype(fmt))
            assert to_bits(x, fmt, out=out) is out
        assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), fmt
        widened = np.empty(x.shape, np.float32)
        assert from_bits(want, fmt, out=widened) is widened
        assert np.array_equal(widened.view(np.uint32), from_bits(want, fmt).view(np.uint32)), fmt
    try:
        to_bits(x, "bfloat16", out=np.empty(x.shape, np.float16))
    except ValueError as exc:
        assert "uint16" in str(exc)
    else:
        raise AssertionError("a buffer of the wrong dtype was taken")


def test_add_from_bits_is_widen_then_add():
    rng = np.random.default_rng(11)
    n = 2 * precision._ADD_BLOCK + 123                                    # several blocks, a short last one
    for fmt in ("float16", "bfloat16", "cbfloat16"):
        a = to_bits((rng.standard_normal(n) * 1e-3).astype(np.float32), fmt)
        b = to_bits((rng.standard_normal(n) * 1e-3).astype(np.float32), fmt)
        want = from_bits(a, fmt) + from_bits(b, fmt)
        total = from_bits(a, fmt)
        assert precision.add_from_bits(total, b, fmt) is total
        assert np.array_equal(total.view(np.uint32), want.view(np.uint32)), fmt


def test_float16_is_numpy_half_where_small_and_normal_values_mix():
    """Zeros, subnormal results and normals side by side in every chunk (a relu's
    outputs, small gradients): the branch-free select must pick per element."""
    rng = np.random.default_rng(12)
    n = 3 * _CHUNK + 17
    x = (rng.standard_normal(n) * np.exp2(rng.uniform(-27, -10, n))).astype(np.float32)
    x[rng.random(n) < 0.4] = 0.0
    x[::7] *= -1
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    for fmt_bits in (to_bits(x, "float16").view(np.uint16), _encode(x, HALF)):
        bad = np.flatnonzero(fmt_bits != want)
        assert bad.size == 0, f"{bad.size} differ, first {x[bad[:3]]}"


def test_quantize_is_encode_then_decode_bit_for_bit():
    """quantize rounds on the float32 bits without the 16-bit patterns (precision._round):
    the same bits as the encoder then the decoder, over every exponent, ties, subnormals of
    each format, overflow, zeros of both signs, and chunks with and without inf and nan."""
    rng = np.random.default_rng(11)
    relu = np.maximum(rng.standard_normal(3 * _CHUNK).astype(np.float32), 0)
    tiny = (rng.standard_normal(3 * _CHUNK) * 1e-6).astype(np.float32)   # float16's subnormal range
    mixed = relu.copy()
    mixed[_CHUNK + 5], mixed[2 * _CHUNK + 9] = np.nan, -np.inf
    for fmt, spec in _SPECS.items():
        drop = 23 - spec.man_bits
        k = rng.integers(0, 0x7F800000 >> drop, 100_000, dtype=np.uint64).astype(np.uint32) << np.uint32(drop)
        ties = k | np.uint32(1 << (drop - 1))
        near = np.arange(-3000, 3000, dtype=np.int64)
        edges = [(np.float32(2.0) ** e).view(np.uint32) + near for e in (1 - spec.bias, 2 ** (spec.exp_bits - 1))]
        edges = np.clip(np.concatenate(edges), 0, 0x7F7FFFFF).astype(np.uint32)
        for x in (_patterns(), -_patterns(), ties.view(np.float32), (ties | np.uint32(1 << 31)).view(np.float32),
                  edges.view(np.float32), -edges.view(np.float32), relu, tiny, mixed,
                  np.full(_CHUNK + 3, -0.0, np.float32), relu.reshape(96, -1)[:, ::3]):
            with np.errstate(over="ignore", invalid="ignore"):
                want = from_bits(to_bits(x, fmt), fmt)
            got = precision.quantize(x, fmt)
            assert got.shape == x.shape and got.dtype == np.float32
            bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
            assert bad.size == 0, f"{fmt}: {bad.size} differ, first {x.reshape(-1)[bad[:3]]}"


def _small_only(fmt: str) -> np.ndarray:
    """float32 values a chunk holds where the one-addition path (_Magic) takes it: below the
    format's largest finite binade, with zeros and subnormals: every finite pattern of the
    format up to there, the halfways between neighbours and a float32 ulp either side,
    float32 subnormals, signed zeros, and random magnitudes over the whole range."""
    spec, magic = _SPECS[fmt], precision._MAGIC[_SPECS[fmt]]
    patterns = np.arange(0, 1 << 15, dtype=np.uint16)
    values = from_bits(patterns, fmt)
    values = values[np.isfinite(values) & (values.view(np.uint32) < magic.rare_from)]
    halfway = ((values[:-1].astype(np.float64) + values[1:]) / 2).astype(np.float32)
    near = [halfway.view(np.uint32) + d for d in (np.uint32(1), np.uint32(0) - np.uint32(1))]
    rng = np.random.default_rng(11)
    random = np.exp2(rng.uniform(-160, (magic.rare_from >> 23) - 127, 100_000)).astype(np.float32)
    tiny = np.arange(0, 1 << 23, 4099, dtype=np.uint32).view(np.float32)     # float32 subnormals
    zeros = np.array([0.0, -0.0], np.float32)
    x = np.concatenate([values, halfway, *(n.view(np.float32) for n in near), random, tiny, zeros])
    x = x[(x.view(np.uint32) & np.uint32(0x7FFFFFFF)) < magic.rare_from]
    assert 1 << spec.man_bits < x.size <= 4 * _CHUNK
    return np.concatenate([x, -x])


def _by_the_integer_path(fn, x: np.ndarray, fmt: str) -> np.ndarray:
    """fn(x) with each chunk sent down the integer path: a value at the largest finite binade
    in every chunk (its own result dropped)."""
    big = np.float32(2.0 ** ((precision._MAGIC[_SPECS[fmt]].rare_from >> 23) - 127))
    step = _CHUNK - 1
    pieces = [np.append(x[i:i + step], big) for i in range(0, x.size, step)]
    return np.concatenate([fn(p)[:-1] for p in pieces])


@pytest.mark.parametrize("fmt", ["float16", "cbfloat16"])
def test_the_one_addition_path_has_the_integer_paths_bits(fmt):
    """Chunks that hold zeros or subnormals (and nothing that could overflow) are rounded and
    encoded by one float32 addition (precision._Magic); the patterns and the rounded values
    are the integer path's, bit for bit (and numpy's half type's, for float16)."""
    x = _small_only(fmt)
    got_bits, got_values = to_bits(x, fmt), precision.quantize(x, fmt)
    want_bits = _by_the_integer_path(lambda a: to_bits(a, fmt), x, fmt)
    want_values = _by_the_integer_path(lambda a: precision.quantize(a, fmt), x, fmt)
    assert np.array_equal(got_bits.view(np.uint16), want_bits.view(np.uint16))
    assert np.array_equal(got_values.view(np.uint32), want_values.view(np.uint32))
    assert np.array_equal(from_bits(got_bits, fmt).view(np.uint32), got_values.view(np.uint32))
    if fmt == "float16":
        assert np.array_equal(got_bits.view(np.uint16), x.astype(np.float16).view(np.uint16))

