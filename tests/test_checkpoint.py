"""Tests for cs_runtime.checkpoint: round trip, plain-npz format, atomic writes,
discovery, pruning, compatibility checks and clear errors.

    python -m pytest tests/test_checkpoint.py -q
"""
from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest

from cs_runtime import checkpoint
from cs_runtime.numerics.model import mlp_spec
from cs_runtime.numerics.optim import Optimizer, OptimizerSpec
from cs_runtime.checkpoint import (
    Checkpoint,
    CheckpointError,
    check_compatible,
    latest,
    list_checkpoints,
    load,
    load_newest,
    prune,
    save,
)

META = {"model": {"name": "fc", "layers": [{"name": "fc0", "in_features": 4}]},
        "params": {"lr": 0.01, "betas": [0.9, 0.999], "note": "δ unicode"}, "input": {"step": 12}}


def make_checkpoint(step: int = 10, seed: int = 0) -> Checkpoint:
    rng = np.random.default_rng(seed)
    shapes = {"fc0": {"weight": (4, 3), "bias": (3,)}, "fc1": {"weight": (3, 2), "bias": (2,)}}
    weights = {l: {p: rng.standard_normal(s).astype(np.float32) for p, s in ps.items()}
               for l, ps in shapes.items()}
    opt = {l: {p: {"exp_avg": rng.standard_normal(s).astype(np.float32),
                   "exp_avg_sq": rng.random(s).astype(np.float32)} for p, s in ps.items()}
           for l, ps in shapes.items()}
    return Checkpoint(global_step=step, input_step=step + 2, weights=weights, opt_state=opt, meta=META)


def assert_same(a: Checkpoint, b: Checkpoint) -> None:
    assert (a.global_step, a.input_step, a.meta) == (b.global_step, b.input_step, b.meta)
    assert a.weights.keys() == b.weights.keys()
    for layer, params in a.weights.items():
        assert params.keys() == b.weights[layer].keys()
        for p, w in params.items():
            np.testing.assert_array_equal(w, b.weights[layer][p])
            assert w.dtype == b.weights[layer][p].dtype
            assert a.opt_state[layer][p].keys() == b.opt_state[layer][p].keys()
            for slot, v in a.opt_state[layer][p].items():
                np.testing.assert_array_equal(v, b.opt_state[layer][p][slot])


def files_in(path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# --------------------------------------------------------------------------
# round trip and format
# --------------------------------------------------------------------------

def test_flatten_is_the_archive_layout_and_unflatten_its_inverse():
    """One key scheme for the file and the wire (LOAD_MODEL, STATE)."""
    ck = make_checkpoint()
    flat = checkpoint.flatten(ck.weights, ck.opt_state)
    assert set(flat) == {f"model/{l}/{p}" for l in ck.weights for p in ck.weights[l]} | {
        f"optimizer/{l}/{p}/{s}" for l in ck.opt_state for p in ck.opt_state[l] for s in ck.opt_state[l][p]}
    weights, opt_state = checkpoint.unflatten(flat)
    assert_same(ck, Checkpoint(ck.global_step, ck.input_step, weights, opt_state, ck.meta))


def test_unflatten_for_checks_the_model_and_fills_missing_slots():
    ck = make_checkpoint()
    spec = mlp_spec("fc", [4, 3, 2], "relu", 0.0)
    flat = checkpoint.flatten(ck.weights, {})   # weights only: the slots start at zero
    weights, opt_state = checkpoint.unflatten_for(spec, Optimizer(OptimizerSpec("sgd", momentum=0.9)), flat)
    np.testing.assert_array_equal(weights["fc1"]["weight"], ck.weights["fc1"]["weight"])
    assert weights["fc1"]["weight"].flags.writeable
    assert not opt_state["fc0"]["bias"]["momentum"].any() and opt_state["fc0"]["bias"]["momentum"].shape == (3,)
    del flat["model/fc1/bias"]
    with pytest.raises(ValueError, match="fc1/bias missing or not of shape"):
        checkpoint.unflatten_for(spec, Optimizer(OptimizerSpec("sgd")), flat)


def test_save_load_round_trip(tmp_path):
    ck = make_checkpoint(step=200)
    path = save(tmp_path / "model_dir", ck)  # the folder is created
    assert path == tmp_path / "model_dir" / "checkpoint_200.npz"
    back = load(path)
    assert isinstance(back.global_step, int) and isinstance(back.input_step, int)
    assert_same(back, ck)


def test_round_trip_without_optimizer_slots(tmp_path):
    ck = make_checkpoint(step=1)
    ck.opt_state = {}
    back = load(save(tmp_path, ck))
    assert back.opt_state == {}
    assert back.weights.keys() == ck.weights.keys()


def test_file_is_a_plain_npz(tmp_path):
    ck = make_checkpoint(step=7)
    path = save(tmp_path, ck)
    with np.load(path, allow_pickle=False) as archive:
        keys = set(archive.files)
        assert keys == {"global_step", "input_step", "meta",
                        *(f"model/{l}/{p}" for l in ck.weights for p in ck.weights[l]),
                        *(f"optimizer/{l}/{p}/{s}" for l in ck.opt_state for p in ck.opt_state[l]
                          for s in ck.opt_state[l][p])}
        assert int(archive["global_step"]) == 7 and int(archive["input_step"]) == 9
        assert archive["global_step"].dtype == np.int64
        assert json.loads(str(archive["meta"])) == META
        np.testing.assert_array_equal(archive["model/fc0/weight"], ck.weights["fc0"]["weight"])
        np.testing.assert_array_equal(archive["optimizer/fc1/bias/exp_avg_sq"],
                                      ck.opt_state["fc1"]["bias"]["exp_avg_sq"])


def test_saving_the_same_step_again_replaces_it(tmp_path):
    save(tmp_path, make_checkpoint(step=5, seed=1))
    second = make_checkpoint(step=5, seed=2)
    save(tmp_path, second)
    assert files_in(tmp_path) == ["checkpoint_5.npz"]
    assert_same(load(tmp_path / "checkpoint_5.npz"), second)


# --------------------------------------------------------------------------
# atomicity
# --------------------------------------------------------------------------

@pytest.mark.parametrize("exc", [OSError("disk full"), KeyboardInterrupt()])
def test_failed_save_leaves_previous_checkpoint_intact(tmp_path, monkeypatch, exc):
    good = make_checkpoint(step=10)
    save(tmp_path, good)
    before = (tmp_path / "checkpoint_10.npz").read_bytes()

    def broken_savez(file, *args, **kwargs):
        file.write(b"PK\x03\x04 half an archive")
        raise exc

    monkeypatch.setattr(checkpoint.np, "savez", broken_savez)
    with pytest.raises(type(exc)):
        save(tmp_path, make_checkpoint(step=20), max_checkpoints=1)
    monkeypatch.undo()

    assert files_in(tmp_path) == ["checkpoint_10.npz"]  # no checkpoint_20, no temp file
    assert (tmp_path / "checkpoint_10.npz").read_bytes() == before
    assert latest(tmp_path) == tmp_path / "checkpoint_10.npz"
    assert_same(load(tmp_path / "checkpoint_10.npz"), good)


def test_failed_overwrite_of_the_same_step_keeps_the_old_file(tmp_path, monkeypatch):
    good = make_checkpoint(step=3)
    save(tmp_path, good)

    def broken_savez(file, *args, **kwargs):
        file.write(b"garbage")
        raise RuntimeError("boom")

    monkeypatch.setattr(checkpoint.np, "savez", broken_savez)
    with pytest.raises(RuntimeError):
        save(tmp_path, make_checkpoint(step=3, seed=9))
    monkeypatch.undo()
    assert files_in(tmp_path) == ["checkpoint_3.npz"]
    assert_same(load(tmp_path / "checkpoint_3.npz"), good)


# --------------------------------------------------------------------------
# discovery and pruning
# --------------------------------------------------------------------------

def test_latest_is_numeric_and_ignores_everything_else(tmp_path):
    assert latest(tmp_path) is None
    assert latest(tmp_path / "does_not_exist") is None
    for step in (20, 100, 3):
        save(tmp_path, make_checkpoint(step=step))
    for junk in (".checkpoint_500.abc123.tmp", "checkpoint_900.npz.tmp", "checkpoint_x.npz",
                 "checkpoint_1000.npy", "checkpoint_-5.npz", "other_2000.npz"):
        (tmp_path / junk).write_bytes(b"junk")
    (tmp_path / "subdir").mkdir()
    assert latest(tmp_path) == tmp_path / "checkpoint_100.npz"  # 100 > 20, though "20" > "100"
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 20, 100]


def test_save_prunes_to_the_newest_n(tmp_path):
    for step in (1, 2, 10, 30, 200):
        save(tmp_path, make_checkpoint(step=step), max_checkpoints=2)
    assert files_in(tmp_path) == ["checkpoint_200.npz", "checkpoint_30.npz"]


@pytest.mark.parametrize("keep", [1, 2, 3, 10])
def test_prune_keeps_newest(tmp_path, keep):
    steps = [5, 50, 9, 100]
    for step in steps:
        save(tmp_path, make_checkpoint(step=step))
    (tmp_path / ".checkpoint_7.x.tmp").write_bytes(b"")
    prune(tmp_path, keep)
    assert [s for s, _ in list_checkpoints(tmp_path)] == sorted(steps)[-keep:]
    assert (tmp_path / ".checkpoint_7.x.tmp").exists()  # prune touches checkpoints only


# --------------------------------------------------------------------------
# compatibility and errors
# --------------------------------------------------------------------------

def test_check_compatible_accepts_a_match():
    ck = make_checkpoint()
    expected = {l: {p: w.shape for p, w in ps.items()} for l, ps in ck.weights.items()}
    check_compatible(ck, expected, "ck.npz")


def test_check_compatible_lists_every_problem_in_one_line():
    ck = make_checkpoint()
    expected = {"fc0": {"weight": (4, 5), "bias": (3,)},        # fc0/weight mis-shaped
                "fc1": {"weight": (3, 2), "bias": (2,), "scale": (2,)},  # fc1/scale missing
                "fc2": {"weight": (2, 2)}}                       # fc2/weight missing
    ck.weights["fc1"]["extra"] = np.zeros(1, np.float32)         # unexpected param
    ck.weights["fc9"] = {"weight": np.zeros((1, 1), np.float32)}  # unexpected layer
    with pytest.raises(CheckpointError) as info:
        check_compatible(ck, expected, "model_dir/checkpoint_9.npz")
    msg = str(info.value)
    assert "\n" not in msg
    assert "model_dir/checkpoint_9.npz" in msg
    for part in ("fc0/weight has shape (4, 3), model needs (4, 5)", "fc1/scale missing",
                 "fc2/weight missing", "fc1/extra", "fc9/weight", "unexpected"):
        assert part in msg, (part, msg)
    assert "fc0/bias" not in msg and "fc1/weight" not in msg


def test_load_missing_file_names_it(tmp_path):
    path = tmp_path / "checkpoint_42.npz"
    with pytest.raises(CheckpointError, match="checkpoint_42.npz"):
        load(path)


def _corruptions(raw: bytes) -> dict[str, bytes]:
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0xFF  # inside an array: the zip CRC catches it
    return {"empty": b"", "garbage": b"not a zip at all" * 8, "truncated": raw[: len(raw) // 2],
            "tail_cut": raw[:-10], "bit_flip": bytes(flipped)}


@pytest.mark.parametrize("kind", ["empty", "garbage", "truncated", "tail_cut", "bit_flip"])
def test_load_corrupt_file_raises_checkpoint_error_naming_it(tmp_path, kind):
    good = save(tmp_path, make_checkpoint(step=8))
    bad = tmp_path / "checkpoint_9.npz"
    bad.write_bytes(_corruptions(good.read_bytes())[kind])
    with pytest.raises(CheckpointError) as info:
        load(bad)
    assert "checkpoint_9.npz" in str(info.value)


def test_load_npz_missing_required_keys(tmp_path):
    path = tmp_path / "checkpoint_1.npz"
    np.savez(path, **{"model/fc0/weight": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointError, match="checkpoint_1.npz"):
        load(path)


def test_load_refuses_pickled_content(tmp_path):
    path = tmp_path / "checkpoint_1.npz"
    np.savez(path, global_step=np.int64(1), input_step=np.int64(1), meta=np.array("{}"),
             evil=np.array([object()], dtype=object))
    with pytest.raises(CheckpointError, match="checkpoint_1.npz"):
        load(path)


# --------------------------------------------------------------------------
# kill -9 at any moment of a save (no exception handler runs)
# --------------------------------------------------------------------------

# Runs in a child process: saves checkpoint 30 and blocks at `where`, reporting
# "blocked" on stdout; the test then kills it with SIGKILL.
CRASHING_SAVE = r"""
import io, os, sys
import numpy as np
from cs_runtime import checkpoint
from tests.test_checkpoint import make_checkpoint

model_dir, where = sys.argv[1], sys.argv[2]

def block(*_):
    print("blocked", flush=True)
    sys.stdin.read()          # until the parent kills us

if where == "mid_write":
    real_savez = np.savez
    def half_savez(f, **arrays):
        buf = io.BytesIO()
        real_savez(buf, **arrays)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        f.flush()
        block()
    np.savez = half_savez
elif where == "before_rename":
    os.replace = block
elif where == "before_prune":
    checkpoint.prune = block
checkpoint.save(model_dir, make_checkpoint(step=30, seed=3), max_checkpoints=2)
"""


def crash_during_save(model_dir, where: str) -> None:
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_SAVE, str(model_dir), where], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "blocked"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.cluster
@pytest.mark.parametrize("where", ["mid_write", "before_rename"])
def test_kill_9_during_a_save_keeps_the_previous_checkpoint(tmp_path, where):
    previous = make_checkpoint(step=20, seed=2)
    save(tmp_path, make_checkpoint(step=10, seed=1), max_checkpoints=2)
    save(tmp_path, previous, max_checkpoints=2)
    crash_during_save(tmp_path, where)
    leftovers = list(tmp_path.glob(".checkpoint_30.*.tmp"))
    assert len(leftovers) == 1 and leftovers[0].stat().st_size > 0  # really killed mid-save
    # The half-written file is never picked, the previous one loads, nothing was pruned.
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10, 20]
    assert_same(load(latest(tmp_path)), previous)
    # The next save (a restarted chief) clears the leftover and prunes as usual.
    save(tmp_path, make_checkpoint(step=40), max_checkpoints=2)
    assert files_in(tmp_path) == ["checkpoint_20.npz", "checkpoint_40.npz"]


@pytest.mark.cluster
def test_kill_9_before_pruning_keeps_every_checkpoint(tmp_path):
    for step in (10, 20):
        save(tmp_path, make_checkpoint(step=step), max_checkpoints=2)
    crash_during_save(tmp_path, "before_prune")
    # The new checkpoint is complete before any old one is deleted.
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10, 20, 30]
    assert_same(load(latest(tmp_path)), make_checkpoint(step=30, seed=3))
    save(tmp_path, make_checkpoint(step=40), max_checkpoints=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [30, 40]


# --------------------------------------------------------------------------
# a full or read-only disk, and falling back to an older checkpoint
# --------------------------------------------------------------------------

@pytest.mark.parametrize("code, why", [(errno.ENOSPC, "no space left on the device (ENOSPC)"),
                                       (errno.EROFS, "the file system is read-only (EROFS)")])
def test_a_full_or_read_only_disk_is_one_line_and_keeps_the_checkpoints(tmp_path, monkeypatch, code, why):
    for step in (10, 20):
        save(tmp_path, make_checkpoint(step=step), max_checkpoints=2)
    before = {name: (tmp_path / name).read_bytes() for name in files_in(tmp_path)}

    def disk_error(file, *args, **kwargs):
        file.write(b"PK\x03\x04 the start of an archive")
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(checkpoint.np, "savez", disk_error)
    with pytest.raises(CheckpointError) as caught:
        save(tmp_path, make_checkpoint(step=30), max_checkpoints=2)
    assert str(caught.value) == (f"cannot write checkpoint {tmp_path / 'checkpoint_30.npz'}: {why}; "
                                 "checkpoints kept: checkpoint_10.npz, checkpoint_20.npz")
    assert caught.value.__cause__ is None and caught.value.__suppress_context__   # no chained tracebacks
    assert {name: (tmp_path / name).read_bytes() for name in files_in(tmp_path)} == before


def test_other_os_errors_still_propagate(tmp_path, monkeypatch):
    def io_error(file, *args, **kwargs):
        raise OSError(errno.EIO, "I/O error")
    monkeypatch.setattr(checkpoint.np, "savez", io_error)
    with pytest.raises(OSError) as caught:
        save(tmp_path, make_checkpoint(step=30))
    assert caught.value.errno == errno.EIO and not isinstance(caught.value, CheckpointError)


def test_load_newest_skips_a_truncated_latest_and_says_why(tmp_path):
    for step in (10, 20, 30):
        save(tmp_path, make_checkpoint(step=step, seed=step))
    cut = tmp_path / "checkpoint_30.npz"
    cut.write_bytes(cut.read_bytes()[:-8])
    state, path, skipped = load_newest(tmp_path)
    assert path == tmp_path / "checkpoint_20.npz"
    assert_same(state, make_checkpoint(step=20, seed=20))
    assert len(skipped) == 1 and skipped[0].startswith(f"checkpoint {cut} is corrupt (")


def test_load_newest_of_nothing_is_none_and_of_only_bad_files_an_error(tmp_path):
    assert load_newest(tmp_path) is None
    for step in (1, 2):
        (tmp_path / f"checkpoint_{step}.npz").write_bytes(b"not an archive")
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* loads: checkpoint .*checkpoint_2.npz is "
                                              r"corrupt .*; checkpoint .*checkpoint_1.npz is corrupt"):
        load_newest(tmp_path)


@pytest.mark.cluster
def test_an_adam_checkpoint_without_step_counts_resumes_as_it_would_have(tmp_path):
    """Checkpoints written before Adam's step count was state lack the `step`
    slots; every step counted then, so the count goes on from the global step
    and the resumed run equals the uninterrupted one bit for bit."""
    from tests.cluster_utils import final_weights, run_cpu, write_params
    params = write_params(tmp_path, optimizer={"optimizer_type": "adamw", "learning_rate": 0.001,
                                               "weight_decay": 0.01},
                          runconfig={"max_steps": 20, "checkpoint_steps": 10, "log_steps": 10})
    full = run_cpu(params, tmp_path / "full")
    assert full.returncode == 0, full.stdout + full.stderr
    with np.load(tmp_path / "full" / "checkpoint_10.npz") as ck:
        arrays = {k: ck[k] for k in ck.files}
    assert float(arrays["optimizer/fc0/weight/step"]) == 10
    old = {k: v for k, v in arrays.items() if not k.endswith("/step")}
    np.savez(tmp_path / "old_10.npz", **old)
    resumed = run_cpu(params, tmp_path / "resumed", "train", "--checkpoint_path", str(tmp_path / "old_10.npz"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    want, got = final_weights(tmp_path / "full"), final_weights(tmp_path / "resumed")
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    with np.load(tmp_path / "resumed" / "checkpoint_20.npz") as ck:
        assert float(ck["optimizer/fc0/weight/step"]) == 20     # and it is saved from now on


def test_a_corrupt_latest_is_called_corrupt_set_aside_and_named(tmp_path):
    for step in (10, 20):
        save(tmp_path, make_checkpoint(step=step, seed=step))
    bad = tmp_path / "checkpoint_20.npz"
    bad.write_bytes(b"garbage, not a zip")
    state, path, skipped = load_newest(tmp_path, set_aside=True)
    assert path == tmp_path / "checkpoint_10.npz" and state.global_step == 10
    assert skipped == [f"checkpoint {bad} is corrupt (not a NumPy archive); set aside as checkpoint_20.npz.corrupt"]
    assert "allow_pickle" not in skipped[0]
    # Kept, byte for byte, where the next save of step 20 cannot overwrite it.
    assert (tmp_path / "checkpoint_20.npz.corrupt").read_bytes() == b"garbage, not a zip" and not bad.exists()
    save(tmp_path, make_checkpoint(step=20, seed=20))
    assert (tmp_path / "checkpoint_20.npz.corrupt").read_bytes() == b"garbage, not a zip"


@pytest.mark.parametrize("kind", ["directory", "fifo", "dangling symlink"])
def test_resume_falls_back_past_what_is_not_a_checkpoint_file(tmp_path, kind):
    save(tmp_path, make_checkpoint(step=10, seed=10))
    odd = tmp_path / "checkpoint_20.npz"
    if kind == "directory":
        odd.mkdir()
    elif kind == "fifo":
        os.mkfifo(odd)
    else:
        odd.symlink_to(tmp_path / "gone.npz")
    state, path, skipped = load_newest(tmp_path, set_aside=True)
    assert path == tmp_path / "checkpoint_10.npz" and state.global_step == 10
    said = {"directory": "a directory", "fifo": "a FIFO", "dangling symlink": f"a dangling symlink (to {tmp_path / 'gone.npz'})"}
    assert skipped == [f"{odd}: {said[kind]}, not a checkpoint"]
    assert os.path.lexists(odd)   # not ours to move
    prune(tmp_path, 1)            # nor to delete
    assert os.path.lexists(odd) and list_checkpoints(tmp_path) == [(10, tmp_path / "checkpoint_10.npz")]


def test_only_non_files_at_checkpoint_names_is_nothing_to_resume_said(tmp_path):
    (tmp_path / "checkpoint_5.npz").mkdir()
    assert load_newest(tmp_path) == (None, None, [f"{tmp_path / 'checkpoint_5.npz'}: a directory, not a checkpoint"])
    with pytest.raises(CheckpointError, match=r"checkpoint_5.npz is a directory, not a checkpoint file"):
        load(tmp_path / "checkpoint_5.npz")


def test_a_checkpoint_of_another_model_is_named_as_such(tmp_path):
    ck = make_checkpoint()
    ck.meta = {**ck.meta, "model": {"name": "fc_mnist"}}
    expected = {"embed": {"tokens": (50257, 768)}, **{f"h{i}": {"w": (768, 768)} for i in range(12)}}
    with pytest.raises(CheckpointError) as caught:
        check_compatible(ck, expected, tmp_path / "checkpoint_10.npz", builds="gpt2")
    assert str(caught.value) == (f"checkpoint {tmp_path / 'checkpoint_10.npz'} is of model fc_mnist; this run builds "
                                 "gpt2 (another --model_dir, or --checkpoint_path of a gpt2 checkpoint)")
    # Of the same model, the mismatch is listed, the first few only: one short line.
    with pytest.raises(CheckpointError) as caught:
        check_compatible(ck, expected, "c.npz", builds="fc_mnist")
    assert "does not match the model" in str(caught.value) and "more" in str(caught.value)
    assert len(str(caught.value)) < 400
