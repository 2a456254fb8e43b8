"""The CS system's front door against careless and hostile clients: listings
in pages that fit the header cap, a rate limit per client key, bounded queues
for clients that do not read, an allow-list of client keys with the user
taken from the key, and a job's turn that polling alone cannot hold.

    python -m pytest tests/test_front_door.py -q
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from cs_runtime.launch import front_door as door_client
from cs_runtime.launch.front_door import FrontDoor, FrontDoorError, SubmittedJob
from cs_runtime.appliance.server import RATE_BURST, RATE_PER_S, RateLimit, read_clients
from cs_runtime.process.directory_client import DirectoryClient
from cs_runtime.wire import auth
from cs_runtime.wire.protocol import MAX_HEADER_BYTES, Message, Msg, encode
from tests.cluster_utils import assert_matches_oracle, kill_tree, wse_command
from tests.test_faults import rss_bytes

pytestmark = pytest.mark.cluster  # the tests here start processes

HEAVY_LABELS = {f"key{i:02d}-{'k' * 55}": "v" * 63 for i in range(31)}   # ~4 KB a row


class System:
    """`cs_system serve` with extra flags; the test's own clients use CS_USER_DIR=tmp/<user>."""

    def __init__(self, tmp: Path, *flags: str):
        self.tmp, self.log = tmp, open(tmp / "server.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "cs_runtime.cli.cs_system", "serve", "--port", "0", *flags],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        found = re.search(r" at (\S+:\d+)", line)
        assert found, f"{line!r}: {(tmp / 'server.log').read_text()[-2000:]}"
        self.address = found.group(1)
        self.others: list[subprocess.Popen] = []

    def door(self, monkeypatch, user: str) -> FrontDoor:
        monkeypatch.setenv(door_client.USER_DIR_ENV, str(self.tmp / user))
        return FrontDoor.open(self.address, insecure=False)

    def csctl(self, user: str, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, door_client.USER_DIR_ENV: str(self.tmp / user)}
        return subprocess.run([sys.executable, "-m", "cs_runtime.cli.csctl", "--cs_ip", self.address, *args],
                              capture_output=True, text=True, timeout=60, env=env)

    def stop(self) -> None:
        for proc in self.others:
            kill_tree(proc)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                kill_tree(self.proc)
        self.log.close()


@pytest.fixture
def system_factory(tmp_path):
    made: list[System] = []

    def make(*flags: str) -> System:
        made.append(System(tmp_path, *flags))
        return made[-1]
    yield make
    for system in made:
        system.stop()


def submit(door: FrontDoor, labels: dict, user: str = "claimed") -> dict:
    meta = {"user": user, "num_csx": 1, "owner": door_client.owner_token(), "labels": labels,
            "keys": auth.key_strings(auth.load_keys(str(KEYS[0])))}
    return door.request(Message(Msg.SUBMIT, meta=meta)).meta


KEYS: list[Path] = []


@pytest.fixture(autouse=True)
def job_keys():
    folder = auth.create_job_dir()
    KEYS[:] = [folder]
    yield
    auth.remove_job_dir(folder)


# --------------------------------------------------------------------------
# listing in pages
# --------------------------------------------------------------------------

def test_a_listing_too_big_for_one_answer_comes_in_pages(system_factory, monkeypatch):
    system = system_factory()
    door = system.door(monkeypatch, "owner")
    try:
        names = [submit(door, {**HEAVY_LABELS, "case": f"n{i}"})["name"] for i in range(36)]
        first = door.request(Message(Msg.GET_JOBS, meta={"after": 0})).meta
        assert "next" in first and 0 < len(first["jobs"]) < 36
        assert len(encode(Message(Msg.JOBS, meta=first))[0]) < MAX_HEADER_BYTES
        assert [j["name"] for j in door.list_jobs()] == names
    finally:
        door.close()
    listed = system.csctl("owner", "get", "jobs", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    assert [j["name"] for j in json.loads(listed.stdout)["jobs"]] == names


# --------------------------------------------------------------------------
# a rate limit per client, and bounded queues for clients that do not read
# --------------------------------------------------------------------------

def test_rate_limit_refills_at_its_rate():
    limit = RateLimit(rate=10.0, burst=3)
    assert [limit.allow("a") for _ in range(4)] == [True, True, True, False]
    assert limit.allow("b")   # per client
    limit.buckets["a"] = (0.0, time.monotonic() - 0.25)   # a quarter second later: 2.5 tokens
    assert [limit.allow("a") for _ in range(3)] == [True, True, False]


def test_a_flooding_client_is_refused_beyond_its_burst_and_others_are_served(system_factory, monkeypatch):
    system = system_factory()
    flooder = system.door(monkeypatch, "flooder")
    polite = system.door(monkeypatch, "polite")
    try:
        # It reads its answers a few at a time, so none is dropped for its queue (a connection
        # that leaves answers unread gets no more, which would hide the refusals).
        answers, started = [], time.monotonic()
        for _ in range(3 * RATE_BURST // 4):
            for _ in range(4):
                flooder.send(Message(Msg.GET_JOBS))
            for _ in range(4):
                got = flooder.endpoint.recv(10_000)
                assert got is not None, "an answer was lost"
                answers.append(got[1])
        refilled = RATE_PER_S * (time.monotonic() - started)   # a loaded machine gives back tokens
        refused = [a for a in answers if a.type == Msg.REFUSED]
        served = [a for a in answers if a.type == Msg.JOBS]
        assert len(served) + len(refused) == 3 * RATE_BURST
        assert RATE_BURST <= len(served) <= RATE_BURST + refilled + 1, (len(served), refilled)
        assert refused or refilled >= 2 * RATE_BURST, (len(served), refilled)   # refused, unless very slow
        assert all("too many requests" in a.meta["reason"] for a in refused)
        assert polite.request(Message(Msg.GET_JOBS)).type == Msg.JOBS   # another key is not limited
    finally:
        flooder.close()
        polite.close()


def test_a_client_that_never_reads_costs_the_server_little(system_factory, monkeypatch):
    system = system_factory()
    door = system.door(monkeypatch, "owner")
    try:
        for i in range(20):
            submit(door, {**HEAVY_LABELS, "case": f"n{i}"})
    finally:
        door.close()
    before = rss_bytes(system.proc.pid)
    ctx = zmq.Context()
    try:
        # Ten keys (the rate limit is per key), each asking for 48 KB pages it never reads.
        for hog in range(10):
            monkeypatch.setenv(door_client.USER_DIR_ENV, str(system.tmp / f"hog{hog}"))
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            host, port = system.address.rsplit(":", 1)
            auth.secure_client(sock, auth.JobKeys(Path(), auth.find_system_key(int(port)), b"",
                                                  *door_client.client_key_pair()))
            sock.setsockopt(zmq.RCVBUF, 4096)   # and a small kernel buffer: answers pile up server-side
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.connect(f"tcp://{system.address}")
            for n in range(RATE_BURST):
                sock.send_multipart(encode(Message(Msg.GET_JOBS, step=n + 1)))
        door = system.door(monkeypatch, "owner")
        try:
            assert len(door.list_jobs()) == 20     # the server still answers a client that reads
        finally:
            door.close()
        grown = rss_bytes(system.proc.pid) - before
    finally:
        ctx.destroy(linger=0)
    # 10 hogs x 40 pages x ~48 KB would be ~19 MB queued; at most CLIENT_QUEUE each are kept.
    assert grown < 12 * 2**20, grown


# --------------------------------------------------------------------------
# an allow-list of client keys; the user comes from the key
# --------------------------------------------------------------------------

def client_line(tmp: Path, user: str, monkeypatch) -> str:
    monkeypatch.setenv(door_client.USER_DIR_ENV, str(tmp / user))
    return f"{user} {door_client.client_key_pair()[0].decode()}"


def test_csctl_key_prints_the_line_for_the_clients_file(tmp_path, monkeypatch):
    line = client_line(tmp_path, "alice", monkeypatch)
    env = {**os.environ, door_client.USER_DIR_ENV: str(tmp_path / "alice")}
    out = subprocess.run([sys.executable, "-m", "cs_runtime.cli.csctl", "key"], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.split()[1] == line.split()[1]
    assert oct((tmp_path / "alice" / "client.key_secret").stat().st_mode & 0o777) == "0o600"


def test_only_listed_keys_get_in_and_the_user_is_the_keys_not_the_claim(system_factory, tmp_path, monkeypatch):
    clients = tmp_path / "clients"
    clients.write_text(f"# who may submit\n{client_line(tmp_path, 'alice', monkeypatch)}\n")
    system = system_factory("--clients", str(clients))
    door = system.door(monkeypatch, "alice")
    try:
        state = submit(door, {"case": "a"}, user="mallory")    # the claim is ignored
        row = next(j for j in door.list_jobs() if j["name"] == state["name"])
        assert row["user"] == "alice"
    finally:
        door.close()
    with pytest.raises(FrontDoorError):   # an unlisted key never completes the handshake
        system.door(monkeypatch, "bob").close()
    refused = system.csctl("bob", "get", "jobs")
    assert refused.returncode == 1 and refused.stderr.startswith("csctl: ") and len(refused.stderr.splitlines()) == 1


def test_a_key_with_a_hash_in_it_is_a_key_not_a_comment(tmp_path):
    path = tmp_path / "clients"
    key = "abc#" + "x" * 36
    path.write_text(f"# the team\n  # indented comment\nalice {key}\n")
    assert read_clients(str(path)) == {key: "alice"}


@pytest.mark.parametrize("text, why", [("alice short-key\n", "line 1: expected USER PUBLIC_KEY"),
                                       ("al ice " + "x" * 40 + "\n", "line 1: expected USER PUBLIC_KEY"),
                                       ("bad/name " + "x" * 40 + "\n", "line 1: expected USER PUBLIC_KEY")])
def test_a_bad_clients_file_is_named(tmp_path, text, why):
    path = tmp_path / "clients"
    path.write_text(text)
    with pytest.raises(ValueError, match=why):
        read_clients(str(path))
    result = subprocess.run([sys.executable, "-m", "cs_runtime.cli.cs_system", "serve", "--port", "0", "--clients",
                             str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and why in result.stderr and len(result.stderr.splitlines()) == 1


# --------------------------------------------------------------------------
# a job's turn cannot be held by polling alone
# --------------------------------------------------------------------------

def test_a_hog_that_only_polls_loses_its_turn_and_the_next_job_runs(system_factory, oracle, tmp_path, monkeypatch):
    """It polls, and with its own job's keys looks MemoryX and SwarmX up as a chief would; without
    a chief's heartbeat that does not make it RUNNING, and its turn ends."""
    system = system_factory("--turn_timeout", "15")
    door = system.door(monkeypatch, "hog")
    ctx = zmq.Context()
    try:
        hog = SubmittedJob(door, 1, {"case": "hog"}, auth.load_keys(str(KEYS[0])))
        state = hog.wait_turn()
        assert state["phase"] == "COMPILING"    # its turn: it never starts a chief
        monkeypatch.setenv(auth.KEYS_ENV, str(KEYS[0]))
        lookup = DirectoryClient(ctx, state["cs_ip"], "chief", 0, state["job"])
        assert lookup.lookup(["memoryx", "swarmx"], timeout=30)["memoryx"]
        lookup.close()
        assert door.request(hog.poll()).meta["phase"] == "COMPILING"   # a lookup is not a chief
        env = {**os.environ, door_client.USER_DIR_ENV: str(tmp_path / "owner")}
        cmd = wse_command(oracle[0], tmp_path / "m", extra_launcher=("--cs_ip", system.address))
        legit = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        system.others.append(legit)
        t0 = time.monotonic()
        while legit.poll() is None and time.monotonic() - t0 < 240:
            hog.check()        # the hog keeps polling all along
            time.sleep(0.1)    # the poll interval
        output = legit.stdout.read()
        assert legit.returncode == 0, output[-3000:]
        assert time.monotonic() - t0 < 120, "the legitimate job waited for the hog"
        assert hog.state["phase"] == "FAILED", hog.state
        assert "its chief did not arrive within 15 s of its turn" in hog.state["reason"]
        said = (system.tmp / "server.log").read_text()
        assert f"{hog.name} ({door_client.user_name()}) FAILED: its chief did not arrive" in said
    finally:
        door.close()
        ctx.destroy(linger=0)
    assert_matches_oracle(tmp_path / "m", oracle)


def test_a_chief_that_stops_heartbeating_loses_the_turn_naming_the_job_and_owner(system_factory, monkeypatch):
    """RUNNING needs the chief's heartbeat; a chief gone silent (killed, or a client that faked one
    for a while) ends the turn after the heartbeat timeout, not after the job's natural end."""
    system = system_factory("--turn_timeout", "60")
    door = system.door(monkeypatch, "faker")
    ctx = zmq.Context()
    try:
        job = SubmittedJob(door, 1, {"case": "faker"}, auth.load_keys(str(KEYS[0])))
        state = job.wait_turn()
        monkeypatch.setenv(auth.KEYS_ENV, str(KEYS[0]))
        chief = DirectoryClient(ctx, state["cs_ip"], "chief", 0, state["job"])
        chief.register({})
        assert chief.lookup(["memoryx", "swarmx"], timeout=30)["memoryx"]
        beat = Message(Msg.HEARTBEAT, meta={"role": "chief", "rank": 0})
        phase, deadline = "COMPILING", time.monotonic() + 10
        while phase == "COMPILING" and time.monotonic() < deadline:
            chief.endpoint.send(beat)   # beats as a chief would, until the job is RUNNING
            phase = door.request(job.poll()).meta["phase"]
            time.sleep(0.2)   # the heartbeat interval
        assert phase == "RUNNING"
        silent_from = time.monotonic()   # no more beats: as if the chief were killed
        while (state := door.request(job.poll()).meta)["phase"] == "RUNNING" and time.monotonic() - silent_from < 30:
            time.sleep(0.2)   # the poll interval
        waited = time.monotonic() - silent_from
        assert state["phase"] == "FAILED" and "its chief on " in state["reason"], state
        assert "stopped heartbeating for 5 s" in state["reason"] and 4 < waited < 15, (state, waited)
        said = (system.tmp / "server.log").read_text()
        assert f"{job.name} ({door_client.user_name()}) FAILED: its chief on " in said
        chief.close()
    finally:
        door.close()
        ctx.destroy(linger=0)
