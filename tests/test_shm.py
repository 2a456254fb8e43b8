"""Shared memory for the weight stream: arenas, references, and what a receiver refuses."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cs_runtime.wire import shm
from cs_runtime.wire.protocol import PROTOCOL_VERSION, Message, Msg, ProtocolError, decode, encode, frames_for
from tests.cluster_utils import (
    FC_MNIST,
    assert_matches_oracle,
    final_weights,
    run_wse,
    tool,
    train_losses,
    write_params,
)

BIG = shm.MIN_SHARED_BYTES // 4 * 2       # float32 elements: twice the sharing threshold


@pytest.fixture
def two_processes(tmp_path):
    """A sender's arena and a receiver's Segments over one folder, as two processes see them."""
    sender = shm.Segments(tmp_path)
    arena = shm.Arena(tmp_path, "cs-job1-memoryx0-1", shm.arena_bytes([(BIG,), (BIG,)], 4))
    sender.add_arena(arena)
    yield sender, arena, shm.Segments(tmp_path)
    arena.close()


def weights_message(arrays: dict) -> Message:
    return Message(Msg.WEIGHTS, step=1, layer=0, meta={"phase": "fwd"}, arrays=arrays)


def test_arrays_in_an_arena_travel_by_reference_and_arrive_intact(two_processes):
    sender, arena, receiver = two_processes
    w = arena.empty((BIG,), np.float32)
    w[:] = np.arange(BIG, dtype=np.float32)
    small = np.ones(4, np.float32)
    frames = encode(weights_message({"weight": w, "bias": small}), sender)
    assert len(frames) == 2                            # the header and the small array's frame only
    got = decode(frames, receiver).arrays
    np.testing.assert_array_equal(got["weight"], w)
    np.testing.assert_array_equal(got["bias"], small)
    assert not got["weight"].flags.writeable
    w[0] = -1.0                                        # the receiver reads the sender's memory itself
    assert got["weight"][0] == -1.0


def test_a_received_shared_array_is_sent_on_by_reference(two_processes):
    sender, arena, middle = two_processes
    w = arena.copy_of(np.ones(BIG, np.float32))
    passed_on = decode(encode(weights_message({"weight": w}), sender), middle).arrays["weight"]
    frames = encode(weights_message({"weight": passed_on}), middle)
    assert len(frames) == 1
    np.testing.assert_array_equal(decode(frames, shm.Segments(arena.path.parent)).arrays["weight"], w)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16"])
def test_swarmx_sums_gradients_into_its_arena_and_sends_them_on_by_reference(two_processes, fmt):
    from cs_runtime.numerics import precision as P
    from cs_runtime.swarmx.server import reduce_messages
    sender, arena, receiver = two_processes
    rng = np.random.default_rng(3)
    parts = [P.quantize(rng.standard_normal(BIG).astype(np.float32), fmt) for _ in range(3)]
    msgs = [Message(Msg.GRADS, step=1, layer=0, meta={"format": fmt}, arrays=P.encode_arrays({"weight": p}, fmt))
            for p in parts]
    into = {"weight": arena.empty((BIG,), np.float32)}   # sums are float32 in every format
    reduced = reduce_messages(msgs, into)
    assert reduced.arrays["weight"] is into["weight"]
    frames = encode(reduced, sender)
    assert sum(len(memoryview(f)) for f in frames) < BIG      # a reference, not the tensor
    got = decode(frames, receiver)
    want = reduce_messages(msgs).arrays["weight"]             # the sum without buffers
    assert got.meta["format"] == "float32"
    np.testing.assert_array_equal(got.arrays["weight"], want)


def test_without_shared_memory_arrays_go_as_frames_and_references_are_refused(two_processes):
    sender, arena, _ = two_processes
    w = arena.copy_of(np.ones(BIG, np.float32))
    assert len(encode(weights_message({"weight": w}))) == 1 + frames_for(w.nbytes)   # no Segments: frames
    with pytest.raises(ProtocolError, match="does not share memory"):
        decode(encode(weights_message({"weight": w}), sender))


def reference(name: str, offset: int = 0, shape=(4,)) -> list:
    header = {"t": "weights", "v": PROTOCOL_VERSION, "job": "", "step": 0, "layer": 0, "meta": {"phase": "fwd"},
              "arrays": [["weight", "float32", list(shape), name, offset]]}
    import msgpack
    return [msgpack.packb(header)]


@pytest.mark.parametrize("name, offset, why", [
    ("cs-job1-memoryx0-1", 2 ** 40, "outside the segment"),
    ("cs-job1-memoryx0-1", -8, "outside the segment"),
    ("cs-../../etc/passwd", 0, "bad segment name"),
    ("passwd", 0, "bad segment name"),
    ("cs-no-such-segment", 0, "No such file"),
])
def test_a_bad_reference_is_refused_before_anything_is_read(two_processes, name, offset, why):
    _, _, receiver = two_processes
    with pytest.raises(ProtocolError, match=re.escape(why)):
        decode(reference(name, offset), receiver)


def test_a_segment_of_another_user_is_refused(tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root to make a file owned by another user")
    path = tmp_path / "cs-job1-stranger-1"
    path.write_bytes(bytes(1024))
    os.chown(path, 65534, 65534)
    with pytest.raises(ProtocolError, match="belongs to uid 65534"):
        decode(reference(path.name), shm.Segments(tmp_path))


def make_directory(path: Path) -> None:
    path.mkdir()


def make_fifo(path: Path) -> None:
    os.mkfifo(path, 0o600)   # opened blocking, this would wait for a writer forever


def make_symlink(path: Path) -> None:
    target = path.parent / "elsewhere"
    target.write_bytes(bytes(1024))
    path.symlink_to(target)


def make_empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("make, why", [(make_directory, "is not a regular file"),
                                       (make_fifo, "is not a regular file"),
                                       (make_symlink, "Too many levels of symbolic links"),
                                       (make_empty, "is empty")])
def test_anything_but_a_regular_file_named_like_a_segment_is_a_protocol_error(tmp_path, make, why):
    path = tmp_path / "cs-job1-wse0-1"
    make(path)
    with pytest.raises(ProtocolError, match=re.escape(why)):
        decode(reference(path.name), shm.Segments(tmp_path, job="job1"))


# A folder of things a peer might name: one good segment among look-alikes.
SEGMENT_LOOKALIKES = {"cs-job1-memoryx0-1": None, "cs-job1-dir": make_directory, "cs-job1-fifo": make_fifo,
                      "cs-job1-link": make_symlink, "cs-job1-empty": make_empty}


@pytest.fixture(scope="module")
def lookalikes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shm")
    arena = shm.Arena(folder, "cs-job1-memoryx0-1", 4096)
    for name, make in SEGMENT_LOOKALIKES.items():
        if make is not None:
            make(folder / name)
    yield folder
    arena.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(SEGMENT_LOOKALIKES) + ["cs-job2-x", "cs-job1-none", "../x", "", "cs-"])
       | st.text(max_size=30),
       offset=st.integers(-2 ** 63, 2 ** 64 - 1) | st.sampled_from([0, 64, 4032, 4096]) | st.floats() | st.text(max_size=4),
       dtype=st.sampled_from(["float32", "uint16", "int64", "object", "xx"]),
       shape=st.lists(st.integers(-2, 2 ** 40) | st.sampled_from([0, 1, 16, 1024]), max_size=3))
def test_fuzz_shared_memory_references_give_an_array_in_bounds_or_a_protocol_error(lookalikes, name, offset,
                                                                                 dtype, shape):
    """A reference to anything (look-alikes, bounds, dtypes, shapes) never blocks, never raises
    anything but ProtocolError, and what it gives lies inside the one real segment."""
    import msgpack
    header = {"t": "weights", "v": PROTOCOL_VERSION, "job": "", "step": 0, "layer": 0, "meta": {"phase": "fwd"},
              "arrays": [["weight", dtype, shape, name, offset]]}
    try:
        got = decode([msgpack.packb(header)], shm.Segments(lookalikes, job="job1")).arrays["weight"]
    except ProtocolError:
        return
    assert name == "cs-job1-memoryx0-1" and 0 <= offset and offset + got.nbytes <= 4096
    assert not got.flags.writeable


def test_a_segment_of_another_job_is_refused(two_processes, tmp_path):
    """A CS system serves many jobs: a process of one job never maps another job's segment."""
    sender, arena, _ = two_processes
    other_job = shm.Segments(tmp_path, job="job2")
    frames = encode(weights_message({"weight": arena.copy_of(np.ones(BIG, np.float32))}), sender)
    with pytest.raises(ProtocolError, match="is not of this job"):
        decode(frames, other_job)
    assert decode(frames, shm.Segments(tmp_path, job="job1")).arrays["weight"].sum() == BIG


def test_an_arena_refuses_to_overflow_and_aligns_its_arrays(tmp_path):
    arena = shm.Arena(tmp_path, "cs-job2-wse0-1", 1000)
    try:
        a = arena.empty((3,), np.float32)
        b = arena.empty((5,), np.float64)
        assert b.ctypes.data % shm.ALIGN == 0 and b.ctypes.data - a.ctypes.data == shm.ALIGN
        with pytest.raises(MemoryError, match="do not fit"):
            arena.empty((1000,), np.float32)
        assert oct(arena.path.stat().st_mode & 0o777) == "0o600"
    finally:
        arena.close()
    assert not arena.path.exists()


def test_remove_job_segments_deletes_that_job_only(tmp_path):
    for name in ("cs-jobA-wse0-1", "cs-jobA-memoryx0-1", "cs-jobB-wse0-1"):
        (tmp_path / name).write_bytes(b"x")
    assert shm.remove_job_segments(tmp_path, "jobA") == 2
    assert [p.name for p in tmp_path.iterdir()] == ["cs-jobB-wse0-1"]


# ---------------------------------------------------------------- whole jobs

def job_segments(output: str) -> list[str]:
    """The segments left in /dev/shm by the job whose launcher wrote `output`."""
    job = re.search(r"job (wsjob-[0-9a-f]+)", output)
    assert job, output
    return [p.name for p in Path("/dev/shm").glob(f"{shm.segment_prefix(job.group(1))}*")]


def test_shared_memory_and_tcp_runs_both_match_the_oracle_and_leave_no_segment(tmp_path, oracle):
    params = oracle[0]
    shared = run_wse(params, tmp_path / "shm")
    assert shared.returncode == 0, shared.stdout + shared.stderr
    assert "via shared memory" in shared.stdout
    tcp = run_wse(params, tmp_path / "tcp", extra_launcher=("--no_shm",))
    assert tcp.returncode == 0, tcp.stdout + tcp.stderr
    assert "via tcp" in tcp.stdout
    for run in ("shm", "tcp"):
        assert_matches_oracle(tmp_path / run, oracle)
    np.testing.assert_array_equal(train_losses(tmp_path / "shm"), train_losses(tmp_path / "tcp"))
    want, got = final_weights(tmp_path / "tcp"), final_weights(tmp_path / "shm")
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    assert job_segments(shared.stderr) == []


def test_a_killed_job_leaves_no_segment(tmp_path, oracle):
    """kill -9 of MemoryX mid-run: its arena is not unlinked by itself; the launcher removes it."""
    params = write_params(tmp_path, runconfig={"max_steps": 100000, "log_steps": 1})
    cmd = [tool("csrun_wse"), sys.executable, FC_MNIST, "--mode", "train", "--params", str(params),
           "--model_dir", str(tmp_path / "md")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in proc.stdout:                       # the first progress line: streaming is under way
            seen.append(line)
            if line.startswith("| Train"):
                break
        running = job_segments("".join(seen))
        # MemoryX's weights, the WSE's gradients, and the input worker's batch slots
        assert {name.split("-")[3].rstrip("0123456789") for name in running} >= {"memoryx", "wse", "worker"}, running
        pid = next(int(p) for p in subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "cs_runtime.memoryx"],
                                                  capture_output=True, text=True).stdout.split())
        os.kill(pid, 9)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0 and "memoryx" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert job_segments("".join(seen)) == []


@pytest.mark.cluster
def test_segments_of_a_dead_launcher_are_removed_and_a_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()                                        # a pid that no longer runs
    orphan = tmp_path / f"cs-wsjob-a-memoryx0-1-l{dead.pid}"
    live = tmp_path / f"cs-wsjob-b-memoryx0-1-l{os.getpid()}"
    other = tmp_path / "cs-wsjob-c-memoryx0-1"         # no launcher named: left alone
    for path in (orphan, live, other):
        path.write_bytes(b"x")
    assert shm.remove_orphaned_segments(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])
