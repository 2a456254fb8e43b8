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

import itertools
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

import zmq

from cs_runtime.launch.directory import DirectoryServer
from cs_runtime.roles import service_of_index
from cs_runtime.wire import auth
from cs_runtime.launch.launcher import ProcessGroup, Task, _signal_group, spawn
from cs_runtime.launch.task import role_argv, role_of_task
from cs_runtime.wire.transport import source_address_towards

# No password prompts; a host that does not answer, or stops answering, fails in seconds.
DEFAULT_SSH_OPTIONS = "-o BatchMode=yes -o ConnectTimeout=10 -o ServerAliveInterval=5 -o ServerAliveCountMax=3"
SSH_CHECK_TIMEOUT_S = 20.0
SLURM_CHECK_TIMEOUT_S = 60.0   # a step's start (credentials, the nodes' slurmstepd) and a Python start
SSH_FAILED = 255   # ssh's exit code for its own errors (connection refused, lost, ...)
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


def ssh_hostname(host: str, options: str = "") -> str:
    """The name ssh connects to for `host`: itself, or what an ssh_config alias says (`ssh -G`)."""
    try:
        socket.getaddrinfo(host, None, socket.AF_INET)
        return host
    except socket.gaierror:
        pass
    if shutil.which("ssh") is None:
        return host
    out = subprocess.run([*ssh_base(options, host)[:-1], "-G", host], capture_output=True, text=True, timeout=10)
    names = [line.split(None, 1)[1] for line in out.stdout.splitlines() if line.startswith("hostname ")]
    return names[0].strip() if out.returncode == 0 and names else host


def bind_address_for(hosts: list[str], options: str = "") -> str:
    """The address to bind here so every host can reach us (loopback if all hosts are this one)."""
    addresses = []
    for host in dict.fromkeys(hosts):
        try:
            addresses.append(source_address_towards(ssh_hostname(host, options)))
        except ValueError as exc:
            raise LaunchError(f"{exc} (nor through ssh_config)") from None
    real = [a for a in addresses if not a.startswith("127.")]
    return real[0] if real else "127.0.0.1"


def local_address(address: str) -> str:
    """--bind_address: an IPv4 address (or name) of this machine, which the job's sockets bind."""
    try:
        resolved = socket.getaddrinfo(address, None, socket.AF_INET)[0][4][0]
        with socket.socket() as probe:
            probe.bind((resolved, 0))
    except (socket.gaierror, IndexError):
        raise LaunchError(f"--bind_address {address}: does not resolve to an IPv4 address") from None
    except OSError as exc:
        raise LaunchError(f"--bind_address {address}: not an address of this machine ({exc.strerror})") from None
    return resolved


def refuse_loopback_across_hosts(bind: str, elsewhere: list[str]) -> None:
    """A job whose tasks run on other hosts cannot reach sockets bound to loopback: say so now,
    not as a registration timeout later."""
    if elsewhere and bind.startswith("127."):
        raise LaunchError(f"the job's services would bind {bind} (loopback), which its tasks on "
                          f"{', '.join(elsewhere)} cannot reach; give --bind_address with an address of "
                          "this machine those hosts reach")


def hosts_elsewhere(hosts: list[str], options: str = "") -> list[str]:
    """The hosts this machine does not reach over loopback."""
    elsewhere = []
    for host in dict.fromkeys(hosts):
        try:
            if not source_address_towards(ssh_hostname(host, options)).startswith("127."):
                elsewhere.append(host)
        except ValueError:
            elsewhere.append(host)  # ssh may know it (an ssh_config alias): surely not this machine's loopback
    return elsewhere


# ---------------------------------------------------------------- tasks seen through a carrier
class CarriedProcess:
    """A task's process as the launcher sees it: through its carrier (the ssh client of its
    host, or the srun of the step), which its host's other tasks share, and the exit code
    its wrapper reported."""

    def __init__(self, carrier: subprocess.Popen, directory: DirectoryServer, role: str, rank: int):
        self.carrier, self.directory, self.key = carrier, directory, (role, rank)

    @property
    def pid(self) -> int:
        return self.carrier.pid

    def poll(self) -> int | None:
        report = self.directory.exits.get(self.key)
        return int(report["code"]) if report is not None else self.carrier.poll()

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Until the task has ended (reported, or its carrier gone)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.carrier.args, timeout)
            try:  # the report comes through the directory, which the launcher's loop serves
                self.directory.serve_once(50)
            except zmq.ZMQError:  # closed: only the carrier's end can tell now
                return self.carrier.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return code


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

    def settle(self, timeout: float) -> None:
        carrier = self.proc.carrier
        try:
            carrier.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            carrier.wait()


class SshTask(RemoteTask):
    def carrier(self) -> str:
        return f"ssh to {self.host}"

    def ended_how(self, rc: int) -> str:
        carrier = self.proc.carrier
        if carrier.poll() == SSH_FAILED and not carrier.stdin.closed:  # ssh ended, not asked to
            # Its wrapper then stops the host's tasks, which would otherwise read as a SIGTERM.
            return f"lost its ssh connection to {self.host} (ssh exited with code {SSH_FAILED})"
        return super().ended_how(rc)

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
    """The user's --ssh_options first: for each option ssh keeps the first value it is given,
    so they add to the defaults and override those they name."""
    return ["ssh", *shlex.split(options), *shlex.split(DEFAULT_SSH_OPTIONS), host]


def task_shell(env: dict[str, str], mode: str) -> str:
    """What ssh runs on a host: the task wrapper, in this working folder, with this PYTHONPATH."""
    return (f"cd {shlex.quote(os.getcwd())} && exec env PYTHONPATH={shlex.quote(env.get('PYTHONPATH', ''))} "
            f"{shlex.quote(sys.executable)} -m cs_runtime.launch.task {mode}")


def check_ssh_hosts(hosts: list[str], options: str, timeout: float = SSH_CHECK_TIMEOUT_S) -> None:
    """Every host must answer over ssh, start the task wrapper in this working folder and keep
    the job's keys (sent as a task's are); the error names each host that cannot, and why."""
    require("ssh", "openssh-client")
    keys = auth.job_keys()
    check = (json.dumps({"keys": auth.key_strings(keys) if keys else None}) + "\n").encode()
    probes = {h: subprocess.Popen([*ssh_base(options, h), task_shell(dict(os.environ), "--check")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
              for h in dict.fromkeys(hosts)}
    deadline = time.monotonic() + timeout
    unreachable, unready = [], []
    for host, probe in probes.items():
        try:
            out, err = probe.communicate(check, timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            probe.kill()
            probe.communicate()
            unreachable.append(f"{host} (no answer within {timeout:.0f} s)")
            continue
        last = (err.decode(errors="replace").strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
        if probe.returncode == SSH_FAILED:  # ssh's own failure: the host was not reached
            unreachable.append(f"{host} ({last})")
        elif probe.returncode != 0 or out.strip() != b"ok":
            unready.append(f"{host} ({last})")
    problems = ([f"host(s) not reachable over SSH: {'; '.join(unreachable)}"] if unreachable else []) + \
               ([f"host(s) that cannot start the job's tasks: {'; '.join(unready)}"] if unready else [])
    if problems:
        raise LaunchError(". ".join(problems))


def remote_env(env: dict[str, str]) -> dict[str, str]:
    """What a task on another host inherits: not the launcher's own terminal, login or key folder."""
    return {k: v for k, v in env.items() if k not in HOST_LOCAL_VARS and k != auth.KEYS_ENV}


def start_ssh_tasks(group: ProcessGroup, directory: DirectoryServer, placement: list[str], env: dict,
                    command: list[str], options: str) -> None:
    """One ssh connection per host: its wrapper starts all of that host's tasks."""
    shell = task_shell(env, "--ssh")
    keys = auth.job_keys()
    by_host: dict[str, list[tuple[str, int]]] = {}
    for index, host in enumerate(placement):
        by_host.setdefault(host, []).append(role_of_task(index))
    for host, tasks in by_host.items():
        carrier = spawn([*ssh_base(options, host), shell], env, stdin=subprocess.PIPE)
        spec = {"host": host, "env": remote_env(env), "keys": auth.key_strings(keys) if keys else None,
                "tasks": [{"role": role, "rank": rank, "argv": role_argv(command, role)} for role, rank in tasks]}
        try:
            carrier.stdin.write((json.dumps(spec) + "\n").encode())
            carrier.stdin.flush()
        except BrokenPipeError:
            pass  # ssh already failed; the supervisor reports its exit code
        for role, rank in tasks:
            task = SshTask(role, rank, host, CarriedProcess(carrier, directory, role, rank))
            task.directory = directory
            group.add(task)


# ---------------------------------------------------------------- Slurm
@dataclass
class SlurmShape:
    per_node: list[int]     # tasks on each node, in node order (task 0, the chief, on the first)
    cpus_per_task: int

    @property
    def nodes(self) -> int:
        return len(self.per_node)

    @property
    def tasks(self) -> int:
        return sum(self.per_node)

    @property
    def tasks_per_node(self) -> int | None:
        """The count every node runs, None when they differ."""
        return self.per_node[0] if len(set(self.per_node)) == 1 else None

    def describe(self) -> str:
        per_node = self.tasks_per_node or compress_counts(self.per_node)
        return f"{self.nodes} node(s) x {per_node} task(s) x {self.cpus_per_task} cpu(s)"


def in_allocation() -> bool:
    return bool(os.environ.get("SLURM_JOB_ID"))


def slurm_shape(total_nodes: int | None, tasks_per_node: int | None, cpus_per_task: int | None) -> SlurmShape:
    """Flags first, then the allocation as it was asked for (-n, -N, --ntasks-per-node: Slurm
    sums them up in SLURM_TASKS_PER_NODE, as srun itself reads them); outside an
    allocation 1 node x 2 tasks x 1 cpu. A shape the allocation cannot hold is an error."""
    env = os.environ
    cpus = cpus_per_task or _leading_int(env.get("SLURM_CPUS_PER_TASK")) or 1
    if in_allocation():
        per_node = allocation_shape(total_nodes, tasks_per_node, cpus)
    else:
        per_node = [tasks_per_node or 2] * (total_nodes or 1)
    shape = SlurmShape(per_node, cpus)
    if shape.tasks < 2:
        raise LaunchError(f"{shape.tasks} task(s) ({shape.describe()}): a job needs at least 2 (the chief and one "
                          "input worker); ask the allocation for more (e.g. salloc -n 3) or give --tasks-per-node")
    return shape


def allocation_shape(total_nodes: int | None, tasks_per_node: int | None, cpus: int) -> list[int]:
    """Tasks per node inside this allocation, checked against the CPUs it holds on each node."""
    env = os.environ
    nodes = _leading_int(env.get("SLURM_JOB_NUM_NODES")) or 1
    given = expand_counts(env.get("SLURM_TASKS_PER_NODE", ""), "SLURM_TASKS_PER_NODE")
    if not given:  # older Slurm: only the total, laid out in blocks as srun does
        total = _leading_int(env.get("SLURM_NTASKS")) or nodes
        given = [total // nodes + (i < total % nodes) for i in range(nodes)]
    if total_nodes is not None and total_nodes > len(given):
        raise LaunchError(f"--total-nodes {total_nodes} but the allocation has {len(given)} node(s) "
                          f"(SLURM_JOB_NUM_NODES={nodes})")
    per_node = [tasks_per_node] * (total_nodes or len(given)) if tasks_per_node else given[:total_nodes]
    held = expand_counts(env.get("SLURM_JOB_CPUS_PER_NODE", ""), "SLURM_JOB_CPUS_PER_NODE")
    for node, (tasks, cpus_held) in enumerate(zip(per_node, held)):
        if tasks * cpus > cpus_held:
            raise LaunchError(f"{tasks} task(s) x {cpus} cpu(s) on node {node} of the allocation, which holds "
                              f"{cpus_held} CPU(s) there (SLURM_JOB_CPUS_PER_NODE={env['SLURM_JOB_CPUS_PER_NODE']}); "
                              "ask the allocation for more (salloc -n / --ntasks-per-node) or fewer tasks")
    return per_node


def expand_counts(value: str, name: str) -> list[int]:
    """Slurm's compressed per-node counts: '2(x3),1' -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in filter(None, value.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise LaunchError(f"{name}={value!r}: expected counts like '2(x3),1'")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def compress_counts(counts: list[int]) -> str:
    """[2, 2, 2, 1] -> '2(x3),1'."""
    parts: list[str] = []
    for value, run in ((v, len(list(g))) for v, g in itertools.groupby(counts)):
        parts.append(f"{value}(x{run})" if run > 1 else str(value))
    return ",".join(parts)


def _leading_int(value: str | None) -> int | None:
    """'2(x3)' -> 2."""
    match = re.match(r"\d+", value or "")
    return int(match.group()) if match else None


def allocation_nodes() -> list[str]:
    """The allocation's node names, in order (empty outside one)."""
    if not os.environ.get("SLURM_JOB_NODELIST") or shutil.which("scontrol") is None:
        return []
    out = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                         capture_output=True, text=True)
    return out.stdout.split() if out.returncode == 0 else []


def services_node(asked: str | None) -> str:
    """Where the services run inside the allocation: --services-node, else its first node."""
    nodes = allocation_nodes()
    if asked is not None and nodes and asked not in nodes:
        raise LaunchError(f"--services-node {asked} is not a node of the allocation ({', '.join(nodes)})")
    return asked or (nodes[0] if nodes else socket.gethostname())


def slurm_bind_address() -> str:
    """Reachable from every node of the allocation; this host's address otherwise."""
    return bind_address_for(allocation_nodes() or [socket.gethostname()])


def require_srun() -> None:
    require("srun", "Slurm's client, e.g. slurm-client")


def srun_argv(shape: SlurmShape, job: str, command: list[str]) -> list[str]:
    """The srun command line; building it needs no srun (the launcher checks before it runs one)."""
    # Uneven counts (an allocation of '2(x3),1'): srun lays the tasks out over the allocation as it was made.
    per_node = [f"--ntasks-per-node={shape.tasks_per_node}"] if shape.tasks_per_node else []
    return ["srun", f"--nodes={shape.nodes}", f"--ntasks={shape.tasks}", *per_node,
            f"--cpus-per-task={shape.cpus_per_task}",
            "--kill-on-bad-exit=1", "--overlap",  # beside the services' step, on the same CPUs
            f"--chdir={os.getcwd()}", "--export=ALL", f"--job-name={job}",
            sys.executable, "-m", "cs_runtime.launch.task", "--slurm", "--", *command]


def srun_env(env: dict[str, str]) -> dict[str, str]:
    """The environment of an srun step: the job's keys as text instead of the launcher's key folder."""
    keys = auth.job_keys()
    env = {k: v for k, v in env.items() if k != auth.KEYS_ENV}
    if keys is not None:  # srun's environment carries them to each node's task wrapper
        env[auth.KEYS_TEXT_ENV] = json.dumps(auth.key_strings(keys))
    return env


def check_slurm_nodes(nodes: list[str], count: int, timeout: float = SLURM_CHECK_TIMEOUT_S) -> None:
    """Inside an allocation, before the job's steps: one short step, one task on each node the
    job will use (`nodes`, or any `count` when the names are unknown), that checks it starts in
    this working folder and can keep the job's keys, which reach it in srun's environment as
    they will reach the tasks. The error names each node that cannot, and why."""
    require_srun()
    where = [f"--nodelist={','.join(nodes)}"] if nodes else []
    count = len(nodes) or count
    argv = ["srun", f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1", *where, "--overlap",
            "--cpus-per-task=1", f"--chdir={os.getcwd()}", "--export=ALL", "--job-name=csrun-check",
            sys.executable, "-m", "cs_runtime.launch.task", "--check-slurm", os.getcwd()]
    try:
        done = subprocess.run(argv, env=srun_env(dict(os.environ)), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout)
        out, err = done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        out, err = _text(exc.stdout), f"no answer within {timeout:.0f} s"
    answers = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    last = (err.strip().splitlines() or ["no answer"])[-1]
    problems = [f"{node} ({why})" for node, why in answers.items() if why != "ok"]
    problems += [f"{node} ({last})" for node in nodes if node not in answers]
    if not nodes and len(answers) < count:
        problems.append(f"{count - len(answers)} node(s) that did not answer ({last})")
    if problems:
        raise LaunchError(f"Slurm node(s) that cannot start the job's tasks: {'; '.join(problems)}")


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def job_nodes(shape: SlurmShape, services: str | None) -> list[str]:
    """The allocation's nodes the job's steps will run on: the tasks' first shape.nodes nodes
    (where srun places a step of that many nodes) and the services' node; [] if unknown."""
    nodes = allocation_nodes()
    if not nodes:
        return []
    used = nodes[:shape.nodes]
    return used + [services] if services and services not in used else used


def start_srun_services(group: ProcessGroup, directory: DirectoryServer, node: str, env: dict, num_csx: int,
                        job: str) -> None:
    """MemoryX, SwarmX and the WSEs as a step of the allocation on `node`, beside the tasks' step
    (--overlap: they share its CPUs; --overcommit: more services than CPUs held there is fine)."""
    require_srun()
    count = 2 + num_csx
    argv = ["srun", "--nodes=1", f"--ntasks={count}", f"--nodelist={node}", "--overlap", "--overcommit",
            "--cpus-per-task=1", "--kill-on-bad-exit=1", f"--chdir={os.getcwd()}", "--export=ALL",
            f"--job-name={job}-services", sys.executable, "-m", "cs_runtime.launch.task", "--slurm-services"]
    carrier = spawn(argv, srun_env(env), stdin=subprocess.DEVNULL)
    for index in range(count):
        role, rank = service_of_index(index)
        task = SrunTask(role, rank, node, CarriedProcess(carrier, directory, role, rank))
        task.directory = directory
        group.add(task)


def start_srun_tasks(group: ProcessGroup, directory: DirectoryServer, shape: SlurmShape, env: dict,
                     command: list[str], job: str) -> None:
    require_srun()
    carrier = spawn(srun_argv(shape, job, command), srun_env(env), stdin=subprocess.DEVNULL)
    for index in range(shape.tasks):
        role, rank = role_of_task(index)
        task = SrunTask(role, rank, "slurm", CarriedProcess(carrier, directory, role, rank))
        task.directory = directory
        group.add(task)
