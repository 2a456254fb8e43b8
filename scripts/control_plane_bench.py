"""Benchmark: the launcher's control plane with many tasks, simulated on this machine.

    python scripts/control_plane_bench.py                        # 1,024 tasks for 20 s
    python scripts/control_plane_bench.py --tasks 32 --seconds 3 # what CI runs

This process is the launcher: the job's directory (with the job's CURVE keys)
under the real `Supervisor`, which watches one task entry per simulated task
as it would watch real ones. The tasks are simulated by --processes child
processes, each holding its share of the tasks: every task registers with the
real `DirectoryClient` (its own connection), looks up the chief, and then
heartbeats on a second connection every HEARTBEAT_INTERVAL, as a real
process's heartbeat thread does, over the real protocol. What it prints:

- heartbeat round trip (send to STATUS answer) p50 / p99 / max, over every
  heartbeat but each connection's first (which waits for its handshake);
- heartbeats per second per task;
- the launcher's CPU over that window, as a share of one core;
- the launcher's open file descriptors per task.
The targets for 1,024 tasks: p99 under 100 ms, launcher CPU under 20% of a core.
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import select
import subprocess
import sys
import time
from pathlib import Path

import zmq

from cs_runtime.launch.directory import DirectoryServer, register_timeout

from cs_runtime.process.directory_client import HEARTBEAT_INTERVAL, DirectoryClient
from cs_runtime.launch.launcher import ProcessGroup, Supervisor, Task, check_file_limit
from cs_runtime.launch.task import role_of_task
from cs_runtime.wire import auth
from cs_runtime.wire.protocol import Message, Msg, encode
from cs_runtime.wire.transport import Endpoint

JOB = "wsjob-control-plane-bench"


# ---------------------------------------------------------------- the simulated tasks (child processes)
class SimulatedTasks:
    """Tasks first..first+count-1 in one process, each with its own two connections (its
    directory client and its heartbeat), as a real process has. Cheap, so that on a small
    machine the figures are the launcher's and not the simulator's: each task's heartbeat is
    encoded once (a real process sends the same bytes every time), due times sit in a heap,
    sockets wait in one epoll (ZeroMQ's FD says "look", EVENTS says what is there), and an
    answer is decoded once per distinct STATUS bytes."""

    def __init__(self, address: str, first: int, count: int):
        self.ctx = zmq.Context()
        self.ctx.max_sockets = 2 * count + 64  # two per task; ZeroMQ's default stops at 1,023
        self.tasks = [role_of_task(i) for i in range(first, first + count)]
        self.clients = [DirectoryClient(self.ctx, address, role, rank, JOB) for role, rank in self.tasks]
        self.beats = [Endpoint(self.ctx, zmq.DEALER, "heartbeat", JOB).connect(address) for _ in self.tasks]
        self.beat_bytes = [encode(Message(Msg.HEARTBEAT, job=JOB, meta={"role": role, "rank": rank}))
                           for role, rank in self.tasks]
        self.epoll = select.epoll()
        self.owner: dict[int, tuple[int, zmq.Socket]] = {}
        self.answers: dict[bytes, bool] = {}     # a STATUS's bytes -> whether it ends the task
        self.sent: list[float | None] = [None] * count
        self.answered = [False] * count
        self.ended = [False] * count
        self.trips: list[tuple[float, float]] = []

    def start(self) -> None:
        for i, (client, beat) in enumerate(zip(self.clients, self.beats)):
            client.register({"input": f"tcp://127.0.0.1:{client.rank}"})
            # as every input worker does; answered once the chief has registered
            client.endpoint.send(Message(Msg.LOOKUP, meta={"roles": ["chief"]}))
            for sock in (client.endpoint.sock, beat.sock):
                fd = sock.getsockopt(zmq.FD)
                self.epoll.register(fd, select.EPOLLIN)
                self.owner[fd] = (i, sock)

    def run(self, seconds: float) -> None:
        """Heartbeat every HEARTBEAT_INTERVAL until the directory answers that the job is done
        (at most `seconds`)."""
        now = time.monotonic()
        due = [(now + random.uniform(0, HEARTBEAT_INTERVAL), i) for i in range(len(self.tasks))]
        heapq.heapify(due)   # spread out, as processes start
        end = now + seconds
        while due and time.monotonic() < end:
            now = time.monotonic()
            while due and due[0][0] <= now:
                when, i = heapq.heappop(due)
                if self.ended[i]:
                    continue
                self.beats[i].sock.send_multipart(self.beat_bytes[i])
                self.sent[i] = now
                heapq.heappush(due, (max(when + HEARTBEAT_INTERVAL, now), i))
                self.drain(i, self.beats[i].sock)   # a send may take the FD's signal: look now
            wait = max(0.0, due[0][0] - time.monotonic()) if due else 0.0
            for fd, _ in self.epoll.poll(wait):
                self.drain(*self.owner[fd])

    def drain(self, i: int, sock: zmq.Socket) -> None:
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = sock.recv_multipart(zmq.NOBLOCK)
            if sock is self.beats[i].sock:
                self.answer(i, frames, time.monotonic())
            # else: the lookup's answer (the chief's address); nothing to do with it

    def answer(self, i: int, frames: list[bytes], arrived: float) -> None:
        ends = self.answers.get(frames[0])
        if ends is None:
            msg = self.beats[i].decode_or_drop(None, frames)
            if msg is None or msg.type != Msg.STATUS:
                return
            ends = msg.meta["done"] or not msg.meta["ok"]
            self.answers[frames[0]] = ends
        if self.sent[i] is not None:
            if self.answered[i]:  # the first waited for the connection's CURVE handshake too
                self.trips.append((self.sent[i], arrived - self.sent[i]))
            self.sent[i], self.answered[i] = None, True
        self.ended[i] = self.ended[i] or ends

    def close(self) -> None:
        self.epoll.close()
        for endpoint in [*self.beats, *(c.endpoint for c in self.clients)]:
            endpoint.close()
        self.ctx.destroy(linger=0)


def simulate(address: str, first: int, count: int, seconds: float, out: Path) -> None:
    """Run tasks first..first+count-1, then write every heartbeat's (send time, round trip) to `out`."""
    tasks = SimulatedTasks(address, first, count)
    try:
        tasks.start()
        tasks.run(seconds)
        out.write_text(json.dumps({"trips": tasks.trips}))
    finally:
        tasks.close()


# ---------------------------------------------------------------- the launcher (this process)
class SimulatedProcess:
    """A task entry for the Supervisor: it polls the simulator process that holds the task."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.pid = proc, proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def process_cpu(pid: int) -> float:
    """CPU seconds a child has used so far, all its threads (Linux /proc; nan elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


def time_service(directory: DirectoryServer) -> list[tuple[float, int]]:
    """Record the directory's service time per batch: from the moment its waiting messages are
    taken off the socket to the moment the last of them is answered (the server side of the
    round trip; the rest is the network, the simulator, and waiting for a core)."""
    served: list[tuple[float, int]] = []
    taken = [0.0]
    receive, serve = directory.endpoint.recv_waiting, directory.serve_once

    def timed_receive(*args):
        waiting = receive(*args)
        taken[0] = time.monotonic()
        return waiting

    def timed_serve(*args, **kwargs):
        count = serve(*args, **kwargs)
        if count:
            served.append((time.monotonic() - taken[0], count))
        return count
    directory.endpoint.recv_waiting, directory.serve_once = timed_receive, timed_serve
    return served


def run(tasks: int, seconds: float, processes: int, folder: Path) -> dict:
    check_file_limit(tasks)
    ctx = zmq.Context()
    directory = DirectoryServer(ctx, JOB, {"chief": 1, "worker": tasks - 1}, host="127.0.0.1")
    group = ProcessGroup()
    fds_before = open_files()
    shares = [tasks // processes + (p < tasks % processes) for p in range(processes)]
    outputs, simulators, first = [], [], 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent.parent),
                                                                    os.environ.get("PYTHONPATH")]))}
    for share in filter(None, shares):
        outputs.append(folder / f"sim{first}.json")
        proc = subprocess.Popen([sys.executable, __file__, "--simulate", directory.address, str(first), str(share),
                                 str(seconds + register_timeout(tasks)), str(outputs[-1])], env=env,
                                start_new_session=True)
        simulators.append(proc)
        for i in range(first, first + share):
            group.add(Task(*role_of_task(i), "simulated", SimulatedProcess(proc)))
        first += share
    window: dict[str, float] = {}
    service = time_service(directory)   # (seconds, messages) of each batch the directory served

    def measure() -> None:
        """In the supervisor's loop: the window opens once every task heartbeats, and
        `seconds` later the job finishes (every heartbeat answer then says done)."""
        now = time.monotonic()
        if "start" not in window:
            if len(directory.peers) == tasks and all(p.beating for p in directory.peers.values()):
                service.clear()
                window.update(start=now, cpu=time.process_time(), python=time.thread_time(), fds=open_files(),
                              simulators=sum(process_cpu(p.pid) for p in simulators), load=os.getloadavg()[0])
        elif now - window["start"] >= seconds and "end" not in window:
            window.update(end=now, cpu=time.process_time() - window["cpu"], batches=len(service),
                          python=time.thread_time() - window["python"],
                          simulators=sum(process_cpu(p.pid) for p in simulators) - window["simulators"],
                          load_end=os.getloadavg()[0])
            supervisor.finish_requested = True
    supervisor = Supervisor(directory, group, finisher_role="chief", handle_signals=False)
    started = time.monotonic()
    code = supervisor.run(measure)
    auth.stop_authenticator(ctx)
    ctx.destroy(linger=0)
    if "end" not in window:
        raise SystemExit(f"control_plane_bench: the tasks did not all heartbeat (job exit {code})")
    trips = [rtt for path in outputs if path.exists() for sent, rtt in json.loads(path.read_text())["trips"]
             if window["start"] <= sent < window["end"]]
    length = window["end"] - window["start"]
    served = service[:int(window["batches"])]
    return {"service_p50_ms": percentile([t for t, _ in served], 0.5) * 1000,
            "service_p99_ms": percentile([t for t, _ in served], 0.99) * 1000,
            "messages_per_batch": sum(n for _, n in served) / max(1, len(served)),
            "tasks": tasks, "code": code, "processes": len(simulators), "start_s": window["start"] - started,
            "heartbeats": len(trips), "per_task_per_s": len(trips) / tasks / length,
            "p50_ms": percentile(trips, 0.5) * 1000, "p99_ms": percentile(trips, 0.99) * 1000,
            "max_ms": max(trips, default=float("nan")) * 1000,
            "launcher_cpu": window["cpu"] / length, "launcher_python_cpu": window["python"] / length,
            "launcher_us_per_heartbeat": window["cpu"] / max(1, len(trips)) * 1e6,
            "simulators_cpu": window["simulators"] / length,
            "load": [window["load"], window["load_end"]], "fds_per_task": (window["fds"] - fds_before) / tasks}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--simulate"]:
        address, first, count, seconds, out = argv[1:]
        return simulate(address, int(first), int(count), float(seconds), Path(out))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1024, help="simulated tasks (default 1024)")
    parser.add_argument("--seconds", type=float, default=20.0, help="heartbeating time (default 20)")
    parser.add_argument("--processes", type=int, default=2, help="processes holding the tasks (default 2)")
    args = parser.parse_args(argv)
    if args.tasks < 2 or args.processes < 1 or args.seconds <= 0:
        parser.error("--tasks needs at least 2, --processes at least 1, --seconds more than 0")
    keys = auth.create_job_dir()
    os.environ[auth.KEYS_ENV] = str(keys)  # the simulated tasks inherit the job's keys, as real ones do
    try:
        result = run(args.tasks, args.seconds, min(args.processes, args.tasks), keys)
    finally:
        auth.remove_job_dir(keys)
    print(f"{result['tasks']} tasks (all heartbeating after {result['start_s']:.1f} s), "
          f"{result['heartbeats']} heartbeats ({result['per_task_per_s']:.2f}/s per task): "
          f"round trip p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms, max {result['max_ms']:.1f} ms "
          f"(of which the directory's own, from taking a batch of {result['messages_per_batch']:.1f} messages "
          f"to its last answer: p50 {result['service_p50_ms']:.2f} ms, p99 {result['service_p99_ms']:.2f} ms); "
          f"launcher CPU {result['launcher_cpu'] * 100:.1f}% of a core (its Python loop "
          f"{result['launcher_python_cpu'] * 100:.1f}%, ZeroMQ's I/O thread and CURVE the rest; "
          f"{result['launcher_us_per_heartbeat']:.0f} us per heartbeat); "
          f"{result['fds_per_task']:.2f} open files per task; the simulated tasks used "
          f"{result['simulators_cpu'] * 100:.0f}% of a core in {result['processes']} process(es); "
          f"load average {result['load'][0]:.1f} then {result['load'][1]:.1f} on {os.cpu_count()} cores; "
          f"job exit {result['code']}")
    print(json.dumps(result))
    sys.exit(0 if result["code"] == 0 else 1)


if __name__ == "__main__":
    main()
