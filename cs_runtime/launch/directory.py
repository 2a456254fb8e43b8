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
A process's side of it (DirectoryClient, the heartbeat thread) is
cs_runtime/process/directory_client.py, below every role.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import zmq

from cs_runtime.process.directory_client import DIRECTORY_MAX_FRAME, HEARTBEAT_TIMEOUT, REGISTER_TIMEOUT
from cs_runtime.wire.protocol import Message, Msg, encode
from cs_runtime.wire.transport import Endpoint

log = logging.getLogger(__name__)

# A peer that said it is leaving (its work done, the process exiting) may take this
# long to exit before it counts as hung: an interpreter with torch loaded takes
# seconds to tear down on a busy machine.
LEAVING_GRACE = 60.0
REGISTER_PER_TASK_S = 0.25  # a launcher starts its tasks one after another: more time per task
SERVE_BATCH = 256           # messages handled per serve_once before the owner's loop runs again


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
        elif msg.type in (Msg.REGISTER, Msg.EXITED) and not self._a_task_of_the_job(msg.meta):
            # What the directory keeps is bounded by the job's own tasks, whoever sends.
            self.endpoint.warn_once(identity, f"{msg.type.value} of {str(msg.meta['role'])[:40]} "
                                              f"{msg.meta['rank']}: not a task of this job")
        elif msg.type == Msg.REGISTER:
            self._register(msg)
        elif msg.type == Msg.LOOKUP:
            roles = tuple(sorted(str(r) for r in msg.meta["roles"]))
            if not set(roles) <= self.expected.keys():   # it could never be answered
                self.endpoint.warn_once(identity, f"lookup of {', '.join(roles)[:80]}: not roles of this job")
                return
            self.lookups.add(frozenset(roles))
            waiting = self.pending.setdefault(roles, [])
            if identity not in waiting:   # asked again: one answer will do
                waiting.append(identity)
            self._answer_lookups(roles)
        elif msg.type == Msg.EXITED:
            self.exits[(msg.meta["role"], msg.meta["rank"])] = dict(msg.meta)
            self._send_status(identity)
        else:
            self.endpoint.warn_once(identity, f"unexpected {msg.type.value} at the directory")

    def _a_task_of_the_job(self, meta: dict) -> bool:
        return 0 <= meta["rank"] < self.expected.get(meta["role"], 0)

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
