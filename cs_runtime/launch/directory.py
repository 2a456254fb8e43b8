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
import weakref
from dataclasses import dataclass, field

import zmq

from cs_runtime.launch import orphan
from cs_runtime.wire.protocol import Message, Msg, encode
from cs_runtime.wire.transport import CONTROL_MAX_FRAME, Endpoint, host_name

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 0.5
HEARTBEAT_TIMEOUT = 5.0     # a peer silent this long is declared hung
# A peer that said it is leaving (its work done, the process exiting) may take this
# long to exit before it counts as hung: an interpreter with torch loaded takes
# seconds to tear down on a busy machine.
LEAVING_GRACE = 60.0
REGISTER_TIMEOUT = 120.0    # generous: a cold start imports numpy, zmq, ...
REGISTER_PER_TASK_S = 0.25  # and more per task: a launcher starts its tasks one after another
FIRST_ANSWER_TIMEOUT = REGISTER_TIMEOUT   # a process waits this long for its directory's first answer
# A process exits with this when its directory stopped answering (HEARTBEAT_TIMEOUT * 2): a
# reaction to the launcher's silence, never the cause the launcher names for a failure.
EXIT_DIRECTORY_LOST = 3
SERVE_BATCH = 256           # messages handled per serve_once before the owner's loop runs again
DIRECTORY_MAX_FRAME = CONTROL_MAX_FRAME   # headers only: no array ever comes here


@dataclass
class Peer:
    role: str
    rank: int
    host: str
    pid: int
    endpoints: dict
    last_seen: float = field(default_factory=time.monotonic)
    beating: bool = False   # its heartbeats have started (a busy start may delay the first)
    leaving: bool = False   # its last heartbeat said it is exiting

    def as_dict(self) -> dict:
        return {"role": self.role, "rank": self.rank, "host": self.host, "pid": self.pid,
                "endpoints": self.endpoints}


class Liveness:
    """When each peer was last heard from, kept in the order heard, one queue per allowance
    (registered but not yet beating, beating, leaving): every peer of a queue gets the same
    allowance, so the silent ones are at its front and a check looks at those alone. A
    heartbeat moves its peer to the back of its queue: O(1) per heartbeat and per check,
    however many peers (a timer wheel with one slot per allowance)."""

    def __init__(self):
        self.waiting: dict[tuple[str, int], Peer] = {}
        self.beating: dict[tuple[str, int], Peer] = {}
        self.leaving: dict[tuple[str, int], Peer] = {}
        self.queue_of: dict[tuple[str, int], dict] = {}

    def add(self, peer: Peer) -> None:
        key = (peer.role, peer.rank)
        self.queue_of.get(key, {}).pop(key, None)   # registered again: the new one counts
        self.waiting[key] = peer
        self.queue_of[key] = self.waiting

    def heard(self, key: tuple[str, int], peer: Peer, leaving: bool, now: float) -> None:
        del self.queue_of[key][key]   # and put back at the end: dicts keep their order
        queue = self.leaving if leaving else self.beating
        queue[key] = peer
        self.queue_of[key] = queue
        peer.last_seen, peer.beating, peer.leaving = now, True, leaving

    def forgive(self, now: float) -> None:
        """Every peer counts as heard from `now` (their order, and so each queue's, is kept)."""
        for queue in (self.waiting, self.beating, self.leaving):
            for peer in queue.values():
                peer.last_seen = max(peer.last_seen, now)

    def silent(self, timeout: float, first_timeout: float) -> list[Peer]:
        now = time.monotonic()
        silent = []
        for queue, allowance in ((self.waiting, first_timeout), (self.beating, timeout),
                                 (self.leaving, max(timeout, LEAVING_GRACE))):
            for peer in queue.values():
                if now - peer.last_seen <= allowance:
                    break   # heard later than every peer behind it
                silent.append(peer)
        return silent


class DirectoryServer:
    """The ROUTER side. Driven by its owner's loop through `serve_once`.

    Built for a thousand tasks heartbeating twice a second: the waiting messages are
    taken in one batch; a heartbeat whose exact bytes were already validated for a
    registered peer (a process sends the same few bytes every time) costs a dictionary
    look-up, its liveness an O(1) move, and its answer the prepared STATUS frame; lookups
    are answered when a registration completes what they wait for, never re-checked per message."""

    def __init__(self, ctx: zmq.Context, job: str, expected: dict[str, int], host: str | None = None,
                 port: int = 0, keys=None):
        # Only small control messages come here: a bigger frame is refused unread.
        self.endpoint = Endpoint(ctx, zmq.ROUTER, "directory", job, max_frame_bytes=DIRECTORY_MAX_FRAME,
                                 keys=keys)
        self.address = self.endpoint.bind(host, port)
        self.expected = dict(expected)
        self.peers: dict[tuple[str, int], Peer] = {}
        self.by_role: dict[str, dict[int, Peer]] = {}
        self.liveness = Liveness()
        self.pending: dict[tuple[str, ...], list[bytes]] = {}   # roles asked for -> who asked
        self.failure: str = ""
        self.done = False  # the job has finished: heartbeat answers tell every process to exit 0
        # (role, rank) -> EXITED meta, for tasks the launcher cannot wait for itself (srun)
        self.exits: dict[tuple[str, int], dict] = {}
        # The role sets asked for: the chief, once it has compiled, asks for MemoryX and SwarmX together.
        self.lookups: set[frozenset] = set()
        self._status: tuple[tuple[str, bool], Message, list[bytes]] | None = None
        # A heartbeat's header bytes, once validated, -> (role, rank, leaving): at most two per peer.
        self._known_beats: dict[bytes, tuple[tuple[str, int], bool]] = {}
        # A registered peer's heartbeat socket, as last heard: where `announce` sends the news unasked.
        self._beat_identities: dict[tuple[str, int], bytes] = {}

    def serve_once(self, timeout_ms: int, batch: int = SERVE_BATCH) -> int:
        """Handle the messages waiting (up to `batch`), waiting up to timeout_ms for the first; how many."""
        waiting = self.endpoint.recv_waiting(timeout_ms, batch)
        now = time.monotonic()   # one clock reading for the batch: each of them arrived by now
        for identity, frames in waiting:
            known = self._known_beats.get(frames[0]) if len(frames) == 1 else None
            peer = self.peers.get(known[0]) if known is not None else None
            if peer is not None:
                self.liveness.heard(known[0], peer, known[1], now)
                self._note_beat(known[0], known[1], identity)
                self._send_status(identity)
                continue
            msg = self.endpoint.decode_or_drop(identity, frames)
            if msg is not None:
                self._handle(identity, msg, frames[0], now)
        return len(waiting)

    def _handle(self, identity: bytes, msg: Message, header: bytes, now: float) -> None:
        if msg.type == Msg.HEARTBEAT:  # by far the most frequent: first
            self._heartbeat(identity, msg, header, now)
        elif msg.type == Msg.REGISTER:
            self._register(msg)
        elif msg.type == Msg.LOOKUP:
            roles = tuple(sorted(str(r) for r in msg.meta["roles"]))
            self.lookups.add(frozenset(roles))
            self.pending.setdefault(roles, []).append(identity)
            self._answer_lookups(roles)
        elif msg.type == Msg.EXITED:
            self.exits[(msg.meta["role"], msg.meta["rank"])] = dict(msg.meta)
            self._send_status(identity)
        else:
            self.endpoint.warn_once(identity, f"unexpected {msg.type.value} at the directory")

    def _register(self, msg: Message) -> None:
        m = msg.meta
        peer = Peer(m["role"], m["rank"], m["host"], m["pid"], m["endpoints"])
        self.peers[(peer.role, peer.rank)] = peer
        self.by_role.setdefault(peer.role, {})[peer.rank] = peer
        self.liveness.add(peer)
        log.debug("registered %s %d on %s", peer.role, peer.rank, peer.host)
        for roles in [r for r in self.pending if peer.role in r]:
            self._answer_lookups(roles)

    def _heartbeat(self, identity: bytes, msg: Message, header: bytes, now: float) -> None:
        key = (msg.meta["role"], msg.meta["rank"])
        peer = self.peers.get(key)
        if peer is not None:
            leaving = bool(msg.meta.get("leaving", False))
            self.liveness.heard(key, peer, leaving, now)
            if len(self._known_beats) < 2 * len(self.peers):   # bounded: two forms per peer
                self._known_beats[header] = (key, leaving)
            self._note_beat(key, leaving, identity)
        self._send_status(identity)

    def _note_beat(self, key: tuple[str, int], leaving: bool, identity: bytes) -> None:
        if leaving:   # its last beat: nothing more to tell it
            self._beat_identities.pop(key, None)
        else:
            self._beat_identities[key] = identity

    def announce(self) -> None:
        """Send the job's state now to every peer still beating, not at its next heartbeat (up to
        HEARTBEAT_INTERVAL later): set `done` first. A job's processes then exit as soon as it ends."""
        for identity in self._beat_identities.values():
            self._send_status(identity)

    def status(self) -> Message:
        """The answer to every heartbeat, made (and encoded) once per change of the job's state."""
        return self._current_status()[1]

    def _current_status(self) -> tuple[tuple[str, bool], Message, list[bytes]]:
        state = (self.failure, self.done)
        if self._status is None or self._status[0] != state:
            status = Message(Msg.STATUS, job=self.endpoint.job,
                             meta={"ok": not self.failure, "reason": self.failure,
                                   "done": self.done and not self.failure})
            self._status = (state, status, encode(status))
        return self._status

    def _send_status(self, identity: bytes) -> None:
        try:
            self.endpoint.forward(self._current_status()[2], identity)
        except zmq.ZMQError:
            pass  # the asker is gone; nothing to answer

    def _answer_lookups(self, roles: tuple[str, ...]) -> None:
        if not all(self._complete(role) for role in roles):
            return
        peers = [p.as_dict() for role in roles for p in self.by_role.get(role, {}).values()]
        answer = Message(Msg.DIRECTORY, meta={"peers": peers})
        for identity in self.pending.pop(roles, []):
            self._send(identity, answer)

    def _complete(self, role: str) -> bool:
        return role in self.expected and len(self.by_role.get(role, ())) >= self.expected[role]

    def _send(self, identity: bytes, msg: Message) -> None:
        try:
            self.endpoint.send(msg, identity)
        except zmq.ZMQError:
            pass  # the asker is gone; nothing to answer

    def silent_peers(self, timeout: float = HEARTBEAT_TIMEOUT, first_timeout: float | None = None) -> list[Peer]:
        """Peers whose heartbeats stopped for `timeout` s (a leaving one: LEAVING_GRACE), the
        longest silent of each kind first; with first_timeout, a peer whose first heartbeat
        has not come gets that long after registering (a thousand tasks starting at once
        wait for their connections' handshakes)."""
        return self.liveness.silent(timeout, timeout if first_timeout is None else first_timeout)

    def forgive_silence(self) -> None:
        """The owner's loop itself stalled (SIGSTOP, a paused VM): what the peers said meanwhile
        waits unread, so the silence measured across the stall is not theirs."""
        self.liveness.forgive(time.monotonic())

    def close(self) -> None:
        self.endpoint.close()


def register_timeout(tasks: int) -> float:
    """How long the launcher waits for `tasks` processes to register: longer for a bigger job."""
    return REGISTER_TIMEOUT + REGISTER_PER_TASK_S * tasks


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
