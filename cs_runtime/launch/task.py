"""One task of a job on its host: `python -m cs_runtime.launch.task` (started by csrun_wse).

    ssh HOST 'cd DIR && python -m cs_runtime.launch.task --ssh'      # the task arrives as one JSON line on stdin
    srun ... python -m cs_runtime.launch.task --slurm -- python run.py ARGS...

The wrapper gives the task its identity (role, rank, and the address to bind:
the one this host uses to reach the launcher, so peers on other hosts can
connect; loopback only when the launcher is on this host), starts it as a
child in its own session, and stops that child when the job goes away:
over SSH when stdin closes (the ssh client ended: job over, launcher killed,
connection lost), and on SIGTERM / SIGHUP / SIGINT (how srun ends a step).
It then reports the exit code to the job's directory (EXITED): through srun
or ssh the launcher sees only one carrier process, not each task.

Task 0 is the chief, task i > 0 input worker i - 1 (under srun: SLURM_PROCID).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

from cs_runtime import env as cs_env

STOP_GRACE_S = 3.0
# Per-process identity: never passed from the launcher's environment.
LOCAL_VARS = cs_env.PROCESS_VARS


def role_argv(command: list[str], role: str) -> list[str]:
    """`python [opts] run.py args` -> `python [opts] -m <role> run.py args`."""
    if os.path.basename(command[0]).startswith("python"):
        script_at = next((i for i, a in enumerate(command[1:], 1) if not a.startswith("-")), None)
        if script_at is None:
            raise SystemExit(f"csrun_wse: no script in {' '.join(command)}")
        return [*command[:script_at], "-m", role, *command[script_at:]]
    return [sys.executable, "-m", role, *command]  # an executable script with a shebang


def role_of_task(task: int) -> tuple[str, int]:
    return ("chief", 0) if task == 0 else ("worker", task - 1)


def task_env(base: dict[str, str], role: str, rank: int, host: str) -> dict[str, str]:
    from cs_runtime.wire.transport import host_of, source_address_towards
    env = {k: v for k, v in base.items() if k not in LOCAL_VARS}
    env.update(CS_ROLE=role, CS_RANK=str(rank), CS_HOST_NAME=host,
               CS_BIND_HOST=source_address_towards(host_of(env["CS_RENDEZVOUS"])))
    return env


def read_ssh_spec() -> dict:
    """The task csrun_wse sent: {"role", "rank", "host", "env", "argv"}, checked before use."""
    line = b""
    while not line.endswith(b"\n"):  # byte by byte: nothing after the line may be buffered away
        byte = os.read(0, 1)
        if not byte or len(line) > 1 << 20:
            break
        line += byte
    try:
        spec = json.loads(line)
    except ValueError:
        raise SystemExit("cs_runtime.launch.task: stdin did not start with a JSON task description") from None
    types = {"role": str, "rank": int, "host": str, "env": dict, "argv": list}
    if not isinstance(spec, dict) or any(not isinstance(spec.get(k), t) for k, t in types.items()):
        raise SystemExit(f"cs_runtime.launch.task: task description needs {', '.join(types)}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in spec["env"].items()) \
            or not spec["argv"] or not all(isinstance(a, str) for a in spec["argv"]):
        raise SystemExit("cs_runtime.launch.task: env and argv must be strings")
    return spec


def watch_stdin(stop: threading.Event) -> None:
    """EOF on stdin means the ssh client is gone: stop the task."""
    def read_to_eof():
        # os.read, not sys.stdin: a daemon thread holding the buffered reader's
        # lock makes interpreter shutdown abort.
        while os.read(0, 4096):
            pass
        stop.set()
    threading.Thread(target=read_to_eof, name="stdin-eof", daemon=True).start()


def run_child(argv: list[str], env: dict[str, str], stop: threading.Event) -> tuple[int, int]:
    """(pid, exit code) of the task, stopped early if `stop` is set."""
    from cs_runtime.launch.launcher import spawn
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    child = spawn(argv, env, stdin=subprocess.DEVNULL)
    while child.poll() is None:
        if stop.wait(0.2):
            return child.pid, stop_child(child)
    return child.pid, child.returncode


def stop_child(child: subprocess.Popen) -> int:
    _killpg(child.pid, signal.SIGTERM)
    try:
        return child.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        _killpg(child.pid, signal.SIGKILL)
        return child.wait()


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def report_exit(env: dict[str, str], role: str, rank: int, host: str, pid: int, code: int) -> None:
    import zmq
    from cs_runtime.wire.auth import KEYS_ENV
    from cs_runtime.launch.directory import DirectoryClient
    if KEYS_ENV in env:  # over ssh the job's keys came with the task's environment, not ours
        os.environ[KEYS_ENV] = env[KEYS_ENV]
    ctx = zmq.Context()
    try:
        client = DirectoryClient(ctx, env["CS_RENDEZVOUS"], role, rank, env["CS_JOB_ID"])
        client.report_exit(host, pid, code)
    finally:
        ctx.destroy(linger=0)


def exit_status(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal N -> 128 + N, as a shell says


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    stop = threading.Event()
    if argv[:1] == ["--ssh"]:
        spec = read_ssh_spec()
        role, rank, host, base, command = spec["role"], spec["rank"], spec["host"], spec["env"], spec["argv"]
        watch_stdin(stop)
    elif argv[:2] == ["--slurm", "--"] and len(argv) > 2:
        role, rank = role_of_task(int(os.environ["SLURM_PROCID"]))
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        base, command = dict(os.environ), role_argv(argv[2:], role)
    else:
        raise SystemExit("usage: python -m cs_runtime.launch.task --ssh | --slurm -- COMMAND...")
    env = task_env(base, role, rank, host)
    pid, code = run_child(command, env, stop)
    report_exit(env, role, rank, host, pid, code)
    sys.exit(exit_status(code))


if __name__ == "__main__":
    main()
