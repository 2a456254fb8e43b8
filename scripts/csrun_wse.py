"""csrun_wse: run a model script on the emulated CS system.

    csrun_wse [--num_csx N] [--num_workers_per_csx W] [--cs_ip HOST:PORT] \\
        python examples/fc_mnist/run.py --mode train --params examples/fc_mnist/configs/params.yaml

Without --cs_ip it starts a local CS system for the job (one MemoryX, one
SwarmX, N WSE emulators). It then starts the user's command as the job's
tasks: task 0 as the chief (`python -m chief run.py ...`), N*W more as input
workers (`python -m worker run.py ...`), and supervises all of them: the job
ends when the chief exits 0; if any process fails or stops answering,
everything is stopped within seconds and one line names what failed; with
--max_restarts K the whole job is then restarted from its latest checkpoint,
up to K times. Traffic is authenticated and encrypted with CURVE keys made for
the job (see cs_runtime/auth.py); --insecure turns that off, on loopback only.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from pathlib import Path

import zmq

from cs_runtime import auth
from cs_runtime.cluster import DirectoryServer
from cs_runtime.launcher import ProcessGroup, Supervisor
from cs_runtime.preflight import PreflightError, check_reachable
from cs_runtime.restart import RESTART_ENV, Outcome, run_with_restarts
from cs_runtime.shm import remove_job_segments
from cs_runtime.service import setup_logging
from cs_runtime.transport import PortInUse, bind_host

# Variables that describe a process's place in a job; never inherited from outside.
JOB_VARS = ("CS_JOB_ID", "CS_ROLE", "CS_RANK", "CS_IP", "CS_RENDEZVOUS", "CS_TARGET",
            "CS_NUM_CSX", "CS_NUM_WORKERS_PER_CSX", auth.KEYS_ENV, RESTART_ENV, "CS_SHM_DIR")
SHM_DIR = "/dev/shm"   # memory-backed on Linux
SERVICE_MODULES = {"memoryx": "cs_runtime.memoryx", "swarmx": "cs_runtime.swarmx", "wse": "wse"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="csrun_wse", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--num_csx", type=int, default=1, help="WSE emulators (default 1)")
    parser.add_argument("--num_workers_per_csx", type=int, default=1, help="input workers per WSE (default 1)")
    parser.add_argument("--cs_ip", default=None, help="HOST:PORT of a running CS system (default: start one)")
    parser.add_argument("--no_shm", action="store_true",
                        help="stream weights over tcp even between local processes (default: shared memory)")
    parser.add_argument("--max_restarts", type=int, default=0,
                        help="restart a failed job from its latest checkpoint up to K times (default 0)")
    parser.add_argument("--port", type=int, default=0,
                        help="port of the job's directory, the address every process registers at "
                             "(default: any free port)")
    parser.add_argument("--insecure", action="store_true",
                        help="no CURVE authentication or encryption (debugging; loopback only)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="python run.py ARGS...")
    ns = parser.parse_args(argv)
    if not ns.command:
        parser.error("no command given (e.g. python examples/fc_mnist/run.py --mode train --params ...)")
    if ns.command[0].startswith("-"):
        parser.error(f"unrecognized argument: {ns.command[0]}")
    if ns.num_csx < 1 or ns.num_workers_per_csx < 1:
        parser.error("--num_csx and --num_workers_per_csx must be at least 1")
    if ns.max_restarts < 0:
        parser.error("--max_restarts must be 0 or more")
    return ns


def role_argv(command: list[str], role: str) -> list[str]:
    """`python [opts] run.py args` -> `python [opts] -m <role> run.py args`."""
    if os.path.basename(command[0]).startswith("python"):
        script_at = next((i for i, a in enumerate(command[1:], 1) if not a.startswith("-")), None)
        if script_at is None:
            raise SystemExit(f"csrun_wse: no script in {' '.join(command)}")
        return [*command[:script_at], "-m", role, *command[script_at:]]
    return [sys.executable, "-m", role, *command]  # an executable script with a shebang


def base_env(ns: argparse.Namespace, job: str, rendezvous: str, cs_ip: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
    env.update(CS_JOB_ID=job, CS_RENDEZVOUS=rendezvous, CS_IP=cs_ip, CS_TARGET="wse",
               CS_NUM_CSX=str(ns.num_csx), CS_NUM_WORKERS_PER_CSX=str(ns.num_workers_per_csx),
               PYTHONUNBUFFERED="1")
    keys = auth.job_keys()
    if keys is not None:  # the job's own processes learn where the keys are, nobody else
        env[auth.KEYS_ENV] = str(keys.folder)
    return env


# BLAS/OpenMP thread variables: the WSEs split the host's cores between them;
# every other process does no heavy linear algebra and gets one thread, so
# idle BLAS threads never spin on a core a WSE is computing on.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def with_threads(env: dict, threads: int) -> dict:
    """env with the BLAS thread count set, unless the user set it for the job."""
    return {**env, **{k: str(threads) for k in THREAD_VARS if k not in os.environ}}


def start_services(group: ProcessGroup, env: dict, num_csx: int, shm_dir: str | None) -> None:
    """MemoryX, SwarmX and the WSEs on this host: with shm_dir they share memory for the weight stream."""
    if shm_dir:
        env = {**env, "CS_SHM_DIR": shm_dir}
    wse_threads = max(1, (os.cpu_count() or 1) // num_csx)
    for role, count in (("memoryx", 1), ("swarmx", 1), ("wse", num_csx)):
        role_env = with_threads(env, wse_threads if role == "wse" else 1)
        for rank in range(count):
            group.start(role, rank, [sys.executable, "-m", SERVICE_MODULES[role]],
                        {**role_env, "CS_ROLE": role, "CS_RANK": str(rank)})


def start_tasks(group: ProcessGroup, env: dict, command: list[str], num_workers: int) -> None:
    env = with_threads(env, 1)    # the chief drives, the workers feed: neither multiplies matrices
    group.start("chief", 0, role_argv(command, "chief"), {**env, "CS_ROLE": "chief", "CS_RANK": "0"})
    for rank in range(num_workers):
        group.start("worker", rank, role_argv(command, "worker"),
                    {**env, "CS_ROLE": "worker", "CS_RANK": str(rank)})


def split_cs_ip(cs_ip: str) -> tuple[str, int]:
    host, sep, port = cs_ip.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise SystemExit(f"csrun_wse: --cs_ip {cs_ip!r} is not HOST:PORT")
    return host, int(port)


def cs_address(cs_ip: str) -> str:
    host, port = split_cs_ip(cs_ip)
    return f"tcp://{host}:{port}"


def preflight(ns: argparse.Namespace) -> None:
    """Fail in seconds, with one line, on what would otherwise fail late or unsafely."""
    if ns.insecure:
        hosts = [bind_host()] + ([split_cs_ip(ns.cs_ip)[0]] if ns.cs_ip else [])
        remote = [h for h in hosts if not auth.is_loopback(h)]
        if remote:
            raise SystemExit(f"csrun_wse: --insecure is for loopback only, not {remote[0]}")
        print("csrun_wse: WARNING: --insecure: CURVE authentication and encryption are OFF; "
              "any local process can connect to this job's sockets and read or inject its traffic",
              file=sys.stderr, flush=True)
    if ns.cs_ip:
        try:
            check_reachable(*split_cs_ip(ns.cs_ip), "--cs_ip")
        except PreflightError as exc:
            raise SystemExit(f"csrun_wse: {exc}") from None


def run_job(ns: argparse.Namespace, attempt: int) -> Outcome:
    """One whole job: its directory, its processes, supervised until it ends."""
    job = f"wsjob-{uuid.uuid4().hex[:12]}"
    num_workers = ns.num_csx * ns.num_workers_per_csx
    ctx = zmq.Context()
    expected = {"chief": 1, "worker": num_workers}
    if ns.cs_ip is None:
        expected.update(memoryx=1, swarmx=1, wse=ns.num_csx)
    try:
        directory = DirectoryServer(ctx, job, expected, port=ns.port)
    except PortInUse as exc:
        auth.stop_authenticator(ctx)
        ctx.destroy(linger=0)
        raise SystemExit(f"csrun_wse: --port: {exc}") from None
    cs_ip = directory.address if ns.cs_ip is None else cs_address(ns.cs_ip)
    env = {**base_env(ns, job, directory.address, cs_ip), RESTART_ENV: str(attempt)}
    group = ProcessGroup()
    logging.getLogger("csrun_wse").info("job %s: %d WSE(s), %d input worker(s)", job, ns.num_csx, num_workers)
    supervisor = Supervisor(directory, group, finisher_role="chief")
    shm_dir = None if ns.no_shm or not os.path.isdir(SHM_DIR) else SHM_DIR
    try:
        if ns.cs_ip is None:
            start_services(group, env, ns.num_csx, shm_dir)
        start_tasks(group, env, ns.command, num_workers)
        code = supervisor.run()
    finally:
        group.stop_all()
        if shm_dir:  # whatever the services left, even when killed
            remove_job_segments(Path(shm_dir), job)
        auth.stop_authenticator(ctx)
        ctx.destroy(linger=0)
    return Outcome(code, supervisor.failure is None or supervisor.failure.retryable)


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging("csrun_wse")
    # Keys for one job, in a private folder that goes when the job does. With
    # --cs_ip a long-lived CS system's folder may be given in CS_KEYS_DIR.
    outside = os.environ.pop(auth.KEYS_ENV, None)
    keys_dir = None if ns.insecure or (ns.cs_ip and outside) else auth.create_job_dir()
    if not ns.insecure:
        os.environ[auth.KEYS_ENV] = str(keys_dir or outside)  # read by auth.job_keys() and base_env
    try:
        preflight(ns)
        code = run_with_restarts(lambda attempt: run_job(ns, attempt), ns.max_restarts)
    finally:
        os.environ.pop(auth.KEYS_ENV, None)
        if outside is not None:
            os.environ[auth.KEYS_ENV] = outside
        if keys_dir is not None:
            auth.remove_job_dir(keys_dir)
    sys.exit(code)


if __name__ == "__main__":
    main()
