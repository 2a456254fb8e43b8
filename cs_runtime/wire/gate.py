"""A bound on handshakes in flight per listening socket, and per source address.

libzmq buffers a frame of up to the socket's MAXMSGSIZE for every connection,
during the CURVE handshake too, before the peer has proven anything; it has
no limit on connections. So a stranger with 300 connections each sending a
frame just under the cap used to cost a process some 300 MB. Here a thread
per bound socket reads the socket's monitor: every connection accepted is
"young" until its handshake succeeds, it closes, or the handshake interval
has passed (a connection still open by then has finished its handshake:
libzmq closes the others), and a new one
that would bring the young ones over the socket's budget, or over its
source's share of it, is shut down at once, before its handshake. A legitimate peer that is refused so during a flood reconnects by
itself (libzmq's reconnect interval), and connections already made are
never touched.

Budget: HANDSHAKE_BUDGET_BYTES of frames in flight per socket, so with every
socket's frames at most 64 KiB (protocol.MAX_FRAME_BYTES) 7 connections may
be young at once (3 from one source address): a stranger may hold those for
the whole handshake interval, so they are what a flood costs for its length.
A connection is shut down only after libzmq has accepted it, and libzmq
starts reading at once, so one the gate has not yet seen costs its frame
and libzmq's state for a connection (about 30 KB) until the shutdown: the
frame cap bounds each (64 KiB; it was 1 MiB, and a loaded machine's late
gate let 23 such frames in at once), and this thread's speed their number,
hence one look at each connection and every waiting event in one go. While
connections end the thread also gives the memory back every 0.2 s
(malloc_trim: glibc otherwise keeps a flood's freed megabytes in its arenas).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import socket as pysocket
import struct
import threading
import time
from collections import deque

import zmq

log = logging.getLogger(__name__)

HANDSHAKE_BUDGET_BYTES = 2**19       # frame bytes a socket's connections in handshake may hold at once
SOURCE_SHARE = 2                     # one source address may take 1/SOURCE_SHARE of a socket's budget
MIN_YOUNG = 2                        # whatever the frame cap, this many may handshake at once
TRIM_EVERY_S = 0.2                   # while connections end, freed memory goes back to the system this often
_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
           | zmq.EVENT_MONITOR_STOPPED)
_DONE = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
_EVENT = struct.Struct("=HI")   # a monitor event's first frame: the event (u16), its value (u32: the fd)
_NOBLOCK, _RCVMORE = int(zmq.NOBLOCK), int(zmq.RCVMORE)


def _glibc(name: str):
    """A function of glibc's allocator, or None elsewhere (the process's own symbols: no library search)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


_trim, _mallopt = _glibc("malloc_trim"), _glibc("mallopt")
_M_ARENA_MAX = -8
_one_arena = False


def one_malloc_arena() -> None:
    """Every thread of this process allocates from glibc's main arena from now on. libzmq's I/O
    thread otherwise gets an arena of its own, and memory freed at the top of a thread's arena
    stays resident (malloc_trim returns only the main arena's top): a flood's megabytes did.
    Called before a process binds, so before its I/O thread's first allocation."""
    global _one_arena
    if not _one_arena and _mallopt is not None:
        _mallopt(_M_ARENA_MAX, 1)
    _one_arena = True


@contextlib.contextmanager
def _borrowed(fd: int, family: int):
    """Connection `fd` as a Python socket, given back, never closed: it stays libzmq's. (No
    duplicate descriptor, and no look at the descriptor to learn its kind: this runs for every
    connection of a flood, and a dup and the look cost 15 us of the 40 a connection took.)"""
    conn = pysocket.socket(family, pysocket.SOCK_STREAM, 0, fileno=fd)
    try:
        yield conn
    finally:
        conn.detach()


def young_limits(max_frame_bytes: int) -> tuple[int, int]:
    """Connections in handshake at once on a socket of that frame cap: in all, and from one source."""
    in_all = max(MIN_YOUNG, HANDSHAKE_BUDGET_BYTES // max_frame_bytes)
    return in_all, max(MIN_YOUNG, in_all // SOURCE_SHARE)


GREETING_BYTES = 64   # ZMTP 3's greeting: all a server sends before the peer's first command is taken
_TCP_INFO = 11        # getsockopt(IPPROTO_TCP, TCP_INFO): struct tcp_info
# In struct tcp_info: tcpi_unacked (u32), tcpi_bytes_acked (u64) and, from Linux 5.5, tcpi_bytes_sent (u64).
_UNACKED, _BYTES_ACKED, _BYTES_SENT = slice(24, 28), slice(120, 128), slice(200, 208)


def _past_greeting(conn: pysocket.socket) -> bool:
    """Whether we may have sent more than our greeting on `conn` (or cannot tell)."""
    try:
        info = conn.getsockopt(pysocket.IPPROTO_TCP, _TCP_INFO, 256)
    except OSError:
        return True
    if len(info) >= _BYTES_SENT.stop:
        return int.from_bytes(info[_BYTES_SENT], "little") > GREETING_BYTES
    if len(info) < _BYTES_ACKED.stop:
        return True
    unacked = int.from_bytes(info[_UNACKED], "little")
    return unacked > 0 or int.from_bytes(info[_BYTES_ACKED], "little") > GREETING_BYTES


class HandshakeGate(threading.Thread):
    """Watches one bound socket's connections; see the module's doc. Start it right after bind;
    it ends by itself when the socket is closed or its context terminated."""

    def __init__(self, sock: zmq.Socket, name: str, max_frame_bytes: int, handshake_s: float):
        super().__init__(name=f"gate {name}", daemon=True)
        self.name, self.handshake_s = name, handshake_s
        self.max_young, self.max_per_source = young_limits(max_frame_bytes)
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)   # tcp://HOST:PORT, [HOST] for IPv6
        self.port = int(endpoint.rsplit(":", 1)[1])
        self.family = pysocket.AF_INET6 if endpoint.startswith("tcp://[") else pysocket.AF_INET
        self.young: deque[tuple[float, int, tuple]] = deque()   # (accepted at, fd, (source, source port))
        self.refused = 0             # connections shut down here (read by tests)
        self._dirty = False          # freed memory may wait in the allocator
        self._last_trim = 0.0
        address = f"inproc://gate-{id(self):x}-{self.port}"
        sock.monitor(address, _EVENTS)
        # Not through ctx.socket(): ctx.destroy() must not close it under this thread. Its term()
        # waits for it instead, and the poll here ends with ETERM, on which this thread closes it.
        self.events = zmq.Socket(sock.context, zmq.PAIR)
        self.events.connect(address)

    def run(self) -> None:
        try:
            while True:
                if self.events.poll(int(TRIM_EVERY_S * 1000)) and not self._handle_waiting():
                    return
                if self._dirty and time.monotonic() - self._last_trim >= TRIM_EVERY_S:
                    self._give_back()
        except zmq.ContextTerminated:
            return
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.ETERM, zmq.ENOTSOCK):
                log.warning("%s: handshake gate stopped: %s", self.name, exc)
        finally:
            self.events.close(linger=0)

    def _handle_waiting(self) -> bool:
        """Every event waiting, in one go (a flood brings thousands a second, and what this thread
        spends on each is time a refused stranger's frame stays in memory); False once the
        monitor has stopped."""
        recv, more = self.events.recv, self.events.getsockopt
        try:
            while True:
                head = recv(_NOBLOCK)
                while more(_RCVMORE):
                    recv()   # the endpoint's address: not needed
                kind, fd = _EVENT.unpack_from(head)
                if not self._handle(kind, fd):
                    return False
        except zmq.Again:
            return True

    def _handle(self, kind: int, fd: int) -> bool:
        if kind == zmq.EVENT_MONITOR_STOPPED:
            return False
        if kind & _DONE:
            self._forget(fd)
            self._dirty = True
        elif kind == zmq.EVENT_ACCEPTED:
            self._admit(fd)
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED and self.young:
            # libzmq does not say which connection: the oldest is the likeliest, and the count stays
            # right either way (a wrong guess only keeps a handshaken one counted until it ages out).
            self.young.popleft()
        return True

    def _admit(self, fd: int) -> None:
        """Count connection `fd` as young, or shut it down when that would bring the young ones
        over the socket's budget or its source's share; one look at the connection for both."""
        now = time.monotonic()
        while self.young and now - self.young[0][0] > self.handshake_s:
            self.young.popleft()   # handshaken by now, or closed by libzmq
        try:
            with _borrowed(fd, self.family) as conn:
                if conn.getsockname()[1] != self.port:
                    return   # gone already, and the number now names another file of ours: not ours
                source = conn.getpeername()[0]
                if self._over(source) and self._shut(conn, source):
                    return
        except OSError:
            return   # gone already
        self.young.append((now, fd, source))   # counted, so that its HANDSHAKE_SUCCEEDED has an entry

    def _over(self, source: str) -> bool:
        return len(self.young) >= self.max_young \
            or sum(1 for *_, s in self.young if s == source) >= self.max_per_source

    def _forget(self, fd: int) -> None:
        for entry in self.young:
            if entry[1] == fd:
                self.young.remove(entry)
                return

    def _shut(self, conn: pysocket.socket, source: str) -> bool:
        """Shut `conn` down (libzmq sees its end and frees it) unless its handshake has gone past
        our greeting: one that has may be a peer of the job already (the monitor's news comes
        late), and its messages must not be cut. Whether it was."""
        if _past_greeting(conn):
            return False
        conn.shutdown(pysocket.SHUT_RDWR)
        self.refused += 1
        self._dirty = True
        if self.refused == 10 ** (len(str(self.refused)) - 1):   # a flood: a line per decade, not per connection
            log.warning("%s: %d connection(s) refused before their handshake: over %d in handshake at once "
                        "(%d per source); the last from %s", self.name, self.refused, self.max_young,
                        self.max_per_source, source)
        return True

    def _give_back(self) -> None:
        self._dirty, self._last_trim = False, time.monotonic()
        if _trim is not None:
            _trim(0)

