"""cstorch.distributed.cluster_resolver: the tasks of a job as the real API describes them.

The emulated job's tasks are the user's process (rank 0) and its input
workers; the model zoo builds a one-task spec for a run off the cluster.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class TaskRole(Enum):
    """What a task does: the master (the user's process) or a worker (an input worker)."""
    MASTER = "master"
    WORKER = "worker"


@dataclass
class TaskSpec:
    """One task: its global rank, its rank among the tasks of its WSE, that WSE, its host, its roles."""
    rank: int
    local_rank: int
    wse_id: int
    node_name: str = "localhost"
    roles: list = None


@dataclass
class ClusterSpec:
    """Every task of the job, this process's rank, the WSEs and the workers per WSE."""
    tasks: list[TaskSpec] = field(default_factory=list)
    rank: int = 0
    num_csx: int = 1
    num_workers_per_csx: int = 1

    def num_tasks(self) -> int:
        """The tasks of the job (the model zoo's HDF5 readers shard their files over them)."""
        return len(self.tasks)

    def filter_tasks_by_role(self, role: TaskRole) -> list[TaskSpec]:
        return [task for task in self.tasks if role in (task.roles or [])]

    def task(self, rank: int | None = None) -> TaskSpec:
        """The task of `rank` (this process's when None)."""
        wanted = self.rank if rank is None else rank
        for spec in self.tasks:
            if spec.rank == wanted:
                return spec
        raise ValueError(f"ClusterSpec: no task of rank {wanted} (ranks {[t.rank for t in self.tasks]})")


def emulated_cluster_spec(num_csx: int, num_workers_per_csx: int) -> ClusterSpec:
    """The emulated job's tasks: the user's process (rank 0, the master), then each WSE's input workers."""
    tasks = [TaskSpec(0, 0, 0, "localhost", [TaskRole.MASTER])]
    for wse in range(num_csx):
        for local in range(num_workers_per_csx):
            tasks.append(TaskSpec(len(tasks), local, wse, "localhost", [TaskRole.WORKER]))
    return ClusterSpec(tasks, 0, num_csx, num_workers_per_csx)
