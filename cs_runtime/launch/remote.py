"""Launch back-ends beyond this machine: tasks over SSH, and under Slurm with srun.

A job's tasks are the user's command started N times: task 0 is the chief,
tasks 1..N-1 the input workers. Each runs inside `python -m cs_runtime.launch.task`
(see cs_runtime/launch/task.py) on its host, which gives it its role, rank and bind
address and stops it when the job ends. Here, on the launcher's side:

- SSH: a hostfile (`host [slots=N]` per line) or `-H h1,h2` says where; a
  pre-flight `ssh HOST true` to every host fails the job at once naming any
  host that does not answer; each task is one `ssh HOST ...` process whose
  stdin carries the task (command, environment as JSON) and whose closing
  stops it on the far side.
- Slurm: one `srun --kill-on-bad-exit=1` step runs every task; the wrappers
  report each task's exit code to the job's directory.

Either way the launcher's directory and the services it starts bind the
address this machine uses to reach the hosts, never loopback across hosts.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from cs_runtime.launch.directory import DirectoryServer
from cs_runtime.launch.launcher import ProcessGroup, Task, _signal_group, spawn
from cs_runtime.launch.task import role_argv, role_of_task
from cs_runtime.wire.transport import source_address_towards

DEFAULT_SSH_OPTIONS = "-o BatchMode=yes -o ConnectTimeout=10"
SSH_CHECK_TIMEOUT_S = 20.0
# Not passed to remote hosts: they describe the launcher's own terminal and login.
HOST_LOCAL_VARS = {"PWD", "OLDPWD", "SHLVL", "_", "HOSTNAME", "DISPLAY", "XAUTHORITY", "TERM", "COLUMNS",
                   "LINES", "SSH_AUTH_SOCK", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "SSH_AGENT_PID"}


class LaunchError(SystemExit):
    """A one-line user-facing error of the launcher (bad hostfile, host down, ...)."""

    def __init__(self, message: str):
        super().__init__(f"csrun_wse: {message}")


# ---------------------------------------------------------------- hosts
@dataclass
class Host:
    name: str
    slots: int = 1


def parse_hostfile(path: str) -> list[Host]:
    """`host [slots=N]` per line; `#` starts a comment; a host listed twice adds its slots."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as exc:
        raise LaunchError(f"hostfile {path}: {exc.strerror}") from None
    hosts: list[Host] = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = 1
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key not in ("slots", "max_slots") or not value.isdigit() or int(value) < 1:
                raise LaunchError(f"hostfile {path}:{number}: expected 'HOST [slots=N]', got {line.strip()!r}")
            if key == "slots":
                slots = int(value)
        add_host(hosts, words[0], slots)
    if not hosts:
        raise LaunchError(f"hostfile {path}: no hosts in it")
    return hosts


def parse_host_list(spec: str) -> list[Host]:
    """`-H h1,h2,h2`: one slot per mention."""
    hosts: list[Host] = []
    for name in spec.split(","):
        if not name.strip():
            raise LaunchError(f"-H {spec!r}: empty host name")
        add_host(hosts, name.strip(), 1)
    return hosts


def add_host(hosts: list[Host], name: str, slots: int) -> None:
    for host in hosts:
        if host.name == name:
            host.slots += slots
            return
    hosts.append(Host(name, slots))


def place_tasks(hosts: list[Host], tasks_per_node: int | None, total_nodes: int | None) -> list[str]:
    """Host of each task, filling hosts in order (task 0, the chief, on the first)."""
    if total_nodes is not None:
        if total_nodes > len(hosts):
            raise LaunchError(f"--total-nodes {total_nodes} but only {len(hosts)} host(s) given")
        hosts = hosts[:total_nodes]
    placement = [h.name for h in hosts for _ in range(tasks_per_node or h.slots)]
    if len(placement) < 2:
        raise LaunchError(f"{len(placement)} task slot(s) on {', '.join(h.name for h in hosts)}: "
                          "a job needs at least 2 (the chief and one input worker); add slots=N or hosts")
    return placement


def bind_address_for(hosts: list[str]) -> str:
    """The address to bind here so every host can reach us (loopback if all hosts are this one)."""
    addresses = []
    for host in dict.fromkeys(hosts):
        try:
            addresses.append(source_address_towards(host))
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
    real = [a for a in addresses if not a.startswith("127.")]
    return real[0] if real else "127.0.0.1"


# ---------------------------------------------------------------- tasks seen through a carrier
class CarriedProcess:
    """A task's process as the launcher sees it: through its carrier (its own ssh
    client, or the one srun all tasks share) and the exit code its wrapper reported."""

    def __init__(self, carrier: subprocess.Popen, directory: DirectoryServer, role: str, rank: int,
                 shared: bool = False):
        self.carrier, self.directory, self.key, self.shared = carrier, directory, (role, rank), shared

    @property
    def pid(self) -> int:
        return self.carrier.pid

    def poll(self) -> int | None:
        report = self.directory.exits.get(self.key)
        if not self.shared:
            # Its own carrier ends right after the task: wait for that, so nothing
            # of the task is left when the launcher returns; the report has the true code.
            code = self.carrier.poll()
            return code if code is None or report is None else int(report["code"])
        return int(report["code"]) if report is not None else self.carrier.poll()

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.carrier.wait(timeout)


class RemoteTask(Task):
    """A task on another host (or under srun): named by the host and pid it registered with,
    or, before it has, by its carrier (whose own messages then say what went wrong)."""

    directory: DirectoryServer | None = None

    @property
    def label(self) -> str:
        key = (self.role, self.rank)
        known = self.directory.exits.get(key) if self.directory else None
        peer = self.directory.peers.get(key) if self.directory else None
        if known is None and peer is not None:
            known = {"host": peer.host, "pid": peer.pid}
        if known:
            return f"{self.role} {self.rank} on {known['host']} (pid {known['pid']})"
        return f"{self.role} {self.rank} via {self.carrier()} (pid {self.proc.pid})"

    def carrier(self) -> str:
        return "its carrier"


class SshTask(RemoteTask):
    def carrier(self) -> str:
        return f"ssh to {self.host}"

    def request_stop(self) -> None:
        # EOF on the far side's stdin: its wrapper stops the task and ssh exits.
        carrier = self.proc.carrier
        if carrier.stdin and not carrier.stdin.closed:
            try:
                carrier.stdin.close()
            except BrokenPipeError:
                pass

    def kill(self) -> None:
        _signal_group(self.proc.carrier, signal.SIGKILL)


class SrunTask(RemoteTask):
    def carrier(self) -> str:
        return "srun"

    def request_stop(self) -> None:
        carrier = self.proc.carrier
        if not getattr(carrier, "stop_requested", False):
            carrier.stop_requested = True
            _signal_group(carrier, signal.SIGTERM)  # srun passes SIGTERM on to every task of the step


# ---------------------------------------------------------------- SSH
def require(program: str, package: str) -> None:
    if shutil.which(program) is None:
        raise LaunchError(f"{program} not found on PATH (install {package})")


def ssh_base(options: str, host: str) -> list[str]:
    return ["ssh", *shlex.split(options), host]


def check_ssh_hosts(hosts: list[str], options: str, timeout: float = SSH_CHECK_TIMEOUT_S) -> None:
    """Every host must answer `ssh HOST true`; the error names each one that does not."""
    require("ssh", "openssh-client")
    probes = {h: subprocess.Popen([*ssh_base(options, h), "true"], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
              for h in dict.fromkeys(hosts)}
    deadline = time.monotonic() + timeout
    failed = []
    for host, probe in probes.items():
        try:
            _, err = probe.communicate(timeout=max(0.1, deadline - time.monotonic()))
            if probe.returncode != 0:
                failed.append(f"{host} ({(err.strip().splitlines() or ['exit code %d' % probe.returncode])[-1]})")
        except subprocess.TimeoutExpired:
            probe.kill()
            probe.communicate()
            failed.append(f"{host} (no answer within {timeout:.0f} s)")
    if failed:
        raise LaunchError(f"host(s) not reachable over SSH: {'; '.join(failed)}")


def remote_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in HOST_LOCAL_VARS}


def start_ssh_tasks(group: ProcessGroup, directory: DirectoryServer, placement: list[str], env: dict,
                    command: list[str], options: str) -> None:
    cwd = os.getcwd()
    pythonpath = env.get("PYTHONPATH", "")
    shell = (f"cd {shlex.quote(cwd)} && exec env PYTHONPATH={shlex.quote(pythonpath)} "
             f"{shlex.quote(sys.executable)} -m cs_runtime.launch.task --ssh")
    for index, host in enumerate(placement):
        role, rank = role_of_task(index)
        carrier = spawn([*ssh_base(options, host), shell], env, stdin=subprocess.PIPE)
        spec = {"role": role, "rank": rank, "host": host, "env": remote_env(env),
                "argv": role_argv(command, role)}
        try:
            carrier.stdin.write((json.dumps(spec) + "\n").encode())
            carrier.stdin.flush()
        except BrokenPipeError:
            pass  # ssh already failed; the supervisor reports its exit code
        task = SshTask(role, rank, host, CarriedProcess(carrier, directory, role, rank))
        task.directory = directory
        group.add(task)


# ---------------------------------------------------------------- Slurm
@dataclass
class SlurmShape:
    nodes: int
    tasks_per_node: int
    cpus_per_task: int

    @property
    def tasks(self) -> int:
        return self.nodes * self.tasks_per_node


def in_allocation() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID"))


def slurm_shape(total_nodes: int | None, tasks_per_node: int | None, cpus_per_task: int | None) -> SlurmShape:
    """Flags first, then what the allocation says, then 1 node x 2 tasks x 1 cpu."""
    env = os.environ
    shape = SlurmShape(total_nodes or _leading_int(env.get("SLURM_JOB_NUM_NODES")) or 1,
                       tasks_per_node or _leading_int(env.get("SLURM_NTASKS_PER_NODE")) or 2,
                       cpus_per_task or _leading_int(env.get("SLURM_CPUS_PER_TASK")) or 1)
    if shape.tasks < 2:
        raise LaunchError(f"{shape.tasks} task(s): a job needs at least 2 (the chief and one input worker); "
                          "raise --tasks-per-node or --total-nodes")
    return shape


def _leading_int(value: str | None) -> int | None:
    """'2(x3)' -> 2 (Slurm's compressed per-node counts)."""
    match = re.match(r"\d+", value or "")
    return int(match.group()) if match else None


def slurm_bind_address() -> str:
    """Reachable from every node of the allocation; this host's address otherwise."""
    nodes = []
    if os.environ.get("SLURM_JOB_NODELIST"):
        out = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                             capture_output=True, text=True)
        nodes = out.stdout.split() if out.returncode == 0 else []
    return bind_address_for(nodes or [socket.gethostname()])


def srun_argv(shape: SlurmShape, job: str, command: list[str]) -> list[str]:
    require("srun", "Slurm's client, e.g. slurm-client")
    return ["srun", f"--nodes={shape.nodes}", f"--ntasks={shape.tasks}",
            f"--ntasks-per-node={shape.tasks_per_node}", f"--cpus-per-task={shape.cpus_per_task}",
            "--kill-on-bad-exit=1", f"--chdir={os.getcwd()}", "--export=ALL", f"--job-name={job}",
            sys.executable, "-m", "cs_runtime.launch.task", "--slurm", "--", *command]


def start_srun_tasks(group: ProcessGroup, directory: DirectoryServer, shape: SlurmShape, env: dict,
                     command: list[str], job: str) -> None:
    carrier = spawn(srun_argv(shape, job, command), env, stdin=subprocess.DEVNULL)
    for index in range(shape.tasks):
        role, rank = role_of_task(index)
        task = SrunTask(role, rank, "slurm", CarriedProcess(carrier, directory, role, rank, shared=True))
        task.directory = directory
        group.add(task)
