"""The job's directory and liveness.

Every process of a job registers with a directory (REGISTER: role, rank, host,
pid, the addresses it bound), asks it where its peers are (LOOKUP, answered
once every expected process of those roles has registered) and heartbeats to
it twice a second. Each heartbeat is answered with STATUS: while the job is
healthy `ok`, once the launcher has declared it failed `ok=False` and the
reason, and the process then exits by itself. A process that hears nothing
from its directory for HEARTBEAT_TIMEOUT exits too: a job never leaves
orphans, even on a host the launcher cannot signal.

The directory lives in the launcher (`csrun_wse`) for the job's own processes
and, for a long-lived CS system, in the appliance process for its services.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import zmq

from cs_runtime.wire.protocol import Message, Msg
from cs_runtime.wire.transport import Endpoint, host_name

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 0.5
HEARTBEAT_TIMEOUT = 5.0     # a peer silent this long is declared hung
REGISTER_TIMEOUT = 120.0    # generous: a cold start imports numpy, zmq, ...
DIRECTORY_MAX_FRAME = 1024 * 1024


@dataclass
class Peer:
    role: str
    rank: int
    host: str
    pid: int
    endpoints: dict
    last_seen: float = field(default_factory=time.monotonic)

    def as_dict(self) -> dict:
        return {"role": self.role, "rank": self.rank, "host": self.host, "pid": self.pid,
                "endpoints": self.endpoints}


class DirectoryServer:
    """The ROUTER side. Driven by its owner's loop through `serve_once`."""

    def __init__(self, ctx: zmq.Context, job: str, expected: dict[str, int], host: str | None = None,
                 port: int = 0, keys=None):
        # Only small control messages come here: a bigger frame is refused unread.
        self.endpoint = Endpoint(ctx, zmq.ROUTER, "directory", job, max_frame_bytes=DIRECTORY_MAX_FRAME,
                                 keys=keys)
        self.address = self.endpoint.bind(host, port)
        self.expected = dict(expected)
        self.peers: dict[tuple[str, int], Peer] = {}
        self.pending: list[tuple[bytes, list]] = []
        self.failure: str = ""
        self.done = False  # the job has finished: heartbeat answers tell every process to exit 0
        # (role, rank) -> EXITED meta, for tasks the launcher cannot wait for itself (srun)
        self.exits: dict[tuple[str, int], dict] = {}
        # The role sets asked for: the chief, once it has compiled, asks for MemoryX and SwarmX together.
        self.lookups: set[frozenset] = set()

    def serve_once(self, timeout_ms: int) -> None:
        got = self.endpoint.recv(timeout_ms)
        if got is None:
            return
        identity, msg = got
        if msg.type == Msg.REGISTER:
            self._register(msg)
        elif msg.type == Msg.LOOKUP:
            self.lookups.add(frozenset(str(r) for r in msg.meta["roles"]))
            self.pending.append((identity, [str(r) for r in msg.meta["roles"]]))
        elif msg.type == Msg.HEARTBEAT:
            self._heartbeat(identity, msg)
        elif msg.type == Msg.EXITED:
            self.exits[(msg.meta["role"], msg.meta["rank"])] = dict(msg.meta)
            self._send(identity, self.status())
        else:
            self.endpoint.warn_once(identity, f"unexpected {msg.type.value} at the directory")
        self._answer_lookups()

    def _register(self, msg: Message) -> None:
        m = msg.meta
        peer = Peer(m["role"], m["rank"], m["host"], m["pid"], m["endpoints"])
        self.peers[(peer.role, peer.rank)] = peer
        log.debug("registered %s %d on %s", peer.role, peer.rank, peer.host)

    def _heartbeat(self, identity: bytes, msg: Message) -> None:
        peer = self.peers.get((msg.meta["role"], msg.meta["rank"]))
        if peer is not None:
            peer.last_seen = time.monotonic()
        self._send(identity, self.status())

    def status(self) -> Message:
        return Message(Msg.STATUS, meta={"ok": not self.failure, "reason": self.failure,
                                         "done": self.done and not self.failure})

    def _answer_lookups(self) -> None:
        still = []
        for identity, roles in self.pending:
            if all(self._complete(role) for role in roles):
                peers = [p.as_dict() for p in self.peers.values() if p.role in roles]
                self._send(identity, Message(Msg.DIRECTORY, meta={"peers": peers}))
            else:
                still.append((identity, roles))
        self.pending = still

    def _complete(self, role: str) -> bool:
        have = sum(1 for (r, _) in self.peers if r == role)
        return have >= self.expected.get(role, 0) and role in self.expected

    def _send(self, identity: bytes, msg: Message) -> None:
        try:
            self.endpoint.send(msg, identity)
        except zmq.ZMQError:
            pass  # the asker is gone; nothing to answer

    def silent_peers(self, timeout: float = HEARTBEAT_TIMEOUT) -> list[Peer]:
        now = time.monotonic()
        return [p for p in self.peers.values() if now - p.last_seen > timeout]

    def close(self) -> None:
        self.endpoint.close()


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

    def report_exit(self, host: str, pid: int, code: int, timeout_ms: int = 2000) -> None:
        """Tell the launcher how this task ended (it cannot see the exit code through srun)."""
        meta = {"role": self.role, "rank": self.rank, "host": host, "pid": pid, "code": code}
        self.endpoint.send(Message(Msg.EXITED, meta=meta))
        got = self.endpoint.recv(timeout_ms)  # the answer says it arrived (LINGER 0 would drop it)
        while got is not None and got[1].type != Msg.STATUS:
            got = self.endpoint.recv(timeout_ms)

    def start_heartbeats(self, on_failure=None) -> "Heartbeat":
        beat = Heartbeat(self.ctx, self.address, self.role, self.rank, self.job, on_failure)
        beat.start()
        return beat

    def close(self) -> None:
        self.endpoint.close()


def _exit_now(reason: str) -> None:
    # Quietly: the launcher prints the one line that says what failed.
    log.debug("stopping: %s", reason)
    logging.shutdown()
    os._exit(1)


def _exit_done() -> None:
    log.debug("stopping: the job has finished")
    logging.shutdown()
    os._exit(0)


class Heartbeat(threading.Thread):
    """Background thread with its own socket (ZeroMQ sockets are not thread safe).

    Exits the process (via `on_failure`) when the directory reports the job
    failed or stops answering, and with code 0 when it reports the job done:
    so no process outlives its job.
    """

    def __init__(self, ctx, address, role, rank, job, on_failure=None):
        super().__init__(name="heartbeat", daemon=True)
        self.ctx, self.address, self.role, self.rank, self.job = ctx, address, role, rank, job
        self.on_failure = on_failure or _exit_now
        self.stopped = threading.Event()

    def run(self) -> None:
        endpoint = Endpoint(self.ctx, zmq.DEALER, "heartbeat", self.job).connect(self.address)
        last_answer = time.monotonic()
        try:
            while not self.stopped.is_set():
                endpoint.send(Message(Msg.HEARTBEAT, meta={"role": self.role, "rank": self.rank}))
                got = endpoint.recv(int(HEARTBEAT_INTERVAL * 1000))
                while got is not None:
                    last_answer = time.monotonic()
                    if got[1].type == Msg.STATUS and not got[1].meta["ok"]:
                        if self.role == "chief":  # the chief's log names what failed
                            log.error("the job is stopping: %s", got[1].meta["reason"])
                        return self.on_failure(f"job failed: {got[1].meta['reason']}")
                    if got[1].type == Msg.STATUS and got[1].meta["done"]:
                        return _exit_done()
                    got = endpoint.recv(0)
                if time.monotonic() - last_answer > HEARTBEAT_TIMEOUT * 2:
                    return self.on_failure(f"directory at {self.address} stopped answering")
                self.stopped.wait(HEARTBEAT_INTERVAL / 2)
        finally:
            endpoint.close()

    def stop(self) -> None:
        self.stopped.set()
