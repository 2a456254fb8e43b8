"""What one client may store on a CS system, checked in process (no service is started): every
limit is checked before anything changes, no row can outgrow a listing's page, and the text a
client sets is shown escaped.

    python -m pytest tests/test_front_door_limits.py -q
"""
from __future__ import annotations

import msgpack
import pytest

from cs_runtime.appliance.server import PAGE_BYTES, CSSystem, JobRecord, Refused
from cs_runtime.wire.protocol import (MAX_HEADER_BYTES, MAX_LABELS, MAX_REASON_CHARS, Message, Msg, ProtocolError,
                                      decode, encode, printable)
from scripts import csctl

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
