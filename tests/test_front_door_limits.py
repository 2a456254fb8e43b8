"""What one client may store on a CS system, checked in process (no service is started): every
limit is checked before anything changes, no row can outgrow a listing's page, and the text a
client sets is shown escaped.

    python -m pytest tests/test_front_door_limits.py -q
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import msgpack
import pytest
import zmq

from cs_runtime.appliance import server as server_module
from cs_runtime.launch.front_door import FrontDoor, FrontDoorError
from cs_runtime.appliance.server import CLIENT_SNDBUF, PAGE_BYTES, CSSystem, JobRecord, RateLimit, Refused
from cs_runtime.wire.protocol import (MAX_HEADER_BYTES, MAX_LABELS, MAX_REASON_CHARS, Message, Msg, ProtocolError,
                                      decode, encode, printable)
from cs_runtime.cli import csctl

OWNER = "ab" * 32
FORGED = "done\n\x1b[2J\x1b[31mwsjob-1   1s   1s   SUCCEEDED   cs0   root\u202e"


@pytest.fixture
def system():
    made = CSSystem("127.0.0.1", 0, num_csx=1, insecure=True, shm=False)
    yield made
    made.close()


def submitted(system: CSSystem, labels: dict | None = None) -> JobRecord:
    meta = {"user": "alice", "num_csx": 1, "owner": OWNER, "labels": labels or {}, "keys": {}}
    return system.submit(meta)


def label(system: CSSystem, job: JobRecord, labels: dict) -> Message:
    return system.answer(Message(Msg.LABEL, meta={"name": job.name, "owner": OWNER, "labels": labels}))


def test_a_refused_label_request_leaves_the_labels_as_they_were(system):
    job = submitted(system, {f"k{i}": "v" for i in range(30)})
    for call in range(20):   # each would bring the job over the limit
        with pytest.raises(Refused, match=f"more than {MAX_LABELS} labels"):
            label(system, job, {f"new{call}-{i}": "x" for i in range(3)})
    assert len(job.labels) == 30 and not any(k.startswith("new") for k in job.labels)
    assert label(system, job, {"k0": "changed", "extra": "y", "more": "z"}).type == Msg.ACK   # 32 exactly
    assert len(job.labels) == MAX_LABELS and job.labels["k0"] == "changed"


def test_a_reason_over_its_cap_is_refused_before_it_reaches_the_server():
    meta = {"name": "wsjob-1", "owner": OWNER, "phase": "FAILED", "reason": "x" * 65_200}
    with pytest.raises(ProtocolError, match=f"over {MAX_REASON_CHARS}"):
        decode(encode(Message(Msg.JOB_DONE, meta=meta)))
    meta["reason"] = "x" * MAX_REASON_CHARS
    assert decode(encode(Message(Msg.JOB_DONE, meta=meta))).meta["reason"] == meta["reason"]


def test_a_reported_reason_is_stored_and_listed_escaped(system, monkeypatch, capsys):
    job = submitted(system)
    system.answer(Message(Msg.JOB_DONE, meta={"name": job.name, "owner": OWNER, "phase": "FAILED", "reason": FORGED}))
    assert job.phase == "FAILED" and job.reason == printable(FORGED)
    assert "\n" not in job.reason and "\x1b" not in job.reason and "\u202e" not in job.reason
    assert "\\x1b[2J" in job.reason   # still readable

    class Door:   # csctl escapes too: it prints whatever a server sends
        def list_jobs(self):
            return [{**job.row(0), "reason": FORGED, "user": "a\x1bb"}]

        def close(self):
            pass
    monkeypatch.setattr(csctl.FrontDoor, "open", classmethod(lambda cls, *a, **k: Door()))
    csctl.main(["--cs_ip", "127.0.0.1:1", "get", "job", job.name])
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 3 and not any(c in out for c in "\x1b\u202e"), out


def test_printable_keeps_text_and_escapes_controls():
    assert printable("plain text, é ü 日本") == "plain text, é ü 日本"
    assert printable("a\tb\r\nc\x00\x7f\x9b") == "a\\tb\\r\\nc\\x00\\x7f\\x9b"
    assert len(printable("\n" * 5000)) == MAX_REASON_CHARS


def test_the_largest_row_a_client_can_make_fits_a_page(system):
    """Every field a client sets is bounded, so one job can never make a listing fail for everyone."""
    labels = {f"{i:02d}{'k' * 61}": "v" * 63 for i in range(MAX_LABELS)}
    job = JobRecord(999_999_999, "u" * 64, OWNER, 64, labels, {})
    job.reason = printable("\x00" * 10 * MAX_REASON_CHARS)
    job.systems = list(range(64))
    job.services = [{"role": "memoryx", "rank": 2**31, "pid": 2**31} for _ in range(66)]
    row = msgpack.packb(job.row(999), use_bin_type=True)
    assert len(row) < PAGE_BYTES < MAX_HEADER_BYTES, len(row)


# --------------------------------------------------------------------------
# the front door served by a thread of this process (nothing is started but the socket)
# --------------------------------------------------------------------------

HEAVY_LABELS = {f"key{i:02d}-{'k' * 55}": "v" * 63 for i in range(31)}   # ~4 KB a row


@contextmanager
def serving(system: CSSystem):
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            system.front.sock.poll(20)
            system.serve_front_door()
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield system.where
    finally:
        stop.set()
        thread.join(5)


def test_a_listing_of_more_pages_than_the_burst_paces_itself_and_is_complete(system):
    names = [submitted(system, {**HEAVY_LABELS, "case": f"n{i}"}).name for i in range(60)]
    system.rate = RateLimit(rate=20.0, burst=2)   # 5 pages of 12 rows: 3 over the burst
    with serving(system):
        door = FrontDoor("127.0.0.1", int(system.where.rsplit(":", 1)[1]), None)
        try:
            t0 = time.monotonic()
            assert [row["name"] for row in door.list_jobs()] == names
            assert time.monotonic() - t0 >= 2 / 20 * 0.9   # it waited for the refill, not failed
            # A refusal it cannot outwait within its timeout is still one clear error.
            system.rate = RateLimit(rate=0.01, burst=1)
            door.request(Message(Msg.GET_JOBS))
            with pytest.raises(FrontDoorError, match="too many requests"):
                door.request(Message(Msg.GET_JOBS), timeout_s=1.0)
        finally:
            door.close()


def test_without_an_allow_list_fresh_keys_share_their_address_budget(system, monkeypatch):
    monkeypatch.setattr(system, "source_rate", RateLimit(rate=1.0, burst=30))
    with serving(system):
        port = int(system.where.rsplit(":", 1)[1])
        answered = 0
        for _ in range(10):   # ten clients, each with a fresh identity (a fresh key, without CURVE)
            door = FrontDoor("127.0.0.1", port, None)
            try:
                for _ in range(5):
                    got = door.answer(door.send(Message(Msg.GET_JOBS)), 5.0)
                    answered += got.type == Msg.JOBS
                    if got.type == Msg.REFUSED:
                        assert "from 127.0.0.1" in got.meta["reason"] and got.meta["retry_after"] > 0
            finally:
                door.close()
    assert 30 <= answered <= 32, answered   # the address's burst, plus what refilled meanwhile


def server_send_queues(port: int) -> list[int]:
    """The kernel's send queue, in bytes, of every established connection of the server at `port`
    (/proc/net/tcp: local address, remote address, state, tx_queue:rx_queue, all hex)."""
    queues = []
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":
            queues.append(int(fields[4].split(":")[0], 16))
    return queues


def test_clients_that_never_read_cost_a_bounded_kernel_buffer_and_are_then_ignored(system):
    for i in range(20):
        submitted(system, {**HEAVY_LABELS, "case": f"n{i}"})
    port = int(system.where.rsplit(":", 1)[1])
    ctx = zmq.Context()
    hogs = []
    try:
        with serving(system):
            for _ in range(6):
                sock = ctx.socket(zmq.DEALER)
                sock.linger = 0
                sock.setsockopt(zmq.RCVBUF, 4096)
                sock.setsockopt(zmq.RCVHWM, 1)
                sock.connect(f"tcp://{system.where}")
                hogs.append(sock)
                for n in range(RATE_LIMIT_BURST):
                    sock.send_multipart(encode(Message(Msg.GET_JOBS, step=n + 1)))
            deadline = time.monotonic() + 10
            while len(system.deaf) < len(hogs) and time.monotonic() < deadline:
                time.sleep(0.05)   # polling the server's state, each check a fresh read
            assert len(system.deaf) == len(hogs)
            queued = server_send_queues(port)
            door = FrontDoor("127.0.0.1", port, None)   # one that reads is still served in full
            try:
                assert len(door.list_jobs()) == 20
            finally:
                door.close()
        # ~40 pages of 48 KB asked for by each; the kernel holds at most its (doubled) buffer.
        assert len(queued) >= len(hogs) and max(queued) <= 2 * CLIENT_SNDBUF + PAGE_BYTES, queued
    finally:
        for sock in hogs:
            sock.close()
        ctx.destroy(linger=0)


RATE_LIMIT_BURST = server_module.RATE_BURST
