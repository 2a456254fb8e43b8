"""cstorch.distributed: the cluster settings of cstorch.backend (ClusterConfig) and the questions a
training script asks about its place in the job.

The emulator's input workers each take their share of the job's batch plan
themselves (cs_torch/cluster_step.py), so a script's input function always
describes the whole global batch: the user's process is the master ordinal
and not a streamer, and get_streaming_batch_size gives the effective batch
size back, as the real API does on the user's node. A script that shards
its data by streaming rank would shard it twice here. The job's tasks
(service_resolver().cluster_spec) are the user's process, rank 0, then the
input workers, which stream the input and receive the outputs as the real
workers do.

    cluster_resolver.py  the tasks of a job as the real API describes them
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from cs_runtime.units import bytes_to_human

from ..backends import ClusterConfig, cluster_config_in_use
from ..nn import CsTorchError
from . import cluster_resolver  # noqa: F401 (cstorch.distributed.cluster_resolver)
from .cluster_resolver import TaskRole, emulated_cluster_spec

__all__ = ["BaseServiceResolver", "ClusterConfig", "SSD_LIMIT", "TaskRole", "WORKER_CACHE_ROOT", "WorkerState",
           "get_ordinal", "get_rank", "get_streaming_batch_size", "get_streaming_rank", "get_worker_state",
           "get_world_size", "hit_worker_cache_limit", "is_master_ordinal", "is_receiver", "is_streamer",
           "num_receivers", "num_streamers", "num_tasks", "service_resolver"]

# The real API's worker cache: copies may fill this share of the workers' SSD, mounted here.
SSD_LIMIT = 0.8
WORKER_CACHE_ROOT = "/n0/cache"


class BaseServiceResolver:
    """The tasks of the job of the current backend, and which of them stream and receive."""

    def __init__(self):
        config = cluster_config_in_use()
        self.cluster_spec = emulated_cluster_spec(config.num_csx, max(1, config.num_workers_per_csx or 1))

    def streamer_ordinals(self) -> list[int]:
        return [t.rank for t in self.cluster_spec.filter_tasks_by_role(TaskRole.WORKER)]

    def receiver_ordinals(self) -> list[int]:
        return self.streamer_ordinals()

    def setup(self) -> None:
        """Nothing to set up: the emulated job's tasks follow from the cluster config."""

    @classmethod
    def get_resolver(cls) -> "BaseServiceResolver":
        return cls()


def service_resolver() -> BaseServiceResolver:
    return BaseServiceResolver.get_resolver()


def num_tasks() -> int:
    """Every task of the job: the user's process and the input workers."""
    return service_resolver().cluster_spec.num_tasks()


def num_receivers() -> int:
    return len(service_resolver().receiver_ordinals())


def is_receiver() -> bool:
    return get_ordinal() in service_resolver().receiver_ordinals()


class WorkerState:
    """A worker's place in the data at a checkpoint: the emulator's input workers keep it themselves."""

    @classmethod
    def get_worker_state(cls):
        return get_worker_state()


def _dir_size(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
               if os.path.isfile(os.path.join(d, f)))


def hit_worker_cache_limit(src_dir: str, dest_dir: str):
    """(whether copying src_dir to dest_dir, a folder of the worker cache, would fill the cache past
    SSD_LIMIT of its disk; src_dir's size; the space the copy may take), the sizes as '1.50KiB'."""
    Path(dest_dir).resolve().relative_to(Path(WORKER_CACHE_ROOT).resolve())   # raises outside the cache
    disk = os.statvfs(WORKER_CACHE_ROOT)
    total, free = disk.f_frsize * disk.f_blocks, disk.f_frsize * disk.f_bavail
    used, size, replaced = total - free, _dir_size(src_dir), _dir_size(dest_dir)
    cap = SSD_LIMIT * total
    available = cap - used + replaced if cap > used - replaced else 0
    return size + used - replaced > cap, bytes_to_human(size), bytes_to_human(available)


def get_ordinal() -> int:
    """This task's rank: the user's process is 0."""
    return 0


def _torch_process_group():
    """torch.distributed when a script has initialized a process group (a GPU run's DDP), else None."""
    import sys
    dist = sys.modules.get("torch.distributed")   # never imports torch: without it there is no group
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def get_rank() -> int:
    """This process's rank in torch.distributed's process group (the model zoo asks it on a GPU run,
    where a group is initialized); 0 without a group, as a job of one process."""
    dist = _torch_process_group()
    return dist.get_rank() if dist is not None else 0


def get_world_size() -> int:
    """The processes of torch.distributed's process group; 1 without a group."""
    dist = _torch_process_group()
    return dist.get_world_size() if dist is not None else 1


def is_master_ordinal(local: bool = False) -> bool:
    return True


def is_streamer() -> bool:
    """Whether this process streams a share of the input: the user's process does not (see above)."""
    return False


def num_streamers() -> int:
    """The input workers of the job: num_csx * num_workers_per_csx of the backend's cluster config."""
    return len(service_resolver().streamer_ordinals())


def get_streaming_rank() -> int:
    raise CsTorchError("distributed.get_streaming_rank: the user's process of the emulated job is not a streamer "
                       "(the input workers take their share of the global batch themselves)")


def get_streaming_batch_size(effective_batch_size: int, global_rank: int | None = None) -> int:
    """The batch an input function makes: the effective (global) batch size, checked."""
    if isinstance(effective_batch_size, bool) or not isinstance(effective_batch_size, int):
        raise TypeError(f"get_streaming_batch_size: expected an integer batch size, got {effective_batch_size!r}")
    if effective_batch_size <= 0:
        raise ValueError(f"get_streaming_batch_size: expected a positive batch size, got {effective_batch_size}")
    return effective_batch_size


@dataclass
class _WorkerState:
    """What a restartable loader's state_dict reads of its worker: the samples it streamed."""
    samples_streamed: int
    worker_id: int = 0


_saving: list[_WorkerState] = []


@contextlib.contextmanager
def saving_worker_state(samples_streamed: int):
    """While cstorch's DataLoader.state_dict asks its loader for its state: the one worker's state
    (the whole global batch is made here, so this process is every worker at once)."""
    _saving.append(_WorkerState(int(samples_streamed)))
    try:
        yield
    finally:
        _saving.pop()


def get_worker_state():
    if _saving:   # a restartable loader's state_dict, called by cstorch's DataLoader.state_dict
        return _saving[-1]
    raise CsTorchError("distributed.get_worker_state: the emulator's input workers keep their own place in the "
                       "batch plan; a worker's state is not emulated")
