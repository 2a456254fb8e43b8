"""csrun_wse: run a model script on the emulated CS system.

    csrun_wse [--num_csx N] [--num_workers_per_csx W] [--cs_ip HOST:PORT] \\
        python examples/fc_mnist/run.py --mode train --params examples/fc_mnist/configs/params.yaml
    csrun_wse --hostfile hosts.txt python run.py ...                                  # tasks over SSH
    csrun_wse --total-nodes 3 --tasks-per-node 2 --cpus-per-task 1 python run.py ...  # tasks with srun

Without --cs_ip it starts a CS system for the job on this machine (one
MemoryX, one SwarmX, N WSE emulators); with --cs_ip HOST:PORT it submits the
job to a shared CS system (`cs_system serve`), waits for its turn in the
queue, and then runs the tasks against the services that system gives the job
(`run_on_cs_system`, also what a Python API can call). It then starts the user's command as
the job's tasks: task 0 as the chief (`python -m chief run.py ...`), the
others as input workers (`python -m worker run.py ...`): on this machine
(N*W workers), over SSH on the hosts of --hostfile / -H, or with srun inside
a Slurm allocation (or when --total-nodes / --tasks-per-node /
--cpus-per-task is given without hosts). It supervises all of them: the job
ends when the chief exits 0; if any process fails or stops answering,
everything is stopped within seconds and one line names what failed; with
--max_restarts K the whole job is then restarted from its latest checkpoint,
up to K times. Traffic is authenticated and encrypted with CURVE keys made for
the job (see cs_runtime/wire/auth.py); --insecure turns that off, on loopback only.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import zmq

from cs_runtime.wire import auth
from cs_runtime.launch import remote
from cs_runtime.launch.directory import DirectoryServer
from cs_runtime.appliance.client import FrontDoor, FrontDoorError, SubmittedJob
from cs_runtime.launch.launcher import SERVICE_MODULES, JobFailed, ProcessGroup, Supervisor, with_threads
from cs_runtime.wire.protocol import ENDED_PHASES, check_labels
from cs_runtime.launch.restart import RESTART_ENV, Outcome, run_with_restarts
from cs_runtime.service import setup_logging
from cs_runtime.wire.shm import remove_job_segments, remove_orphaned_segments
from cs_runtime.launch.task import role_argv
from cs_runtime.wire.transport import PortInUse

# Variables that describe a process's place in a job; never inherited from outside.
JOB_VARS = ("CS_JOB_ID", "CS_ROLE", "CS_RANK", "CS_IP", "CS_RENDEZVOUS", "CS_TARGET", "CS_NUM_CSX",
            "CS_NUM_WORKERS_PER_CSX", "CS_NUM_WORKERS", "CS_HOST_NAME", "CS_BIND_HOST",
            auth.KEYS_ENV, RESTART_ENV, "CS_SHM_DIR", "CS_TRACE")
SHM_DIR = "/dev/shm"   # memory-backed on Linux


def add_flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """--name_with_underscores and --name-with-dashes are the same flag."""
    spellings = dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"])
    parser.add_argument(*spellings, dest=name, **kwargs)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="csrun_wse", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    add_flag(parser, "num_csx", type=int, default=1, help="WSE emulators (default 1)")
    add_flag(parser, "num_workers_per_csx", type=int, default=None,
             help="input workers per WSE, on this machine (default 1); over SSH or Slurm every task "
                  "after the chief is an input worker")
    add_flag(parser, "cs_ip", default=None, help="HOST:PORT of a running CS system (default: start one)")
    add_flag(parser, "hostfile", default=None, help="run the tasks over SSH on these hosts ('HOST [slots=N]' a line)")
    parser.add_argument("-H", "--hosts", default=None, help="run the tasks over SSH on h1,h2,... (one slot each)")
    add_flag(parser, "ssh_options", default=remote.DEFAULT_SSH_OPTIONS,
             help=f"options for ssh, e.g. --ssh_options='-p 2222' (default {remote.DEFAULT_SSH_OPTIONS!r})")
    add_flag(parser, "total_nodes", type=int, default=None, help="nodes (Slurm: srun -N; SSH: the first N hosts)")
    add_flag(parser, "tasks_per_node", type=int, default=None,
             help="tasks per node (Slurm: default from the allocation, else 2; SSH: default the slots)")
    add_flag(parser, "cpus_per_task", type=int, default=None, help="CPUs per task (Slurm; default 1)")
    add_flag(parser, "launcher", choices=("auto", "local", "ssh", "slurm"), default="auto",
             help="auto (default): ssh with --hostfile/-H; slurm inside an allocation or with "
                  "--total-nodes/--tasks-per-node/--cpus-per-task; else local")
    add_flag(parser, "max_restarts", type=int, default=0,
             help="restart a failed job from its latest checkpoint up to K times (default 0)")
    add_flag(parser, "port", type=int, default=0,
             help="port of the job's directory, the address every process registers at (default: any free port)")
    add_flag(parser, "insecure", action="store_true",
             help="no CURVE authentication or encryption (debugging; loopback only)")
    add_flag(parser, "no_shm", action="store_true",
             help="stream weights over tcp even between local processes (default: shared memory)")
    add_flag(parser, "job_label", action="append", default=[], metavar="KEY=VALUE",
             help="with --cs_ip: a label of the job, shown by csctl get jobs (repeatable)")
    add_flag(parser, "trace", action="store_true",
             help="record a timeline of every process; the chief writes model_dir/trace.json (Perfetto)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="python run.py ARGS...")
    ns = parser.parse_args(argv)
    if not ns.command:
        parser.error("no command given (e.g. python examples/fc_mnist/run.py --mode train --params ...)")
    if ns.command[0].startswith("-"):
        parser.error(f"unrecognized argument: {ns.command[0]}")
    for flag in ("num_csx", "num_workers_per_csx", "total_nodes", "tasks_per_node", "cpus_per_task"):
        if getattr(ns, flag) is not None and getattr(ns, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if ns.max_restarts < 0:
        parser.error("--max_restarts must be 0 or more")
    ns.job_labels = dict(pair.partition("=")[::2] for pair in ns.job_label)
    if any("=" not in pair for pair in ns.job_label):
        parser.error("--job_label takes KEY=VALUE")
    try:
        check_labels(ns.job_labels)
    except ValueError as exc:
        parser.error(f"--job_label: {exc}")
    if ns.job_labels and not ns.cs_ip:
        parser.error("--job_label is for jobs on a CS system (--cs_ip)")
    ns.launcher = choose_launcher(ns, parser)
    return ns


def choose_launcher(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    if ns.hostfile and ns.hosts:
        parser.error("give --hostfile or -H, not both")
    slurm_flags = any(v is not None for v in (ns.total_nodes, ns.tasks_per_node, ns.cpus_per_task))
    launcher = ns.launcher
    if launcher == "auto":
        if ns.hostfile or ns.hosts:
            launcher = "ssh"
        elif remote.in_allocation() or slurm_flags:
            launcher = "slurm"
        else:
            launcher = "local"
    if launcher == "ssh" and not (ns.hostfile or ns.hosts):
        parser.error("--launcher ssh needs --hostfile or -H")
    if launcher != "local" and ns.num_workers_per_csx is not None:
        parser.error(f"--num_workers_per_csx is for local runs; with {launcher} every task after the chief "
                     "is an input worker (set the tasks with --tasks-per-node or slots=N)")
    if launcher == "ssh" and ns.cpus_per_task is not None:
        parser.error("--cpus-per-task is for Slurm; over SSH give each host the slots it can run")
    if launcher == "local" and slurm_flags:
        parser.error("--total-nodes, --tasks-per-node and --cpus-per-task need SSH hosts or Slurm")
    return launcher


@dataclass
class Layout:
    """Where the job's tasks run and which address its sockets bind."""
    launcher: str
    num_workers: int
    bind: str = "127.0.0.1"
    placement: list[str] | None = None          # SSH: the host of each task
    shape: remote.SlurmShape | None = None      # Slurm: nodes x tasks x cpus


def plan_layout(ns: argparse.Namespace) -> Layout:
    if ns.launcher == "ssh":
        hosts = remote.parse_hostfile(ns.hostfile) if ns.hostfile else remote.parse_host_list(ns.hosts)
        placement = remote.place_tasks(hosts, ns.tasks_per_node, ns.total_nodes)
        return Layout("ssh", len(placement) - 1, remote.bind_address_for(placement), placement=placement)
    if ns.launcher == "slurm":
        shape = remote.slurm_shape(ns.total_nodes, ns.tasks_per_node, ns.cpus_per_task)
        return Layout("slurm", shape.tasks - 1, remote.slurm_bind_address(), shape=shape)
    # One machine: loopback, unless the user exported CS_BIND_HOST (e.g. for a --cs_ip elsewhere).
    return Layout("local", ns.num_csx * (ns.num_workers_per_csx or 1), os.environ.get("CS_BIND_HOST", "127.0.0.1"))


def describe(layout: Layout) -> str:
    if layout.launcher == "ssh":
        return f"over SSH (task hosts: {' '.join(layout.placement)})"
    if layout.launcher == "slurm":
        s = layout.shape
        return f"with srun ({s.nodes} node(s) x {s.tasks_per_node} task(s) x {s.cpus_per_task} cpu(s))"
    return "on this machine"


def base_env(ns: argparse.Namespace, job: str, rendezvous: str, cs_ip: str, layout: Layout) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
    env.update(CS_JOB_ID=job, CS_RENDEZVOUS=rendezvous, CS_IP=cs_ip, CS_TARGET="wse",
               CS_NUM_CSX=str(ns.num_csx), CS_NUM_WORKERS=str(layout.num_workers),
               CS_BIND_HOST=layout.bind, PYTHONUNBUFFERED="1", CS_TRACE="1" if ns.trace else "0")
    keys = auth.job_keys()
    if keys is not None:  # the job's own processes learn where the keys are, nobody else
        env[auth.KEYS_ENV] = str(keys.folder)
    return env


def start_services(group: ProcessGroup, env: dict, num_csx: int, shm_dir: str | None) -> None:
    """MemoryX, SwarmX and the WSEs, on this machine: with shm_dir they share memory for the weight stream."""
    if shm_dir:
        env = {**env, "CS_SHM_DIR": shm_dir}
    wse_threads = max(1, (os.cpu_count() or 1) // num_csx)
    for role, count in (("memoryx", 1), ("swarmx", 1), ("wse", num_csx)):
        role_env = with_threads(env, wse_threads if role == "wse" else 1)
        for rank in range(count):
            group.start(role, rank, [sys.executable, "-m", SERVICE_MODULES[role]],
                        {**role_env, "CS_ROLE": role, "CS_RANK": str(rank)})


def start_local_tasks(group: ProcessGroup, env: dict, command: list[str], num_workers: int) -> None:
    group.start("chief", 0, role_argv(command, "chief"), {**env, "CS_ROLE": "chief", "CS_RANK": "0"})
    for rank in range(num_workers):
        group.start("worker", rank, role_argv(command, "worker"),
                    {**env, "CS_ROLE": "worker", "CS_RANK": str(rank)})


def start_tasks(group: ProcessGroup, directory: DirectoryServer, layout: Layout, env: dict,
                ns: argparse.Namespace, job: str) -> None:
    env = with_threads(env, 1)    # the chief drives, the workers feed: neither multiplies matrices
    if layout.launcher == "ssh":
        remote.start_ssh_tasks(group, directory, layout.placement, env, ns.command, ns.ssh_options)
    elif layout.launcher == "slurm":
        remote.start_srun_tasks(group, directory, layout.shape, env, ns.command, job)
    else:
        start_local_tasks(group, env, ns.command, layout.num_workers)


def preflight(ns: argparse.Namespace, layout: Layout) -> FrontDoor | None:
    """Fail in seconds, with one line, on what would otherwise fail late or unsafely.

    With --cs_ip: the connection to the CS system's front door."""
    if ns.insecure:
        outside = [h for h in [layout.bind] if not auth.is_loopback(h)]
        if outside:
            raise SystemExit(f"csrun_wse: --insecure is for loopback only, not {outside[0]}")
        print("csrun_wse: WARNING: --insecure: CURVE authentication and encryption are OFF; "
              "any local process can connect to this job's sockets and read or inject its traffic",
              file=sys.stderr, flush=True)
    if layout.launcher == "ssh":
        remote.preflight(layout.placement, ns.ssh_options)
    elif layout.launcher == "slurm":
        remote.require_srun()  # before the services start, not after
    if not ns.cs_ip:
        return None
    try:
        return FrontDoor.open(ns.cs_ip, ns.insecure, what="--cs_ip")
    except FrontDoorError as exc:
        raise SystemExit(f"csrun_wse: {exc}") from None


@dataclass
class Job:
    """A started job: its directory, its processes and what they hold; `close()` releases it all."""
    id: str
    ctx: zmq.Context
    directory: DirectoryServer
    group: ProcessGroup
    supervisor: Supervisor
    env: dict[str, str]
    shm_dir: str | None

    def close(self) -> None:
        self.group.stop_all()
        if self.shm_dir:  # whatever the services left, even when killed
            remove_job_segments(Path(self.shm_dir), self.id)
        auth.stop_authenticator(self.ctx)
        self.ctx.destroy(linger=0)


def start_job(ns: argparse.Namespace, layout: Layout, attempt: int, tasks: bool = True,
              handle_signals: bool = True, job: str | None = None, cs_ip: str | None = None) -> Job:
    """The job's directory and, with cs_ip None, its CS system here (MemoryX, SwarmX, WSEs);
    else `cs_ip` is the directory the shared CS system made for `job`. With `tasks`
    also the chief and the input workers of ns.command. The caller supervises
    (`job.supervisor.run()`) and always calls `job.close()`."""
    job = job or f"wsjob-{uuid.uuid4().hex[:12]}"
    ctx = zmq.Context()
    expected = {"chief": 1, "worker": layout.num_workers}
    if cs_ip is None:
        expected.update(memoryx=1, swarmx=1, wse=ns.num_csx)
    try:
        directory = DirectoryServer(ctx, job, expected, host=layout.bind, port=ns.port)
    except PortInUse as exc:
        auth.stop_authenticator(ctx)
        ctx.destroy(linger=0)
        raise SystemExit(f"csrun_wse: --port: {exc}") from None
    env = {**base_env(ns, job, directory.address, cs_ip or directory.address, layout), RESTART_ENV: str(attempt)}
    group = ProcessGroup()
    logging.getLogger("csrun_wse").info("job %s: %d WSE(s), %d input worker(s), tasks %s", job, ns.num_csx,
                                        layout.num_workers, describe(layout))
    supervisor = Supervisor(directory, group, finisher_role="chief", handle_signals=handle_signals)
    shm_dir = None if cs_ip or ns.no_shm or not os.path.isdir(SHM_DIR) else SHM_DIR
    started = Job(job, ctx, directory, group, supervisor, env, shm_dir)
    if shm_dir:
        remove_orphaned_segments(Path(shm_dir))
    try:
        if cs_ip is None:
            start_services(group, env, ns.num_csx, shm_dir)
        if tasks:
            start_tasks(group, directory, layout, env, ns, job)
    except BaseException:
        directory.close()
        started.close()
        raise
    return started


def run_job(ns: argparse.Namespace, layout: Layout, attempt: int, door: FrontDoor | None = None) -> Outcome:
    """One whole job, on a CS system of its own (door None) or on the shared one behind `door`."""
    if door is not None:
        return run_on_cs_system(ns, layout, attempt, door)
    return supervise_job(ns, layout, attempt)[0]


def supervise_job(ns: argparse.Namespace, layout: Layout, attempt: int, job: str | None = None,
                  cs_ip: str | None = None, extra_check=None) -> tuple[Outcome, Supervisor]:
    """start_job, supervised until the job ends, then closed."""
    started = start_job(ns, layout, attempt, job=job, cs_ip=cs_ip)
    try:
        code = started.supervisor.run(extra_check)
    finally:
        started.close()
    failure = started.supervisor.failure
    return Outcome(code, failure is None or failure.retryable), started.supervisor


def say(line: str) -> None:
    print(f"csrun_wse: {line}", file=sys.stderr, flush=True)


def submit(ns: argparse.Namespace, door: FrontDoor) -> SubmittedJob:
    try:
        job = SubmittedJob(door, ns.num_csx, ns.job_labels, auth.job_keys())
    except FrontDoorError as exc:
        raise SystemExit(f"csrun_wse: {exc}") from None
    say(f"submitted {job.name} to the CS system at {ns.cs_ip} (csctl --cs_ip {ns.cs_ip} get jobs)")
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


def run_on_cs_system(ns: argparse.Namespace, layout: Layout, attempt: int, door: FrontDoor) -> Outcome:
    """Submit to the shared CS system, wait for the job's turn, then run its chief and input workers
    against the directory the CS system made for it, until the job ends or the CS system ends it."""
    job = submit(ns, door)
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
    outcome, supervisor = supervise_job(ns, layout, attempt, state["job"], state["cs_ip"], follower(job))
    failure = supervisor.failure
    if failure is None:
        job.done("SUCCEEDED")
    else:
        job.done("CANCELLED" if str(failure).startswith("interrupted") else "FAILED", str(failure))
    return outcome


@contextmanager
def job_keys(ns: argparse.Namespace):
    """CURVE keys for one job, in a private folder that goes when the job does
    (CS_KEYS_DIR of this process while it runs; with --cs_ip they travel,
    encrypted, to the CS system's services for this job)."""
    outside = os.environ.pop(auth.KEYS_ENV, None)
    keys_dir = None if ns.insecure else auth.create_job_dir()
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


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging("csrun_wse")
    layout = plan_layout(ns)
    with job_keys(ns):
        door = preflight(ns, layout)
        try:
            code = run_with_restarts(lambda attempt: run_job(ns, layout, attempt, door), ns.max_restarts)
        finally:
            if door is not None:
                door.close()
    sys.exit(code)


if __name__ == "__main__":
    main()
