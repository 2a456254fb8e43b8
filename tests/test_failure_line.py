"""The launcher's failure line comes as soon as the fault is known, before the
moment it gives remote processes to hear of it; an answer that cannot be
delivered is not reported as a bad message.

    python -m pytest tests/test_failure_line.py -q
"""
from __future__ import annotations

import logging
import signal
from types import SimpleNamespace

import zmq

from cs_runtime.launch.launcher import Supervisor
from cs_runtime.wire.protocol import Message, Msg
from cs_runtime.wire.transport import Endpoint


class FakeDirectory:
    def __init__(self):
        self.failure, self.peers, self.served = "", {}, 0

    def serve_once(self, timeout_ms: int) -> None:
        self.served += 1

    def silent_peers(self, timeout: float, **_) -> list:
        return []

    def close(self) -> None:
        pass


class FakeGroup:
    """One task that dies (SIGKILL) once the supervisor has served the directory once."""

    def __init__(self, directory: FakeDirectory):
        self.directory = directory
        proc = SimpleNamespace(pid=4242, poll=lambda: None)
        self.task = SimpleNamespace(role="wse", rank=0, label="wse 0 on here (pid 4242)", proc=proc,
                                    ended_how=lambda rc: "exited with signal SIGKILL")
        self.tasks = [self.task]
        self.stopped = False

    def exited(self):
        return [(self.task, -signal.SIGKILL)] if self.directory.served else []

    def stop_all(self, grace: float = 3.0) -> None:
        self.stopped = True


def test_the_failure_line_is_printed_before_the_status_drain(capsys, monkeypatch):
    directory = FakeDirectory()
    group = FakeGroup(directory)
    supervisor = Supervisor(directory, group, finisher_role="chief", handle_signals=False)
    seen_at_drain = []
    monkeypatch.setattr(supervisor, "_drain_status", lambda seconds: seen_at_drain.append(capsys.readouterr().err))
    assert supervisor.run() == 1
    assert seen_at_drain == ["csrun: job failed: wse 0 on here (pid 4242) exited with signal SIGKILL\n"]
    assert directory.served == 1          # known at the first check after one 100 ms poll, said at once
    assert group.stopped and directory.failure.startswith("wse 0 on here")


def test_an_undelivered_answer_is_not_a_bad_message(caplog):
    ctx = zmq.Context()
    router = Endpoint(ctx, zmq.ROUTER, "directory", "job1")
    try:
        router.bind("127.0.0.1")
        with caplog.at_level(logging.INFO, logger="cs_runtime.wire.transport"):
            router.send(Message(Msg.STATUS, meta={"ok": True, "reason": "", "done": False}), b"gone")
            router.send(Message(Msg.STATUS, meta={"ok": True, "reason": "", "done": False}), b"gone")
        lines = [r for r in caplog.records if "not delivered" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.INFO          # once per peer, as INFO
        assert "status to 676f6e65 not delivered: the peer has disconnected" in lines[0].getMessage()
        assert "dropped bad message" not in caplog.text
    finally:
        router.close()
        ctx.destroy(linger=0)
