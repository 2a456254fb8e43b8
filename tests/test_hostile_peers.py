"""What a local process without the job's keys can cost a job: a few MB a
process however many connections it makes (a few handshakes in flight per
port, cs_runtime/wire/gate.py), given back when it stops, and no descriptors beyond the
2 s a handshake may take.

libzmq reads ZMTP handshake commands with the socket's MAXMSGSIZE as the only
limit, so before CURVE has checked anything a stranger can make a process
buffer a frame of up to that size. These tests speak raw ZMTP: a CURVE
greeting, then a command frame that declares 200 MB and streams its bytes, or
one a byte under the port's cap from many connections at once.

    python -m pytest tests/test_hostile_peers.py -q
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from cs_runtime.wire import auth
from cs_runtime.wire.protocol import MAX_FRAME_BYTES
from cs_runtime.wire.transport import CONTROL_MAX_FRAME, CURVE_FRAME_OVERHEAD, HANDSHAKE_IVL_MS
from cs_runtime.process.directory_client import DirectoryClient
from cs_runtime.wire.gate import young_limits
from scripts.chaos import near_cap_handshakes
from tests.cluster_utils import (FC_MNIST, GATED_RUN, final_weights, gated_fc_mnist, kill_tree, run_cpu, run_wse,
                                 tool, train_losses, write_params, wse_command)
from tests.test_faults import assert_matches, pids_by_role, process_env, read_until, rss_bytes, start_job

pytestmark = pytest.mark.cluster  # the tests here start processes

GREETING = (b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0") + b"\x00" + bytes(31))
DECLARED = 200 * 2**20
# What near-cap handshakes at every port may cost each process of a job: at their peak, and a
# second after. Measured 0.6 to 7.5 MB at the peak and 0 to 1.1 MB after on 2 cores at load 11 to
# 20 (docs/security.md): the peak's part beyond the young connections is the connections the gate
# has not yet seen, which the machine's load decides, hence the margin.
PEAK_BOUND, FINAL_BOUND = 10 * 2**20, 4 * 2**20


def tcp_of(address: str) -> tuple[str, int]:
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


def stream_frame(conn: socket.socket, send_bytes: int) -> int:
    """Greet as a CURVE client, declare a DECLARED-byte command frame and stream
    up to send_bytes of it; the bytes the server took before it hung up."""
    sent = 0
    try:
        conn.sendall(GREETING + b"\x06" + DECLARED.to_bytes(8, "big"))
        chunk = bytes(1 << 20)
        while sent < send_bytes:
            sent += conn.send(chunk)
    except OSError:
        pass   # reset or broken pipe: the server dropped us
    return sent


def flood(address: str, send_bytes: int, timeout: float = 10.0) -> int:
    with socket.create_connection(tcp_of(address), timeout=timeout) as conn:
        return stream_frame(conn, send_bytes)


def hold(address: str, count: int) -> list[socket.socket]:
    """`count` connections that greet and then say nothing more."""
    held = []
    for _ in range(count):
        conn = socket.create_connection(tcp_of(address), timeout=5)
        conn.sendall(GREETING)
        held.append(conn)
    return held


def closed_by_server(conn: socket.socket, within_s: float) -> bool:
    conn.settimeout(within_s)
    try:
        while True:
            data = conn.recv(4096)   # the server's greeting first, then EOF
            if not data:
                return True
    except ConnectionResetError:
        return True
    except (TimeoutError, socket.timeout):
        return False


SERVER = """
import sys, zmq
from cs_runtime.wire.transport import Endpoint
ctx = zmq.Context()
kwargs = {} if sys.argv[1] == "default" else {"max_frame_bytes": int(sys.argv[1])}
from cs_runtime.wire import auth
ep = Endpoint(ctx, zmq.ROUTER, "target", "job", keys=auth.load_keys(sys.argv[2]), **kwargs)
print(ep.bind("127.0.0.1"), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def job_keys():
    folder = auth.create_job_dir()
    yield str(folder)
    auth.remove_job_dir(folder)


def grown_by_flood(max_frame: str, keys: str, send_bytes: int, expect_bytes: int) -> tuple[int, int]:
    """Peak RSS growth of a lone CURVE ROUTER while a stranger floods it, and the bytes it
    took. The connection stays open while we read: at EOF the server frees what it holds,
    and on a loaded machine it may still be draining the kernel's buffers when the last
    send returns, so we watch (up to 10 s) until the growth reaches expect_bytes. A server
    that hung up on us is read once."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER, max_frame, keys], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()
        before = rss_bytes(proc.pid)
        with socket.create_connection(tcp_of(address), timeout=10) as conn:
            sent = stream_frame(conn, send_bytes)
            grown, deadline = rss_bytes(proc.pid) - before, time.monotonic() + 10
            while expect_bytes and grown < expect_bytes and time.monotonic() < deadline:
                time.sleep(0.05)   # polling the RSS, not waiting for an event
                grown = max(grown, rss_bytes(proc.pid) - before)
        return grown, sent
    finally:
        proc.kill()
        proc.wait()


def test_curve_buffers_a_strangers_frame_up_to_maxmsgsize_and_our_cap_stops_it(job_keys):
    """The measurement behind the cap: with a 2 GiB MAXMSGSIZE (the old setting) 64 MB streamed
    before any authentication stay in the server; with ours the stranger is dropped at the
    frame's header."""
    old_grown, old_sent = grown_by_flood(str(2 * 2**30), job_keys, 64 * 2**20, expect_bytes=48 * 2**20)
    assert old_sent >= 64 * 2**20 and old_grown > 48 * 2**20, (old_grown, old_sent)
    grown, sent = grown_by_flood("default", job_keys, 64 * 2**20, expect_bytes=0)
    assert grown < 4 * 2**20, grown
    assert sent < 16 * 2**20, sent   # what the kernel's buffers took before the reset


def test_a_silent_stranger_is_dropped_after_the_handshake_interval(job_keys):
    proc = subprocess.Popen([sys.executable, "-c", SERVER, "default", job_keys], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        held = hold(proc.stdout.readline().strip(), 50)
        t0 = time.monotonic()
        assert all(closed_by_server(conn, HANDSHAKE_IVL_MS / 1000 + 3) for conn in held)
        assert time.monotonic() - t0 < HANDSHAKE_IVL_MS / 1000 + 3
        for conn in held:
            conn.close()
    finally:
        proc.kill()
        proc.wait()


def open_descriptors(pid: int) -> int:
    try:
        return len(list(Path(f"/proc/{pid}/fd").iterdir()))
    except FileNotFoundError:
        return 0


def test_floods_and_held_connections_on_every_port_cost_little_and_change_nothing(tmp_path, monkeypatch):
    params = write_params(tmp_path, runconfig={"max_steps": 120, "log_steps": 10, "checkpoint_steps": 0})
    script, gate = tmp_path / "gated_run.py", tmp_path / "gate"
    script.write_text(GATED_RUN)
    os.mkfifo(gate)
    cpu_cmd = [tool("csrun_cpu"), sys.executable, FC_MNIST, "--mode", "train", "--params", str(params),
               "--model_dir", str(tmp_path / "cpu")]
    cpu = subprocess.run(gated_fc_mnist(cpu_cmd, script), capture_output=True, text=True, timeout=120)
    assert cpu.returncode == 0, cpu.stderr[-2000:]
    monkeypatch.setenv("GATE_FIFO", str(gate))
    monkeypatch.setenv("GATE_AT", "60")   # past the first "| Train" line (step 10)
    proc = start_job(gated_fc_mnist(wse_command(params, tmp_path / "m"), script))
    seen: list[str] = []
    ctx = zmq.Context()
    held: list[socket.socket] = []
    try:
        read_until(proc, r"\| Train", seen)
        roles = pids_by_role(proc)
        env = process_env(roles["chief"][0])
        os.environ[auth.KEYS_ENV] = env[auth.KEYS_ENV]   # an insider only to learn the addresses
        try:
            found = DirectoryClient(ctx, env["CS_RENDEZVOUS"], "tester", 0, env["CS_JOB_ID"]).lookup(
                ["chief", "memoryx", "swarmx", "wse"], timeout=30)
        finally:
            del os.environ[auth.KEYS_ENV]
        targets = {"launcher": (proc.pid, env["CS_RENDEZVOUS"]),
                   "chief": (roles["chief"][0], found["chief"][0]["endpoints"]["router"]),
                   "memoryx": (roles["memoryx"][0], found["memoryx"][0]["endpoints"]["router"]),
                   "swarmx": (roles["swarmx"][0], found["swarmx"][0]["endpoints"]["router"]),
                   "wse": (roles["wse"][0], found["wse"][0]["endpoints"]["input"])}
        rss_before = {name: rss_bytes(pid) for name, (pid, _) in targets.items()}
        fds_before = {name: open_descriptors(pid) for name, (pid, _) in targets.items()}
        streamed = {name: sum(flood(address, 32 * 2**20) for _ in range(5))
                    for name, (_, address) in targets.items()}
        for name, (_, address) in targets.items():
            held += hold(address, 100)
        rss_after = {name: rss_bytes(pid) for name, (pid, _) in targets.items()}
        # The gate shuts the connections beyond its bound as it hears of them (a thread of each
        # process, slower on a loaded machine): within a second, well before libzmq's 2 s.
        settle = time.monotonic() + 1.0
        while True:
            fds_held = {name: open_descriptors(pid) for name, (pid, _) in targets.items()}
            if time.monotonic() > settle or all(fds_held[n] - fds_before[n] <= held_bound(n) for n in targets):
                break
            time.sleep(0.05)   # a fresh count of each process's descriptors each time
        dropped = sum(closed_by_server(conn, HANDSHAKE_IVL_MS / 1000 + 5) for conn in held)
        fds_after = {name: open_descriptors(pid) for name, (pid, _) in targets.items()}
        # Every port at once: 100 connections each, frames 1 byte under the cap, reconnecting for 3 s.
        rss_base = {name: rss_bytes(pid) for name, (pid, _) in targets.items()}
        peak = dict(rss_base)
        attacks = [threading.Thread(target=near_cap_handshakes, daemon=True,
                                    args=(address, 100, 3.0, max_frame_of(name) - 1))
                   for name, (_, address) in targets.items()]
        for attack in attacks:
            attack.start()
        while any(attack.is_alive() for attack in attacks):
            for name, (pid, _) in targets.items():   # sampled: a fresh read of each process each time
                peak[name] = max(peak[name], rss_bytes(pid) or 0)
            time.sleep(0.05)
        settle = time.monotonic() + 1.0
        while time.monotonic() < settle:   # malloc_trim runs within 0.2 s of the last connection's end
            time.sleep(0.05)
        rss_final = {name: rss_bytes(pid) for name, (pid, _) in targets.items()}
        with open(gate, "w"):   # let the input worker go on: the job ends as the CPU run did
            pass
        output = "".join(seen) + proc.stdout.read()
        assert proc.wait(timeout=180) == 0, output[-3000:]
    finally:
        for conn in held:
            conn.close()
        ctx.destroy(linger=0)
        kill_tree(proc)
    print("streamed", streamed, "rss growth", {n: rss_after[n] - rss_before[n] for n in targets},
          "fds", fds_before, fds_held, fds_after)
    assert all(sent < 16 * 2**20 * 5 for sent in streamed.values()), streamed
    growth = {name: rss_after[name] - rss_before[name] for name in targets if rss_after[name] is not None}
    assert len(growth) == len(targets) and max(growth.values()) < 8 * 2**20, growth
    # Held connections beyond the few one source may have in handshake are shut down at once,
    # the rest within 2 s.
    assert all(fds_held[n] - fds_before[n] <= held_bound(n) for n in targets), (fds_before, fds_held)
    assert dropped == len(held)
    print("near-cap handshakes: base", rss_base, "peak", peak, "final", rss_final)
    # What a refused stranger costs is its frame (64 KiB at most) and libzmq's state for a connection
    # until the gate acts (milliseconds, more on a loaded machine): 100 connections a port used to
    # cost 100 MB a process, and up to 23 MB with the gate and 1 MiB frames.
    assert max(peak[n] - rss_base[n] for n in targets) < PEAK_BOUND, (rss_base, peak)
    assert max(rss_final[n] - rss_base[n] for n in targets) < FINAL_BOUND, (rss_base, rss_final)
    assert max(fds_after[n] - fds_before[n] for n in targets) < 10, (fds_before, fds_after)
    assert "dropped bad message" not in output and "Traceback" not in output
    assert_matches(tmp_path / "m", tmp_path / "cpu")


def held_bound(target: str) -> int:
    """Descriptors a held flood may cost a port's process: the connections one source may have in
    handshake, and a few more (the gate's own duplicates, a connection being accepted)."""
    return young_limits(max_frame_of(target))[1] + 4


def max_frame_of(target: str) -> int:
    """The MAXMSGSIZE of a job's port: the directory's is a control socket's."""
    return (CONTROL_MAX_FRAME if target == "launcher" else MAX_FRAME_BYTES) + CURVE_FRAME_OVERHEAD


def test_tensors_bigger_than_a_frame_cross_tcp_split_and_match_the_oracle(tmp_path):
    """784 x 512 float32 weights (1.5 MiB) over tcp, no shared memory: split into frames and joined."""
    params = write_params(tmp_path, model={"hidden_sizes": [512]}, runconfig={"max_steps": 20, "log_steps": 5,
                                                                             "checkpoint_steps": 0})
    assert run_cpu(params, tmp_path / "cpu").returncode == 0
    result = run_wse(params, tmp_path / "m", num_csx=2, extra_launcher=("--no_shm",))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dropped bad message" not in result.stderr
    assert_matches(tmp_path / "m", tmp_path / "cpu")


@pytest.mark.parametrize("num_csx", [1, 2])
def test_16_bit_tensors_bigger_than_a_frame_over_tcp_equal_the_shared_memory_run(tmp_path, num_csx):
    """784 x 1024 float16 weights (1.5 MiB) over tcp: joined into the WSE's and MemoryX's kept buffers
    (float16 from one WSE, SwarmX's float32 sums from two), the same numbers as by shared memory."""
    params = write_params(tmp_path, model={"hidden_sizes": [1024], "mixed_precision": True},
                          runconfig={"max_steps": 6, "log_steps": 2, "checkpoint_steps": 0})
    for run, extra in (("tcp", ("--no_shm",)), ("shm", ())):
        result = run_wse(params, tmp_path / run, num_csx=num_csx, extra_launcher=extra)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "dropped bad message" not in result.stderr
    np.testing.assert_array_equal(train_losses(tmp_path / "tcp"), train_losses(tmp_path / "shm"))
    want, got = final_weights(tmp_path / "shm"), final_weights(tmp_path / "tcp")
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
