"""Whether an address answers: a TCP connection, then a ZeroMQ handshake with the job's keys.

Checked before a job starts a single process (the CS system's front door at
--cs_ip), so a wrong address fails in seconds with one line instead of a long
wait for peers."""
from __future__ import annotations

import socket
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from cs_runtime.errors import CsError
from cs_runtime.wire import auth

CONNECT_TIMEOUT_S = 5.0
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class UnreachableError(CsError, RuntimeError):
    """host:port did not answer, or refused the handshake; the message names it."""


def check_reachable(host: str, port: int, what: str, timeout: float = CONNECT_TIMEOUT_S,
                    keys: auth.JobKeys | None = None, insecure: bool = False) -> None:
    """A TCP connection and a ZeroMQ handshake (with the job's keys) to host:port, or raise naming it.

    The handshake matters: a firewall or proxy may accept TCP for any address,
    and only a completed handshake shows a ZeroMQ peer that takes our keys.
    """
    check_tcp(host, port, what, timeout)
    _check_handshake(host, port, what, timeout, keys, insecure)


def check_tcp(host: str, port: int, what: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Something accepts TCP connections at host:port, or raise naming it."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except socket.timeout:
        raise UnreachableError(f"{what} {host}:{port} is unreachable (no answer within {timeout:.0f} s)") from None
    except OSError as exc:
        raise UnreachableError(f"{what} {host}:{port} is unreachable ({exc.strerror or exc})") from None


def _check_handshake(host: str, port: int, what: str, timeout: float, keys, insecure: bool) -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        if not insecure:
            auth.secure_client(sock, keys)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED)
        sock.connect(f"tcp://{host}:{port}")
        deadline = time.monotonic() + timeout
        while monitor.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
            if event & HANDSHAKE_FAILED:
                raise UnreachableError(f"{what} {host}:{port} refused this job's handshake "
                                     f"(not a CS system, or other CURVE keys / --insecure on one side only)")
        raise UnreachableError(f"{what} {host}:{port} is unreachable (no ZeroMQ handshake within {timeout:.0f} s)")
    finally:
        ctx.destroy(linger=0)
