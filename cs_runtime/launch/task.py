"""A job's tasks on one host: `python -m cs_runtime.launch.task` (started by csrun_wse).

    ssh HOST 'cd DIR && python -m cs_runtime.launch.task --ssh'      # the host's tasks: one JSON line on stdin
    srun ... python -m cs_runtime.launch.task --slurm -- python run.py ARGS...
    srun ... python -m cs_runtime.launch.task --slurm-services      # MemoryX, SwarmX, the WSEs in an allocation
    ssh HOST 'cd DIR && python -m cs_runtime.launch.task --check'    # the launcher's pre-flight
    srun --ntasks-per-node=1 ... python -m cs_runtime.launch.task --check-slurm DIR   # and in an allocation

The job's CURVE keys come with the task, never by a path into the launcher's
file system: in the JSON description over ssh ("keys"), in CS_JOB_KEYS under
srun. The wrapper writes them into a private folder of this host (0700, files
0600), gives the task that folder (CS_KEYS_DIR), and removes it at the end.
`--check` reads {"keys": ...} the same way, writes and reads them back, and
prints "ok": so a host that could not start a task fails the pre-flight instead.
`--check-slurm` does the same on each node of an allocation, with the keys in
CS_JOB_KEYS as the tasks will get them, and checks srun could enter DIR.

Over SSH one wrapper (one ssh connection) starts every task of its host, so
sshd's MaxStartups and MaxSessions never see more than one connection per host
per job; under srun each task has its own. The wrapper gives each task its
identity (role, rank, and the address to bind: the one this host uses to reach
the launcher, so peers on other hosts can connect; loopback only when the
launcher is on this host), starts it as a child in its own session, and stops
its tasks when the job goes away: over SSH when stdin closes (the ssh client
ended: job over, launcher killed, connection lost), and on SIGTERM / SIGHUP /
SIGINT (how srun ends a step). It reports each exit code to the job's
directory (EXITED) as it happens: the launcher sees only the carrier (ssh,
srun), not each task.

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
import time
from pathlib import Path

from cs_runtime import env as cs_env
from cs_runtime.roles import ROLES, SERVICE_ROLES, module_of, service_of_index

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


def service_argv(role: str, base: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """A service's command, and its environment: a WSE gets the node's cores divided between the WSEs."""
    from cs_runtime.launch.launcher import numerics_env
    threads = ROLES[role].threads(int(base.get("CS_NUM_CSX", "1")))
    return [sys.executable, "-m", module_of(role)], numerics_env(base, threads)


def task_env(base: dict[str, str], role: str, rank: int, host: str) -> dict[str, str]:
    from cs_runtime.wire.transport import host_of, source_address_towards
    env = {k: v for k, v in base.items() if k not in LOCAL_VARS}
    env.update(CS_ROLE=role, CS_RANK=str(rank), CS_HOST_NAME=host,
               CS_BIND_HOST=source_address_towards(host_of(env["CS_RENDEZVOUS"])))
    return env


def read_stdin_json() -> object:
    line = b""
    while not line.endswith(b"\n"):  # byte by byte: nothing after the line may be buffered away
        byte = os.read(0, 1)
        if not byte or len(line) > 1 << 20:
            break
        line += byte
    try:
        return json.loads(line)
    except ValueError:
        raise SystemExit("cs_runtime.launch.task: stdin did not start with a JSON task description") from None


def read_ssh_spec() -> dict:
    """The host's tasks csrun_wse sent, checked before use:
    {"host", "env", "keys", "tasks": [{"role", "rank", "argv"}, ...]}."""
    spec = read_stdin_json()
    types = {"host": str, "env": dict, "tasks": list}
    if not isinstance(spec, dict) or any(not isinstance(spec.get(k), t) for k, t in types.items()):
        raise SystemExit(f"cs_runtime.launch.task: task description needs {', '.join(types)}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in spec["env"].items()):
        raise SystemExit("cs_runtime.launch.task: env must map strings to strings")
    task_types = {"role": str, "rank": int, "argv": list}
    for task in spec["tasks"]:
        if not isinstance(task, dict) or any(not isinstance(task.get(k), t) for k, t in task_types.items()) \
                or not task["argv"] or not all(isinstance(a, str) for a in task["argv"]):
            raise SystemExit("cs_runtime.launch.task: each task needs role, rank and argv (strings)")
    if not spec["tasks"]:
        raise SystemExit("cs_runtime.launch.task: no tasks in the description")
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


def run_tasks(tasks: list[tuple[str, int, list[str]]], base: dict[str, str], host: str,
              stop: threading.Event) -> list[int]:
    """Start every task, report each exit as it happens, stop the rest when `stop` is set; the codes."""
    from cs_runtime.launch.launcher import spawn
    from cs_runtime.process.orphan import SERVICE_DEATH_SIGNAL
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    reporter = ExitReporter(base)
    live = [(role, rank, spawn(argv, task_env(base, role, rank, host), stdin=subprocess.DEVNULL,
                               death_signal=SERVICE_DEATH_SIGNAL if role in SERVICE_ROLES else signal.SIGKILL))
            for role, rank, argv in tasks]
    codes = []
    try:
        while live:
            if stop.wait(0.2):
                stop_children([child for _, _, child in live])
            ended = [(role, rank, child) for role, rank, child in live if child.poll() is not None]
            if ended:
                reporter.report(host, [(role, rank, child.pid, child.returncode) for role, rank, child in ended],
                                timeout_ms=1000 if stop.is_set() else 2000)
                codes += [child.returncode for _, _, child in ended]
                live = [task for task in live if task[2].returncode is None]
    finally:
        reporter.close()
    return codes


def stop_children(children: list[subprocess.Popen]) -> None:
    for child in children:
        _killpg(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _killpg(child.pid, signal.SIGKILL)
            child.wait()


class ExitReporter:
    """Tells the job's directory how each task ended (through ssh or srun the launcher cannot see it)."""

    def __init__(self, env: dict[str, str]):
        import zmq
        from cs_runtime.wire.auth import KEYS_ENV
        from cs_runtime.wire.transport import Endpoint
        if KEYS_ENV in env:  # the job's keys are the ones this wrapper wrote
            os.environ[KEYS_ENV] = env[KEYS_ENV]
        self.ctx = zmq.Context()
        self.endpoint = Endpoint(self.ctx, zmq.DEALER, "task-wrapper", env["CS_JOB_ID"]).connect(env["CS_RENDEZVOUS"])

    def report(self, host: str, exits: list[tuple[str, int, int, int]], timeout_ms: int) -> None:
        from cs_runtime.wire.protocol import Message, Msg
        for role, rank, pid, code in exits:
            self.endpoint.send(Message(Msg.EXITED, meta={"role": role, "rank": rank, "host": host, "pid": pid,
                                                         "code": code}))
        # Each is answered: wait for that (LINGER 0 would drop what is not yet sent), not past the deadline.
        deadline, answers = time.monotonic() + timeout_ms / 1000, 0
        while answers < len(exits):
            got = self.endpoint.recv(max(0, int((deadline - time.monotonic()) * 1000)))
            if got is None:
                return
            answers += got[1].type == Msg.STATUS

    def close(self) -> None:
        self.endpoint.close()
        self.ctx.destroy(linger=0)


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class KeysNotKept(Exception):
    """This host cannot write the job's keys into a private folder, or read them back."""


def keep_keys(keys: object | None) -> str | None:
    """The job's keys, sent as text, in a private folder of this host; its path (None: no keys)."""
    if keys is None:
        return None
    from cs_runtime.wire import auth
    try:
        folder = auth.write_job_dir(auth.keys_from_text(keys))
        auth.load_keys(str(folder))  # what every process of the task will do first
    except (auth.AuthError, OSError) as exc:
        raise KeysNotKept(f"cannot keep the job's keys on this host: {exc}") from None
    return str(folder)


def write_keys(keys: object | None, host: str = "") -> str | None:
    """keep_keys, or exit with the one line that says why not (naming `host`)."""
    try:
        return keep_keys(keys)
    except KeysNotKept as exc:
        raise SystemExit(f"cs_runtime.launch.task{f' on {host}' if host else ''}: {exc}") from None


def task_keys(env: dict[str, str], sent: object | None, host: str = "") -> str | None:
    """Write the keys the task came with; the task's environment then names that folder."""
    from cs_runtime.wire.auth import KEYS_ENV, KEYS_TEXT_ENV
    text = env.pop(KEYS_TEXT_ENV, None)
    if sent is None and text is not None:
        try:
            sent = json.loads(text)
        except ValueError:
            raise SystemExit(f"cs_runtime.launch.task: {KEYS_TEXT_ENV} is not JSON") from None
    env.pop(KEYS_ENV, None)  # a folder on the launcher's host means nothing here
    folder = write_keys(sent, host)
    if folder is not None:
        env[KEYS_ENV] = folder
    return folder


def check_host() -> None:
    """The pre-flight: this host can start a task (python, the code, the working folder) and keep the keys."""
    sent = read_stdin_json()
    folder = write_keys(sent.get("keys") if isinstance(sent, dict) else None)
    if folder is not None:
        from cs_runtime.wire.auth import remove_job_dir
        remove_job_dir(Path(folder))
    print("ok", flush=True)


def check_slurm_node(workdir: str) -> None:
    """The Slurm pre-flight, one task per node: srun put it in the job's working folder, and
    the keys in its environment (as the tasks will get them) parse and can be kept here.
    One line on stdout, `NODE: ok` or `NODE: why not`; exit 1 on a problem."""
    from cs_runtime.wire.auth import KEYS_TEXT_ENV, remove_job_dir
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        if os.path.realpath(os.getcwd()) != os.path.realpath(workdir):   # srun goes on in /tmp instead
            raise KeysNotKept(f"cannot work in {workdir} (srun started the step in {os.getcwd()})")
        text = os.environ.get(KEYS_TEXT_ENV)
        try:
            keys = None if text is None else json.loads(text)
        except ValueError:
            raise KeysNotKept(f"the job's keys in {KEYS_TEXT_ENV} are not JSON") from None
        folder = keep_keys(keys)
        if folder is not None:
            remove_job_dir(Path(folder))
    except KeysNotKept as exc:
        print(f"{node}: {exc}", flush=True)
        sys.exit(1)
    print(f"{node}: ok", flush=True)


def exit_status(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal N -> 128 + N, as a shell says


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    stop = threading.Event()
    sent_keys = None
    if argv[:1] == ["--check"]:
        return check_host()
    if argv[:1] == ["--check-slurm"] and len(argv) == 2:
        return check_slurm_node(argv[1])
    if argv[:1] == ["--ssh"]:
        spec = read_ssh_spec()
        host, base, sent_keys = spec["host"], dict(spec["env"]), spec.get("keys")
        tasks = [(t["role"], t["rank"], t["argv"]) for t in spec["tasks"]]
        watch_stdin(stop)
    elif argv[:2] == ["--slurm", "--"] and len(argv) > 2:
        role, rank = role_of_task(int(os.environ["SLURM_PROCID"]))
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        base, tasks = dict(os.environ), [(role, rank, role_argv(argv[2:], role))]
    elif argv == ["--slurm-services"]:
        role, rank = service_of_index(int(os.environ["SLURM_PROCID"]))
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        command, base = service_argv(role, dict(os.environ))
        tasks = [(role, rank, command)]
    else:
        raise SystemExit("usage: python -m cs_runtime.launch.task --ssh | --slurm -- COMMAND... | --slurm-services"
                         " | --check | --check-slurm WORKDIR")
    folder = task_keys(base, sent_keys, host)
    try:
        codes = run_tasks(tasks, base, host, stop)
    finally:
        if folder is not None:
            from cs_runtime.wire.auth import remove_job_dir
            remove_job_dir(Path(folder))
    sys.exit(exit_status(next((c for c in codes if c != 0), 0)))


if __name__ == "__main__":
    main()
