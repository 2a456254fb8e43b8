"""The depthwise convolution's C loops (_windows.c, where setup.py built them) give the numpy
path's bits, forward, input gradient and weight gradient, over strides, dilations, padding
and odd sizes.
The kernels' numbers against torch: tests/test_ops.py."""
import numpy as np
import pytest

from cs_runtime.numerics import windows

GEOMETRIES = [  # (n, c, h, w, k, stride, pad, dilation)
    (2, 3, 7, 9, 3, (1, 1), (1, 1), (1, 1)),
    (3, 4, 11, 8, 5, (2, 2), (2, 2), (1, 1)),
    (1, 5, 9, 9, 3, (2, 1), (0, 1), (2, 1)),
    (2, 2, 6, 6, 1, (1, 1), (0, 0), (1, 1)),
    (5, 3, 19, 21, 3, (1, 1), (1, 1), (1, 1)),   # weight-gradient sums of 2,000 terms
]


@pytest.mark.parametrize("n, c, h, w, k, stride, pad, dil", GEOMETRIES)
@pytest.mark.parametrize("layout", ["planes first", "channels last"])
def test_the_depthwise_loops_give_the_numpy_paths_bits(monkeypatch, n, c, h, w, k, stride, pad, dil, layout):
    if windows.depthwise_path() != "C loops":
        pytest.skip("_windows.c is not built here (pip install -e . builds it where a C compiler is found)")
    monkeypatch.setattr(windows, "CHANNELS_LAST_RATIO", 1 << 30 if layout == "planes first" else 0)
    rng = np.random.default_rng(k)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    weight = rng.standard_normal((c, 1, k, k)).astype(np.float32)
    by_loops = windows.conv2d(x, weight, c, stride, pad, dil)
    g = rng.standard_normal(by_loops.shape).astype(np.float32)
    grads_by_loops = windows.conv2d_vjp(g, x, weight, c, stride, pad, dil)
    monkeypatch.setattr(windows, "_depthwise_loops", None)
    assert windows.depthwise_path() == "numpy"
    by_numpy = windows.conv2d(x, weight, c, stride, pad, dil)
    grads_by_numpy = windows.conv2d_vjp(g, x, weight, c, stride, pad, dil)
    assert by_loops.tobytes() == by_numpy.tobytes()
    for ours, theirs in zip(grads_by_loops, grads_by_numpy):
        assert ours.shape == theirs.shape and ours.tobytes() == theirs.tobytes()


def test_the_loops_refuse_buffers_that_do_not_match_their_dimensions():
    if windows.depthwise_path() != "C loops":
        pytest.skip("_windows.c is not built here")
    xp, w, y = np.zeros((1, 2, 5, 5), np.float32), np.zeros((2, 3, 3), np.float32), np.zeros((1, 2, 3, 3), np.float32)
    with pytest.raises(ValueError, match="dimensions"):
        windows._depthwise_loops.forward(xp, w, y, (1, 2, 5, 5, 3, 3, 4, 4, 1, 1, 1, 1, 1))   # 4 x 4 out of a 5 x 5
