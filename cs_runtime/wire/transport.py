"""ZeroMQ plumbing shared by every process: sockets, send/receive, byte counts.

Everything between processes goes through `Endpoint.send` / `Endpoint.recv`,
which use the wire protocol in `protocol.py`. Sockets are made with LINGER 0
(so shutdown never hangs on unsent data) and unlimited high-water marks
(our messages are few and MB-sized; dropping one would corrupt a step).

What a peer without the job's keys can cost a process: libzmq buffers each
ZMTP frame up to MAXMSGSIZE even during the CURVE handshake, before the peer
has proven anything, and has one MAXMSGSIZE per socket for a connection's
whole life. No frame of the protocol exceeds MAX_FRAME_BYTES, a header's cap
(big arrays are split), so that is every socket's MAXMSGSIZE, 64 KiB for a
stranger and for the job's tensors alike; a connection that has not
finished its handshake within HANDSHAKE_IVL_MS is closed; and a process that binds raises its
descriptor limit to the hard limit, so held connections cannot starve it of
files for a checkpoint; and a gate per bound socket (gate.py) shuts down
connections beyond a few in handshake at once. Together: a few MB a
process, however many connections.
"""
from __future__ import annotations

import logging
import resource
import socket as pysocket
import time
from collections import Counter, OrderedDict

import zmq

from cs_runtime import env
from cs_runtime.wire import auth
from cs_runtime.wire.gate import HandshakeGate, one_malloc_arena
from cs_runtime.wire.protocol import (MAX_FRAME_BYTES, MAX_HEADER_BYTES, Message, MessageTooLarge, ProtocolError,
                                      array_bytes, decode, encode)

log = logging.getLogger(__name__)

# Sockets that carry only headers (directory, front door): no frame is bigger.
CONTROL_MAX_FRAME = MAX_HEADER_BYTES
# A CURVE handshake takes milliseconds; libzmq's default gives a stranger 30 s.
HANDSHAKE_IVL_MS = 2000
LISTEN_BACKLOG = 64     # connections the kernel queues before libzmq accepts them
# Plain ints: pyzmq's flag enums cost a Python-level `|` per frame on a hot path.
_NOBLOCK, _SNDMORE, _RCVMORE, _POLLIN = (int(f) for f in (zmq.NOBLOCK, zmq.SNDMORE, zmq.RCVMORE, zmq.POLLIN))
# CURVE wraps each frame in a MESSAGE command (name, nonce, flags, MAC: 33 bytes),
# and MAXMSGSIZE counts the wrapped frame.
CURVE_FRAME_OVERHEAD = 256


def bind_host() -> str:
    """Interface services bind to: loopback unless the launcher says otherwise."""
    return env.BIND_HOST.get()


def source_address_towards(host: str) -> str:
    """The address this machine uses to reach `host`: what a process here binds
    so that `host` can connect to it (loopback only when `host` is this machine
    via loopback). No packet is sent: a UDP connect only picks the route."""
    try:
        address = pysocket.getaddrinfo(host, None, pysocket.AF_INET)[0][4][0]
    except (pysocket.gaierror, IndexError):
        raise ValueError(f"host {host!r} does not resolve to an IPv4 address") from None
    if address.startswith("127."):
        return "127.0.0.1"
    with pysocket.socket(pysocket.AF_INET, pysocket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))
        except OSError as exc:
            raise ValueError(f"no route to host {host!r} ({address}): {exc.strerror}") from None
        return probe.getsockname()[0]


def host_of(address: str) -> str:
    """tcp://HOST:PORT -> HOST."""
    return address.split("://", 1)[-1].rsplit(":", 1)[0]


def host_name() -> str:
    return env.HOST_NAME.get() or pysocket.gethostname()


def raise_descriptor_limit() -> None:
    """Soft descriptor limit up to the hard one (as Ray and torchrun's agents do): a
    process that accepts connections must still open its checkpoint files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass   # a hard limit of RLIM_INFINITY on some systems: keep what we have


class PortInUse(OSError):
    pass


class SenderLog:
    """"Once per sender" lines whose cost does not grow with the senders: the senders already
    named are an LRU of KEPT, and at most PER_WINDOW lines go out per WINDOW_S; the rest are
    counted and summed up in one line when the next window opens. (A stranger who reconnects
    is a new sender each time: 68k connections used to be 68k lines and a set of 68k entries.)"""

    KEPT, PER_WINDOW, WINDOW_S = 256, 20, 60.0

    def __init__(self, name: str):
        self.name = name
        self.named: OrderedDict = OrderedDict()
        self.window_start, self.lines, self.unsaid = float("-inf"), 0, Counter()

    def once(self, level: int, key, text: str, *args) -> None:
        if key in self.named:
            self.named.move_to_end(key)
            return
        self.named[key] = None
        if len(self.named) > self.KEPT:
            self.named.popitem(last=False)
        now = time.monotonic()
        if now - self.window_start >= self.WINDOW_S:
            self._sum_up()
            self.window_start, self.lines = now, 0
        if self.lines < self.PER_WINDOW:
            self.lines += 1
            log.log(level, text, *args)
        else:
            self.unsaid[logging.getLevelName(level)] += 1

    def _sum_up(self) -> None:
        for level, count in self.unsaid.items():
            log.log(logging.getLevelName(level), "%s: %d more such %s lines not written in the last %.0f s "
                    "(at most %d a window)", self.name, count, level, self.WINDOW_S, self.PER_WINDOW)
        self.unsaid.clear()


class Endpoint:
    """One ZeroMQ socket plus the protocol, byte counters and bad-sender log.

    For ROUTER sockets `recv` returns (identity, Message) and `send` takes the
    identity of the peer to route to; otherwise identity is None.
    """

    def __init__(self, ctx: zmq.Context, kind: int, name: str, job: str = "",
                 max_frame_bytes: int = MAX_FRAME_BYTES, keys: "auth.JobKeys | None" = None,
                 any_client: bool | frozenset = False):
        self.ctx = ctx
        self.keys, self.any_client = keys, any_client   # None: the job's keys from the environment
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        # ZeroMQ drops a peer that sends a bigger frame before allocating it,
        # authenticated or not (handshake commands are frames too).
        self.max_frame_bytes = max_frame_bytes + CURVE_FRAME_OVERHEAD
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        if kind == zmq.ROUTER:
            # Fail loudly instead of silently dropping a message to an unknown peer.
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.is_router = kind == zmq.ROUTER
        self.name = name
        self.job = job
        self.bytes_sent = 0
        self.bytes_received = 0
        self._received_mark = 0
        self.sent_by_type: Counter = Counter()
        self.sender_log = SenderLog(name)   # bad messages and undelivered answers, once per peer
        self.segments = None      # shm.Segments: big arrays by reference, same host only
        self.last_user = ""       # the CURVE public key (Z85) of the peer that sent the last message
        self._has_user_ids = False   # a CURVE server's messages carry the ZAP handler's User-Id
        self.peer_address = ""    # what a connecting socket connected to (named when a send is refused)
        self.last_address = ""    # the IP address the last message came from (bound_queues' sockets only)
        self._wants_address = False

    def share_memory(self, segments) -> "Endpoint":
        """Send arrays that lie in a shared segment by reference, and accept such references."""
        self.segments = segments
        return self

    def bind(self, host: str | None = None, port: int = 0) -> str:
        """Bind on `host` (default: bind_host()) at `port` (0: any free one); the address."""
        host = host or bind_host()
        raise_descriptor_limit()
        one_malloc_arena()
        self.sock.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
        auth.secure_server(self.ctx, self.sock, host, self.keys, self.any_client)
        # Only then is there a User-Id to read: asking any other socket raises per message.
        self._has_user_ids = bool(self.sock.getsockopt(zmq.CURVE_SERVER))
        if not port:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        else:
            try:
                self.sock.bind(f"tcp://{host}:{port}")
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EADDRINUSE:
                    raise PortInUse(f"{self.name}: port {port} on {host} is already in use") from None
                raise
        # Strangers' handshakes in flight, bounded (each may hold a frame of up to MAXMSGSIZE).
        HandshakeGate(self.sock, self.name, self.max_frame_bytes, HANDSHAKE_IVL_MS / 1000).start()
        return f"tcp://{host}:{port}"

    def connect(self, address: str) -> "Endpoint":
        auth.secure_client(self.sock, self.keys)
        self.sock.connect(address)
        self.peer_address = address
        return self

    def send(self, msg: Message, identity: bytes | None = None, share: bool = True) -> bool:
        """Send `msg` (to `identity` on a ROUTER); share=False: frames only, for peers elsewhere.
        False when it was not delivered (said once per peer): the peer is gone or does not read."""
        if not msg.job:
            msg.job = self.job
        try:
            frames = encode(msg, self.segments if share else None)
        except MessageTooLarge as exc:   # said here, naming both ends, not dropped by the peer unsaid
            peer = identity.hex() if identity is not None else self.peer_address or "its peer"
            raise MessageTooLarge(f"{self.name}: cannot send to {peer}: {exc}") from None
        if not self._send_frames(frames, identity, msg.type.value):
            return False
        payload = array_bytes(msg)
        self.bytes_sent += payload
        self.sent_by_type[msg.type.value] += payload
        return True

    def forward(self, frames: list, identity: bytes | None = None) -> None:
        """Send already-encoded frames on (SwarmX's zero-copy broadcast)."""
        if not self._send_frames(frames, identity, "forwarded message"):
            return
        self.bytes_sent += sum(len(f.buffer) if hasattr(f, "buffer") else len(f) for f in frames[1:])

    def _send_frames(self, frames: list, identity: bytes | None, what: str) -> bool:
        parts = [identity, *frames] if self.is_router else frames
        send = self.sock.send
        try:
            # send_multipart, less its per-call checks: a thousand heartbeat answers a second go here
            for part in parts[:-1]:
                send(part, _SNDMORE, copy=False)
            send(parts[-1], 0, copy=False)
            return True
        except zmq.Again:
            self.note_undelivered(identity, what, "the peer does not read its answers")
            return False
        except zmq.error.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
        # The peer is gone. The launcher notices and stops the job; dying here
        # too would only hide which process failed first.
        self.note_undelivered(identity, what, "the peer has disconnected")
        return False

    def recv_raw(self, timeout_ms: int | None = None):
        """Next (identity, frames) or None on timeout; frames are not decoded."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart(copy=False)
        identity = None
        if self.is_router:
            identity, frames = frames[0].bytes, frames[1:]
        self.last_user = ""
        if self._has_user_ids and frames:
            try:   # the ZAP handler's User-Id: the client's public key (CURVE only)
                self.last_user = frames[0].get("User-Id")
            except zmq.ZMQError:
                pass
        if self._wants_address and frames:
            try:
                self.last_address = frames[0].get("Peer-Address")
            except zmq.ZMQError:
                self.last_address = ""
        return identity, frames

    def recv_waiting(self, timeout_ms: int, limit: int) -> list[tuple[bytes | None, list[bytes]]]:
        """Up to `limit` messages as they wait on the socket, undecoded (waiting up to timeout_ms
        for the first): a busy server's batch, one poll for all of them. Frames come as bytes
        (copying a small control message is cheaper than a zero-copy frame); `last_user` is not
        set. The caller decodes each with `decode_or_drop` before acting on it."""
        if not zmq.zmq_poll([(self.sock, _POLLIN)], timeout_ms):   # Socket.poll makes a Poller each call
            return []
        waiting, recv, more = [], self.sock.recv, self.sock.getsockopt
        try:
            while len(waiting) < limit:
                frames = [recv(_NOBLOCK)]
                while more(_RCVMORE):   # the rest of a message is there once its first frame is
                    frames.append(recv(_NOBLOCK))
                waiting.append((frames[0], frames[1:]) if self.is_router else (None, frames))
        except zmq.Again:
            pass
        return waiting

    def bound_queues(self, per_peer: int, kernel_bytes: int) -> "Endpoint":
        """At most `per_peer` messages queued for, and from, each peer, and `kernel_bytes` in
        the kernel's send buffer of each connection (else a socket's own buffer, megabytes a
        connection, takes what the queue limit keeps out); an answer to a peer that does not
        read is dropped, never queued without bound (a front door). Messages then also
        say where they came from (`last_address`)."""
        for option in (zmq.SNDHWM, zmq.RCVHWM):
            self.sock.setsockopt(option, per_peer)
        self.sock.setsockopt(zmq.SNDBUF, kernel_bytes)
        self.sock.setsockopt(zmq.SNDTIMEO, 0)
        self._wants_address = True
        return self

    def recv(self, timeout_ms: int | None = None, into=None):
        """Next valid message as (identity, Message), or None on timeout.

        Malformed messages and messages of another job are logged once per
        sender and dropped; the caller's state is untouched. `into`: the
        receiver's kept buffers for streamed arrays (protocol.decode).
        """
        while True:
            got = self.recv_raw(timeout_ms)
            if got is None:
                return None
            identity, frames = got
            msg = self.decode_or_drop(identity, frames, into)
            if msg is not None:
                return identity, msg

    def decode_or_drop(self, identity, frames, into=None, build: bool = True) -> Message | None:
        try:
            # Every sender stamps its job; an unstamped message is as foreign as another job's
            # (decode refuses it before it copies a byte into a kept buffer).
            msg = decode(frames, self.segments, into, job=self.job or None, build=build)
        except ProtocolError as exc:
            self.warn_once(identity, str(exc))
            return None
        self.bytes_received += array_bytes(msg)
        return msg

    def note_undelivered(self, identity, what: str, why: str) -> None:
        """Once per peer: a message of ours did not go out. Not a bad message (nothing
        was received), and usually the peer is simply done: an INFO line, not a warning."""
        peer = identity.hex() if identity else "peer"
        self.sender_log.once(logging.INFO, ("undelivered", peer), "%s: %s to %s not delivered: %s",
                             self.name, what, peer, why)

    def warn_once(self, identity, reason: str) -> None:
        sender = identity.hex() if identity else "peer"
        self.sender_log.once(logging.WARNING, sender, "%s: dropped bad message from %s: %s", self.name, sender, reason)

    def take_received(self) -> int:
        """Array bytes received since the previous call (per-step traffic counts)."""
        mark = self._received_mark
        self._received_mark = self.bytes_received
        return self.bytes_received - mark

    def close(self) -> None:
        self.sock.close(linger=0)
