"""Tests for cs_runtime.data: IDX reading, embedded digits, batching, sharding."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from cs_runtime.data.batches import BatchPlan, shard_rows, worker_steps
from cs_runtime.data.mnist import DataError, load_embedded_digits, load_mnist, read_idx


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------

def idx_bytes(arr: np.ndarray) -> bytes:
    """Serialise a uint8 array as IDX (type code 0x08, big-endian dims)."""
    header = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def write(path: Path, payload: bytes, gz: bool = False) -> Path:
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)
    return path


def synthetic(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8), rng.integers(0, 10, size=n, dtype=np.uint8)


def write_split(d: Path, prefix: str, n: int, gz: bool = False, dotted: bool = False) -> tuple[np.ndarray, np.ndarray]:
    images, labels = synthetic(n)
    sep = "." if dotted else "-"
    write(d / f"{prefix}-images{sep}idx3-ubyte", idx_bytes(images), gz)
    write(d / f"{prefix}-labels{sep}idx1-ubyte", idx_bytes(labels), gz)
    return images, labels


# --------------------------------------------------------------------------
# IDX / MNIST reader
# --------------------------------------------------------------------------

@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("split,prefix", [("train", "train"), ("test", "t10k")])
def test_idx_round_trip(tmp_path: Path, gz: bool, split: str, prefix: str) -> None:
    images, labels = write_split(tmp_path, prefix, 7, gz=gz)
    x, y = load_mnist(str(tmp_path), split)
    assert x.shape == (7, 784) and x.dtype == np.float32
    assert y.shape == (7,) and y.dtype == np.int64
    np.testing.assert_allclose(x, images.reshape(7, 784) / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(y, labels)
    assert 0.0 <= x.min() and x.max() <= 1.0


def test_dotted_spelling(tmp_path: Path) -> None:
    images, labels = write_split(tmp_path, "train", 3, dotted=True)
    x, y = load_mnist(str(tmp_path), "train")
    np.testing.assert_array_equal(y, labels)
    np.testing.assert_allclose(x * 255.0, images.reshape(3, -1), atol=1e-4)


def test_read_idx_other_dtypes(tmp_path: Path) -> None:
    arr = (np.arange(12).reshape(3, 4) - 5).astype(">i4")
    raw = bytes([0, 0, 0x0C, 2]) + struct.pack(">2I", 3, 4) + arr.tobytes()
    out = read_idx(str(write(tmp_path / "ints", raw)))
    np.testing.assert_array_equal(out, arr)
    assert out.dtype == np.int32 and out.dtype.isnative


def test_loaded_arrays_are_read_only(tmp_path: Path) -> None:
    write_split(tmp_path, "train", 2)
    for x, y in (load_mnist(str(tmp_path), "train"), load_mnist(None, "train")):
        assert not x.flags.writeable and not y.flags.writeable


def test_missing_file(tmp_path: Path) -> None:
    images, _ = synthetic(2)
    write(tmp_path / "train-images-idx3-ubyte", idx_bytes(images))
    with pytest.raises(DataError, match="train-labels-idx1-ubyte.*not found"):
        load_mnist(str(tmp_path), "train")


def test_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nope"):
        load_mnist(str(tmp_path / "nope"), "train")


def test_bad_split() -> None:
    with pytest.raises(DataError, match="valid"):
        load_mnist(None, "valid")


def corrupt_cases(images: np.ndarray, labels: np.ndarray) -> dict[str, tuple[str, bytes, bytes, str]]:
    good_img, good_lbl = idx_bytes(images), idx_bytes(labels)
    return {
        "bad magic": ("images", b"\x12\x34" + good_img[2:], good_lbl, "magic"),
        "bad type code": ("images", good_img[:2] + b"\x07" + good_img[3:], good_lbl, "magic"),
        "truncated data": ("images", good_img[:-10], good_lbl, "truncated"),
        "truncated header": ("labels", good_img, good_lbl[:6], "truncated"),
        "trailing bytes": ("labels", good_img, good_lbl + b"\0", "trailing"),
        "count mismatch": ("labels", good_img, idx_bytes(labels[:-1]), "labels but"),
        "wrong ndim": ("images", idx_bytes(images.reshape(len(images), -1)), good_lbl, "expected uint8 images"),
    }


@pytest.mark.parametrize("case", list(corrupt_cases(*synthetic(4))))
@pytest.mark.parametrize("gz", [False, True])
def test_corrupt_files(tmp_path: Path, case: str, gz: bool) -> None:
    which, img, lbl, what = corrupt_cases(*synthetic(4))[case]
    write(tmp_path / "train-images-idx3-ubyte", img, gz)
    write(tmp_path / "train-labels-idx1-ubyte", lbl, gz)
    with pytest.raises(DataError, match=what) as info:
        load_mnist(str(tmp_path), "train")
    msg = str(info.value)
    assert f"train-{which}-idx" in msg and "\n" not in msg


def test_truncated_gzip_stream(tmp_path: Path) -> None:
    images, labels = synthetic(4)
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(images))[:-20])
    write(tmp_path / "train-labels-idx1-ubyte", idx_bytes(labels))
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz"):
        load_mnist(str(tmp_path), "train")


def test_data_error_is_value_error() -> None:
    assert issubclass(DataError, ValueError)


# --------------------------------------------------------------------------
# embedded digits
# --------------------------------------------------------------------------

def test_embedded_shapes_and_ranges() -> None:
    x_all, y_all = load_embedded_digits()
    assert x_all.shape == (1797, 784) and y_all.shape == (1797,)
    x_tr, y_tr = load_mnist(None, "train")
    x_te, y_te = load_mnist(None, "test")
    assert x_tr.shape == (1500, 784) and x_te.shape == (297, 784)
    assert x_tr.dtype == np.float32 and y_tr.dtype == np.int64
    assert x_tr.min() == 0.0 and x_tr.max() == 1.0
    np.testing.assert_array_equal(np.concatenate([y_tr, y_te]), y_all)
    assert set(np.unique(y_tr)) == set(range(10)) == set(np.unique(y_te))


def test_embedded_geometry() -> None:
    x, _ = load_mnist(None, "train")
    imgs = x.reshape(-1, 28, 28)
    # 2-pixel zero border, and each 3x3 block is constant (upscaled 8x8).
    assert not imgs[:, :2].any() and not imgs[:, -2:].any()
    assert not imgs[:, :, :2].any() and not imgs[:, :, -2:].any()
    inner = imgs[:, 2:26, 2:26].reshape(-1, 8, 3, 8, 3)
    assert (inner == inner[:, :, :1, :, :1]).all()
    # Values are multiples of 1/16.
    np.testing.assert_allclose(x * 16, np.round(x * 16), atol=1e-5)


def test_embedded_is_cached() -> None:
    assert load_embedded_digits() is load_embedded_digits()


def test_embedded_digits_are_real() -> None:
    x_tr, y_tr = load_mnist(None, "train")
    x_te, y_te = load_mnist(None, "test")
    means = np.stack([x_tr[y_tr == c].mean(axis=0) for c in range(10)])
    # Class means are distinct from each other ...
    dists = np.linalg.norm(means[:, None] - means[None], axis=-1)
    assert dists[~np.eye(10, dtype=bool)].min() > 1.0
    # ... and a nearest-class-mean classifier generalises: this is digits, not noise.
    d2 = (x_te**2).sum(1)[:, None] - 2 * x_te @ means.T + (means**2).sum(1)[None]
    accuracy = (d2.argmin(axis=1) == y_te).mean()
    assert accuracy > 0.8


# --------------------------------------------------------------------------
# BatchPlan
# --------------------------------------------------------------------------

def epoch_batches(plan: BatchPlan, epoch: int) -> list[np.ndarray]:
    spe = plan.steps_per_epoch
    return [plan.global_indices(s) for s in range(epoch * spe, (epoch + 1) * spe)]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_once_per_epoch(shuffle: bool, drop_last: bool) -> None:
    plan = BatchPlan(num_samples=103, batch_size=10, shuffle=shuffle, drop_last_batch=drop_last, seed=7)
    assert plan.steps_per_epoch == (10 if drop_last else 11)
    for epoch in range(3):
        batches = epoch_batches(plan, epoch)
        assert all(b.dtype == np.int64 for b in batches)
        assert [len(b) for b in batches] == [10] * 10 + ([] if drop_last else [3])
        seen = np.concatenate(batches)
        assert len(np.unique(seen)) == len(seen)
        if drop_last:
            assert len(seen) == 100 and set(seen) <= set(range(103))
        else:
            np.testing.assert_array_equal(np.sort(seen), np.arange(103))


def test_no_shuffle_is_sequential() -> None:
    plan = BatchPlan(num_samples=25, batch_size=10, shuffle=False, drop_last_batch=False, seed=0)
    np.testing.assert_array_equal(plan.global_indices(2), np.arange(20, 25))
    np.testing.assert_array_equal(plan.global_indices(3), np.arange(0, 10))  # epoch 1


def test_shuffle_determinism_and_epochs() -> None:
    kw = dict(num_samples=50, batch_size=8, shuffle=True, drop_last_batch=True)
    a, b = BatchPlan(seed=3, **kw), BatchPlan(seed=3, **kw)
    for step in (0, 5, 6, 17, 1000):
        np.testing.assert_array_equal(a.global_indices(step), b.global_indices(step))
    # Epoch order matches the documented recipe; epochs and seeds differ.
    np.testing.assert_array_equal(
        a.global_indices(a.steps_per_epoch), np.random.default_rng([3, 1]).permutation(50)[:8]
    )
    assert not np.array_equal(np.concatenate(epoch_batches(a, 0)), np.concatenate(epoch_batches(a, 1)))
    assert not np.array_equal(a.global_indices(0), BatchPlan(seed=4, **kw).global_indices(0))


def test_global_indices_is_a_copy() -> None:
    plan = BatchPlan(num_samples=20, batch_size=5, shuffle=True, drop_last_batch=False, seed=1)
    first = plan.global_indices(0)
    first[:] = -1
    assert (plan.global_indices(0) >= 0).all()


def test_batch_larger_than_data() -> None:
    with pytest.raises(DataError, match=r"batch_size 64.*size 10"):
        BatchPlan(num_samples=10, batch_size=64, shuffle=False, drop_last_batch=True, seed=0)
    plan = BatchPlan(num_samples=10, batch_size=64, shuffle=False, drop_last_batch=False, seed=0)
    assert plan.steps_per_epoch == 1
    np.testing.assert_array_equal(plan.global_indices(1), np.arange(10))


def test_bad_plan_arguments() -> None:
    with pytest.raises(DataError):
        BatchPlan(num_samples=10, batch_size=0, shuffle=False, drop_last_batch=False, seed=0)
    plan = BatchPlan(num_samples=10, batch_size=2, shuffle=False, drop_last_batch=False, seed=0)
    with pytest.raises(DataError):
        plan.global_indices(-1)


# --------------------------------------------------------------------------
# shard_rows / worker_steps
# --------------------------------------------------------------------------

@pytest.mark.parametrize("batch_len", [0, 1, 5, 7, 16, 100, 101])
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 7, 16])
def test_shard_rows_tile_batch(batch_len: int, num_ranks: int) -> None:
    rows = np.arange(batch_len)
    slices = [shard_rows(batch_len, r, num_ranks) for r in range(num_ranks)]
    np.testing.assert_array_equal(np.concatenate([rows[s] for s in slices]), rows)
    sizes = [s.stop - s.start for s in slices]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # earlier ranks take the extra rows
    assert all(s.step is None for s in slices)


def test_shard_rows_bad_rank() -> None:
    with pytest.raises(DataError):
        shard_rows(10, 2, 2)


@pytest.mark.parametrize("start,stop", [(0, 0), (0, 10), (3, 17), (5, 6), (12, 12), (9, 4)])
@pytest.mark.parametrize("num_workers", [1, 2, 3, 5])
def test_worker_steps_partition(start: int, stop: int, num_workers: int) -> None:
    parts = [worker_steps(start, stop, w, num_workers) for w in range(num_workers)]
    for w, steps in enumerate(parts):
        assert all(s % num_workers == w for s in steps)
    assert sorted(s for p in parts for s in p) == list(range(start, stop))


def test_worker_steps_bad_worker() -> None:
    with pytest.raises(DataError):
        worker_steps(0, 10, 3, 3)
