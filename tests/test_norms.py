"""The row passes' C loops (_norms.c, where setup.py built them) give the numpy path's bits:
layer norm's forward, a training step's forward with its statistics, and the vjp from them
and from x, with and without gain and bias; softmax's and attention's backward; over row
widths on each side of numpy's pairwise-sum blocks (8 and 128). The ops' numbers against
torch: tests/test_ops.py."""
import numpy as np
import pytest

from cs_runtime.numerics import ops

# (shape, gain, bias): each width with one of the four kinds of parameters, every kind twice
CASES = [((3, 7), True, True), ((2, 5, 65), True, False), ((4, 192), False, True), ((2, 3, 256), False, False),
         ((3, 300), True, True), ((2, 1024), True, False), ((2, 2, 9), False, True), ((5, 129), False, False)]


def _case(shape, gain, bias, rng):
    width = shape[-1]
    x = (rng.standard_normal(shape) * 3 + rng.standard_normal(shape[:-1] + (1,)) * 10).astype(np.float32)
    inputs = [x, rng.standard_normal(width).astype(np.float32) if gain else None]
    if bias:
        inputs.append(rng.standard_normal(width).astype(np.float32))
    return inputs, {"normalized_shape": [width], "eps": 1e-5}


def _all_results(inputs, attrs, g):
    op = ops.OPS["layer_norm"]
    out = op.forward(inputs, attrs)
    value, stats = op.residual(inputs, attrs)
    return [out, value, *stats, *(d for d in op.residual_vjp(g, inputs, stats, attrs) if d is not None),
            *(d for d in op.vjp(g, inputs, out, attrs) if d is not None)]


@pytest.mark.parametrize("shape, gain, bias", CASES, ids=str)
def test_the_layer_norm_loops_give_the_numpy_paths_bits(monkeypatch, shape, gain, bias):
    if ops.norms_path() != "C loops":
        pytest.skip("_norms.c is not built here (pip install -e . builds it where a C compiler is found)")
    rng = np.random.default_rng(len(shape) * 1000 + shape[-1])
    inputs, attrs = _case(shape, gain, bias, rng)
    g = rng.standard_normal(shape).astype(np.float32)
    by_loops = _all_results(inputs, attrs, g)
    monkeypatch.setattr(ops, "_norm_loops", None)
    assert ops.norms_path() == "numpy"
    by_numpy = _all_results(inputs, attrs, g)
    assert len(by_loops) == len(by_numpy)
    for ours, theirs in zip(by_loops, by_numpy):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype and ours.tobytes() == theirs.tobytes()


def test_the_loops_refuse_buffers_that_do_not_match_their_dimensions():
    if ops.norms_path() != "C loops":
        pytest.skip("_norms.c is not built here")
    x, rstd = np.zeros((2, 8), np.float32), np.zeros(2, np.float32)
    with pytest.raises(ValueError, match="dimensions"):
        ops._norm_loops.forward(x, x, x, x, rstd, x, (3, 8, 0, 0), 1e-5)    # 3 rows of 8 in 16 floats


@pytest.mark.parametrize("width", [7, 65, 128, 200])
def test_the_softmax_backward_loop_gives_the_numpy_paths_bits(monkeypatch, width):
    """softmax's vjp and attention's (scaled, in place on the scores' gradient)."""
    if ops.norms_path() != "C loops":
        pytest.skip("_norms.c is not built here")
    rng = np.random.default_rng(width)
    scores = (rng.standard_normal((2, 3, width)) * 4).astype(np.float32)
    q, k, v = (rng.standard_normal((2, 2, 5 if i == 0 else width, 8)).astype(np.float32) for i in range(3))
    cases = [("softmax", [scores], {"dim": -1}), ("scaled_dot_product_attention", [q, k, v], {})]

    def grads():
        got = []
        for name, inputs, attrs in cases:
            op = ops.OPS[name]
            out = op.forward(inputs, attrs)
            g = np.random.default_rng(1).standard_normal(out.shape).astype(np.float32)
            got += [d for d in op.vjp(g, inputs, out, attrs) if d is not None]
        return got
    by_loops = grads()
    monkeypatch.setattr(ops, "_norm_loops", None)
    by_numpy = grads()
    assert len(by_loops) == len(by_numpy) == 4
    for ours, theirs in zip(by_loops, by_numpy):
        assert ours.dtype == theirs.dtype == np.float32 and ours.tobytes() == theirs.tobytes()
