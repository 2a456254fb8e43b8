"""Faults, bad input and intruders, on whole clusters checked against the CPU oracle.

    python -m pytest tests/test_faults.py -q

- kill -9 of each non-chief role at a random step, with --max_restarts 1:
  the job restarts from its latest checkpoint and ends with the oracle's numbers;
- malformed messages (hypothesis) thrown at every service's socket during a
  run, by a peer that holds the job's keys: logged once per sender, dropped,
  no process dies or grows, the run still matches its oracle;
- rogue peers without the job's keys: refused at the handshake, nothing lands;
- bad input from the user: one line naming the thing, non-zero exit, no restart.
"""
from __future__ import annotations

import dataclasses
import os
import random
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message

from cs_runtime.wire import auth
from cs_runtime.process.directory_client import DirectoryClient
from cs_runtime.wire.protocol import PROTOCOL_VERSION, Message, Msg, ProtocolError, decode, encode
from tests.cluster_utils import (FC_MNIST, GATED_RUN, TOL, alive, assert_matches_oracle, descendants, final_weights,
                                 gated_fc_mnist, kill_tree, relative_error, run_cpu, run_wse, tool, train_losses,
                                 wse_command, write_params)
from tests.test_cluster import ROLE_PATTERNS

pytestmark = pytest.mark.cluster  # every test here starts processes (see tests/conftest.py)

DROPPED_RE = re.compile(r" (\S+) WARNING (\S+): dropped bad message from (\S+):")


def start_job(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_until(proc: subprocess.Popen, pattern: str, seen: list[str]) -> re.Match:
    for line in proc.stdout:
        seen.append(line)
        found = re.search(pattern, line)
        if found:
            return found
    raise AssertionError("job ended before " + pattern + ":\n" + "".join(seen[-40:]))


def pids_by_role(proc: subprocess.Popen) -> dict[str, list[int]]:
    tree = descendants(proc.pid)
    return {role: [pid for pid, args in tree if pattern in args + " "] for role, pattern in ROLE_PATTERNS.items()}


def process_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def rss_bytes(pid: int) -> int | None:
    """Resident bytes of `pid`, or None once it has exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def with_launcher_flags(cmd: list[str], *flags: str) -> list[str]:
    return [cmd[0], *flags, *cmd[1:]]


def assert_matches(model_dir: Path, cpu_dir: Path) -> None:
    got, want = train_losses(model_dir), train_losses(cpu_dir)
    assert len(got) == len(want)
    assert (np.abs(got - want) / np.abs(want)).max() < TOL
    got_w, want_w = final_weights(model_dir), final_weights(cpu_dir)
    for name in want_w:
        assert relative_error(got_w[name], want_w[name]) < TOL, name


# --------------------------------------------------------------------------
# restart from the latest checkpoint
# --------------------------------------------------------------------------

@pytest.mark.parametrize("role", ["wse", "memoryx", "swarmx", "worker"])
def test_kill_9_at_a_random_step_restarts_and_ends_with_the_oracles_weights(tmp_path, oracle, role):
    kill_at = random.Random().randrange(10, 80, 5)  # before or after checkpoint_50
    params = write_params(tmp_path, runconfig={"log_steps": 5})  # the oracle's maths, more progress lines
    proc = start_job(with_launcher_flags(wse_command(params, tmp_path / "m"), "--max_restarts", "1"))
    seen: list[str] = []
    try:
        while int(read_until(proc, r"\| Train .*Step=(\d+)", seen).group(1)) < kill_at:
            pass
        first = pids_by_role(proc)
        victim = first[role][0]
        subprocess.run(["kill", "-9", str(victim)], check=True)
        output = "".join(seen) + proc.stdout.read()
        assert proc.wait(timeout=180) == 0, f"killed {role} at step {kill_at}:\n{output[-3000:]}"
        failed = [l for l in output.splitlines() if "job failed" in l]
        assert len(failed) == 1 and f"{role} 0 on" in failed[0] and f"(pid {victim})" in failed[0], output[-3000:]
        assert "restarting the whole job from the latest checkpoint (restart 1 of 1)" in output
        assert [pid for pids in first.values() for pid in pids if alive(pid)] == []
        assert_matches_oracle(tmp_path / "m", oracle)
    finally:
        kill_tree(proc)


def test_without_restarts_a_failure_ends_the_job(tmp_path):
    params = write_params(tmp_path, runconfig={"max_steps": 100000, "log_steps": 5})
    proc = start_job(wse_command(params, tmp_path / "m"))
    try:
        read_until(proc, r"\| Train", [])
        subprocess.run(["kill", "-9", str(pids_by_role(proc)["swarmx"][0])], check=True)
        output = proc.stdout.read()
        assert proc.wait(timeout=30) != 0
        assert "job failed: swarmx 0" in output and "restarting" not in output
    finally:
        kill_tree(proc)


# --------------------------------------------------------------------------
# malformed messages at every service, during a run
# --------------------------------------------------------------------------

def header(**fields) -> dict:
    base = {"t": "train_step", "v": PROTOCOL_VERSION, "job": "", "step": 0, "layer": -1,
            "meta": {"lr": 0.1}, "arrays": []}
    base.update(fields)
    return base


def pack(h: dict, *frames: bytes) -> list[bytes]:
    return [msgpack.packb(h, use_bin_type=True), *frames]


@st.composite
def bad_messages(draw, job: str) -> list[bytes]:
    """Messages every receiver must drop: malformed, or valid but not of this job."""
    kind = draw(st.sampled_from(["random", "truncated", "version", "type", "meta", "shape", "frames",
                                 "huge_claim", "big_junk", "dtype", "foreign_job", "unstamped"]))
    ok_grads = encode(Message(Msg.GRADS, job=job, step=1, layer=0,
                              arrays={"weight": np.ones((4, 3), np.float32)}))
    if kind == "random":
        return draw(st.lists(st.binary(max_size=300), min_size=1, max_size=4))
    if kind == "truncated":
        raw = ok_grads[0]
        return [raw[: draw(st.integers(0, len(raw) - 1))], *ok_grads[1:]]
    if kind == "version":
        return pack(header(job=job, v=draw(st.integers(-2**63, 2**64 - 1).filter(lambda v: v != PROTOCOL_VERSION))))
    if kind == "type":
        return pack(header(job=job, t=draw(st.text(max_size=30).filter(lambda t: t not in Msg._value2member_map_))))
    if kind == "meta":
        return pack(header(job=job, meta={"lr": draw(st.one_of(st.text(), st.none(), st.booleans()))}))
    if kind == "shape":
        shape = draw(st.lists(st.integers(0, 64), min_size=1, max_size=3).filter(lambda s: int(np.prod(s)) != 12))
        return pack(header(job=job, t="grads", meta={}, arrays=[["weight", "float32", shape]]), bytes(48))
    if kind == "frames":
        return pack(header(job=job, t="grads", meta={}, arrays=[["weight", "float32", [4, 3]]]))
    if kind == "huge_claim":  # must be refused before anything is allocated
        dims = draw(st.lists(st.integers(2**20, 2**62), min_size=1, max_size=8))
        return pack(header(job=job, t="grads", meta={}, arrays=[["weight", "float32", dims]]), bytes(16))
    if kind == "big_junk":
        return pack(header(job=job, t="grads", meta={}, arrays=[["weight", "float32", [4, 3]]]),
                    bytes(draw(st.integers(100_000, 400_000))))
    if kind == "dtype":
        return pack(header(job=job, t="grads", meta={}, arrays=[["w", draw(st.sampled_from(["object", "V8", "O"])), [1]]]),
                    bytes(8))
    if kind == "foreign_job":
        return encode(Message(Msg.TRAIN_STEP, job=draw(st.text(min_size=1, max_size=20).filter(lambda j: j != job)),
                              step=0, meta={"lr": 10.0}))
    return encode(Message(Msg.TRAIN_STEP, job="", step=0, meta={"lr": 10.0}))


def is_dropped(frames: list[bytes], job: str) -> bool:
    try:
        return decode(frames).job != job
    except ProtocolError:
        return True


def test_bad_messages_during_a_run_are_logged_once_and_change_nothing(tmp_path, monkeypatch):
    # Held at its 60th batch (GATED_RUN) until the bad messages are sent and the services' memory
    # is read, however fast this machine trains.
    params = write_params(tmp_path, runconfig={"max_steps": 120, "log_steps": 10, "checkpoint_steps": 0})
    cpu = run_cpu(params, tmp_path / "cpu")
    assert cpu.returncode == 0, cpu.stderr[-2000:]
    script, gate = tmp_path / "gated_run.py", tmp_path / "gate"
    script.write_text(GATED_RUN)
    os.mkfifo(gate)
    monkeypatch.setenv("GATE_FIFO", str(gate))
    monkeypatch.setenv("GATE_AT", "60")   # past the first "| Train" line (step 10)
    proc = start_job(gated_fc_mnist(wse_command(params, tmp_path / "m"), script))
    seen: list[str] = []
    ctx = zmq.Context()
    try:
        read_until(proc, r"\| Train", seen)
        roles = pids_by_role(proc)
        env = process_env(roles["chief"][0])  # an insider: the job's keys and addresses
        job = env["CS_JOB_ID"]
        monkeypatch.setenv(auth.KEYS_ENV, env[auth.KEYS_ENV])
        found = DirectoryClient(ctx, env["CS_RENDEZVOUS"], "tester", 0, job).lookup(
            ["chief", "memoryx", "swarmx", "wse"], timeout=30)
        targets = {"directory": (zmq.DEALER, env["CS_RENDEZVOUS"]),
                   "chief": (zmq.DEALER, found["chief"][0]["endpoints"]["router"]),
                   "memoryx": (zmq.DEALER, found["memoryx"][0]["endpoints"]["router"]),
                   "swarmx": (zmq.DEALER, found["swarmx"][0]["endpoints"]["router"]),
                   "wse0-input": (zmq.DEALER, found["wse"][0]["endpoints"]["input"])}
        sockets = {}
        for name, (kind, address) in targets.items():
            sock = ctx.socket(kind)
            sock.linger = 0
            auth.secure_client(sock)
            sock.connect(address)
            sockets[name] = sock
        services = [pid for role in ("memoryx", "swarmx", "wse", "chief") for pid in roles[role]]
        rss_before = {pid: rss_bytes(pid) for pid in services}

        @settings(max_examples=250, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(target=st.sampled_from(sorted(targets)), frames=bad_messages(job))
        def throw(target, frames):
            assert is_dropped(frames, job)
            sockets[target].send_multipart(frames)

        throw()
        for name in targets:  # one of each at every socket, whatever hypothesis drew
            sockets[name].send_multipart([b"\xc1 not msgpack"])
        assert proc.poll() is None, "the run ended before the bad messages were all sent"
        rss_after = {pid: rss_bytes(pid) for pid in services}
        # a service that finished its part of the run in the meantime has no memory to read
        growth = {pid: rss - rss_before[pid] for pid, rss in rss_after.items()
                  if rss is not None and rss_before[pid] is not None}
        assert growth, "every service had exited before its memory could be read"
        with open(gate, "w"):   # let the input worker go on: the job ends as the CPU run did
            pass
        output = "".join(seen) + proc.stdout.read()
        assert proc.wait(timeout=180) == 0, output[-3000:]
    finally:
        ctx.destroy(linger=0)
        kill_tree(proc)
    assert max(growth.values()) < 64 * 2**20, growth
    dropped = Counter(DROPPED_RE.findall(output))
    assert {name for _, name, _ in dropped} >= set(targets), output[-3000:]
    assert max(dropped.values()) == 1, dropped   # once per sender, however many it sent
    assert "Traceback" not in output
    assert_matches(tmp_path / "m", tmp_path / "cpu")


# --------------------------------------------------------------------------
# intruders: no keys, other keys, or only the server's public key
# --------------------------------------------------------------------------

def rogue_socket(ctx: zmq.Context, keys: auth.JobKeys | None, address: str) -> int:
    """Connect as a rogue, try to inject a step anyway, return the handshake event seen."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if keys is not None:
        auth.secure_client(sock, keys)
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(address)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and monitor.poll(1000):
            event = recv_monitor_message(monitor)["event"]
            if event & (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                         | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH):
                try:  # a valid step of the right job with a wild learning rate
                    sock.send_multipart(encode(Message(Msg.TRAIN_STEP, job=JOB[0], step=50, meta={"lr": 100.0})),
                                        flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
                return event
        raise AssertionError(f"no handshake event from {address}")
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()


JOB = [""]


def test_rogue_peers_are_refused_and_the_run_is_untouched(tmp_path, oracle):
    proc = start_job(wse_command(oracle[0], tmp_path / "m"))
    seen: list[str] = []
    ctx = zmq.Context()
    try:
        read_until(proc, r"\| Train", seen)
        roles = pids_by_role(proc)
        env = process_env(roles["memoryx"][0])
        JOB[0] = env["CS_JOB_ID"]
        keys = auth.load_keys(env[auth.KEYS_ENV])
        # Keys never show on a command line.
        for _, args in descendants(proc.pid):
            assert keys.server_secret.decode() not in args and env[auth.KEYS_ENV] not in args
        other_dir = auth.create_job_dir()
        other = auth.load_keys(str(other_dir))
        auth.remove_job_dir(other_dir)
        memoryx = [l for l in seen if "MemoryX serving at" in l] or [""]
        address = re.search(r"tcp://\S+", memoryx[0] + " " + env["CS_IP"]).group(0)
        for target in {address, env["CS_RENDEZVOUS"]}:
            assert not rogue_socket(ctx, None, target) & zmq.EVENT_HANDSHAKE_SUCCEEDED
            assert not rogue_socket(ctx, other, target) & zmq.EVENT_HANDSHAKE_SUCCEEDED
            half = dataclasses.replace(other, server_public=keys.server_public)
            assert rogue_socket(ctx, half, target) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        output = "".join(seen) + proc.stdout.read()
        assert proc.wait(timeout=120) == 0, output[-3000:]
    finally:
        ctx.destroy(linger=0)
        kill_tree(proc)
    assert "dropped bad message" not in output  # nothing a rogue sent even reached a socket
    assert not Path(env[auth.KEYS_ENV]).exists()  # the job's keys go with the job
    assert_matches_oracle(tmp_path / "m", oracle)


def test_insecure_says_so_and_is_for_loopback_only(tmp_path):
    params = write_params(tmp_path, runconfig={"max_steps": 5})
    result = run_wse(params, tmp_path / "m", extra=())
    cmd = with_launcher_flags(wse_command(params, tmp_path / "i"), "--insecure")
    insecure = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and insecure.returncode == 0, insecure.stderr[-2000:]
    assert "WARNING: --insecure: CURVE authentication and encryption are OFF" in insecure.stderr
    assert "--insecure" not in result.stderr
    remote = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "CS_BIND_HOST": "0.0.0.0"})
    assert remote.returncode != 0
    assert remote.stderr.strip().splitlines()[-1] == "csrun_wse: --insecure is for loopback only, not 0.0.0.0"


# --------------------------------------------------------------------------
# bad input from the user: one line naming the thing, non-zero exit, no restart
# --------------------------------------------------------------------------

def run_with_restarts(params: Path, model_dir: Path, *run_args: str, launcher: tuple = ()):
    cmd = [tool("csrun_wse"), "--max_restarts", "2", *launcher, sys.executable, FC_MNIST, "--mode", "train",
           "--params", str(params), "--model_dir", str(model_dir), *run_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_missing_data_dir_is_named_and_not_restarted(tmp_path):
    params = write_params(tmp_path, train_input={"data_dir": str(tmp_path / "nowhere")})
    result = run_with_restarts(params, tmp_path / "m")
    assert result.returncode != 0
    # Said before anything starts, by csrun_wse's check (exit 2: not restarted).
    assert result.returncode == 2
    assert f"error: train_input.data_dir {tmp_path / 'nowhere'}: no such file or folder" in result.stderr
    assert "restarting" not in result.stderr
    assert not list((tmp_path / "m").glob("checkpoint_*"))


def test_corrupt_data_file_is_named(tmp_path):
    data = tmp_path / "mnist"
    data.mkdir()
    dims = b"".join(d.to_bytes(4, "big") for d in (5, 28, 28))
    (data / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03" + dims + bytes(20))  # cut short
    (data / "train-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x05" + bytes(5))
    params = write_params(tmp_path, train_input={"data_dir": str(data)})
    result = run_with_restarts(params, tmp_path / "m")
    assert result.returncode != 0
    assert re.search(rf"{data}/train-images-idx3-ubyte: truncated", result.stderr), result.stderr[-2000:]
    assert "restarting" not in result.stderr


def test_checkpoint_of_another_model_lists_the_mismatch(tmp_path):
    other = write_params(tmp_path, "other.yaml", model={"hidden_sizes": [16]}, runconfig={"max_steps": 2})
    assert run_cpu(other, tmp_path / "other").returncode == 0
    params = write_params(tmp_path)
    result = run_with_restarts(params, tmp_path / "m", "--checkpoint_path",
                               str(tmp_path / "other" / "checkpoint_2.npz"))
    assert result.returncode != 0
    line = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    assert len(line) == 1 and "does not match the model" in line[0], result.stderr
    assert "fc0/weight has shape (784, 16), model needs (784, 64)" in line[0]
    assert line[0].endswith("; and 2 more")   # the first mismatches, not every one (fc2's too)
    assert "restarting" not in result.stderr
    assert not list((tmp_path / "m").glob("checkpoint_*"))


def test_params_typo_is_named_and_not_restarted(tmp_path):
    params = write_params(tmp_path, runconfig={"max_step": 10})
    result = run_with_restarts(params, tmp_path / "m")
    assert result.returncode != 0
    assert "runconfig.max_step" in result.stdout + result.stderr
    assert "restarting" not in result.stderr


def test_port_in_use_is_named(tmp_path):
    params = write_params(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_with_restarts(params, tmp_path / "m", launcher=("--port", str(port)))
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == f"csrun_wse: --port: directory: port {port} on 127.0.0.1 is already in use"


def test_unreachable_cs_ip_fails_fast_naming_the_address(tmp_path):
    params = write_params(tmp_path)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]  # closed again below: nobody listens there
    result = run_with_restarts(params, tmp_path / "m", launcher=("--cs_ip", f"127.0.0.1:{port}"))
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith(f"csrun_wse: --cs_ip 127.0.0.1:{port} is unreachable")
    assert "job" not in result.stderr  # nothing was started
