"""A captured model's random draws (ops.py `draw`: torch.rand, randn, randperm and their
_like forms): fresh each step, seeded as dropout's masks, and the same numbers for a
sample whichever shard holds it. The torch side (capture, training against torch eager
fed the run's draws, two WSEs) is tests/test_torch_draws.py."""
import numpy as np
import pytest

from cs_runtime.numerics import kernels
from cs_runtime.numerics.ops import OPS, OpError

BATCH = 8


def _context(rows: slice, step=3, seed=7):
    return np.array([seed, step, rows.start, rows.stop, BATCH, 1], np.int64)


def _draw(rows, shape, dist, step=3, site=0, dtype="float32", batched=True):
    """OPS["draw"] on a shard of `rows`, of `shape` (batched: dim 0 read off a first input of it)."""
    attrs = {"dist": dist, "shape": [-1, *shape[1:]] if batched else list(shape), "site": site, "dtype": dtype}
    first = [np.zeros(shape, np.float32)] if batched else []
    return OPS["draw"].forward([*first, _context(rows, step)], attrs)


@pytest.mark.parametrize("dist,mean,var", [("uniform", 0.5, 1 / 12), ("normal", 0.0, 1.0)])
def test_draws_have_their_distributions_moments(dist, mean, var):
    x = _draw(slice(0, BATCH), (BATCH, 100, 50), dist).astype(np.float64)   # 40000 draws
    tolerance = 5 * np.sqrt(var / x.size)
    assert abs(x.mean() - mean) < tolerance
    assert abs(x.var() - var) < 5 * var * np.sqrt(2 / x.size) * (1.5 if dist == "uniform" else 1.0)
    if dist == "uniform":
        assert 0.0 <= x.min() and x.max() < 1.0
        assert np.histogram(x, bins=10, range=(0, 1))[0].min() > 0.09 * x.size
    else:
        z = (x - x.mean()) / x.std()
        assert abs((z ** 3).mean()) < 0.05 and abs((z ** 4).mean() - 3.0) < 0.15   # skew 0, kurtosis 3
        assert 0.31 < (np.abs(z) > 1).mean() < 0.33                                 # 31.7% outside one sigma


def test_a_permutation_is_one_and_differs_by_step_and_site():
    perm = _draw(slice(0, 1), (50,), "permutation", batched=False)
    assert perm.dtype == np.int64 and sorted(perm.tolist()) == list(range(50))
    assert not np.array_equal(perm, _draw(slice(0, 1), (50,), "permutation", step=4, batched=False))
    assert not np.array_equal(perm, _draw(slice(0, 1), (50,), "permutation", site=1, batched=False))


def test_draws_are_independent_across_steps_sites_and_dropouts_masks():
    first = _draw(slice(0, BATCH), (BATCH, 2500), "normal").ravel()
    tolerance = 5 / np.sqrt(first.size)
    for other in (_draw(slice(0, BATCH), (BATCH, 2500), "normal", step=4),
                  _draw(slice(0, BATCH), (BATCH, 2500), "normal", site=1)):
        assert abs(np.corrcoef(first, other.ravel())[0, 1]) < tolerance
    uniform = _draw(slice(0, BATCH), (BATCH, 2500), "uniform").ravel()
    mask = kernels.sample_keep_mask(7, 3, 0, slice(0, BATCH), (BATCH, 2500), 0.5).ravel()
    assert abs(np.corrcoef(uniform, mask)[0, 1]) < tolerance   # dropout site 0 is another stream


@pytest.mark.parametrize("dist", ["uniform", "normal"])
@pytest.mark.parametrize("sizes", [[1] * BATCH, [4, 4], [3, 5]], ids=["rows", "halves", "uneven"])
def test_shards_draw_what_the_whole_batch_draws_for_their_rows(dist, sizes):
    whole = _draw(slice(0, BATCH), (BATCH, 3, 5), dist)
    starts = np.cumsum([0, *sizes])
    parts = [_draw(slice(a, b), (b - a, 3, 5), dist) for a, b in zip(starts[:-1], starts[1:])]
    assert np.concatenate(parts).tobytes() == whole.tobytes()
    # A value with several rows per sample (a [B*T, D] view) splits the same way.
    flat = _draw(slice(0, BATCH), (BATCH * 3, 5), dist)
    assert flat.tobytes() == whole.tobytes()
    assert _draw(slice(3, 8), (15, 5), dist).tobytes() == whole[3:].tobytes()
    # Without the batch: the same numbers on every shard.
    fixed = [_draw(slice(a, b), (6, 2), dist, batched=False) for a, b in zip(starts[:-1], starts[1:])]
    assert all(f.tobytes() == fixed[0].tobytes() for f in fixed)


def test_no_gradient_flows_into_a_draw_and_its_shape_rule_and_cost():
    x = np.ones((3, 4), np.float32)
    attrs = {"dist": "normal", "shape": [-1, 4], "site": 0, "dtype": "float64"}
    out = OPS["draw"].forward([x, _context(slice(2, 5))], attrs)
    assert out.dtype == np.float64 and out.shape == OPS["draw"].shape([x.shape, (6,)], attrs) == (3, 4)
    assert OPS["draw"].vjp(np.ones_like(out), [x, _context(slice(2, 5))], out, attrs) == [None, None]
    assert OPS["draw"].flops([x.shape, (6,)], out.shape, attrs) > 0
    with pytest.raises(OpError, match="only dim 0 follows the batch"):
        OPS["draw"].shape([(6,)], attrs)
    with pytest.raises(OpError, match="do not split into the rows"):
        OPS["draw"].forward([np.ones((3, 4)), _context(slice(0, 5))], attrs)
    with pytest.raises(OpError, match="a draw from 'gamma'"):
        OPS["draw"].forward([x, _context(slice(2, 5))], {**attrs, "dist": "gamma"})
