"""The launcher's control plane at scale: the directory, heartbeats, file descriptors,
and a small run of scripts/control_plane_bench.py (its figures are printed, never asserted as timings)."""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import zmq

from cs_runtime.launch import launcher
from cs_runtime.launch.directory import DirectoryServer, Liveness, Peer, register_timeout
from cs_runtime.process.directory_client import REGISTER_TIMEOUT, DirectoryClient, Heartbeat
from cs_runtime.wire.protocol import Message, Msg
from cs_runtime.wire.transport import Endpoint
from tests.cluster_utils import REPO


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def serve_until(directory: DirectoryServer, done, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the directory did not get there"
        directory.serve_once(20)


def status(done: bool = False) -> Message:
    """The directory's answer to a heartbeat: the job is fine (and, `done`, over)."""
    return Message(Msg.STATUS, meta={"ok": True, "reason": "", "done": done})


@contextmanager
def heartbeat_answered_once(ctx, job: str):
    """A worker's Heartbeat against a fake directory (a ROUTER), its first beat answered:
    (the fake, the heartbeat, the heartbeat's identity there); both stopped after."""
    fake = Endpoint(ctx, zmq.ROUTER, "directory", job)
    address = fake.bind("127.0.0.1")
    beat = Heartbeat(ctx, address, "worker", 0, job, on_failure=lambda reason: None)
    beat.start()
    try:
        first = fake.recv(10000)
        assert first is not None and first[1].type == Msg.HEARTBEAT
        fake.send(status(), first[0])
        yield fake, beat, first[0]
    finally:
        beat.stop()
        beat.join(5)
        fake.close()


def test_lookups_are_answered_when_the_last_expected_peer_registers(ctx):
    directory = DirectoryServer(ctx, "job-l", {"chief": 1, "worker": 3, "wse": 2}, host="127.0.0.1")
    try:
        workers = [DirectoryClient(ctx, directory.address, "worker", r, "job-l") for r in range(3)]
        for client in workers:
            client.endpoint.send(Message(Msg.LOOKUP, meta={"roles": ["wse", "chief"]}))
        chief = DirectoryClient(ctx, directory.address, "chief", 0, "job-l")
        chief.register({"a": "tcp://x:1"})
        wses = [DirectoryClient(ctx, directory.address, "wse", r, "job-l") for r in range(2)]  # kept: LINGER 0
        wses[1].register({"a": "tcp://w1:1"})
        serve_until(directory, lambda: len(directory.peers) == 2 and sum(map(len, directory.pending.values())) == 3)
        assert all(w.endpoint.recv(100) is None for w in workers)  # wse 0 is still missing
        wses[0].register({"a": "tcp://w0:1"})
        serve_until(directory, lambda: not directory.pending)
        for client in workers:
            _, answer = client.endpoint.recv(5000)
            ranks = sorted((p["role"], p["rank"]) for p in answer.meta["peers"])
            assert answer.type == Msg.DIRECTORY and ranks == [("chief", 0), ("wse", 0), ("wse", 1)]
    finally:
        directory.close()


def test_a_peer_gets_the_start_timeout_until_its_first_heartbeat(ctx):
    directory = DirectoryServer(ctx, "job-s", {"worker": 2}, host="127.0.0.1")
    try:
        clients = [DirectoryClient(ctx, directory.address, "worker", rank, "job-s") for rank in range(2)]
        for client in clients:
            client.register({})
        serve_until(directory, lambda: len(directory.peers) == 2)
        beat = Endpoint(ctx, zmq.DEALER, "heartbeat", "job-s").connect(directory.address)
        beat.send(Message(Msg.HEARTBEAT, meta={"role": "worker", "rank": 1}))
        serve_until(directory, lambda: directory.peers[("worker", 1)].beating)
        assert beat.recv(5000)[1].meta == {"ok": True, "reason": "", "done": False}
        for peer in directory.peers.values():
            peer.last_seen -= 10   # both silent for 10 s
        assert [p.rank for p in directory.silent_peers(5.0, first_timeout=60.0)] == [1]
        assert sorted(p.rank for p in directory.silent_peers(5.0)) == [0, 1]
        beat.close()
    finally:
        directory.close()


def test_liveness_finds_the_silent_peers_at_the_front_of_each_queue(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    live = Liveness()
    peers = {rank: Peer("worker", rank, "h", rank, {}, last_seen=100.0) for rank in range(4)}
    for peer in peers.values():
        live.add(peer)
    clock[0] = 101.0
    live.heard(("worker", 2), peers[2], False, 101.0)
    live.heard(("worker", 0), peers[0], False, 102.0)
    live.heard(("worker", 3), peers[3], True, 101.5)    # its last heartbeat: it is exiting
    clock[0] = 106.5
    # beating: 2 (heard at 101) is silent for 5.5 s, 0 (at 102) is not; 1 never beat (first timeout)
    assert [p.rank for p in live.silent(5.0, first_timeout=60.0)] == [2]
    assert [p.rank for p in live.silent(5.0, first_timeout=5.0)] == [1, 2]
    clock[0] = 200.0   # a leaving peer gets LEAVING_GRACE
    assert [p.rank for p in live.silent(5.0, first_timeout=60.0)] == [1, 2, 0, 3]
    live.add(Peer("worker", 2, "h2", 99, {}, last_seen=200.0))  # registered again: the new one counts
    assert 2 not in [p.rank for p in live.silent(5.0, first_timeout=5.0)]


def answer_to(directory: DirectoryServer, beat: Endpoint, meta: dict):
    """Send a heartbeat, serve the directory until it answers: the answer."""
    beat.send(Message(Msg.HEARTBEAT, meta=meta))
    serve_until(directory, lambda: beat.sock.poll(0))
    return beat.recv(0)[1]


def test_a_known_heartbeat_is_answered_from_its_bytes_and_keeps_its_peer_alive(ctx):
    directory = DirectoryServer(ctx, "job-k", {"worker": 1}, host="127.0.0.1")
    try:
        client = DirectoryClient(ctx, directory.address, "worker", 0, "job-k")
        client.register({})
        serve_until(directory, lambda: len(directory.peers) == 1)
        beat = Endpoint(ctx, zmq.DEALER, "heartbeat", "job-k").connect(directory.address)
        for leaving in (False, False, True):   # the second is the cached bytes' path
            meta = {"role": "worker", "rank": 0, **({"leaving": True} if leaving else {})}
            before = directory.peers[("worker", 0)].last_seen
            answer = answer_to(directory, beat, meta)
            assert answer.type == Msg.STATUS and answer.meta == {"ok": True, "reason": "", "done": False}
            peer = directory.peers[("worker", 0)]
            assert peer.beating and peer.leaving == leaving and peer.last_seen > before
        assert len(directory._known_beats) == 2   # one per form, no more
        directory.failure = "worker 1 on h exited with exit code 1"
        answer = answer_to(directory, beat, {"role": "worker", "rank": 0})
        assert answer.meta == {"ok": False, "reason": directory.failure, "done": False}
        # another job's heartbeat with the same role and rank is not this job's, cached or not
        beat.job = "job-other"
        beat.send(Message(Msg.HEARTBEAT, meta={"role": "worker", "rank": 0}))
        assert directory.serve_once(5000) == 1 and beat.recv(300) is None
        beat.close()
    finally:
        directory.close()


def test_the_jobs_end_is_sent_at_once_to_every_peer_still_beating(ctx):
    """Not at each one's next heartbeat (up to half a second later): one that said it is leaving is told nothing."""
    directory = DirectoryServer(ctx, "job-e", {"worker": 1, "chief": 1}, host="127.0.0.1")
    beats = {}
    try:
        clients = [DirectoryClient(ctx, directory.address, role, 0, "job-e") for role in ("worker", "chief")]
        for client in clients:   # kept: LINGER 0
            client.register({})
        serve_until(directory, lambda: len(directory.peers) == 2)
        for role in ("worker", "chief"):
            beats[role] = Endpoint(ctx, zmq.DEALER, "heartbeat", "job-e").connect(directory.address)
            assert answer_to(directory, beats[role], {"role": role, "rank": 0}).meta["done"] is False
        answer_to(directory, beats["chief"], {"role": "chief", "rank": 0, "leaving": True})
        directory.done = True
        directory.announce()
        news = beats["worker"].recv(5000)
        assert news is not None and news[1].type == Msg.STATUS and news[1].meta == {"ok": True, "reason": "",
                                                                                     "done": True}
        assert beats["chief"].recv(300) is None
    finally:
        for beat in beats.values():
            beat.close()
        directory.close()


def test_a_heartbeat_acts_on_news_between_its_beats(ctx, monkeypatch):
    """It used to sleep between beats and read the news only after its next one."""
    import threading
    from cs_runtime.process import directory_client as directory_module
    finished = threading.Event()
    monkeypatch.setattr(directory_module, "_exit_done", finished.set)   # not os._exit: this is pytest
    monkeypatch.setattr(directory_module, "HEARTBEAT_INTERVAL", 60.0)   # the next beat: far away
    with heartbeat_answered_once(ctx, "job-n") as (fake, beat, peer):
        assert fake.recv(300) is None   # answered: it waits for its next beat, a minute away
        fake.send(status(done=True), peer)
        assert finished.wait(10)   # not a minute
        beat.join(10)
        assert not beat.is_alive()


def test_recv_waiting_takes_every_waiting_message_in_one_batch(ctx):
    server = Endpoint(ctx, zmq.ROUTER, "server", "job-b")
    address = server.bind("127.0.0.1")
    client = Endpoint(ctx, zmq.DEALER, "client", "job-b").connect(address)
    try:
        assert server.recv_waiting(0, 10) == []
        for rank in range(5):
            client.send(Message(Msg.HEARTBEAT, meta={"role": "worker", "rank": rank}))
        first = server.recv_waiting(5000, 10)
        deadline = time.monotonic() + 5
        while len(first) < 5 and time.monotonic() < deadline:
            first += server.recv_waiting(100, 10)
        assert len(first) == 5 and len({identity for identity, _ in first}) == 1
        assert [server.decode_or_drop(i, frames).meta["rank"] for i, frames in first] == list(range(5))
        for rank in range(3):
            client.send(Message(Msg.HEARTBEAT, meta={"role": "worker", "rank": rank}))
        got = []
        while len(got) < 3 and time.monotonic() < deadline + 5:
            batch = server.recv_waiting(100, 2)
            assert len(batch) <= 2   # the limit holds
            got += batch
        assert len(got) == 3
    finally:
        client.close()
        server.close()


def test_registration_timeout_grows_with_the_task_count():
    assert register_timeout(2) >= REGISTER_TIMEOUT
    assert register_timeout(1024) > register_timeout(64) + 200


def test_the_launcher_and_the_cs_system_share_one_registration_deadline(monkeypatch):
    """Both wait register_timeout(tasks) for a process to register, then name the first missing one."""
    from cs_runtime.appliance.server import JobRuntime
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    tasks = [launcher.Task("wse", rank, "cs1", SimpleNamespace(pid=100 + rank)) for rank in range(600)]
    directory = SimpleNamespace(peers={("wse", r): None for r in range(600) if r != 7}, exits={},
                                silent_peers=lambda *a, **k: [])
    group = SimpleNamespace(tasks=tasks, exited=lambda: [])
    runtime = SimpleNamespace(group=group, directory=directory, started=0.0)
    deadline = register_timeout(600)
    assert deadline > REGISTER_TIMEOUT + 100   # the old fixed 120 s would have failed this job
    clock[0] = deadline - 1
    assert launcher.registration_overdue(directory, tasks, 0.0) is None
    assert JobRuntime.failure(runtime) is None
    clock[0] = deadline + 1
    line = f"wse 7 on cs1 (pid 107) did not register within {deadline:.0f} s"
    assert launcher.registration_overdue(directory, tasks, 0.0) == line
    assert JobRuntime.failure(runtime) == line
    assert launcher.registration_overdue(directory, tasks, 0.0, ended={("wse", 7)}) is None


def test_heartbeats_go_out_twice_a_second_not_faster(ctx, monkeypatch):
    """The documented rate is 2/s per process; the heartbeat used to wait a fixed time
    after each answer as well, nearly doubling it. (A shorter interval keeps the test short.)"""
    from cs_runtime.process import directory_client as directory_module
    monkeypatch.setattr(directory_module, "HEARTBEAT_INTERVAL", 0.1)
    with heartbeat_answered_once(ctx, "job-h") as (fake, _beat, _peer):
        window, count = 8 * directory_module.HEARTBEAT_INTERVAL, 0
        end = time.monotonic() + window
        while (got := fake.recv(max(1, int((end - time.monotonic()) * 1000)))) is not None:
            count += got[1].type == Msg.HEARTBEAT
            fake.send(status(), got[0])
            if time.monotonic() >= end:
                break
        # 8 intervals: at most 8 heartbeats (+1 at the edge); the old schedule sent about 15
        assert 1 <= count <= 9, count


def test_a_heartbeat_waits_for_its_first_answer_as_long_as_registration_may_take(ctx, monkeypatch):
    """Hundreds of tasks starting at once queue for their CURVE handshakes: a task used to give up
    10 s after its first heartbeat, while the launcher still waited for it (exit code 1, no word)."""
    import threading
    from cs_runtime.process import directory_client as directory_module
    monkeypatch.setattr(directory_module, "HEARTBEAT_TIMEOUT", 0.1)       # 0.2 s between answers
    monkeypatch.setattr(directory_module, "FIRST_ANSWER_TIMEOUT", 1.5)
    fake = Endpoint(ctx, zmq.ROUTER, "directory", "job-p")
    address = fake.bind("127.0.0.1")
    beats = []
    try:
        for answer_first in (False, True):
            gave_up = threading.Event()
            beat = Heartbeat(ctx, address, "worker", int(answer_first), "job-p", on_failure=lambda _: gave_up.set())
            beats.append(beat)
            started = time.monotonic()
            beat.start()
            if answer_first:
                got = fake.recv(10000)
                while got[1].meta["rank"] != 1:   # the first one's heartbeats, still queued
                    got = fake.recv(10000)
                fake.send(status(), got[0])
                started = time.monotonic()
            assert gave_up.wait(20)
            waited = time.monotonic() - started
            # never answered: it waited the first-answer timeout; answered once, then silent: far less
            assert (waited >= 1.5) if not answer_first else (waited < 1.5), (answer_first, waited)
    finally:
        for beat in beats:
            beat.stopped.set()
            beat.join(5)
        fake.close()


def test_file_limit_is_raised_to_what_the_tasks_need_or_refused_in_one_line(monkeypatch):
    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda _, limits: calls.append(limits))
    launcher.check_file_limit(100)
    assert calls == []                                    # 1,024 is enough for 100 tasks
    launcher.check_file_limit(900)
    assert calls == [(launcher.FDS_BASE + launcher.FDS_PER_TASK * 900, 4096)]
    with pytest.raises(SystemExit, match=r"csrun_wse: 1024 task\(s\) need about 4352 open files here but the "
                                         r"limit is 1024 \(hard limit 4096\); raise it \(ulimit -n 4352\)"):
        launcher.check_file_limit(1024)


@pytest.mark.cluster
def test_control_plane_bench_small_run_reports_its_figures():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "control_plane_bench.py"), "--tasks", "24",
                             "--seconds", "2", "--processes", "2"], capture_output=True, text=True, timeout=300,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["tasks"] == 24 and figures["code"] == 0
    assert figures["heartbeats"] > 0 and figures["p50_ms"] <= figures["p99_ms"] <= figures["max_ms"]
    # two connections per task (its client and its heartbeat), whatever the count
    assert figures["fds_per_task"] <= launcher.FDS_PER_TASK
    assert "round trip p50" in result.stdout and "% of a core" in result.stdout
