"""CURVE on every socket: per-job keys, a rogue peer refused, loopback-only insecure mode.

    python -m pytest tests/test_auth.py -q
"""
from __future__ import annotations

import dataclasses
import stat
import subprocess
import sys

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from cs_runtime.wire import auth
from cs_runtime.wire.protocol import Message, Msg, encode
from cs_runtime.wire.transport import Endpoint

HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@pytest.fixture
def job_keys(monkeypatch):
    folder = auth.create_job_dir()
    monkeypatch.setenv(auth.KEYS_ENV, str(folder))
    yield auth.load_keys(str(folder))
    auth.remove_job_dir(folder)


@pytest.fixture
def server(job_keys):
    ctx = zmq.Context()
    endpoint = Endpoint(ctx, zmq.ROUTER, "memoryx", "job-1")
    address = endpoint.bind()
    yield endpoint, address
    auth.stop_authenticator(ctx)
    ctx.destroy(linger=0)


def handshake(keys: auth.JobKeys | None, address: str) -> tuple[int, zmq.Context, zmq.Socket]:
    """Connect a plain DEALER with `keys` (None: no CURVE) and return the first handshake event."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if keys is not None:
        auth.secure_client(sock, keys)
    monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
    sock.connect(address)
    assert monitor.poll(10_000), "no handshake event at all"
    return recv_monitor_message(monitor)["event"], ctx, sock


def test_key_files_are_private_and_removed(job_keys):
    folder = job_keys.folder
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["client.key", "client.key_secret", "launcher.pid", "server.key", "server.key_secret"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in folder.iterdir())
    assert job_keys.server_secret != job_keys.client_secret
    auth.remove_job_dir(folder)
    assert not folder.exists()


@pytest.mark.cluster
def test_a_folder_left_by_a_killed_launcher_is_removed_by_the_next_one():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = auth.create_job_dir()
    (stale / auth.OWNER_FILE).write_text(dead)  # as if its launcher had been killed
    live = auth.create_job_dir()
    try:
        assert not stale.exists()
        assert live.exists()
        other = auth.create_job_dir()
        assert live.exists()  # its owner (this process) is alive
        auth.remove_job_dir(other)
    finally:
        auth.remove_job_dir(live)
        auth.remove_job_dir(stale)


def test_each_job_gets_its_own_keys():
    a, b = auth.create_job_dir(), auth.create_job_dir()
    try:
        assert auth.load_keys(str(a)).server_public != auth.load_keys(str(b)).server_public
    finally:
        auth.remove_job_dir(a)
        auth.remove_job_dir(b)


def test_a_client_with_the_job_keys_gets_through(server, job_keys):
    endpoint, address = server
    event, ctx, sock = handshake(job_keys, address)
    try:
        assert event == zmq.EVENT_HANDSHAKE_SUCCEEDED
        sock.send_multipart(encode(Message(Msg.HELLO, job="job-1", meta={"role": "chief", "rank": 0})))
        got = endpoint.recv(10_000)
        assert got is not None and got[1].type == Msg.HELLO
    finally:
        ctx.destroy(linger=0)


def rogue_keys(job_keys: auth.JobKeys, kind: str) -> auth.JobKeys | None:
    if kind == "no_keys":
        return None
    other_folder = auth.create_job_dir()
    other = auth.load_keys(str(other_folder))
    auth.remove_job_dir(other_folder)
    if kind == "other_job_keys":
        return other
    # Knows the job's server public key (it is "public") but has no client key of the job.
    return dataclasses.replace(other, server_public=job_keys.server_public)


HANDSHAKE_FAILED = HANDSHAKE_EVENTS & ~zmq.EVENT_HANDSHAKE_SUCCEEDED


@pytest.mark.parametrize("kind,refusal", [
    ("no_keys", HANDSHAKE_FAILED),
    ("other_job_keys", HANDSHAKE_FAILED),
    ("server_key_only", zmq.EVENT_HANDSHAKE_FAILED_AUTH),  # refused by the ZAP handler
])
def test_a_rogue_peer_is_refused_and_cannot_inject(server, job_keys, kind, refusal, caplog):
    endpoint, address = server
    event, ctx, sock = handshake(rogue_keys(job_keys, kind), address)
    try:
        assert event & refusal, f"handshake event {event}"
        # A perfectly valid message of the right job: it must never arrive. (With no
        # authenticated connection the DEALER may have nowhere to queue it at all.)
        try:
            sock.send_multipart(encode(Message(Msg.TRAIN_STEP, job="job-1", step=0, meta={"lr": 1.0})),
                                flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        assert endpoint.recv(1000) is None
        assert "dropped bad message" not in caplog.text  # not even seen as bad: nothing arrived
    finally:
        ctx.destroy(linger=0)


def test_without_keys_only_loopback_may_bind(monkeypatch):
    monkeypatch.delenv(auth.KEYS_ENV, raising=False)
    ctx = zmq.Context()
    try:
        endpoint = Endpoint(ctx, zmq.ROUTER, "memoryx", "job-1")
        with pytest.raises(auth.AuthError, match="refusing to bind 0.0.0.0 without CURVE keys"):
            endpoint.bind("0.0.0.0")
        assert endpoint.bind("127.0.0.1").startswith("tcp://127.0.0.1:")
    finally:
        ctx.destroy(linger=0)


def test_unreadable_keys_name_the_folder(tmp_path):
    with pytest.raises(auth.AuthError, match=str(tmp_path)):
        auth.load_keys(str(tmp_path))
