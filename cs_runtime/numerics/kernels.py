"""Numpy kernels behind the op set (ops.py): dropout masks, random draws, GELU, attention,
the token loss and the forward pieces its ops are written with.

    out, cache = attention_forward(qkv, heads, causal, key_keep, drop)
    dqkv = attention_backward(dout, cache)

Every kernel works in the dtype it is given (float64 in the gradient tests,
float32 in training). tests/test_kernels.py checks each backward against
central differences.

Dropout masks, and a captured model's random draws (sample_draws), come from
a counter-based hash, not a sequential generator: the element of (key, global
sample row, position) is a pure function of those numbers, so a sample gets
the same mask or draw whichever WSE (or replica) holds it, and no process
draws more random numbers than its own rows need.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from cs_runtime.numerics import compiled, parallel
from cs_runtime.numerics.batch_check import IGNORE_INDEX
from cs_runtime.numerics.hashing import GOLDEN, hash_key, splitmix64, splitmix64_rounds

MASKED_SCORE = -1e9     # attention score of a key a query may not see

# ---------------------------------------------------------------- dropout masks (hashing.py's draws)

def keep_mask(key: np.uint64, rows: slice, per_sample: tuple[int, ...], p: float, dtype) -> np.ndarray:
    """Dropout's scaled keep-mask (0 or 1/(1-p)) for `rows` of a global batch: element
    (r, j) kept where hash_uniform's draw is >= p, the same bits as
    `(hash_uniform(key, rows, per_sample) >= float32(p)).astype(dtype) * dtype(1/(1-p))`.

    Done in chunks and in place, since masks are drawn for every dropout site every
    step (a fifth of GPT-2's step before): a draw is 24 bits times 2**-24, exact in
    float32, so `draw >= float32(p)` is `bits >= ceil(float32(p) * 2**24)` on the integers."""
    n = int(np.prod(per_sample))
    start, stop = rows.start, rows.stop
    out = np.empty((stop - start) * n, dtype=dtype)
    threshold = math.ceil(float(np.float32(p)) * 2.0 ** 24)
    # z >> 40 >= threshold, compared without the shift (p = 1: nothing is kept, as before)
    keep_from = np.uint64(threshold << 40) if threshold < 1 << 24 else None
    scale = dtype(1.0 / (1.0 - p))

    def fill(lo: int, hi: int, z: np.ndarray, t: np.ndarray, keep: np.ndarray) -> None:
        first = start * n + lo                       # counters start*n + i: row r's element j is r*n + j
        z[:] = np.arange(first, first + hi - lo, dtype=np.uint64)
        z ^= key
        z += GOLDEN                                 # splitmix64, in place in z
        splitmix64_rounds(z, t, top_bits_only=True)   # 24 random bits: z's top ones
        if keep_from is None:
            keep[:] = False
        else:
            np.greater_equal(z, keep_from, out=keep)
        np.multiply(keep, scale, out=out[lo:hi], dtype=dtype)
    # a chunk at a time: its uint64 passes stay in the cache (a GPT-2 block's masks are
    # ~4M elements, 32 MB a pass)
    parallel.in_chunks(out.size, fill, lambda size: (np.empty(size, np.uint64), np.empty(size, np.uint64),
                                                     np.empty(size, bool)))
    return out.reshape((stop - start, *per_sample))


def sample_keep_mask(seed: int, step: int, site: int, rows: slice, shape: tuple[int, ...], p: float,
                     dtype=np.float32) -> np.ndarray:
    """A captured model's dropout site's scaled keep-mask of `shape` for `rows` of the global
    batch of `step`: each sample's elements in C order, a function of (seed, step, site, the
    sample's row, the element's index in the sample) and nothing else (not of the shard)."""
    n = int(np.prod(shape, dtype=np.int64))
    count = rows.stop - rows.start
    if count <= 0 or n % count:
        raise ValueError(f"dropout mask of shape {tuple(shape)} for {count} rows of the batch: "
                         "its elements do not split into the rows")
    key = hash_key(seed, step, site, 0)
    return keep_mask(key, rows, (n // count,), p, dtype).reshape(shape)


# A captured model's draws (rand, randn, randperm) hash (seed, step, site, DRAW_STREAM): keys
# of their own, apart from its dropout sites' (seed, step, site, 0).
DRAW_STREAM = 0x52414E44
DRAWS = ("uniform", "normal", "permutation")


def sample_draws(seed: int, step: int, site: int, rows: slice, shape: tuple[int, ...], dist: str,
                 dtype=np.float32) -> np.ndarray:
    """A captured model's random draw of `shape` for `rows` of the global batch of `step`: each
    sample's elements in C order, element j of row r a function of (seed, step, site, r, j)
    alone, so any shard draws what the whole batch draws for its rows (a value without the
    batch is drawn as one row, 0: the same on every shard). `dist`: "uniform" on [0, 1)
    (24 random bits in float32, as torch.rand; 53 in float64), "normal" (Box-Muller on one
    64-bit draw's halves, in float64, then rounded to dtype), or "permutation" of the
    `shape[0]` elements (int64, the order that sorts their draws; torch.randperm)."""
    n = int(np.prod(shape, dtype=np.int64))
    count = rows.stop - rows.start
    if count <= 0 or n % count:
        raise ValueError(f"a draw of shape {tuple(shape)} for {count} rows of the batch: its elements do not "
                         "split into the rows")
    per_sample = n // count
    counters = (np.arange(rows.start * per_sample, rows.stop * per_sample, dtype=np.uint64)
                ^ hash_key(seed, step, site, DRAW_STREAM))
    bits = splitmix64(counters)
    if dist == "permutation":
        return np.argsort(bits, kind="stable").astype(np.int64).reshape(shape)
    if dist == "uniform":
        if np.dtype(dtype) == np.float64:
            return ((bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53).reshape(shape)
        return ((bits >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)).astype(dtype).reshape(shape)
    if dist != "normal":
        raise ValueError(f"a draw from {dist!r} (known: {', '.join(DRAWS)})")
    u1 = ((bits >> np.uint64(32)).astype(np.float64) + 0.5) * 2.0 ** -32     # (0, 1): its log is finite
    u2 = (bits & np.uint64(0xFFFFFFFF)).astype(np.float64) * 2.0 ** -32
    return (np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)).astype(dtype).reshape(shape)


def rows_keep_mask(seed: int, step: int, layer_index: int, global_batch: int, width: int,
                   rows: slice, p: float) -> np.ndarray:
    """A dense layer's scaled keep-mask (0 or 1/(1-p)) for `rows` of the global batch of
    `step`: drawn for the whole global batch by a generator seeded by (seed, step, layer)."""
    # The draws of default_rng(...).random(dtype=float32), from their bits: each is the next
    # 32 bits of PCG64 (a 64-bit output's low half, then its high half) >> 8, times 2**-24,
    # exact in float32; so `draw >= float32(p)` is `bits >> 8 >= ceil(float32(p) * 2**24)`
    # on the integers, that is `bits >= threshold * 2**8`, and the floats are never made
    # (a third less time, the same mask).
    entropy = (seed, step, layer_index, 104729)
    threshold = min(max(math.ceil(float(np.float32(p)) * 2.0 ** 24), 0), 1 << 24)
    start, stop, stride = rows.indices(global_batch) if isinstance(rows, slice) else (0, 0, 0)
    if _mask_loops is not None and threshold < 1 << 24 and stride == 1 and min(entropy) >= 0:
        out = np.empty((max(stop - start, 0), width), np.float32)
        _mask_loops.rows_keep_mask(_seed_words(entropy), width, start, out, threshold << 8,
                                   float(np.float32(1.0) / np.float32(1.0 - p)))
        return out
    bits = np.random.PCG64(np.random.SeedSequence(list(entropy)))
    count = global_batch * width
    draws = bits.random_raw((count + 1) // 2).view(np.uint32)[:count].reshape(global_batch, width)[rows]
    if threshold == 1 << 24:   # nothing kept (p = 1: 0 / 0, as the float rule gives)
        return np.divide(np.zeros(draws.shape, bool), np.float32(1.0 - p), dtype=np.float32)
    # 1 times the float32 1 / (1 - p) is that quotient's bits, as dividing a kept 1 by (1 - p) gives
    return np.multiply(draws >= np.uint32(threshold << 8), np.float32(1.0) / np.float32(1.0 - p), dtype=np.float32)


# optional: rows_keep_mask's generator and mask as one C call (_masks.c), the same bits
_mask_loops = compiled.load("_masks", api=1)


def mask_path() -> str:
    """How this install draws a dense layer's dropout mask: "C loops" (_masks.c, built by
    setup.py where a C compiler was found) or "numpy" (the same bits, slower)."""
    return "numpy" if _mask_loops is None else "C loops"


def _seed_words(values: tuple[int, ...]) -> np.ndarray:
    """The uint32 words numpy's SeedSequence makes of these non-negative ints: each one's
    32-bit words, low first (0: one word)."""
    words = []
    for value in map(int, values):
        words.append(value & 0xFFFFFFFF)
        value >>= 32
        while value:
            words.append(value & 0xFFFFFFFF)
            value >>= 32
    return np.array(words, np.uint32)


# ---------------------------------------------------------------- GELU

# GELU, x * Phi(x), in two forms (as torch and the model zoo name them):
# "gelu" is exact (erf; torch's nn.GELU() default, HF BERT's hidden_act), and
# "gelu_new" / "gelu_tanh" is the tanh approximation (GPT-2's gelu_new, torch's
# GELU(approximate="tanh")). They differ by up to 1e-3 (around |x| = 2).

_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
# erfc(z) = t * exp(-z^2 + P(t)), t = 1 / (1 + z/2), z >= 0: a Chebyshev fit with
# relative error below 1.2e-7 everywhere (Numerical Recipes' erfcc). numpy has
# no erf, and scipy is no dependency; float32 keeps 6e-8, so this is ~2 ulp.
_ERFC = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
         0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277)


# optional: the float64 passes as C loops (_gelu.c), numpy's exp between them: the same bits
_gelu_loops = compiled.load("_gelu", api=1)
if _gelu_loops is not None:
    _gelu_loops.coefficients(_ERFC, _SQRT_HALF, _INV_SQRT_2PI)


def _half_erfc_nonnegative(z: np.ndarray) -> np.ndarray:
    """erfc(z) / 2 for float64 z >= 0, overwriting z (in place: each pass is one
    array, not a new one)."""
    t = np.multiply(z, 0.5)
    t += 1.0
    np.divide(1.0, t, out=t)   # np.reciprocal's result, by a vectorised loop (3x faster)
    poly = np.full_like(z, _ERFC[-1])
    for c in _ERFC[-2:0:-1]:
        poly *= t
        poly += c
    poly *= t
    poly += _ERFC[0]
    np.square(z, out=z)
    poly -= z
    np.exp(poly, out=poly)
    poly *= t
    poly *= 0.5
    return poly


def normal_cdf(x: np.ndarray) -> np.ndarray:
    """Phi(x) in float64, relatively accurate in both tails (no 1 - erf cancellation)."""
    x = np.asarray(x)
    z = np.abs(x, dtype=np.float64)
    z *= _SQRT_HALF
    tail = _half_erfc_nonnegative(z)
    # x < 0: the tail itself; x >= 0: 1 - tail (np.where's out= with where= is 20x slower).
    # The sign bit says which was flipped, -0.0's included (x >= 0 would add 1 to its +0.5).
    np.copysign(tail, -x, out=tail)
    tail += np.signbit(tail)
    return tail


def _in_float64(fn, x: np.ndarray) -> np.ndarray:
    """fn (float64 in, float64 out) over x a cache-sized chunk at a time, in x's dtype."""
    return parallel.map_chunks(lambda chunk: fn(chunk.astype(np.float64)), x)


def _gelu64(x: np.ndarray) -> np.ndarray:
    cdf = normal_cdf(x)
    cdf *= x
    return cdf


def _gelu_grad64(x: np.ndarray) -> np.ndarray:
    density = np.square(x)
    density *= -0.5
    np.exp(density, out=density)
    density *= _INV_SQRT_2PI
    density *= x
    density += normal_cdf(x)
    return density


def _gelu_and_grad64(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(_gelu64(x), _gelu_grad64(x)), the same operations in the same order, Phi(x) made once."""
    cdf = normal_cdf(x)
    slope = np.square(x)
    slope *= -0.5
    np.exp(slope, out=slope)
    slope *= _INV_SQRT_2PI
    slope *= x
    slope += cdf
    cdf *= x
    return cdf, slope


def gelu_path() -> str:
    """How this install runs the exact GELU's float64 passes: "C loops" (_gelu.c, built by
    setup.py where a C compiler was found) or "numpy" (the same bits, slower)."""
    return "numpy" if _gelu_loops is None else "C loops"


def _by_loops(x: np.ndarray) -> bool:
    return _gelu_loops is not None and x.dtype == np.float32


# The C loops' chunk: a quarter of parallel.CHUNK, so that a chunk's three float64 scratch
# arrays (768 KB) stay in the core's L2 between the loops and numpy's exps. 800K elements
# (ViT's MLP activation), CPU ms, median of 8: 3.82 at 2**17, 3.16 at 2**15, 3.35 at 2**13.
GELU_LOOP_CHUNK = 1 << 15


def _gelu_and_grad_by_loops(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """_gelu_and_grad64's results in float32, by the C loops (_gelu.c) and numpy's exp, a
    chunk at a time: the same operations in the same order, so the same bits."""
    flat = np.ascontiguousarray(x).reshape(-1)
    values, slopes = np.empty_like(flat), np.empty_like(flat)

    def chunk(start: int, stop: int, t, tail, density) -> None:
        _gelu_loops.prepare(flat[start:stop], t, tail, density)
        np.exp(tail, out=tail)
        np.exp(density, out=density)
        _gelu_loops.finish(flat[start:stop], t, tail, density, values[start:stop], slopes[start:stop])
    parallel.in_chunks(flat.size, chunk, lambda size: tuple(np.empty(size, np.float64) for _ in range(3)),
                       chunk=GELU_LOOP_CHUNK)
    return values.reshape(x.shape), slopes.reshape(x.shape)


def gelu(x: np.ndarray) -> np.ndarray:
    """Exact GELU: x * Phi(x) (evaluated in float64, returned in x's dtype)."""
    if _by_loops(x):
        return _gelu_and_grad_by_loops(x)[0]
    return _in_float64(_gelu64, x)


def gelu_grad(x: np.ndarray) -> np.ndarray:
    """d/dx x * Phi(x) = Phi(x) + x * phi(x)."""
    if _by_loops(x):
        return _gelu_and_grad_by_loops(x)[1]
    return _in_float64(_gelu_grad64, x)


def gelu_and_grad(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(gelu(x), gelu_grad(x)), bit for bit, in one pass: what a training step's forward
    computes, so that its backward only multiplies (ops.py's gelu residual)."""
    if _by_loops(x):
        return _gelu_and_grad_by_loops(x)
    return parallel.map_chunks_pair(lambda chunk: _gelu_and_grad64(chunk.astype(np.float64)), x)


_C = 0.7978845608  # sqrt(2 / pi)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation (GPT-2's gelu_new)."""
    return 0.5 * x * (1.0 + np.tanh(_C * (x + 0.044715 * (x * x * x))))


def gelu_tanh_grad(x: np.ndarray) -> np.ndarray:
    t = np.tanh(_C * (x + 0.044715 * (x * x * x)))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * x * x)


# activation name -> (forward, derivative from the pre-activation)
GELUS = {"gelu": (gelu, gelu_grad), "gelu_new": (gelu_tanh, gelu_tanh_grad),
         "gelu_tanh": (gelu_tanh, gelu_tanh_grad)}


def activate(kind: str, z: np.ndarray) -> np.ndarray:
    """A built-in layer's activation by name."""
    if kind == "relu":
        return np.maximum(z, 0.0)
    if kind == "tanh":
        return np.tanh(z)
    if kind == "sigmoid":
        return 1.0 / (1.0 + np.exp(-z))
    if kind in GELUS:
        return GELUS[kind][0](z)
    return z


# ---------------------------------------------------------------- embedding

def embedding_forward(tokens: np.ndarray, table: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Token plus learned position embedding: [B, T] ids -> [B, T, D]."""
    seq = tokens.shape[1]
    if seq > positions.shape[0]:
        raise ValueError(f"sequence length {seq} exceeds the {positions.shape[0]} position embeddings")
    return table[tokens] + positions[:seq]


# ---------------------------------------------------------------- layer norm

@dataclass
class LayerNormCache:
    xhat: np.ndarray
    rstd: np.ndarray


def layer_norm_forward(x: np.ndarray, gain: np.ndarray, bias: np.ndarray, eps: float):
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = (centred * centred).mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + x.dtype.type(eps))
    xhat = centred * rstd
    return xhat * gain + bias, LayerNormCache(xhat, rstd)


# ---------------------------------------------------------------- attention

@dataclass
class AttentionCache:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    probs: np.ndarray           # softmax, before dropout
    dropped: np.ndarray         # probs after dropout (what multiplies v)
    drop: np.ndarray | None


def _split_heads(t: np.ndarray, heads: int) -> np.ndarray:
    b, s, d = t.shape
    return t.reshape(b, s, heads, d // heads).transpose(0, 2, 1, 3)


@functools.lru_cache(maxsize=16)
def _causal_allowed(seq: int) -> np.ndarray:
    """Bool [1, 1, T, T], read-only: built once per sequence length, not per call."""
    allowed = np.tril(np.ones((seq, seq), dtype=bool))[None, None]
    allowed.flags.writeable = False
    return allowed


def attention_scores_mask(seq: int, causal: bool, key_keep: np.ndarray | None) -> np.ndarray | None:
    """Bool [B or 1, 1, T, T]: True where query i may attend to key j."""
    allowed = None
    if causal:
        allowed = _causal_allowed(seq)
    if key_keep is not None:
        keys = key_keep[:, None, None, :]
        allowed = keys if allowed is None else allowed & keys
    return allowed


def _heads(qkv: np.ndarray, heads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v [B, heads, T, head_dim] (views) of a packed [B, T, 3D] projection."""
    return tuple(_split_heads(t, heads) for t in np.split(qkv, 3, axis=-1))


def attention_probs(qkv: np.ndarray, heads: int, causal: bool, key_keep: np.ndarray | None = None,
                    drop: np.ndarray | None = None, into: np.ndarray | None = None) -> AttentionCache:
    """The heads and attention probabilities of attention_forward (all its backward needs);
    the probabilities made in `into` ([B, heads, T, T]) when given."""
    b, s, three_d = qkv.shape
    d = three_d // 3
    q, k, v = _heads(qkv, heads)
    scale = qkv.dtype.type(1.0 / np.sqrt(d // heads))
    scores = np.matmul(q, k.transpose(0, 1, 3, 2), out=into)
    scores *= scale
    allowed = attention_scores_mask(s, causal, key_keep)
    if allowed is not None:
        np.copyto(scores, qkv.dtype.type(MASKED_SCORE), where=~allowed)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores, out=scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return AttentionCache(q, k, v, probs, _dropped(probs, drop), drop)


def _dropped(probs: np.ndarray, drop: np.ndarray | None) -> np.ndarray:
    return probs * drop if drop is not None else probs


def attention_forward(qkv: np.ndarray, heads: int, causal: bool, key_keep: np.ndarray | None = None,
                      drop: np.ndarray | None = None, into: np.ndarray | None = None):
    """Multi-head self-attention from packed [B, T, 3D] projections -> [B, T, D].

    causal: query i sees keys j <= i (GPT). key_keep: bool [B, T], False for
    padding keys nobody may attend to (BERT). drop: scaled keep-mask on the
    attention probabilities, [B, heads, T, T]. into: where the probabilities
    are made (attention_probs).
    """
    b, s, three_d = qkv.shape
    cache = attention_probs(qkv, heads, causal, key_keep, drop, into)
    out = (cache.dropped @ cache.v).transpose(0, 2, 1, 3).reshape(b, s, three_d // 3)
    return out, cache


def attention_backward(dout: np.ndarray, cache: AttentionCache) -> np.ndarray:
    """d qkv [B, T, 3D]. Masked keys have probability 0, so they get no gradient."""
    q, k, v = cache.q, cache.k, cache.v
    b, heads, s, hd = q.shape
    do = dout.reshape(b, s, heads, hd).transpose(0, 2, 1, 3)
    dv = cache.dropped.transpose(0, 1, 3, 2) @ do
    dprobs = do @ v.transpose(0, 1, 3, 2)
    if cache.drop is not None:
        dprobs *= cache.drop
    p = cache.probs
    dscores = dprobs   # p * (dprobs - rowsum(dprobs * p)), in place
    dscores -= (dprobs * p).sum(axis=-1, keepdims=True)
    dscores *= p
    dscores *= q.dtype.type(1.0 / np.sqrt(hd))
    dq = dscores @ k
    dk = dscores.transpose(0, 1, 3, 2) @ q
    merged = [t.transpose(0, 2, 1, 3).reshape(b, s, heads * hd) for t in (dq, dk, dv)]
    return np.concatenate(merged, axis=-1)


def by_samples(qkv: np.ndarray, heads: int, work) -> None:
    """work(lo, hi) over the batch's samples in parallel.py's fixed cut: attention never
    mixes samples, so each piece is the whole computation for its samples, the same bits."""
    b, s, _ = qkv.shape
    parallel.in_pieces(b, work, elements=b * heads * s * s)


def sample_rows(t: np.ndarray | None, lo: int, hi: int) -> np.ndarray | None:
    """A per-sample operand's samples lo:hi (one broadcast over the batch stays whole)."""
    return t if t is None or np.ndim(t) == 0 or t.shape[0] == 1 else t[lo:hi]


def attention_output(qkv: np.ndarray, heads: int, causal: bool, key_keep: np.ndarray | None = None,
                     drop: np.ndarray | None = None) -> np.ndarray:
    """attention_forward's output alone, a piece of the batch at a time (side by side
    where parallel.py allows), with nothing kept for the backward."""
    b, s, three_d = qkv.shape
    out = np.empty((b, s, three_d // 3), qkv.dtype)

    def piece(lo: int, hi: int) -> None:
        keep, dropped = sample_rows(key_keep, lo, hi), sample_rows(drop, lo, hi)
        out[lo:hi] = attention_forward(qkv[lo:hi], heads, causal, keep, dropped)[0]
    by_samples(qkv, heads, piece)
    return out


def attention_output_and_probs(qkv: np.ndarray, heads: int, causal: bool, key_keep: np.ndarray | None = None,
                               drop: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(attention_output, the probabilities before dropout [B, heads, T, T]): a training
    step's forward, which keeps the probabilities so that its backward need not recompute
    them (attention_grad_from_probs); a piece of the batch at a time."""
    b, s, three_d = qkv.shape
    out = np.empty((b, s, three_d // 3), qkv.dtype)
    probs = np.empty((b, heads, s, s), qkv.dtype)

    def piece(lo: int, hi: int) -> None:
        out[lo:hi] = attention_forward(qkv[lo:hi], heads, causal, sample_rows(key_keep, lo, hi),
                                       sample_rows(drop, lo, hi), into=probs[lo:hi])[0]
    by_samples(qkv, heads, piece)
    return out, probs


def attention_grad_from_probs(dout: np.ndarray, qkv: np.ndarray, probs: np.ndarray, heads: int,
                              drop: np.ndarray | None = None) -> np.ndarray:
    """attention_grad's d qkv, the bits the same, from the probabilities the forward kept
    (attention_output_and_probs): the masks are in them already."""
    grad = np.empty(qkv.shape, np.result_type(dout, qkv))

    def piece(lo: int, hi: int) -> None:
        kept, dropped = probs[lo:hi], sample_rows(drop, lo, hi)
        cache = AttentionCache(*_heads(qkv[lo:hi], heads), kept, _dropped(kept, dropped), dropped)
        grad[lo:hi] = attention_backward(dout[lo:hi], cache)
    by_samples(qkv, heads, piece)
    return grad


def attention_grad(dout: np.ndarray, qkv: np.ndarray, heads: int, causal: bool,
                   key_keep: np.ndarray | None = None, drop: np.ndarray | None = None) -> np.ndarray:
    """d qkv from the packed projection alone: the probabilities recomputed (not kept
    from the forward) and attention_backward, a piece of the batch at a time."""
    grad = np.empty(qkv.shape, np.result_type(dout, qkv))

    def piece(lo: int, hi: int) -> None:
        keep, dropped = sample_rows(key_keep, lo, hi), sample_rows(drop, lo, hi)
        cache = attention_probs(qkv[lo:hi], heads, causal, keep, dropped)
        grad[lo:hi] = attention_backward(dout[lo:hi], cache)
    by_samples(qkv, heads, piece)
    return grad


# ---------------------------------------------------------------- loss

# How a token model's summed loss is normalised (the model zoo's choices):
# "batch_size": loss_weight * sum / samples in the global batch (BERT's default:
#   mlm_loss_weight, 1.0 unless set; model-zoo configs set ~1/masked tokens per sample);
# "num_tokens" / "num_masked": sum / labelled tokens in the global batch (GPT-2's
#   default; HF's mean over every masked token of the batch);
# "precomputed_num_masked": the same count, which the model zoo's data loader
#   computes. Here the input pipeline always counts it: a WSE sees only its rows.
def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray, global_batch: int):
    """A classifier's loss on one shard: (sum of its per-sample losses / global_batch, a
    float64; d loss / d logits, in the logits' dtype; predictions right). Divided by the
    global batch, not multiplied by its inverse, so every shard's rows round alike."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    denom = exp.sum(axis=1, keepdims=True)
    log_probs = shifted - np.log(denom)
    rows = np.arange(len(labels))
    loss = -log_probs[rows, labels].astype(np.float64).sum() / global_batch
    dlogits = exp / denom
    dlogits[rows, labels] -= 1.0
    dlogits /= logits.dtype.type(global_batch)
    correct = int((logits.argmax(axis=1) == labels).sum())
    return float(loss), dlogits, correct


TOKEN_LOSS_SCALINGS = ("batch_size", "num_tokens", "num_masked", "precomputed_num_masked")


def token_loss_weight(scaling: str, loss_weight: float, global_batch: int, label_count: int | None) -> float:
    """The factor every labelled token's loss is multiplied by."""
    if scaling == "batch_size":
        return loss_weight / global_batch
    if scaling not in TOKEN_LOSS_SCALINGS:
        raise ValueError(f"unknown loss scaling {scaling!r}; expected one of {', '.join(TOKEN_LOSS_SCALINGS)}")
    if label_count is None:
        raise ValueError(f"loss scaling {scaling} needs the number of labelled tokens in the global batch")
    return 1.0 / max(label_count, 1)


def token_cross_entropy(logits: np.ndarray, labels: np.ndarray, token_weight: float):
    """Softmax cross-entropy of [B, T, C] logits, labels == IGNORE_INDEX left out.

    The loss is the sum of every labelled token's loss times `token_weight`
    (token_loss_weight: one factor for the whole global batch), so the shards
    of a global batch add up to its loss whatever the split.
    Returns (loss, dlogits, correct, loss_sum, count): loss_sum is the float64
    sum of every counted token's loss and count their number (for eval).
    """
    classes = logits.shape[-1]
    flat, lab = logits.reshape(-1, classes), labels.reshape(-1)
    counted = lab != IGNORE_INDEX
    if np.any((lab < IGNORE_INDEX) | ((lab > IGNORE_INDEX) & (lab < 0)) | (lab >= classes)):
        raise ValueError(f"labels outside [0, {classes}) (and not the ignore index {IGNORE_INDEX})")
    safe = np.where(counted, lab, 0)
    shifted = flat - flat.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    denom = exp.sum(axis=1, keepdims=True)
    rows = np.arange(len(lab))
    token_loss = (np.log(denom[:, 0]) - shifted[rows, safe]).astype(np.float64)
    weight = counted * token_weight
    loss = float((token_loss * weight).sum())
    dlogits = exp / denom
    dlogits[rows, safe] -= 1.0
    dlogits *= weight.astype(flat.dtype)[:, None]
    correct = int(((flat.argmax(axis=1) == lab) & counted).sum())
    return loss, dlogits.reshape(logits.shape), correct, float(token_loss[counted].sum()), int(counted.sum())
