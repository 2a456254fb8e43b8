"""A CS system that many jobs share: `cs_system serve --port 9000 --num_csx 2`.

One long-lived process, the front door, owns N CS systems (WSE emulators
cs0..cs{N-1}) and a queue. `csrun_wse --cs_ip HOST:9000 ...` submits a job
(SUBMIT), then polls it (JOB_POLL, twice a second, which also says the
submitter is alive). Jobs start in submission order as soon as enough
systems are free (the head of the queue is never overtaken); a job holds
its systems until it ends. When a job's turn comes the front door gives it a
MemoryX, a SwarmX and one WSE per system, and a directory of its own; the
next poll answer (phase COMPILING) tells the submitter that directory's
address, and the submitter runs the chief and input workers against it as
csrun_wse does for a local system. The chief registers with that directory
and heartbeats to it; the phase becomes RUNNING when the chief, compiled and
heartbeating, looks up MemoryX, and a chief silent for HEARTBEAT_TIMEOUT ends
the job; the submitter reports how its tasks ended (JOB_DONE). csctl lists,
cancels and labels jobs over the same front door.

Isolation: a service process serves one job, then is stopped. The front
door keeps a pool of service processes started ahead of time (imports
done, waiting on stdin; see service.py) and hands one out per role when a
job starts, with that job's id, its CURVE keys (sent by the submitter,
encrypted) and its directory; a fresh process replaces it in the pool.
So no socket, key, mapping or state of one job exists in a process of
another, each job's directory admits only that job's keys, every message
carries the job id and is dropped by another job, and a process maps only
shared-memory segments named for its job. A job that fails, is cancelled, or
whose submitter stops polling for 10 s has its service processes stopped
and its segments and key folder deleted; the systems are then free.

Ownership: see client.py (a per-user owner credential; the job keeps its
SHA-256, and CANCEL / LABEL must carry the credential).

Admission and fairness (docs/security.md): with `--clients FILE` only the
client public keys listed there complete the CURVE handshake, and a job's
user is the name the file gives its submitter's key, not what the client
claims. Every client (by public key) may make RATE_PER_S requests a second
(bursts of RATE_BURST), and without --clients every address its SOURCE_ share
too; at most CLIENT_QUEUE answers, and CLIENT_SNDBUF bytes of the kernel's,
wait for a client that does not read, and once one is dropped nothing more is
made for that connection; what a client stores is checked before anything
changes and bounded, so a job's row fits a listing's page, which fits the
protocol's header cap; and a job whose chief has not arrived within
--turn_timeout seconds of its turn loses it, so no client can hold the
systems by polling alone, nor by looking services up without a chief.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from cs_runtime import env as cs_env
from cs_runtime.roles import ROLES, SERVICE_ROLES, module_of, service_counts, services_of_job
from cs_runtime.wire import auth
from cs_runtime.launch.directory import DirectoryServer
from cs_runtime.process.directory_client import DIRECTORY_MAX_FRAME, HEARTBEAT_TIMEOUT
from cs_runtime.process.orphan import SERVICE_DEATH_SIGNAL
from cs_runtime.launch.launcher import (ProcessGroup, Task, describe_exit, registration_overdue,
                                       numerics_env, spawn)
from cs_runtime.wire.protocol import (ENDED_PHASES, MAX_LABELS, USER_NAME, Message, MessageTooLarge, Msg,
                                      printable)
from cs_runtime.process.service import AWAIT_JOB_ENV
from cs_runtime.wire.shm import SHM_ENV, remove_job_segments, remove_orphaned_segments
from cs_runtime.wire.transport import Endpoint, host_name

log = logging.getLogger("cs_system")

SUBMITTER_TIMEOUT_S = 10.0   # a job whose csrun_wse has not polled this long has lost its submitter
ENDED_KEPT = 500             # ended jobs csctl still lists
MAX_WAITING = 1000           # jobs queued or running at once; more are refused
PAGE_BYTES = 48 * 1024       # a JOBS answer stays under the protocol's 64 KB header cap
CLIENT_QUEUE = 8             # answers queued for one client before more are dropped
CLIENT_SNDBUF = 64 * 1024    # kernel send buffer per client connection (Linux doubles it)
RATE_PER_S, RATE_BURST = 20.0, 40   # requests per client (public key) a second, and its burst
# Without --clients keys are free, so every address (all clients of one host together) has a
# bucket too: what many fresh keys from one place can ask for, a second and at once.
SOURCE_RATE_PER_S, SOURCE_BURST = 100.0, 200
KEPT_CLIENTS = 4096          # rate buckets, and clients that do not read, kept (least recently seen go first)
TURN_TIMEOUT_S = 120.0       # a job's chief must arrive this soon after its turn came
RESPAWN_DELAY_S = 5.0        # an idle service that died is replaced after this (no spawn loop on a broken install)
CHIEF = ("chief", 0)         # registers with its job's directory here and heartbeats while it trains


def read_clients(path: str) -> dict[str, str]:
    """`--clients FILE`: one `USER PUBLIC_KEY` a line (the key as `csctl key` prints it), lines
    starting with '#' are comments; {key: user}."""
    clients = {}
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--clients {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        words = line.split()
        if not words or words[0].startswith("#"):   # a comment line ('#' is also a Z85 digit)
            continue
        if len(words) != 2 or len(words[1]) != 40 or not USER_NAME.match(words[0]):
            raise ValueError(f"--clients {path}, line {number}: expected USER PUBLIC_KEY (a 40-character Z85 key)")
        clients[words[1]] = words[0]
    return clients


class RateLimit:
    """A token bucket per client: RATE_PER_S requests a second, bursts of RATE_BURST."""

    def __init__(self, rate: float = RATE_PER_S, burst: int = RATE_BURST):
        self.rate, self.burst = rate, burst
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()   # client -> (tokens, when)

    def allow(self, client: str) -> bool:
        tokens = self._tokens(client)
        allowed = tokens >= 1.0
        self.buckets[client] = (tokens - 1.0 if allowed else tokens, time.monotonic())
        while len(self.buckets) > KEPT_CLIENTS:
            self.buckets.popitem(last=False)
        return allowed

    def wait_s(self, client: str) -> float:
        """Seconds until `client` has a request again."""
        return max(0.0, 1.0 - self._tokens(client)) / self.rate

    def _tokens(self, client: str) -> float:
        now = time.monotonic()
        tokens, then = self.buckets.pop(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        self.buckets[client] = (tokens, now)
        return tokens


class Refused(Exception):
    """A front-door request that is not carried out; the message goes back to the client."""


def owner_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass
class JobRecord:
    """The CS system's record of one submitted job, from QUEUED to its end (a row of csctl get jobs)."""
    number: int
    user: str
    owner: str              # SHA-256 of the submitter's owner credential
    num_csx: int
    labels: dict
    keys: dict              # the job's CURVE keys (Z85), until it starts; {} when insecure
    run_id: str = ""        # the id every process and message of the job carries
    phase: str = "QUEUED"
    reason: str = ""
    systems: list = field(default_factory=list)
    submitted: float = field(default_factory=time.time)
    started: float | None = None
    ended: float | None = None
    last_poll: float = field(default_factory=time.monotonic)
    runtime: "JobRuntime | None" = None
    services: list = field(default_factory=list)   # [{role, rank, pid}] of the processes that served it

    def __post_init__(self):
        # Unique across CS systems and restarts: segment names and messages carry it.
        self.run_id = f"{self.name}-{secrets.token_hex(4)}"

    @property
    def name(self) -> str:
        return f"wsjob-{self.number}"

    @property
    def over(self) -> bool:
        return self.phase in ENDED_PHASES

    def row(self, position: int) -> dict:
        now = time.time()
        return {"name": self.name, "job_id": self.run_id, "phase": self.phase, "user": self.user,
                "labels": dict(self.labels), "systems": [f"cs{i}" for i in self.systems],
                "num_csx": self.num_csx, "age_s": round(now - self.submitted, 1),
                "duration_s": None if self.started is None else round((self.ended or now) - self.started, 1),
                "submitted": self.submitted, "position": position, "reason": self.reason,
                "services": list(self.services)}


class ServicePool:
    """Service processes started ahead of time, each waiting for the one job it will serve."""

    def __init__(self, num_csx: int):
        self.idle: dict[str, list[subprocess.Popen]] = {role: [] for role in SERVICE_ROLES}
        self.num_csx = num_csx
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CS_") or k == cs_env.LOG_LEVEL.name}
        self.env.update({AWAIT_JOB_ENV: "1", "PYTHONUNBUFFERED": "1"})
        self.not_before: dict[str, float] = {}

    def spawn(self, role: str) -> subprocess.Popen:
        env = numerics_env(self.env, ROLES[role].threads(self.num_csx))
        return spawn([sys.executable, "-m", module_of(role)], env, SERVICE_DEATH_SIGNAL,
                     stdin=subprocess.PIPE, stdout=sys.stderr)   # services log to stderr; stdout stays the server's own

    def refill(self, targets: dict[str, int]) -> None:
        for role, want in targets.items():
            for dead in [p for p in self.idle[role] if p.poll() is not None]:
                log.warning("an idle %s (pid %d) exited with %s; starting another in %.0f s", role, dead.pid,
                            describe_exit(dead.returncode), RESPAWN_DELAY_S)
                self.not_before[role] = time.monotonic() + RESPAWN_DELAY_S
            self.idle[role] = [p for p in self.idle[role] if p.poll() is None]
            if time.monotonic() < self.not_before.get(role, 0.0):
                continue
            while len(self.idle[role]) < want:
                self.idle[role].append(self.spawn(role))

    def take(self, role: str, assignment: dict[str, str]) -> subprocess.Popen:
        """An idle process of `role` (or a new one), given its job."""
        while True:
            proc = self.idle[role].pop(0) if self.idle[role] else self.spawn(role)
            try:
                proc.stdin.write(json.dumps(assignment).encode() + b"\n")
                proc.stdin.close()
                return proc
            except (BrokenPipeError, ValueError):
                proc.wait()   # it died while idle: take the next one

    def stop_all(self) -> None:
        group = ProcessGroup()
        for role, procs in self.idle.items():
            for proc in procs:
                if proc.stdin:
                    proc.stdin.close()   # EOF: an idle service exits by itself
                group.add(Task(role, 0, host_name(), proc))
        group.stop_all()
        self.idle = {role: [] for role in SERVICE_ROLES}


class JobRuntime:
    """One running job on the CS system: its directory, its service processes, its keys."""

    def __init__(self, job: JobRecord, host: str, pool: ServicePool, shm_dir: str | None):
        self.job, self.shm_dir = job, shm_dir
        self.ctx = zmq.Context()     # its own ZAP handler, admitting only this job's keys
        self.keys_dir = auth.write_job_dir(job.keys) if job.keys else None
        keys = auth.load_keys(str(self.keys_dir)) if self.keys_dir else None
        self.directory = DirectoryServer(self.ctx, job.run_id, {**service_counts(job.num_csx), CHIEF[0]: 1},
                                         host=host, keys=keys)
        env = {"CS_JOB_ID": job.run_id, "CS_IP": self.directory.address, "CS_NUM_CSX": str(job.num_csx),
               "CS_BIND_HOST": host}
        if self.keys_dir:
            env[auth.KEYS_ENV] = str(self.keys_dir)
        if shm_dir:
            env[SHM_ENV] = shm_dir
        self.group = ProcessGroup()
        for role, rank in services_of_job(job.num_csx):
            proc = pool.take(role, {**env, "CS_ROLE": role, "CS_RANK": str(rank)})
            self.group.add(Task(role, rank, host_name(), proc))
        self.started = time.monotonic()

    @property
    def socket(self) -> zmq.Socket:
        return self.directory.endpoint.sock

    def serve(self) -> None:
        while self.socket.poll(0):
            self.directory.serve_once(0)

    @property
    def chief_arrived(self) -> bool:
        """The chief has compiled, looks for MemoryX and heartbeats here: the job is training.
        A LOOKUP alone (anyone with the job's keys can send one) does not hold the turn."""
        chief = self.directory.peers.get(CHIEF)
        return frozenset(("memoryx", "swarmx")) in self.directory.lookups and chief is not None and chief.beating

    def failure(self) -> str | None:
        """What went wrong with the job's services or its chief, if anything."""
        for task, rc in self.group.exited():
            return f"{task.label} exited with {describe_exit(rc)}"
        for peer in self.directory.silent_peers(HEARTBEAT_TIMEOUT):
            if (peer.role, peer.rank) == CHIEF and peer.leaving:
                continue   # its work is done; the submitter's JOB_DONE follows
            if (peer.role, peer.rank) == CHIEF:
                return (f"its chief on {peer.host} (pid {peer.pid}) stopped heartbeating for "
                        f"{HEARTBEAT_TIMEOUT:g} s; the systems went to the next job")
            return f"{peer.role} {peer.rank} on {peer.host} (pid {peer.pid}) stopped answering"
        return registration_overdue(self.directory, self.group.tasks, self.started)

    def stop(self, reason: str) -> None:
        """Stop every process of the job and delete what it leaves: segments, keys, sockets."""
        self.directory.failure = reason     # heartbeat answers now tell any straggler to exit
        self.group.stop_all()               # services keep nothing worth a grace period
        if self.shm_dir:
            remove_job_segments(Path(self.shm_dir), self.job.run_id)
        self.directory.close()
        auth.stop_authenticator(self.ctx)
        self.ctx.destroy(linger=0)
        if self.keys_dir:
            auth.remove_job_dir(self.keys_dir)


class CSSystem:
    """The front door, the queue and the systems."""

    def __init__(self, host: str, port: int, num_csx: int, insecure: bool, shm: bool,
                 clients: dict[str, str] | None = None, turn_timeout_s: float = TURN_TIMEOUT_S):
        self.host, self.num_csx, self.insecure = host, num_csx, insecure
        self.clients = clients            # {public key: user}: the allow-list, or None (any key)
        self.turn_timeout_s = turn_timeout_s
        self.rate = RateLimit()
        self.source_rate = None if clients is not None else RateLimit(SOURCE_RATE_PER_S, SOURCE_BURST)
        self.deaf: OrderedDict[bytes, None] = OrderedDict()   # connections whose answers were dropped
        self.shm_dir = "/dev/shm" if shm and os.path.isdir("/dev/shm") else None
        if self.shm_dir:
            remove_orphaned_segments(Path(self.shm_dir))
        os.environ.pop(auth.KEYS_ENV, None)   # this process has no job of its own
        self.keys_dir, keys = (None, None) if insecure else auth.create_system_dir()
        self.keys_watch = auth.FolderWatch(self.keys_dir) if self.keys_dir else None   # gone with us, however
        self.ctx = zmq.Context()
        admitted = True if clients is None else frozenset(clients)
        self.front = Endpoint(self.ctx, zmq.ROUTER, "cs_system", "", max_frame_bytes=DIRECTORY_MAX_FRAME,
                              keys=keys, any_client=admitted).bound_queues(CLIENT_QUEUE, CLIENT_SNDBUF)
        try:
            self.port = int(self.front.bind(host, port).rsplit(":", 1)[1])
        except Exception:
            self.close()
            raise
        if self.keys_dir:
            auth.write_system_port(self.keys_dir, self.port)
        self.public_key = keys.server_public.decode() if keys else ""
        self.where = f"{host}:{self.port}"
        self.jobs: list[JobRecord] = []
        self.submitted = 0     # jobs are numbered 1, 2, ... in submission order
        self.free = set(range(num_csx))
        self.pool = ServicePool(num_csx)
        self.stopping = ""

    # ------------------------------------------------------------ main loop
    def serve_forever(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, _: setattr(self, "stopping", signal.Signals(signum).name))
        try:
            while not self.stopping:
                self.step(100)
        finally:
            self.shutdown()

    def step(self, timeout_ms: int) -> None:
        poller = zmq.Poller()
        poller.register(self.front.sock, zmq.POLLIN)
        for job in self.running():
            poller.register(job.runtime.socket, zmq.POLLIN)
        poller.poll(timeout_ms)
        self.serve_front_door()
        for job in self.running():
            job.runtime.serve()
            self.watch(job)
        self.drop_lost_submitters()
        self.schedule()
        self.pool.refill(service_counts(self.num_csx))

    def running(self) -> list[JobRecord]:
        return [j for j in self.jobs if j.runtime is not None]

    def serve_front_door(self) -> None:
        for _ in range(100):   # bounded: the jobs' directories must be served too
            got = self.front.recv(0)
            if got is None:
                return
            identity, msg = got
            if identity in self.deaf:
                continue   # it left answers unread: nothing more is made for this connection
            client = self.front.last_user or identity.hex()
            answer = self.rate_refusal(client, self.front.last_address)
            if answer is None:
                try:
                    answer = self.answer(msg, client)
                except Refused as refusal:
                    answer = Message(Msg.REFUSED, meta={"reason": str(refusal)})
            answer.step = msg.step        # the client matches answers to requests by it
            try:
                delivered = self.front.send(answer, identity)
            except MessageTooLarge as exc:   # the client would drop it: a refusal that says why, not a crash
                delivered = self.front.send(Message(Msg.REFUSED, step=msg.step, meta={"reason": str(exc)}), identity)
            if not delivered:
                self.deaf[identity] = None
                while len(self.deaf) > KEPT_CLIENTS:
                    self.deaf.popitem(last=False)

    def rate_refusal(self, client: str, source: str) -> Message | None:
        """A REFUSED answer when `client` (its key), or without --clients its address, is over its rate."""
        limits = [(self.rate, client, f"at most {RATE_PER_S:.0f} a second per client")]
        if self.source_rate is not None:
            limits.append((self.source_rate, f"source {source}",
                           f"at most {SOURCE_RATE_PER_S:.0f} a second from {source or 'one address'}"))
        for limit, key, rule in limits:
            if not limit.allow(key):
                return Message(Msg.REFUSED, meta={"reason": f"too many requests: {rule}; slow down",
                                                  "retry_after": round(limit.wait_s(key), 3)})
        return None

    def watch(self, job: JobRecord) -> None:
        failure = job.runtime.failure()
        if failure:
            self.end(job, "FAILED", failure)
        elif job.phase == "COMPILING" and job.runtime.chief_arrived:
            job.phase = "RUNNING"
            log.info("%s is running", job.name)
        elif job.phase == "COMPILING" and time.monotonic() - job.runtime.started > self.turn_timeout_s:
            self.end(job, "FAILED", f"its chief did not arrive within {self.turn_timeout_s:g} s of its turn "
                                    "(--turn_timeout); the systems went to the next job")

    def drop_lost_submitters(self) -> None:
        now = time.monotonic()
        for job in self.jobs:
            if not job.over and now - job.last_poll > SUBMITTER_TIMEOUT_S:
                self.end(job, "FAILED", f"its csrun_wse stopped polling for {SUBMITTER_TIMEOUT_S:.0f} s "
                                        "(killed, or the connection was lost)")

    def schedule(self) -> None:
        """Start queued jobs in order while the head of the queue fits the free systems."""
        for job in [j for j in self.jobs if j.phase == "QUEUED"]:
            if job.num_csx > len(self.free):
                return
            job.systems = sorted(self.free)[:job.num_csx]
            self.free -= set(job.systems)
            job.phase, job.started = "COMPILING", time.time()
            try:
                job.runtime = JobRuntime(job, self.host, self.pool, self.shm_dir)
            except Exception as exc:  # e.g. no free port: the job fails, the system goes on
                self.end(job, "FAILED", f"could not start its services: {exc}")
                continue
            job.keys = {}
            job.services = [{"role": t.role, "rank": t.rank, "pid": t.proc.pid} for t in job.runtime.group.tasks]
            log.info("%s (%s) started on %s", job.name, job.user, ",".join(f"cs{i}" for i in job.systems))

    def end(self, job: JobRecord, phase: str, reason: str = "") -> None:
        if job.over:
            return
        runtime, job.runtime = job.runtime, None
        if runtime is not None:
            runtime.stop(reason or f"job {phase.lower()}")
        self.free |= set(job.systems)
        job.phase, job.reason, job.ended, job.keys = phase, reason, time.time(), {}
        log.info("%s (%s) %s%s", job.name, job.user, phase, f": {reason}" if reason else "")
        ended = [j for j in self.jobs if j.over]
        for old in ended[:max(0, len(ended) - ENDED_KEPT)]:
            self.jobs.remove(old)

    # ------------------------------------------------------------ requests
    def answer(self, msg: Message, client: str = "") -> Message:
        m = msg.meta
        if msg.type == Msg.SUBMIT:
            return self.job_state(self.submit(m, client))
        if msg.type == Msg.GET_JOBS:
            return self.jobs_page(int(m.get("after", 0)))
        if msg.type not in (Msg.JOB_POLL, Msg.JOB_DONE, Msg.CANCEL, Msg.LABEL):
            raise Refused(f"{msg.type.value} is not a request the CS system takes")
        verb = {Msg.JOB_POLL: "follow", Msg.JOB_DONE: "report on", Msg.CANCEL: "cancel", Msg.LABEL: "label"}
        job = self.owned(m["name"], m["owner"], verb[msg.type])
        if msg.type == Msg.JOB_POLL:
            job.last_poll = time.monotonic()
        elif msg.type == Msg.JOB_DONE:   # the reason is shown to every user and logged: escaped
            self.end(job, m["phase"] if m["phase"] in ENDED_PHASES else "FAILED", printable(m["reason"]))
        elif msg.type == Msg.CANCEL:
            if job.over:
                raise Refused(f"{job.name} has already ended ({job.phase})")
            self.end(job, "CANCELLED", "cancelled by its owner (csctl cancel job)")
            return Message(Msg.ACK, meta={"what": "cancel"})
        else:   # checked before anything changes: a refused request leaves the labels as they were
            if len(job.labels.keys() | m["labels"].keys()) > MAX_LABELS:
                raise Refused(f"{job.name}: more than {MAX_LABELS} labels (it has {len(job.labels)})")
            job.labels.update(m["labels"])
            return Message(Msg.ACK, meta={"what": "label"})
        return self.job_state(job)

    def jobs_page(self, after: int) -> Message:
        """The rows of the jobs numbered above `after`, as many as fit PAGE_BYTES; `next`
        (the last number listed) when more follow."""
        import msgpack
        rows, size, more = [], 0, False
        for job in self.jobs:
            if job.number <= after:
                continue
            row = job.row(self.position(job))
            row_size = len(msgpack.packb(row, use_bin_type=True))
            if rows and size + row_size > PAGE_BYTES:
                more = True
                break
            rows.append(row)
            size += row_size
        meta = {"jobs": rows, "system": {"address": self.where, "num_csx": self.num_csx,
                                         "free": [f"cs{i}" for i in sorted(self.free)]}}
        if more:
            meta["next"] = int(rows[-1]["name"].split("-")[1])
        return Message(Msg.JOBS, meta=meta)

    def submit(self, m: dict, client: str = "") -> JobRecord:
        if m["num_csx"] > self.num_csx:
            raise Refused(f"the job asks for {m['num_csx']} CS systems; the CS system at {self.where} "
                          f"has {self.num_csx}")
        if sum(not j.over for j in self.jobs) >= MAX_WAITING:
            raise Refused(f"the CS system at {self.where} has {MAX_WAITING} jobs waiting or running; try later")
        if bool(m["keys"]) == self.insecure:
            raise Refused("this CS system runs " + ("--insecure: submit with --insecure" if self.insecure
                                                     else "with CURVE: submit without --insecure"))
        self.submitted += 1
        # With an allow-list the key says who submits; without one the client's claim is all there is.
        user = self.clients[client] if self.clients is not None else m["user"]
        job = JobRecord(self.submitted, user, owner_hash(m["owner"]), m["num_csx"], dict(m["labels"]), dict(m["keys"]))
        self.jobs.append(job)
        log.info("%s (%s, %d system(s)) queued at position %d", job.name, job.user, job.num_csx, self.position(job))
        return job

    def owned(self, name: str, owner: str, verb: str) -> JobRecord:
        job = next((j for j in self.jobs if j.name == name), None)
        if job is None:
            raise Refused(f"no job {name} on {self.where}")
        if not hmac.compare_digest(job.owner, owner_hash(owner)):
            raise Refused(f"permission denied: {name} belongs to {job.user}, and only its owner may {verb} it "
                          "(this request does not carry the owner credential it was submitted with)")
        return job

    def position(self, job: JobRecord) -> int:
        queued = [j for j in self.jobs if j.phase == "QUEUED"]
        return queued.index(job) + 1 if job in queued else 0

    def job_state(self, job: JobRecord) -> Message:
        return Message(Msg.JOB_STATE, meta={
            "name": job.name, "job": job.run_id, "phase": job.phase, "reason": job.reason,
            "cs_ip": job.runtime.directory.address if job.runtime else "", "position": self.position(job),
            "systems": [f"cs{i}" for i in job.systems]})

    # ------------------------------------------------------------ stop
    def shutdown(self) -> None:
        live = [j for j in self.jobs if not j.over]
        for job in live:
            self.end(job, "CANCELLED", f"the CS system stopped ({self.stopping or 'shut down'})")
        if live:   # a moment to tell the submitters, so they stop at once rather than time out
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                self.front.sock.poll(50)
                self.serve_front_door()
        self.pool.stop_all()
        self.close()
        log.info("stopped")

    def close(self) -> None:
        self.front.close()
        auth.stop_authenticator(self.ctx)
        self.ctx.destroy(linger=0)
        if self.keys_dir:
            auth.remove_job_dir(self.keys_dir)
            self.keys_watch.close()
