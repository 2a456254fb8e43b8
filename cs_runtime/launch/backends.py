"""Where a job's processes run: one back-end per launcher, each with the same small interface.

    backend = backend_for(options)                       # chosen once, from JobOptions
    layout = backend.place(options)                      # which host runs which task, what the job binds
    backend.check(layout, options)                       # hosts and nodes answer, before anything starts
    backend.start_services(group, directory, layout, env, options, job, shm_dir)   # MemoryX, SwarmX, WSEs
    backend.start_tasks(group, directory, layout, env, options, job)              # chief, input workers
    backend.describe(layout)                             # for the job's first log line

Local runs everything on this machine; Ssh starts the tasks on hosts of a hostfile (services here);
Slurm starts them with srun (services here, or as a step on a node of the allocation); CsSystem
wraps one of them for a job of a shared CS system (--cs_ip), whose services that system starts.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from cs_runtime import env as cs_env
from cs_runtime.launch import remote
from cs_runtime.launch.launcher import ProcessGroup, numerics_env
from cs_runtime.launch.task import role_argv
from cs_runtime.roles import ROLES, module_of, services_of_job

@dataclass
class Layout:
    """Where the job's tasks run and which address its sockets bind."""
    num_workers: int
    bind: str = "127.0.0.1"
    placement: list[str] | None = None          # SSH: the host of each task
    shape: remote.SlurmShape | None = None      # Slurm: nodes x tasks x cpus
    services_node: str | None = None            # inside an allocation: where the services run


class Backend:
    """The interface every back-end has, with what most share: services on this machine."""
    name = ""

    def place(self, options) -> Layout:
        """Which host runs which task, and what the job binds."""
        raise NotImplementedError

    def hosts_elsewhere(self, layout: Layout, options) -> list[str]:
        """The hosts other than this one that must reach the job's sockets (loopback is refused then)."""
        return []

    def check(self, layout: Layout, options) -> None:
        """Fail in seconds, with one line, on hosts or nodes that cannot start the job's processes."""

    def start_services(self, group: ProcessGroup, directory, layout: Layout, env: dict, options, job: str,
                       shm_dir: str | None) -> None:
        """MemoryX, SwarmX and the WSEs, on this machine: with shm_dir they share memory for the weight stream."""
        if shm_dir:
            env = {**env, "CS_SHM_DIR": shm_dir}
        for role, rank in services_of_job(options.num_csx):
            role_env = numerics_env(env, ROLES[role].threads(options.num_csx))
            group.start(role, rank, [sys.executable, "-m", module_of(role)],
                        {**role_env, "CS_ROLE": role, "CS_RANK": str(rank)})

    def start_tasks(self, group: ProcessGroup, directory, layout: Layout, env: dict, options, job: str) -> None:
        """The chief and the input workers of options.command."""
        raise NotImplementedError

    def describe(self, layout: Layout) -> str:
        """Where the tasks run, for the job's first log line."""
        raise NotImplementedError

    def services_here(self, layout: Layout) -> bool:
        """Whether the job's services run on this machine (so they may share its memory)."""
        return True

    def tasks_here(self) -> bool:
        """Whether the chief and the input workers run on this machine."""
        return False

    def processes_here(self, options) -> int:
        """How many of the job's processes this machine runs (the size check before a start): the services,
        and the tasks where they run here."""
        return len(services_of_job(options.num_csx)) + _tasks_here(self, options)


class Local(Backend):
    """The chief, the input workers and the services, all on this machine."""
    name = "local"

    def place(self, options) -> Layout:
        # Loopback, unless the user exported CS_BIND_HOST (e.g. for a --cs_ip elsewhere).
        return Layout(options.num_csx * (options.num_workers_per_csx or 1), cs_env.BIND_HOST.get())

    def start_tasks(self, group: ProcessGroup, directory, layout: Layout, env: dict, options, job: str) -> None:
        group.start("chief", 0, role_argv(options.command, "chief"), {**env, "CS_ROLE": "chief", "CS_RANK": "0"})
        for rank in range(layout.num_workers):
            group.start("worker", rank, role_argv(options.command, "worker"),
                        {**env, "CS_ROLE": "worker", "CS_RANK": str(rank)})

    def describe(self, layout: Layout) -> str:
        return "on this machine"

    def tasks_here(self) -> bool:
        return True


class Ssh(Backend):
    """The tasks on the hosts of a hostfile or -H list, over SSH; the services on this machine."""
    name = "ssh"

    def place(self, options) -> Layout:
        hosts = (remote.parse_hostfile(options.hostfile) if options.hostfile
                 else remote.parse_host_list(options.hosts))
        placement = remote.place_tasks(hosts, options.tasks_per_node, options.total_nodes)
        return Layout(len(placement) - 1, remote.bind_address_for(placement, options.ssh_options),
                      placement=placement)

    def hosts_elsewhere(self, layout: Layout, options) -> list[str]:
        return remote.hosts_elsewhere(layout.placement, options.ssh_options)

    def check(self, layout: Layout, options) -> None:
        remote.check_ssh_hosts(layout.placement, options.ssh_options)

    def start_tasks(self, group: ProcessGroup, directory, layout: Layout, env: dict, options, job: str) -> None:
        remote.start_ssh_tasks(group, directory, layout.placement, env, options.command, options.ssh_options)

    def describe(self, layout: Layout) -> str:
        return f"over SSH (task hosts: {' '.join(layout.placement)})"


class Slurm(Backend):
    """The tasks as an srun step; the services here, or inside an allocation as a step on one of its nodes."""
    name = "slurm"

    def place(self, options) -> Layout:
        remote.require_srun()  # before anything starts, not when the tasks do
        shape = remote.slurm_shape(options.total_nodes, options.tasks_per_node, options.cpus_per_task)
        node = remote.services_node(options.services_node) if remote.in_allocation() else None
        return Layout(shape.tasks - 1, remote.slurm_bind_address(), shape=shape, services_node=node)

    def hosts_elsewhere(self, layout: Layout, options) -> list[str]:
        return [f"{layout.shape.nodes} Slurm nodes"] if layout.shape.nodes > 1 else []

    def check(self, layout: Layout, options) -> None:
        if remote.in_allocation():   # the nodes are known only inside one (outside, srun makes it with the step)
            remote.check_slurm_nodes(remote.job_nodes(layout.shape, layout.services_node), layout.shape.nodes)

    def start_services(self, group: ProcessGroup, directory, layout: Layout, env: dict, options, job: str,
                       shm_dir: str | None) -> None:
        if layout.services_node:
            remote.start_srun_services(group, directory, layout.services_node, env, options.num_csx, job)
        else:
            super().start_services(group, directory, layout, env, options, job, shm_dir)

    def start_tasks(self, group: ProcessGroup, directory, layout: Layout, env: dict, options, job: str) -> None:
        remote.start_srun_tasks(group, directory, layout.shape, env, options.command, job)

    def describe(self, layout: Layout) -> str:
        services = f", services on {layout.services_node} (srun)" if layout.services_node else ""
        return f"with srun ({layout.shape.describe()}){services}"

    def services_here(self, layout: Layout) -> bool:
        # Services started as an srun step share memory on their node, not with this host.
        return not layout.services_node

    def processes_here(self, options) -> int:
        return 0   # srun's: the size check leaves a Slurm job to its nodes


class CsSystem(Backend):
    """A job of a shared CS system (--cs_ip): its services are the system's; the tasks run as `tasks` starts them."""

    def __init__(self, tasks: Backend, cs_ip: str):
        self.tasks, self.cs_ip, self.name = tasks, cs_ip, tasks.name

    def place(self, options) -> Layout:
        return self.tasks.place(options)

    def hosts_elsewhere(self, layout: Layout, options) -> list[str]:
        return self.tasks.hosts_elsewhere(layout, options)

    def check(self, layout: Layout, options) -> None:
        self.tasks.check(layout, options)

    def start_services(self, group: ProcessGroup, directory, layout: Layout, env: dict, options, job: str,
                       shm_dir: str | None) -> None:
        """Nothing: the CS system starts the job's services from its pool when its turn comes."""

    def start_tasks(self, group: ProcessGroup, directory, layout: Layout, env: dict, options, job: str) -> None:
        self.tasks.start_tasks(group, directory, layout, env, options, job)

    def describe(self, layout: Layout) -> str:
        return f"{self.tasks.describe(layout)}, services on the CS system at {self.cs_ip}"

    def services_here(self, layout: Layout) -> bool:
        return False

    def tasks_here(self) -> bool:
        return self.tasks.tasks_here()

    def processes_here(self, options) -> int:
        return _tasks_here(self, options)


def _tasks_here(backend: Backend, options) -> int:
    return 1 + options.num_csx * (options.num_workers_per_csx or 1) if backend.tasks_here() else 0


_BACKENDS = {backend.name: backend for backend in (Local(), Ssh(), Slurm())}
LAUNCHERS = tuple(_BACKENDS)   # csrun_wse --launcher's choices (besides auto)


def backend_for(options) -> Backend:
    """The back-end of options.launcher, wrapped as a CS system's job with options.cs_ip."""
    tasks = _BACKENDS[options.launcher]
    return CsSystem(tasks, options.cs_ip) if options.cs_ip else tasks
