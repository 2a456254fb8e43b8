"""The chief's TensorBoard writers: on a full disk one line and exit 2, never a traceback or a hang;
events in order; and no torch imported for them.

    python -m pytest tests/test_summaries.py -q
"""
from __future__ import annotations

import errno
import importlib.util
import subprocess
import sys
import threading

import pytest

pytest.importorskip("tensorboardX", reason="the chief's summaries are written with tensorboardX")

from chief import summaries as summaries_module  # noqa: E402
from chief.summaries import Summaries  # noqa: E402
from cs_runtime.run_args import RunError  # noqa: E402
from tests.cluster_utils import REPO  # noqa: E402


def full_disk(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_in_tensorboardXs_thread_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    exits, hook = [], threading.excepthook
    monkeypatch.setattr(summaries_module.os, "_exit", exits.append)   # the hook would end pytest
    summaries = Summaries(tmp_path)
    summaries.exit_on_disk_errors()
    try:
        writer = summaries.writer("train")
        event_writer = writer.file_writer.event_writer
        monkeypatch.setattr(event_writer._ev_writer, "write_event", full_disk)
        writer.add_scalar("loss", 1.0, 1)
        event_writer._worker.join(10)   # the writer thread died of it (its queue would now fill and block)
        assert exits == [2]
        assert capsys.readouterr().out == (f"error: cannot write TensorBoard summaries under {tmp_path}: "
                                           "no space left on the device (ENOSPC)\n")
    finally:
        summaries.abandon()
        threading.excepthook = hook


def test_a_full_disk_at_a_flush_is_a_run_error_and_leaves_atexit_nothing_to_retry(tmp_path, monkeypatch):
    summaries = Summaries(tmp_path)
    writer = summaries.writer("train")
    event_writer = writer.file_writer.event_writer
    monkeypatch.setattr(event_writer._ev_writer, "flush", full_disk)
    with pytest.raises(RunError, match=r"^cannot write TensorBoard summaries under .*/train: no space left on the "
                                       r"device \(ENOSPC\)$"):
        summaries.flush()
    summaries.abandon()
    event_writer.close()   # what tensorboardX's atexit clean-up calls: nothing left to fail
    assert summaries.writers == {}


def test_scalars_reach_the_file_in_order_through_a_thread_queue(tmp_path):
    """The writer thread's queue passes events by reference (no multiprocessing queue: it pickled
    each event through a pipe); tensorboardX's module is left as it was; the file holds every event."""
    import multiprocessing
    import struct

    from tensorboardX import event_file_writer
    from tensorboardX.proto import event_pb2

    s = Summaries(tmp_path)
    writer = s.writer("train")
    assert isinstance(writer.file_writer.event_writer._event_queue, summaries_module._ThreadQueue)
    assert event_file_writer.multiprocessing is multiprocessing
    for step in range(1, 26):
        writer.add_scalar("loss", 1.0 / step, step)
    s.close()
    (path,) = (tmp_path / "train").glob("events*")
    data, at, got = path.read_bytes(), 0, []
    while at < len(data):
        size = struct.unpack("<Q", data[at:at + 8])[0]
        event = event_pb2.Event.FromString(data[at + 12:at + 12 + size])
        at += 16 + size
        got += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
    assert got == [(step, "loss", pytest.approx(1.0 / step)) for step in range(1, 26)]


def read_scalars(folder):
    import struct

    from tensorboardX.proto import event_pb2
    (path,) = folder.glob("events*")
    data, at, got = path.read_bytes(), 0, []
    while at < len(data):
        size = struct.unpack("<Q", data[at:at + 8])[0]
        event = event_pb2.Event.FromString(data[at + 12:at + 12 + size])
        at += 16 + size
        got += [(event.step, v.tag, v.simple_value, event.wall_time) for v in event.summary.value]
    return got


def test_held_scalars_are_on_disk_in_order_after_a_flush(tmp_path):
    """Summaries.scalar holds scalars and hands them to the writer thread SCALAR_BATCH at a time:
    a flush writes what is held and waits for the thread, so the file has every one, in order,
    with the wall time of its call, before the writer is closed."""
    s = Summaries(tmp_path)
    count = summaries_module.SCALAR_BATCH + 7   # one batch handed over by count, the rest by the flush
    for step in range(1, count + 1):
        s.scalar("train", "loss", 1.0 / step, step)
        s.scalar("train", "rate", float(step), step)
    held = [(step, tag, value) for step in range(1, count + 1) for tag, value in (("loss", 1.0 / step), ("rate", step))]
    s.flush()
    got = read_scalars(tmp_path / "train")
    assert [g[:2] for g in got] == [h[:2] for h in held]
    assert [g[2] for g in got] == pytest.approx([h[2] for h in held])
    assert all(a[3] <= b[3] for a, b in zip(got, got[1:]))   # each its call's wall time, in order
    s.scalar("train", "loss", 0.5, count + 1)
    s.close()
    assert read_scalars(tmp_path / "train")[-1][:3] == (count + 1, "loss", 0.5)


@pytest.mark.cluster
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed: nothing to keep out")
def test_the_chiefs_writer_does_not_import_torch_and_a_script_still_can(tmp_path):
    """tensorboardX's writer imports torch when it can (1.1 s and a few hundred MB per chief)."""
    check = ("import sys; from chief.summaries import summary_writer\n"
             f"writer = summary_writer({str(tmp_path)!r}); writer.add_scalar('loss', 1.5, 1); writer.close()\n"
             "assert 'torch' not in sys.modules, 'torch was imported'\n"
             "import torch; print(torch.zeros(2).sum().item())\n")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "0.0", done.stderr[-2000:]
    assert list(tmp_path.glob("events.out.tfevents.*"))
