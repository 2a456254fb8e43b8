"""The chief's TensorBoard event files (tensorboardX), and a full disk met while writing them.

tensorboardX writes events from a thread of its own. A write there that meets a
full or read-only disk kills that thread with a traceback; after it, adding an
event blocks as soon as the thread's queue is full (the chief hangs), and the
writer's atexit clean-up prints another traceback. Here such an error, in that
thread or in a flush or close of ours, is one line naming the folder and the
cause and exit code 2 (EXIT_BAD_INPUT), as for a checkpoint that cannot be
written: a restart would meet the same disk, and the checkpoints already
written stay as they are.

Scalars (every step's loss, and a log step's rates and norms) are held here and
handed to the writer thread SCALAR_BATCH at a time, as one item of its queue
that the queue unpacks into the same events in the same order (_ThreadQueue):
a scalar then costs the step an append, not tensorboardX's checks, protobuf and
a hand-off to the thread (about 18 us of the chief's thread and 17 of the
writer's each, measured). A flush hands over what is held and waits until the
thread has written everything queued before it, so what a checkpoint says is
on disk is.
"""
from __future__ import annotations

import errno
import os
import queue
import sys
import threading
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

from cs_runtime.checkpoint import DISK_ERRNOS
from cs_runtime.errors import EXIT_BAD_INPUT
from cs_runtime.run_args import RunError

# Scalars held before they go to the writer thread as one item: a few log steps' worth,
# so the thread wakes rarely; every flush and close hands over the rest.
SCALAR_BATCH = 64
# ...or once the first of them is this old: a slow run's scalars reach the writer thread (which
# flushes them to disk every two minutes) about as soon as they did one by one.
HOLD_S = 5.0
# How long a flush waits for the writer thread to reach it (a thread that died of a disk
# error never will: the run then ends by the error hook, or the flush goes on without it).
DRAIN_WAIT_S = 30.0


class Summaries:
    """One tensorboardX SummaryWriter per split (train, eval) under model_dir."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.writers: dict = {}
        self._held: dict[str, list] = {}   # split -> [(tag, value, step, wall time)] not yet handed over
        self._default_hook = None
        self._abandoned = False

    def exit_on_disk_errors(self) -> None:
        """From now on a disk error in tensorboardX's thread ends this process (the chief's own run;
        not a user's process that drives steps itself, cs_torch)."""
        if self._default_hook is None:
            self._default_hook = threading.excepthook
            threading.excepthook = self._thread_failed

    def writer(self, split: str):
        if split not in self.writers:
            self.writers[split] = summary_writer(self.model_dir / split)
        return self.writers[split]

    def scalar(self, split: str, tag: str, value: float, step: int) -> None:
        """writer(split).add_scalar(tag, value, step), held and handed over SCALAR_BATCH at a time."""
        held = self._held.get(split)
        if held is None:
            self.writer(split)   # the split's folder and file from its first scalar on, as add_scalar made them
            held = self._held[split] = []
        now = time.time()
        held.append((tag, float(value), step, now))
        if len(held) >= SCALAR_BATCH or now - held[0][3] > HOLD_S:
            self._hand_over(split)

    def _hand_over(self, split: str) -> None:
        """The split's held scalars to its writer thread: one queue item where the queue is ours,
        else one add_scalar each (another tensorboardX)."""
        held, self._held[split] = self._held.get(split, []), []
        if not held:
            return
        writer = self.writer(split)
        if isinstance(_event_queue(writer), _ThreadQueue):
            writer.file_writer.event_writer.add_event(_Scalars(held))
            return
        for tag, value, step, wall_time in held:
            writer.add_scalar(tag, value, step, walltime=wall_time)

    def flush(self) -> None:
        """Everything added so far, written and flushed to disk."""
        for split, writer in self.writers.items():
            self._hand_over(split)
            queue_ = _event_queue(writer)
            if isinstance(queue_, _ThreadQueue):
                queue_.wait_until_written(writer)
            self._disk_safe(split, writer.flush)

    def close(self) -> None:
        """Flush and close every writer; a disk error is a RunError (one line, exit 2)."""
        try:
            for split, writer in self.writers.items():
                self._hand_over(split)
                self._disk_safe(split, writer.close)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """On the way out after a failure: close what closes, and leave no flush for atexit to retry."""
        for writer in self.writers.values():
            try:
                writer.close()
            except OSError:
                pass
            for file_writer in (writer.all_writers or {}).values():
                file_writer.event_writer.close = lambda: None   # its atexit clean-up would flush again
        self.writers, self._held = {}, {}
        self._abandoned = True   # the hook stays: a writer thread still dying says nothing more

    def _disk_safe(self, split: str, action) -> None:
        try:
            action()
        except OSError as exc:
            raise RunError(self._line(split, exc)) from None

    def _line(self, split: str, exc: OSError) -> str:
        cause = DISK_ERRNOS.get(exc.errno, exc.strerror or str(exc))
        name = f" ({errno.errorcode[exc.errno]})" if exc.errno in DISK_ERRNOS else ""
        return f"cannot write TensorBoard summaries under {self.model_dir / split}: {cause}{name}"

    def _thread_failed(self, args) -> None:
        """tensorboardX's writer thread met a disk error: say so in one line and exit 2 now,
        before the main thread blocks on the dead thread's queue."""
        exc = args.exc_value
        if not type(args.thread).__module__.startswith("tensorboardX"):
            return self._default_hook(args)
        if self._abandoned:
            return None   # closed under it on the way out, after the line that said why
        if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
            print(f"error: {self._line('', exc)}", flush=True)
            sys.stderr.flush()
            return os._exit(EXIT_BAD_INPUT)
        return self._default_hook(args)


class _Scalars:
    """Held scalars, one item of the writer thread's queue (Summaries.scalar)."""

    def __init__(self, held: list):
        self.held = held

    def events(self) -> list:
        """The events add_scalar would have made of them, in order."""
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary
        return [Event(wall_time=wall_time, step=step, summary=Summary(value=[Summary.Value(tag=tag, simple_value=value)]))
                for tag, value, step, wall_time in self.held]


class _Written:
    """A mark in the writer thread's queue: set once the thread has taken it, so has written
    everything queued before it."""

    def __init__(self):
        self.reached = threading.Event()


class _ThreadQueue(queue.Queue):
    """The queue between tensorboardX's add_* calls and its writer thread, both in this process.
    tensorboardX makes it a multiprocessing.Queue, which pickles every event through a pipe and
    a feeder thread of its own: most of the chief's CPU time per step on a small model (about
    0.7 to 1.5 ms for a step's five scalars). Here the events pass by reference, in the same
    order, to the same thread, which writes the same file. Full: a put blocks, as before.
    The thread's get also unpacks held scalars (_Scalars) and passes the marks of a flush."""

    def __init__(self, maxsize: int = 0):
        super().__init__(maxsize)
        self._unpacked: deque = deque()   # the writer thread's alone

    def get(self, block: bool = True, timeout: float | None = None):
        while not self._unpacked:
            item = super().get(block, timeout)
            if isinstance(item, _Scalars):
                self._unpacked.extend(item.events())
            elif isinstance(item, _Written):
                item.reached.set()   # the thread took it: what came before is written
            else:
                return item
        return self._unpacked.popleft()

    def wait_until_written(self, writer) -> None:
        """Until the writer thread has written every event queued so far."""
        mark = _Written()
        writer.file_writer.event_writer.add_event(mark)
        mark.reached.wait(DRAIN_WAIT_S)

    def close(self) -> None:   # the multiprocessing queue's; nothing to release here
        pass


def _event_queue(writer):
    """The queue of the writer's thread, or None (another tensorboardX's writer)."""
    return getattr(getattr(getattr(writer, "file_writer", None), "event_writer", None), "_event_queue", None)


def summary_writer(logdir: Path):
    """A tensorboardX SummaryWriter whose event queue is a _ThreadQueue (it makes its one file
    writer, and that its queue, as it is constructed)."""
    SummaryWriter, event_file_writer = _tensorboardx()
    made_with = getattr(event_file_writer, "multiprocessing", None)
    if made_with is None:   # another tensorboardX: its own queue, whatever it is
        return SummaryWriter(str(logdir))
    event_file_writer.multiprocessing = SimpleNamespace(Queue=_ThreadQueue)
    try:
        return SummaryWriter(str(logdir))
    finally:
        event_file_writer.multiprocessing = made_with


def _tensorboardx():
    """tensorboardX's SummaryWriter and event_file_writer, imported without torch. Its writer
    module tries `import torch` only to accept torch tensors as values; where torch is installed
    that cost every chief 1.1 s and a few hundred MB before its first step, for scalars that are
    floats. A script that imported torch itself (a cstorch script) has it already: no cost."""
    blocked = "torch" not in sys.modules and "tensorboardX" not in sys.modules
    if blocked:
        sys.modules["torch"] = None   # while this is here, `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter, event_file_writer
    finally:
        if blocked:
            del sys.modules["torch"]   # the script may still import torch later, for real
    return SummaryWriter, event_file_writer
