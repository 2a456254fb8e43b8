"""Work cut into pieces that run side by side (cs_runtime/numerics/parallel.py): every cut
computation gives the bits of the uncut one, and the pieces do run on two threads."""
import threading

import numpy as np
import pytest

from cs_runtime.numerics import blas, kernels, ops, parallel

needs_setter = pytest.mark.skipif(blas.started_with() == 0,
                                  reason="numpy's BLAS here is not an OpenBLAS with a thread setter: nothing is cut")


@pytest.fixture
def two_threads(monkeypatch):
    """Pieces on two threads, under the one-thread rule (as a transformer layer runs them)."""
    monkeypatch.setattr(parallel, "threads", lambda: 2)
    with blas.unit_threads():
        yield


def uncut(monkeypatch, fn, *args):
    """fn(*args) with nothing cut: the reference."""
    with monkeypatch.context() as patch:
        patch.setattr(parallel, "_cutting_products", lambda: False)
        patch.setattr(parallel, "MIN_ELEMENTS", 1 << 62)
        return fn(*args)


def test_cuts_cover_the_range_once_in_aligned_parts():
    for n, pieces, align in ((4096, 4, 8), (256, 2, 8), (12, 4, 8), (5, 4, 8), (100, 4, 8), (70000, 4, 1 << 15)):
        parts = parallel.cuts(n, pieces, align)
        assert len(parts) <= pieces and parts[0][0] == 0 and parts[-1][1] == n
        assert all(hi == next_lo for (_, hi), (next_lo, _) in zip(parts, parts[1:]))
        assert all(lo % align == 0 and hi > lo for lo, hi in parts)
    assert parallel.cuts(0) == []


def test_pieces_run_side_by_side_and_every_piece_runs_once(monkeypatch):
    """Two pieces that each wait for the other: done only if they run on two threads at once."""
    monkeypatch.setattr(parallel, "threads", lambda: 2)
    arrived = [threading.Event(), threading.Event()]
    ran = []

    def piece(i):
        arrived[i].set()
        ran.append((i, arrived[1 - i].wait(timeout=60)))
    parallel.run([lambda: piece(0), lambda: piece(1)])
    assert sorted(ran) == [(0, True), (1, True)]


def test_with_one_thread_the_pieces_run_in_order_here(monkeypatch):
    monkeypatch.setattr(parallel, "threads", lambda: 1)
    here, ran = threading.get_ident(), []
    parallel.run([lambda i=i: ran.append((i, threading.get_ident())) for i in range(5)])
    assert ran == [(i, here) for i in range(5)]


def test_a_failing_piece_raises_after_the_others_finish(monkeypatch):
    monkeypatch.setattr(parallel, "threads", lambda: 2)
    done = []

    def fail():
        raise ValueError("piece 2 failed")
    with pytest.raises(ValueError, match="piece 2 failed"):
        parallel.run([lambda: done.append(0), lambda: done.append(1), fail, lambda: done.append(3)])
    assert sorted(done) == [0, 1, 3]


# The products of the transformer preset (4096 tokens, width 256, MLP 1024; weight
# gradients with the tokens inside), BERT-like and odd shapes, and stacked attention heads.
SHAPES_2D = [((4096, 256), (256, 768), False), ((4096, 1024), (1024, 256), False), ((4096, 256), (256, 260), False),
             ((256, 4096), (4096, 768), True), ((1024, 4096), (4096, 256), True), ((1000, 600), (600, 77), False)]


@needs_setter
@pytest.mark.parametrize("a_shape, b_shape, transposed", SHAPES_2D)
def test_a_cut_product_is_the_uncut_product_bit_for_bit(monkeypatch, two_threads, a_shape, b_shape, transposed):
    rng = np.random.default_rng(1)
    a = rng.standard_normal(a_shape[::-1] if transposed else a_shape).astype(np.float32)
    a = a.T if transposed else a                 # a weight gradient's operand: a transposed view
    b = rng.standard_normal(b_shape).astype(np.float32)
    assert 2 * a.shape[0] * a.shape[1] * b.shape[1] >= parallel.MIN_FLOPS
    got = parallel.matmul(a, b)
    assert got.tobytes() == (a @ b).tobytes() == uncut(monkeypatch, parallel.matmul, a, b).tobytes()


@needs_setter
def test_stacked_products_are_cut_by_their_leading_index(monkeypatch, two_threads):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((32, 4, 128, 64)).astype(np.float32)
    k = rng.standard_normal((32, 4, 128, 64)).astype(np.float32)
    got = parallel.matmul(q, np.swapaxes(k, -1, -2))
    assert got.tobytes() == (q @ np.swapaxes(k, -1, -2)).tobytes()
    small = q[:, :, :4, :4]                      # under MIN_FLOPS: not cut, still right
    assert parallel.matmul(small, small).tobytes() == (small @ small).tobytes()
    broadcast = rng.standard_normal((128, 64)).astype(np.float32)    # other shapes: plain a @ b
    assert parallel.matmul(q, broadcast.T @ broadcast).tobytes() == (q @ (broadcast.T @ broadcast)).tobytes()


@needs_setter
@pytest.mark.parametrize("causal, padded, dropped", [(True, False, True), (False, True, True), (False, False, False)])
def test_attention_by_pieces_of_the_batch_is_attention_whole(monkeypatch, two_threads, causal, padded, dropped):
    rng = np.random.default_rng(3)
    b, s, heads, width = 16, 64, 4, 128
    assert b * heads * s * s >= parallel.MIN_ELEMENTS
    qkv = rng.standard_normal((b, s, 3 * width)).astype(np.float32)
    keep = rng.random((b, s)) > 0.2 if padded else None
    drop = None
    if dropped:
        drop = kernels.keep_mask(kernels.hash_key(1, 2, 3), slice(0, b), (heads, s, s), 0.1, np.float32)
    dout = rng.standard_normal((b, s, width)).astype(np.float32)
    out, cache = kernels.attention_forward(qkv, heads, causal, keep, drop)
    assert kernels.attention_output(qkv, heads, causal, keep, drop).tobytes() == out.tobytes()
    want = kernels.attention_backward(dout, cache)
    assert kernels.attention_grad(dout, qkv, heads, causal, keep, drop).tobytes() == want.tobytes()
    # a training step's forward keeps the probabilities, and its backward starts from them
    kept_out, probs = kernels.attention_output_and_probs(qkv, heads, causal, keep, drop)
    assert kept_out.tobytes() == out.tobytes() and probs.tobytes() == cache.probs.tobytes()
    assert kernels.attention_grad_from_probs(dout, qkv, probs, heads, drop).tobytes() == want.tobytes()


@needs_setter
def test_masks_gelus_and_layer_norm_by_pieces_are_the_same_bits(monkeypatch, two_threads):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((32, 128, 1024)).astype(np.float32)
    key = kernels.hash_key(5, 6, 7)
    passes = ((kernels.keep_mask, (key, slice(3, 35), (128, 1024), 0.1, np.float32)), (kernels.gelu, (x,)),
              (kernels.gelu_grad, (x,)), (ops.gelu_tanh, (x,)), (ops.gelu_tanh_grad, (x,)))
    for fn, args in passes:
        assert fn(*args).tobytes() == uncut(monkeypatch, fn, *args).tobytes(), fn.__name__
    for pair, value, grad in ((kernels.gelu_and_grad, kernels.gelu, kernels.gelu_grad),
                              (ops.gelu_tanh_and_grad, ops.gelu_tanh, ops.gelu_tanh_grad)):
        got = pair(x)
        assert [a.tobytes() for a in got] == [a.tobytes() for a in uncut(monkeypatch, pair, x)], pair.__name__
        assert [a.tobytes() for a in got] == [value(x).tobytes(), grad(x).tobytes()], pair.__name__
    h = x[:, :, :256]
    gain, bias = rng.standard_normal(256).astype(np.float32), rng.standard_normal(256).astype(np.float32)
    g = rng.standard_normal(h.shape).astype(np.float32)
    attrs = {"normalized_shape": [256], "eps": 1e-5}
    layer_norm = ops.OPS["layer_norm"]
    for inputs in ([h, gain, bias], [h, None, bias], [h]):
        forward = layer_norm.forward(inputs, attrs)
        assert forward.tobytes() == uncut(monkeypatch, layer_norm.forward, inputs, attrs).tobytes()
        cut = layer_norm.vjp(g, inputs, forward, attrs)
        whole = uncut(monkeypatch, layer_norm.vjp, g, inputs, forward, attrs)
        assert len(cut) == len(whole)
        for got, want in zip(cut, whole):
            assert (got is None and want is None) or got.tobytes() == want.tobytes()


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "cbfloat16"])
def test_16_bit_conversions_by_pieces_are_the_same_bits(monkeypatch, two_threads, fmt):
    """Encode, decode, round and the gradient sum, over arrays of several pieces that hold
    zeros, subnormals, overflow, inf and nan in different pieces."""
    from cs_runtime.numerics import precision
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(300_000) * np.exp2(rng.integers(-30, 30, 300_000))).astype(np.float32)
    x[::7] = 0.0
    x[200_000:200_010] = [np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45, 7e4, -7e4, 3e38, -0.0]
    bits = precision.to_bits(x, fmt)
    assert bits.tobytes() == uncut(monkeypatch, precision.to_bits, x, fmt).tobytes()
    assert precision.from_bits(bits, fmt).tobytes() == uncut(monkeypatch, precision.from_bits, bits, fmt).tobytes()
    assert precision.quantize(x, fmt).tobytes() == uncut(monkeypatch, precision.quantize, x, fmt).tobytes()
    total = rng.standard_normal(x.size).astype(np.float32)
    summed = precision.add_from_bits(total.copy(), bits, fmt)
    assert summed.tobytes() == uncut(monkeypatch, precision.add_from_bits, total.copy(), bits, fmt).tobytes()


@pytest.mark.parametrize("mask", [None, "per_sample", "broadcast", "float"])
def test_scaled_dot_product_attention_by_pieces_is_the_same_bits(monkeypatch, two_threads, mask):
    """A captured model's attention (torch's F.scaled_dot_product_attention), cut by samples
    where every operand is per sample; a float mask (its gradient sums over samples) is not cut."""
    rng = np.random.default_rng(6)
    b, heads, t, d = 16, 4, 64, 32
    q, k, v = (rng.standard_normal((b, heads, t, d)).astype(np.float32) for _ in range(3))
    inputs = [q, k, v]
    if mask == "per_sample":
        inputs.append(rng.random((b, 1, t, t)) > 0.1)
    elif mask == "broadcast":
        inputs.append(np.tril(np.ones((1, 1, t, t), bool)))
    elif mask == "float":
        inputs.append(rng.standard_normal((1, 1, t, t)).astype(np.float32))
    sdpa = ops.OPS["scaled_dot_product_attention"]
    attrs = {"is_causal": mask is None}
    out = sdpa.forward(inputs, attrs)
    assert out.tobytes() == uncut(monkeypatch, sdpa.forward, inputs, attrs).tobytes()
    g = rng.standard_normal(out.shape).astype(np.float32)
    cut, whole = sdpa.vjp(g, inputs, out, attrs), uncut(monkeypatch, sdpa.vjp, g, inputs, out, attrs)
    assert len(cut) == len(whole) == len(inputs)
    for got, want in zip(cut, whole):
        assert (got is None and want is None) or got.tobytes() == want.tobytes()


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_an_update_by_pieces_is_the_same_bits(monkeypatch, two_threads, kind):
    """Each piece of a parameter's update has its own scratch, so pieces side by side give
    the bits of one pass over the whole (three steps, moments carried)."""
    from cs_runtime.numerics.optim import Optimizer, OptimizerSpec
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal((300, 1000)).astype(np.float32)
    grads = [rng.standard_normal(w0.shape).astype(np.float32) for _ in range(3)]

    def train():
        opt = Optimizer(OptimizerSpec(kind, momentum=0.9, weight_decay=0.01))
        params = {"w": w0.copy()}
        state = opt.init_state(params)
        for g in grads:
            opt.update(params, {"w": g}, state, 0.01)
        return params["w"]
    assert train().tobytes() == uncut(monkeypatch, train).tobytes()


def test_a_forked_child_runs_pieces_on_a_pool_of_its_own(monkeypatch):
    """The parent's pool threads do not survive a fork: the child starts its own."""
    import os
    monkeypatch.setattr(parallel, "threads", lambda: 2)
    parallel.run([lambda: None, lambda: None])          # the parent's pool exists
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                         # the child: two pieces that wait for each other
        arrived = [threading.Event(), threading.Event()]

        def piece(i):
            arrived[i].set()
            assert arrived[1 - i].wait(timeout=30)
        try:
            parallel.run([lambda: piece(0), lambda: piece(1)])
            os.write(write, b"ok")
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read()
    os.waitpid(pid, 0)
    assert said == b"ok"


def test_binary_ops_by_pieces_are_the_plain_ufunc(monkeypatch, two_threads):
    """Residual adds, dropout's multiply: cut by the first axis where the result has an
    operand's shape; broadcasts either way, scalars and mixed dtypes as numpy gives them."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((32, 128, 256)).astype(np.float32)
    cases = [(x, rng.standard_normal(x.shape).astype(np.float32)), (x, rng.standard_normal(256).astype(np.float32)),
             (rng.standard_normal((1, 128, 256)).astype(np.float32), x), (x, np.float32(0.5)), (x, 2.0),
             (x, x[:, :1]), (x.astype(np.int32), 1.5), (x[:, :2, :2], x[:, :2, :2])]
    for a, b in cases:
        for ufunc in (np.add, np.multiply):
            want = ufunc(a, b)
            got = parallel.binary(ufunc, a, b, commutative=True)
            assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    with pytest.raises(ValueError):
        parallel.binary(np.add, x, x[:5, :5])          # shapes that do not broadcast: numpy's own error


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "cbfloat16"])
def test_16_bit_attention_by_pieces_is_the_same_bits(monkeypatch, two_threads, fmt):
    """A GPT-2 / BERT block's attention in a 16-bit format (operands rounded), cut by samples."""
    from cs_runtime.numerics import mixed_ops
    rng = np.random.default_rng(9)
    b, s, heads, width = 16, 64, 4, 128
    qkv = rng.standard_normal((b, s, 3 * width)).astype(np.float32)
    keep = rng.random((b, s)) > 0.2
    drop = kernels.keep_mask(kernels.hash_key(4, 5, 6), slice(0, b), (heads, s, s), 0.1, np.float32)
    attrs = {"heads": heads, "causal": False, "key_keep": True, "drop": True}
    inputs = [qkv, keep, drop]
    out = mixed_ops.forward("self_attention", inputs, attrs, fmt)
    assert out.tobytes() == uncut(monkeypatch, mixed_ops.forward, "self_attention", inputs, attrs, fmt).tobytes()
    g = rng.standard_normal(out.shape).astype(np.float32)
    got = mixed_ops.vjp("self_attention", g, inputs, out, attrs, fmt)[0]
    assert got.tobytes() == uncut(monkeypatch, mixed_ops.vjp, "self_attention", g, inputs, out, attrs, fmt)[0].tobytes()
