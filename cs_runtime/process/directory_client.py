"""A process's side of its job's directory (launch/directory.py is the launcher's side): register,
look peers up, and heartbeat from a thread of its own, so no process outlives its job.

A process that hears nothing from its directory for HEARTBEAT_TIMEOUT twice exits with
EXIT_DIRECTORY_LOST; the directory's "done" ends it with 0, its "failed" through on_failure.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref

import zmq

from cs_runtime.process import orphan
from cs_runtime.wire.protocol import Message, Msg
from cs_runtime.wire.transport import CONTROL_MAX_FRAME, Endpoint, host_name

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 0.5
HEARTBEAT_TIMEOUT = 5.0     # a peer silent this long is declared hung
REGISTER_TIMEOUT = 120.0    # generous: a cold start imports numpy, zmq, ...
FIRST_ANSWER_TIMEOUT = REGISTER_TIMEOUT   # a process waits this long for its directory's first answer
EXIT_DIRECTORY_LOST = 3
DIRECTORY_MAX_FRAME = CONTROL_MAX_FRAME   # headers only: no array ever comes here


class DirectoryClient:
    """A process's view of a directory: register, look peers up, heartbeat."""

    def __init__(self, ctx: zmq.Context, address: str, role: str, rank: int, job: str):
        self.ctx, self.address, self.role, self.rank, self.job = ctx, address, role, rank, job
        self.endpoint = Endpoint(ctx, zmq.DEALER, f"{role}{rank}->directory", job).connect(address)

    def register(self, endpoints: dict) -> None:
        meta = {"role": self.role, "rank": self.rank, "host": host_name(), "pid": os.getpid(),
                "endpoints": endpoints}
        self.endpoint.send(Message(Msg.REGISTER, meta=meta))

    def lookup(self, roles: list[str], timeout: float = REGISTER_TIMEOUT) -> dict[str, list[dict]]:
        """{role: [peer dicts sorted by rank]} once all of them have registered."""
        self.endpoint.send(Message(Msg.LOOKUP, meta={"roles": roles}))
        got = self.endpoint.recv(int(timeout * 1000))
        while got is not None and got[1].type != Msg.DIRECTORY:
            got = self.endpoint.recv(int(timeout * 1000))
        if got is None:
            raise TimeoutError(f"no answer from the directory at {self.address} within {timeout:.0f} s "
                               f"(waiting for {', '.join(roles)})")
        by_role: dict[str, list[dict]] = {r: [] for r in roles}
        for peer in got[1].meta["peers"]:
            by_role[peer["role"]].append(peer)
        return {r: sorted(p, key=lambda p: p["rank"]) for r, p in by_role.items()}

    def start_heartbeats(self, on_failure=None, before_exit=None) -> "Heartbeat":
        """before_exit(reason): called before the process leaves because the job stopped (the
        chief says there how far the run got)."""
        beat = Heartbeat(self.ctx, self.address, self.role, self.rank, self.job, on_failure, before_exit)
        beat.start()
        return beat

    def close(self) -> None:
        self.endpoint.close()


def _exit_now(reason: str) -> None:
    # Quietly: the launcher prints the one line that says what failed.
    log.debug("stopping: %s", reason)
    logging.shutdown()
    os._exit(1)


def _exit_lost(reason: str) -> None:
    log.debug("stopping: %s", reason)
    logging.shutdown()
    os._exit(EXIT_DIRECTORY_LOST)


def _exit_done() -> None:
    log.debug("stopping: the job has finished")
    logging.shutdown()
    os._exit(0)


# Every heartbeat thread of this process, so that a process on its way out stops them before it
# destroys their context (stop_heartbeats).
_BEATING: "weakref.WeakSet[Heartbeat]" = weakref.WeakSet()


def stop_heartbeats() -> None:
    """Stop this process's heartbeat threads (each says it is leaving): before ctx.destroy, which
    must not close a socket another thread is using."""
    for beat in list(_BEATING):
        beat.stop()


# What a socket's calls raise once its context is being destroyed by another thread (ENOTSUP: the
# socket closed in the middle of a call; a heartbeat's DEALER supports every call it makes).
CONTEXT_GONE_ERRNOS = (zmq.ENOTSOCK, zmq.ETERM, zmq.ENOTSUP)


class Heartbeat(threading.Thread):
    """Background thread with its own socket (ZeroMQ sockets are not thread safe).

    Exits the process (via `on_failure`) when the directory reports the job
    failed or stops answering (then with EXIT_DIRECTORY_LOST), and with code 0
    when it reports the job done: so no process outlives its job.
    """

    def __init__(self, ctx, address, role, rank, job, on_failure=None, before_exit=None):
        super().__init__(name="heartbeat", daemon=True)
        self.before_exit = before_exit or (lambda reason: None)
        self.ctx, self.address, self.role, self.rank, self.job = ctx, address, role, rank, job
        self.on_failure = on_failure or _exit_now
        self.on_lost = on_failure or _exit_lost
        self.stopped = threading.Event()
        self.said_leaving = threading.Event()
        self._wake_r, self._wake_w = os.pipe()   # stop() wakes the thread from its wait on the socket
        self._wake_lock = threading.Lock()
        _BEATING.add(self)

    def run(self) -> None:
        endpoint = Endpoint(self.ctx, zmq.DEALER, "heartbeat", self.job).connect(self.address)
        last_answer = next_beat = time.monotonic()
        # Until the first answer, as long as the launcher waits for it: hundreds of tasks starting
        # at once queue for their connections' CURVE handshakes; after it, twice the timeout.
        patience = FIRST_ANSWER_TIMEOUT
        try:
            while not self.stopped.is_set():
                endpoint.send(Message(Msg.HEARTBEAT, meta={"role": self.role, "rank": self.rank}))
                next_beat += HEARTBEAT_INTERVAL  # a fixed period: the answer's delay does not add to it
                # The answer, and what the directory sends unasked (the job's end), as they come.
                while self._wait(endpoint, next_beat):
                    got = endpoint.recv(0)
                    while got is not None:
                        last_answer, patience = time.monotonic(), HEARTBEAT_TIMEOUT * 2
                        if got[1].type == Msg.STATUS and not got[1].meta["ok"]:
                            if self.role == "chief":  # the chief's log names what failed
                                log.error("the job is stopping: %s", got[1].meta["reason"])
                            self.before_exit(got[1].meta["reason"])
                            return self.on_failure(f"job failed: {got[1].meta['reason']}")
                        if got[1].type == Msg.STATUS and got[1].meta["done"]:
                            return _exit_done()
                        got = endpoint.recv(0)
                orphan.leave_if_orphaned()   # a service whose launcher died without its signal arriving
                if time.monotonic() - last_answer > patience:
                    self.before_exit(f"the launcher's directory at {self.address} stopped answering")
                    return self.on_lost(f"directory at {self.address} stopped answering")
                next_beat = max(next_beat, time.monotonic())  # late (a stall): beat now, no burst of beats
            # The last heartbeat says this process is leaving, so the time it takes
            # to exit is not mistaken for a hang.
            endpoint.send(Message(Msg.HEARTBEAT, meta={"role": self.role, "rank": self.rank, "leaving": True}))
            endpoint.recv(int(HEARTBEAT_INTERVAL * 1000))
        except zmq.ZMQError as exc:
            # The process is closing its context under this thread (an error on its way out):
            # it is leaving anyway, and its own line says why; no second traceback from here.
            if exc.errno not in CONTEXT_GONE_ERRNOS and not (self.ctx.closed or endpoint.sock.closed):
                raise
        finally:
            self.said_leaving.set()
            endpoint.close()
            self._close_wake()

    def _wait(self, endpoint: Endpoint, until: float) -> bool:
        """Whether a message waits on the socket before `until` (False once stopped)."""
        remaining_ms = max(0, int((until - time.monotonic()) * 1000))
        ready = zmq.zmq_poll([(endpoint.sock, zmq.POLLIN), (self._wake_r, zmq.POLLIN)], remaining_ms)
        return not self.stopped.is_set() and any(item is endpoint.sock for item, _ in ready)

    def stop(self) -> None:
        self.stopped.set()
        with self._wake_lock:
            if self._wake_w >= 0:
                os.write(self._wake_w, b"x")
        if self.is_alive():
            self.said_leaving.wait(HEARTBEAT_TIMEOUT)

    def _close_wake(self) -> None:
        with self._wake_lock:   # not while stop() writes to it (a closed fd's number is reused)
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._wake_r = self._wake_w = -1
