"""One job of the emulated CS system, as a library: what csrun_wse runs and cs_torch.Session starts.

    options = JobOptions(command=["python", "run.py", "--mode", "train", "--params", "p.yaml"], num_csx=2)
    code = run(options)         # supervised to its end, restarted up to options.max_restarts times

Without cs_ip a job gets a CS system of its own on this machine (one MemoryX,
one SwarmX, num_csx WSE emulators); with cs_ip it is submitted to the shared
CS system there (`cs_system serve`), waits for its turn, and runs against
the services that system gives it (`run_on_cs_system`). Its tasks (the
command as the chief, then as every input worker) run on this machine, over
SSH or with srun (`plan_layout`). A caller that supervises by itself
(cs_torch.Session) uses the pieces: `job_keys`,
`check_insecure_and_ssh_hosts`, `open_front_door`, `submit`, `start_job`.
"""
from __future__ import annotations

import logging
import os
import sys
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from cs_runtime import env as cs_env
from cs_runtime.errors import UserInputError
from cs_runtime.roles import service_counts
from cs_runtime.launch.front_door import FrontDoor, FrontDoorError, SubmittedJob
from cs_runtime.launch import local_jobs, remote
from cs_runtime.launch.backends import Layout, backend_for
from cs_runtime.launch.directory import DirectoryServer
from cs_runtime.launch.launcher import (JobFailed, ProcessGroup, Supervisor, check_file_limit,
                                       numerics_env)
from cs_runtime.launch.remote import LaunchError
from cs_runtime.launch.restart import RESTART_ENV, Outcome, run_with_restarts
from cs_runtime.wire import auth
from cs_runtime.wire.protocol import ENDED_PHASES
from cs_runtime.wire.shm import remove_job_segments, remove_orphaned_segments
from cs_runtime.wire.transport import PortInUse

log = logging.getLogger("csrun_wse")

# Variables that describe a process's place in a job; never inherited from outside.
JOB_VARS = cs_env.JOB_VARS
SHM_DIR = "/dev/shm"   # memory-backed on Linux


@dataclass(frozen=True)
class JobOptions:
    """Everything a job is started with: csrun_wse's flags, checked (cs_runtime/cli/csrun_wse.py)."""
    command: list[str]                        # python run.py ARGS...: every task of the job
    num_csx: int = 1                          # WSE emulators
    num_workers_per_csx: int | None = None    # local runs: input workers per WSE (None: 1)
    cs_ip: str | None = None                  # HOST:PORT of a shared CS system (None: start one)
    launcher: str = "local"                   # local, ssh or slurm
    hostfile: str | None = None               # ssh: 'HOST [slots=N]' a line
    hosts: str | None = None                  # ssh: h1,h2,... (one slot each)
    ssh_options: str = ""                     # added to remote.DEFAULT_SSH_OPTIONS
    total_nodes: int | None = None
    tasks_per_node: int | None = None
    cpus_per_task: int | None = None          # Slurm
    max_restarts: int = 0
    port: int = 0                             # of the job's directory (0: any free port)
    insecure: bool = False                    # no CURVE (loopback only)
    no_shm: bool = False                      # weights over tcp even between local processes
    job_labels: dict[str, str] = field(default_factory=dict)   # shown by csctl get jobs
    trace: bool = False                       # a timeline of every process (model_dir/trace.json)
    bind_address: str | None = None           # what the directory and services bind (None: chosen)
    services_node: str | None = None          # inside a Slurm allocation: where the services run


def plan_layout(options: JobOptions) -> Layout:
    """Where the tasks run and what the job binds: --bind_address, else the address this machine
    reaches the hosts by; loopback is refused for tasks on other hosts."""
    backend = backend_for(options)
    layout = backend.place(options)
    if options.bind_address:
        layout.bind = remote.local_address(options.bind_address)
    remote.refuse_loopback_across_hosts(layout.bind, backend.hosts_elsewhere(layout, options))
    return layout


def base_env(options: JobOptions, job: str, rendezvous: str, cs_ip: str, layout: Layout) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
    env.update(CS_JOB_ID=job, CS_RENDEZVOUS=rendezvous, CS_IP=cs_ip, CS_TARGET="wse",
               CS_NUM_CSX=str(options.num_csx), CS_NUM_WORKERS=str(layout.num_workers),
               CS_BIND_HOST=layout.bind, PYTHONUNBUFFERED="1", CS_TRACE="1" if options.trace else "0")
    keys = auth.job_keys()
    if keys is not None:  # the job's own processes learn where the keys are, nobody else
        env[auth.KEYS_ENV] = str(keys.folder)
    return env


def check_insecure_and_ssh_hosts(options: JobOptions, layout: Layout) -> None:
    """Fail in seconds, with one line, on what would otherwise fail late or unsafely:
    --insecure off loopback, too few open files allowed, and SSH hosts or Slurm nodes that cannot
    start tasks."""
    check_file_limit(layout.num_workers + 1 + options.num_csx + 2)  # tasks, WSEs, MemoryX, SwarmX
    if options.insecure:
        outside = [h for h in [layout.bind] if not auth.is_loopback(h)]
        if outside:
            raise LaunchError(f"--insecure is for loopback only, not {outside[0]}")
        print("csrun_wse: WARNING: --insecure: CURVE authentication and encryption are OFF; "
              "any local process can connect to this job's sockets and read or inject its traffic",
              file=sys.stderr, flush=True)
    backend_for(options).check(layout, options)


class BadJob(UserInputError):
    """A job that cannot run as asked on this machine: one line before anything starts, exit 2."""


# What one process of a job holds before its share of the model (Python, numpy, ZeroMQ): an FC-MNIST
# job on 2 WSEs measured 45-50 MB for MemoryX and SwarmX, 62 for a WSE, 70-90 for the chief and the
# workers. And how many processes a core can take before their heartbeats, each sent twice a second,
# miss the launcher's 10 s.
PROCESS_MB = 70
PROCESSES_PER_CORE = 32


def check_fits_host(options: JobOptions) -> None:
    """The processes a job starts on this machine against its memory and cores, with the
    estimate (BadJob): its services unless a CS system (--cs_ip) or Slurm runs them, its
    tasks when local. Tasks on other hosts are those hosts' business."""
    backend = backend_for(options)
    workers = options.num_csx * (options.num_workers_per_csx or 1) if backend.tasks_here() else 0
    processes = backend.processes_here(options)
    need_mb = processes * PROCESS_MB
    available_mb = available_memory_mb()
    cores = os.cpu_count() or 1
    what = (f"--num_csx {options.num_csx}" + (f" with {workers} input worker(s)" if workers else "")
            + f" starts {processes} processes here")
    if available_mb is not None and need_mb > available_mb:
        raise BadJob(f"{what}, about {need_mb:,} MB before the model ({PROCESS_MB} MB each), but this machine has "
                     f"{available_mb:,} MB available; use fewer WSEs or workers")
    if processes > PROCESSES_PER_CORE * cores:
        raise BadJob(f"{what}, more than {PROCESSES_PER_CORE} per core on {cores} core(s): their heartbeats "
                     f"would time out; use fewer WSEs or workers")


def available_memory_mb() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), in MB; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def open_front_door(options: JobOptions) -> FrontDoor | None:
    """With cs_ip: a connection to the CS system's front door, checked to answer (None without)."""
    if not options.cs_ip:
        return None
    try:
        return FrontDoor.open(options.cs_ip, options.insecure, what="--cs_ip")
    except FrontDoorError as exc:
        raise LaunchError(str(exc)) from None


@dataclass
class StartedJob:
    """A started job: its directory, its processes and what they hold; `close()` releases it all."""
    id: str
    ctx: zmq.Context
    directory: DirectoryServer
    group: ProcessGroup
    supervisor: Supervisor
    env: dict[str, str]
    shm_dir: str | None
    local: local_jobs.LocalJob | None = None   # its entry in this user's registry (a job without cs_ip)

    def close(self) -> None:
        if self.local is not None:
            local_jobs.unregister(self.local)
        self.group.stop_all()
        if self.shm_dir:  # whatever the services left, even when killed
            remove_job_segments(Path(self.shm_dir), self.id)
        auth.stop_authenticator(self.ctx)
        self.ctx.destroy(linger=0)


def register_local(job: str, options: JobOptions) -> local_jobs.LocalJob | None:
    """A job with a CS system of its own, in this user's registry: csctl lists and cancels it. If the
    registry cannot take it, the job runs all the same, and says in one line that csctl will not see it."""
    try:
        local = local_jobs.register(job, options.num_csx, options.job_labels)
    except (local_jobs.LocalJobError, OSError) as exc:
        print(f"csrun: this job is not listed by csctl: {exc}", file=sys.stderr, flush=True)
        return None
    log.info("job %s is %s in `csctl get jobs` (csctl cancel job %s)", job, local.name, local.name)
    return local


def start_job(options: JobOptions, layout: Layout, attempt: int, tasks: bool = True,
              handle_signals: bool = True, job: str | None = None, cs_ip: str | None = None) -> StartedJob:
    """The job's directory and, with cs_ip None, its CS system here (MemoryX, SwarmX, WSEs);
    else `cs_ip` is the directory the shared CS system made for `job`. With `tasks`
    also the chief and the input workers of options.command. The caller supervises
    (`job.supervisor.run()`) and always calls `job.close()`."""
    # The id stays unique across users and CS systems (the shared-memory segments are named for it); a
    # job with a CS system of its own is also listed under a short name (wsjob-N) for csctl.
    job = job or f"wsjob-{uuid.uuid4().hex[:12]}"
    local = register_local(job, options) if cs_ip is None else None
    try:
        return _start_job(options, layout, tasks, handle_signals, job, cs_ip, attempt, local)
    except BaseException:
        if local is not None:
            local_jobs.unregister(local)
        raise


def _start_job(options: JobOptions, layout: Layout, tasks: bool, handle_signals: bool, job: str,
               cs_ip: str | None, attempt: int, local) -> StartedJob:
    ctx = zmq.Context()
    expected = {"chief": 1, "worker": layout.num_workers}
    if cs_ip is None:
        expected.update(service_counts(options.num_csx))
    try:
        directory = DirectoryServer(ctx, job, expected, host=layout.bind, port=options.port)
    except PortInUse as exc:
        auth.stop_authenticator(ctx)
        ctx.destroy(linger=0)
        raise LaunchError(f"--port: {exc}") from None
    env = {**base_env(options, job, directory.address, cs_ip or directory.address, layout),
           RESTART_ENV: str(attempt)}
    group = ProcessGroup()
    backend = backend_for(options)
    log.info("job %s: %d WSE(s), %d input worker(s), tasks %s", job, options.num_csx, layout.num_workers,
             backend.describe(layout))
    supervisor = Supervisor(directory, group, finisher_role="chief", handle_signals=handle_signals)
    # Services elsewhere (a CS system's, an srun step's) share no memory with this host: tcp.
    here = backend.services_here(layout) and not options.no_shm and os.path.isdir(SHM_DIR)
    shm_dir = SHM_DIR if here else None
    started = StartedJob(job, ctx, directory, group, supervisor, env, shm_dir, local)
    if shm_dir:
        remove_orphaned_segments(Path(shm_dir))
    try:
        backend.start_services(group, directory, layout, env, options, job, shm_dir)
        if tasks:
            # the chief drives, the workers feed: neither multiplies matrices
            task_env = numerics_env(env, 1)
            if shm_dir and backend.tasks_here():   # the workers hand the WSEs batches in shared memory
                task_env[cs_env.SHM_DIR.name] = shm_dir
            backend.start_tasks(group, directory, layout, task_env, options, job)
    except BaseException:
        directory.close()
        started.close()
        raise
    return started


def run_job(options: JobOptions, layout: Layout, attempt: int, door: FrontDoor | None = None) -> Outcome:
    """One whole job, on a CS system of its own (door None) or on the shared one behind `door`."""
    if door is not None:
        return run_on_cs_system(options, layout, attempt, door)
    return supervise_job(options, layout, attempt)[0]


def supervise_job(options: JobOptions, layout: Layout, attempt: int, job: str | None = None,
                  cs_ip: str | None = None, extra_check=None) -> tuple[Outcome, Supervisor]:
    """start_job, supervised until the job ends, then closed."""
    started = start_job(options, layout, attempt, job=job, cs_ip=cs_ip)
    try:
        code = started.supervisor.run(extra_check)
    finally:
        started.close()
    failure = started.supervisor.failure
    return Outcome(code, failure is None or failure.retryable), started.supervisor


def say(line: str) -> None:
    print(f"csrun_wse: {line}", file=sys.stderr, flush=True)


def submit(options: JobOptions, door: FrontDoor) -> SubmittedJob:
    try:
        job = SubmittedJob(door, options.num_csx, options.job_labels, auth.job_keys())
    except FrontDoorError as exc:
        raise LaunchError(str(exc)) from None
    say(f"submitted {job.name} to the CS system at {options.cs_ip} (csctl --cs_ip {options.cs_ip} get jobs)")
    return job


def follower(job: SubmittedJob):
    """A supervisor check: the CS system may end the job (cancelled, or one of its services failed)."""
    def follow() -> None:
        try:
            now = job.check()
        except FrontDoorError as exc:
            raise JobFailed(str(exc)) from None
        if now["phase"] in ENDED_PHASES:
            raise JobFailed(f"{job.name} {now['phase'].lower()} on the CS system: {now['reason']}",
                            retryable=now["phase"] == "FAILED")
    return follow


def run_on_cs_system(options: JobOptions, layout: Layout, attempt: int, door: FrontDoor) -> Outcome:
    """Submit to the shared CS system, wait for the job's turn, then run its chief and input workers
    against the directory the CS system made for it, until the job ends or the CS system ends it."""
    job = submit(options, door)
    try:
        state = job.wait_turn(lambda position: say(f"{job.name} is queued (position {position})"))
    except KeyboardInterrupt:
        job.done("CANCELLED", "interrupted by SIGINT while queued")
        say(f"{job.name} cancelled while queued")
        return Outcome(130, retryable=False)
    except FrontDoorError as exc:
        say(f"{job.name}: {exc}")
        return Outcome(1)
    if state["phase"] in ENDED_PHASES:
        say(f"{job.name} {state['phase']}: {state['reason']}")
        return Outcome(1, retryable=state["phase"] == "FAILED")
    say(f"{job.name} starts on {','.join(state['systems'])}")
    outcome, supervisor = supervise_job(options, layout, attempt, state["job"], state["cs_ip"], follower(job))
    failure = supervisor.failure
    if failure is None:
        job.done("SUCCEEDED")
    else:
        job.done("CANCELLED" if str(failure).startswith("interrupted") else "FAILED", str(failure))
    return outcome


@contextmanager
def job_keys(insecure: bool):
    """CURVE keys for one job, in a private folder that goes when the job does
    (CS_KEYS_DIR of this process while it runs; with cs_ip they travel,
    encrypted, to the CS system's services for this job). None with `insecure`."""
    outside = os.environ.pop(auth.KEYS_ENV, None)
    keys_dir = None if insecure else auth.create_job_dir()
    watch = None if keys_dir is None else auth.FolderWatch(keys_dir)   # removes it should we be killed
    if keys_dir is not None:
        os.environ[auth.KEYS_ENV] = str(keys_dir)  # read by auth.job_keys() and base_env
    try:
        yield
    finally:
        os.environ.pop(auth.KEYS_ENV, None)
        if outside is not None:
            os.environ[auth.KEYS_ENV] = outside
        if keys_dir is not None:
            auth.remove_job_dir(keys_dir)
            watch.close()


def run(options: JobOptions) -> int:
    """The whole job, supervised to its end and restarted up to options.max_restarts times;
    the exit code. Raises LaunchError (a one-line SystemExit) on bad options or hosts."""
    layout = plan_layout(options)
    with job_keys(options.insecure):
        check_insecure_and_ssh_hosts(options, layout)
        door = open_front_door(options)
        try:
            return run_with_restarts(lambda attempt: run_job(options, layout, attempt, door), options.max_restarts)
        finally:
            if door is not None:
                door.close()
