"""The roles of a job, named once: what each process is, how it starts, and its share of the cores.

    services: MemoryX, SwarmX and the WSEs (`python -m <module>`), started before the user's script
    tasks:    the chief and the input workers (the user's run.py with CS_ROLE set; the runner hands
              over to the role's entry point)

The launcher (every back-end), the task wrapper, the runner, orphan clean-up and the CS system's
service pool read this table; none spells a role's module or thread share itself.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Role:
    name: str
    module: str | None = None                 # a service: `python -m module`
    entry: tuple[str, str] | None = None      # a task: the runner's (module, function(args, fns))
    shares_cores: bool = False                # the host's cores are divided between its processes of this role

    @property
    def is_service(self) -> bool:
        return self.module is not None

    def threads(self, num_csx: int, cores: int | None = None) -> int:
        """BLAS threads of one process of this role: a WSE gets the host's cores divided between the
        job's WSEs; every other role one (the chief drives, workers feed, MemoryX and SwarmX move bytes)."""
        if not self.shares_cores:
            return 1
        return max(1, (cores or os.cpu_count() or 1) // max(1, num_csx))


# In start order: the services first (MemoryX, SwarmX, then the WSEs), then the tasks.
ROLES: dict[str, Role] = {role.name: role for role in (
    Role("memoryx", module="cs_runtime.memoryx"),
    Role("swarmx", module="cs_runtime.swarmx"),
    Role("wse", module="wse", shares_cores=True),
    Role("chief", entry=("chief.trainer", "run_on_cluster")),
    Role("worker", entry=("worker.input_worker", "serve_inputs")),
)}
SERVICE_ROLES = tuple(name for name, role in ROLES.items() if role.is_service)
TASK_ROLES = tuple(name for name, role in ROLES.items() if not role.is_service)

# What the runner runs for a CS_ROLE that is not a job role: "" (no CS_ROLE) is the CPU path,
# the others are csrun_wse's and cs_input_analyzer's one-shot probes and checks.
TOOL_ENTRY_POINTS: dict[str, tuple[str, str]] = {
    "": ("chief.trainer", "run_on_cpu"),
    "input_probe": ("worker.probe", "measure_input"),
    "wse_probe": ("wse.probe", "measure_consumption"),
    "precheck": ("chief.trainer", "run_precheck"),
}


def entry_point(role: str) -> tuple[str, str]:
    """The runner's (module, function) for CS_ROLE `role`; anything unknown runs the CPU path."""
    job_role = ROLES.get(role)
    if job_role is not None and job_role.entry is not None:
        return job_role.entry
    return TOOL_ENTRY_POINTS.get(role, TOOL_ENTRY_POINTS[""])


def services_of_job(num_csx: int) -> list[tuple[str, int]]:
    """(role, rank) of every service of a job with `num_csx` WSEs, in start order."""
    return [(name, rank) for name in SERVICE_ROLES for rank in range(num_csx if name == "wse" else 1)]


def service_counts(num_csx: int) -> dict[str, int]:
    """How many processes of each service role a job with `num_csx` WSEs has."""
    counts: dict[str, int] = {}
    for name, _ in services_of_job(num_csx):
        counts[name] = counts.get(name, 0) + 1
    return counts


def service_of_index(index: int) -> tuple[str, int]:
    """The index-th service of services_of_job (a Slurm step's task 0 MemoryX, 1 SwarmX, 2.. WSE 0..)."""
    fixed = [name for name in SERVICE_ROLES if name != "wse"]
    return (fixed[index], 0) if index < len(fixed) else ("wse", index - len(fixed))


def module_of(role: str) -> str:
    """A service's module (`python -m` it); KeyError for a task role."""
    module = ROLES[role].module
    if module is None:
        raise KeyError(f"{role} is a task, not a service")
    return module
