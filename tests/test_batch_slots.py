"""Batches by shared memory: a worker's slot is written again only after the WSE said it is done
with the batch in it (BATCHES_DONE), and a worker never runs more than BATCH_SLOTS batches ahead."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import zmq

from cs_runtime.wire import shm
from cs_runtime.wire.protocol import BATCH_SLOTS, BATCHES_DONE_EVERY, Message, Msg
from cs_runtime.wire.transport import Endpoint
from worker.input_worker import WseLane
from wse.emulator import InputMerger

JOB = "job-slots"
ROWS, WIDTH = 64, 512          # float32: 128 KiB, over the sharing threshold


@pytest.fixture
def worker_and_wse(tmp_path, monkeypatch):
    """A worker's lane to a WSE's input merger over loopback, both sharing memory in tmp_path."""
    monkeypatch.setenv("CS_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(shm, "_process_segments", shm.Segments(tmp_path, JOB))
    ctx = zmq.Context()
    wse_side = Endpoint(ctx, zmq.ROUTER, "wse0-input", JOB).share_memory(shm.Segments(tmp_path, JOB))
    address = wse_side.bind("127.0.0.1")
    worker_side = Endpoint(ctx, zmq.DEALER, "worker0->wse", JOB).connect(address)
    lane = WseLane(worker_side.share_memory(shm._process_segments), shm._process_segments, JOB, "worker0")
    try:
        yield lane, InputMerger(wse_side)
    finally:
        ctx.destroy(linger=0)
        for path in tmp_path.glob("cs-*"):
            path.unlink()


def send_batch(lane: WseLane, step: int) -> None:
    x = np.full((ROWS, WIDTH), step, np.float32)
    meta = {"stream": "train", "global_batch": ROWS, "row_start": 0, "row_stop": ROWS}
    lane.send(Message(Msg.BATCH, step=step, meta=meta, arrays=lane.placed({"x": x, "y": np.zeros(ROWS, np.int64)})))


def test_a_slot_is_reused_only_after_the_wse_is_done_with_its_batch(worker_and_wse, caplog):
    lane, merger = worker_and_wse
    for step in range(BATCH_SLOTS):
        send_batch(lane, step)
    assert lane.full()
    while len(merger.buffer) < BATCH_SLOTS:   # all there: the WSE never waits, so it tells only every 4
        merger.receive(5000)
    taken = [merger.take("train", step, poll_ms=5000) for step in range(BATCHES_DONE_EVERY + 1)]
    for step, batch in enumerate(taken):   # read where the worker wrote them, not copied
        assert batch.arrays["x"][0, 0] == step and not batch.arrays["x"].flags.writeable
        segment, _ = merger.pull.segments.locate(batch.arrays["x"])
        assert segment.startswith(f"{shm.segment_prefix(JOB)}worker0-")
    lane.hear(5000)   # taking the fifth released the fourth: one count for all four
    assert lane.done == BATCHES_DONE_EVERY and not lane.full()
    send_batch(lane, BATCH_SLOTS)           # into batch 0's slot, now free
    assert taken[0].arrays["x"][0, 0] == BATCH_SLOTS and taken[1].arrays["x"][0, 0] == 1
    merger.take("train", BATCHES_DONE_EVERY + 1, poll_ms=5000)
    merger.tell_all()                       # as before waiting for input: the exact count, not a multiple
    lane.hear(5000)
    assert lane.done == BATCHES_DONE_EVERY + 1
    with caplog.at_level(logging.WARNING):  # a count beyond what was sent is dropped, with a line
        merger.pull.send(Message(Msg.BATCHES_DONE, meta={"done": lane.sent + 1}), merger.holding)
        lane.hear(5000)
    assert lane.done == BATCHES_DONE_EVERY + 1 and "unexpected batches_done" in caplog.text
