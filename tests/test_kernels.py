"""The kernels (dropout masks, GELU, attention, the token loss) against central differences, in float64.

    python -m pytest tests/test_kernels.py -q

Each test builds a random scalar function L = sum(out * R) of the kernel's
output (R fixed random), so dL/dout = R, and compares the kernel's backward
with (L(a + h) - L(a - h)) / 2h for every input element. The layers built from
them are checked as lowered programs in tests/test_families.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from cs_runtime.numerics import hashing as H
from cs_runtime.numerics import kernels as K

from .test_model import assert_close, numeric_grad

RTOL = 1e-6


def rand(rng, *shape, scale=1.0):
    return rng.standard_normal(shape) * scale


def check(f, analytic, arr, what):
    assert_close(analytic, numeric_grad(f, arr), RTOL, what)


@pytest.mark.parametrize("kind", sorted(K.GELUS))
def test_gelu_matches_its_gradient_and_known_values(kind):
    gelu, grad = K.GELUS[kind]
    x = np.linspace(-4, 4, 41)
    assert_close(gelu(np.array([0.0, 10.0, -10.0])), [0.0, 10.0, 0.0], 1e-6, "gelu limits")
    numeric = (gelu(x + 1e-6) - gelu(x - 1e-6)) / 2e-6
    assert_close(grad(x), numeric, RTOL, f"{kind}'")


@pytest.mark.parametrize("kind", sorted(K.GELUS))
def test_gelus_gradient_at_minus_zero_is_its_gradient_at_zero(kind):
    """The exact GELU's Phi(-0.0) was 1.5 (1 - tail added for x >= 0 to a tail kept for the sign bit)."""
    grad = K.GELUS[kind][1]
    at_zero = grad(np.array([0.0, -0.0], np.float32))
    assert np.abs(at_zero - 0.5).max() < 1e-6   # the fit: within 2 ulp of 0.5 on either side
    assert abs(K.normal_cdf(np.array([-0.0]))[0] - 0.5) < 1e-7


def test_exact_gelus_c_loops_give_the_numpy_passes_bits(monkeypatch):
    """The exact GELU by the C loops (_gelu.c, numpy's exp between them) against the numpy
    passes, bit for bit: every float32 exponent with odd low bits, both tails, the kink,
    subnormals, signed zeros, infs and nans, arrays of several chunks and of one."""
    if K._gelu_loops is None:
        pytest.skip("the exact GELU's C loops are not built (no C compiler at install): the numpy path alone")
    rng = np.random.default_rng(8)
    sweep = np.arange(0, 2 ** 32, 65537, dtype=np.uint64).astype(np.uint32).view(np.float32)
    near = (rng.standard_normal(300_000) * rng.choice([1e-3, 1.0, 3.0, 9.0], 300_000)).astype(np.float32)
    special = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 3e38, -3e38, np.inf, -np.inf, np.nan], np.float32)
    by_loops = {}
    with np.errstate(all="ignore"):
        for name, x in (("many chunks", np.concatenate([sweep, near, special])), ("one chunk", near[:1000]),
                        ("2-d", near[:3000].reshape(30, 100)), ("empty", near[:0])):
            by_loops[name] = (x, K.gelu(x), K.gelu_grad(x), *K.gelu_and_grad(x))
        monkeypatch.setattr(K, "_gelu_loops", None)
        for name, (x, *got) in by_loops.items():
            want = (K.gelu(x), K.gelu_grad(x), *K.gelu_and_grad(x))
            for what, a, b in zip(("gelu", "gelu_grad", "gelu_and_grad[0]", "gelu_and_grad[1]"), got, want):
                assert a.shape == b.shape == x.shape and a.dtype == np.float32, (name, what)
                same = (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))
                assert same.all(), f"{name} {what}: differ at {x[~same][:3]}"


def test_exact_gelus_c_loops_round_each_float64_operation_as_numpy_does():
    """The float32 results hide most float64 differences, so the C loop with the long
    chain (the erfc polynomial, where a fused multiply-add would round once instead of
    twice) is checked on its float64 outputs, against the same operations in numpy."""
    if K._gelu_loops is None:
        pytest.skip("the exact GELU's C loops are not built (no C compiler at install)")
    x = (np.random.default_rng(9).standard_normal(100_000) * 3).astype(np.float32)
    t, tail_arg, density_arg = (np.empty(x.size) for _ in range(3))
    K._gelu_loops.prepare(x, t, tail_arg, density_arg)
    x64 = x.astype(np.float64)
    z = np.abs(x64) * K._SQRT_HALF
    want_t = 1.0 / (z * 0.5 + 1.0)
    poly = np.full_like(z, K._ERFC[-1])
    for c in K._ERFC[-2:0:-1]:
        poly = poly * want_t + c
    poly = poly * want_t + K._ERFC[0]
    for got, want in ((t, want_t), (tail_arg, poly - z * z), (density_arg, x64 * x64 * -0.5)):
        assert got.tobytes() == want.tobytes()


def test_embedding_and_layer_norm_forward_the_interpreter_runs():
    """The compiler's interpreter gives its embedding and layer_norm ops these meanings
    (their gradients are the op set's: tests/test_ops.py)."""
    rng = np.random.default_rng(2)
    tokens = np.array([[1, 3, 1], [0, 1, 2]])
    table, pos = rand(rng, 5, 4), rand(rng, 6, 4)
    out = K.embedding_forward(tokens, table, pos)
    assert np.array_equal(out[1, 2], table[2] + pos[2])
    with pytest.raises(ValueError, match="exceeds the 2 position"):
        K.embedding_forward(tokens, table, pos[:2])
    x = rand(rng, 2, 3, 6, scale=3.0)
    y, _ = K.layer_norm_forward(x, np.ones(6), np.zeros(6), 1e-5)
    assert np.allclose(y.mean(-1), 0, atol=1e-12) and np.allclose(y.std(-1), 1, atol=1e-5)


@pytest.mark.parametrize("causal,padded,dropped", [(True, False, False), (False, True, False),
                                                    (True, True, True), (False, False, True)])
def test_attention_matches_finite_differences(causal, padded, dropped):
    rng = np.random.default_rng(4)
    b, t, d, heads = 2, 4, 6, 2
    qkv, r = rand(rng, b, t, 3 * d), rand(rng, b, t, d)
    keep = np.array([[True] * 4, [True, True, True, False]]) if padded else None
    drop = (rng.random((b, heads, t, t)) > 0.3) / 0.7 if dropped else None
    f = lambda: float((K.attention_forward(qkv, heads, causal, keep, drop)[0] * r).sum())  # noqa: E731
    _, cache = K.attention_forward(qkv, heads, causal, keep, drop)
    check(f, K.attention_backward(r, cache), qkv, "qkv")


def test_attention_masks_what_it_must():
    rng = np.random.default_rng(5)
    qkv = rand(rng, 1, 4, 6)
    _, cache = K.attention_forward(qkv, 1, causal=True)
    assert np.allclose(np.triu(cache.probs[0, 0], 1), 0) and np.allclose(cache.probs.sum(-1), 1)
    keep = np.array([[True, True, False, False]])
    out, cache = K.attention_forward(qkv, 1, causal=False, key_keep=keep)
    assert np.allclose(cache.probs[..., 2:], 0)
    # What a padding key holds cannot change any output.
    changed = qkv.copy()
    changed[0, 2:, 4:] += 100.0  # the values of the padding keys
    assert np.allclose(K.attention_forward(changed, 1, causal=False, key_keep=keep)[0], out)


def test_token_cross_entropy_ignores_labels_and_matches_finite_differences():
    rng = np.random.default_rng(6)
    logits = rand(rng, 2, 3, 5)
    labels = np.array([[1, K.IGNORE_INDEX, 4], [0, 2, 3]])
    loss, dlogits, correct, loss_sum, count = K.token_cross_entropy(logits, labels, 0.25)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    token = -np.take_along_axis(logp, np.maximum(labels, 0)[..., None], -1)[..., 0]
    assert count == 5 and abs(loss_sum - (token.sum() - token[0, 1])) < 1e-12
    # the labelled tokens' sum times the one weight
    assert abs(loss - (token.sum() - token[0, 1]) * 0.25) < 1e-12
    kept = labels != K.IGNORE_INDEX
    assert correct == int(((logits.argmax(-1) == labels) & kept).sum())
    check(lambda: K.token_cross_entropy(logits, labels, 0.25)[0], dlogits, logits, "logits")
    assert not dlogits[0, 1].any()
    # two shards add up to the whole
    halves = [K.token_cross_entropy(logits[r], labels[r], 0.25)[0] for r in (slice(0, 1), slice(1, 2))]
    assert abs(sum(halves) - loss) < 1e-12
    with pytest.raises(ValueError, match="labels outside"):
        K.token_cross_entropy(logits, np.full((2, 3), 5), 1.0)


def test_token_loss_weights_are_the_model_zoos_normalisers():
    assert K.token_loss_weight("batch_size", 0.058, 8, None) == 0.058 / 8   # mlm_loss_weight / batch
    for scaling in ("num_tokens", "num_masked", "precomputed_num_masked"):
        assert K.token_loss_weight(scaling, 0.058, 8, 20) == 1 / 20         # the batch's labelled tokens
    with pytest.raises(ValueError, match="needs the number of labelled tokens"):
        K.token_loss_weight("num_masked", 1.0, 8, None)
    with pytest.raises(ValueError, match="unknown loss scaling"):
        K.token_loss_weight("per_sample", 1.0, 8, 20)


def test_dropout_masks_are_per_sample_whatever_the_shard():
    key = K.hash_key(1, 2, 3, 0)
    whole = K.keep_mask(key, slice(0, 8), (4, 5), 0.25, np.float32)
    assert set(np.unique(whole)) <= {0.0, np.float32(1 / 0.75)}
    assert 0.1 < (whole == 0).mean() < 0.4
    assert np.array_equal(K.keep_mask(key, slice(3, 6), (4, 5), 0.25, np.float32), whole[3:6])
    assert not np.array_equal(K.keep_mask(K.hash_key(1, 3, 3, 0), slice(0, 8), (4, 5), 0.25, np.float32), whole)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_dropout_keep_mask_is_the_draws_compared_with_p(dtype):
    """keep_mask (in chunks, compared on the integers) gives the bits of the plain formula:
    (hash_uniform >= float32(p)) as dtype, times 1/(1-p); several chunks, p at the edges."""
    key = K.hash_key(3, 5, 7, 11)
    for rows, per_sample in ((slice(0, 3), (5, 7)), (slice(7, 9), (40000,)), (slice(2, 4), (4, 128, 128))):
        for p in (0.0, 0.1, 1 / 3, 0.5, 1e-7, 0.9999):
            want = (H.hash_uniform(key, rows, per_sample) >= np.float32(p)).astype(dtype) * dtype(1.0 / (1.0 - p))
            got = K.keep_mask(key, rows, per_sample, p, dtype)
            assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


def test_splitmix64_in_place_rounds_equal_the_python_int_finaliser():
    """The array finaliser (its rounds shared with keep_mask) against the plain-int one, and
    splitmix64's published first output for the state 0."""
    x = np.array([0, 1, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15, 12345678901234567], dtype=np.uint64)
    assert [int(v) for v in H.splitmix64(x)] == [H._splitmix64_int(int(v)) for v in x]
    assert int(H.splitmix64(np.zeros(1, np.uint64))[0]) == 0xE220A8397B1DCDAF


@pytest.mark.parametrize("global_batch, width, rows, p", [
    (128, 256, slice(0, 128), 0.1), (7, 33, slice(2, 5), 0.3), (5, 3, slice(0, 5), 0.0),
    (1, 1, slice(0, 1), 0.5), (9, 4, slice(4, 9), 1 - 1e-9)])
@pytest.mark.parametrize("path", ["C loop", "numpy"])
def test_rows_keep_mask_is_the_generator_float_draws_compared_with_p(global_batch, width, rows, p, path,
                                                                     monkeypatch):
    """rows_keep_mask works on the PCG64 bits; the mask is that of the float32 draws themselves,
    by the C loop (_masks.c, where built) and by the numpy path."""
    if path == "numpy":
        monkeypatch.setattr(K, "_mask_loops", None)
    elif K._mask_loops is None:
        pytest.skip("the dropout mask's C loop is not built (no C compiler at install)")
    draws = np.random.default_rng([11, 3, 2, 104729]).random((global_batch, width), dtype=np.float32)[rows]
    expected = (draws >= p).astype(np.float32) / np.float32(1.0 - p)
    got = K.rows_keep_mask(11, 3, 2, global_batch, width, rows, p)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_the_mask_loop_gives_the_numpy_paths_bits(monkeypatch):
    """_masks.c's SeedSequence, PCG64 and mask against numpy's, bit for bit: seeds of one, two
    and three 32-bit words, zero, any step and layer, row ranges starting on odd words, empty
    ones, every probability kind (0, tiny, 1/2, near 1), and p = 1 (left to numpy)."""
    if K._mask_loops is None:
        pytest.skip("the dropout mask's C loop is not built (no C compiler at install)")
    rng = np.random.default_rng(5)
    cases = [(int(rng.choice([0, 1, 2**31, 2**32, 2**40 + 5, 2**64 + 3, int(rng.integers(0, 2**62))])),
              int(rng.integers(0, 10**7)), int(rng.integers(0, 50)), int(rng.integers(1, 30)),
              int(rng.integers(1, 30)), float(rng.choice([0.0, 1e-9, 0.5, 0.999, 1.0, float(rng.random())])))
             for _ in range(300)]
    cases += [(1, 5, 3, 512, 2048, 0.1)]
    by_loop = []
    for seed, step, layer, batch, width, p in cases:
        start = int(rng.integers(0, batch + 1))
        rows = slice(start, int(rng.integers(start, batch + 2)))
        by_loop.append((seed, step, layer, batch, width, rows, p))
    with np.errstate(invalid="ignore"):   # p = 1: 0 / 0, as the float rule gives
        got = [K.rows_keep_mask(*case) for case in by_loop]
        monkeypatch.setattr(K, "_mask_loops", None)
        for case, mask in zip(by_loop, got):
            want = K.rows_keep_mask(*case)
            assert mask.shape == want.shape and mask.dtype == np.float32, case
            assert np.array_equal(mask.view(np.uint32), want.view(np.uint32)), case
