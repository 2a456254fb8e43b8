"""cstorch.distributed: the cluster settings of cstorch.backend (ClusterConfig) and the questions a
training script asks about its place in the job.

The emulator's input workers each take their share of the job's batch plan
themselves (cs_torch/cluster_step.py), so a script's input function always
describes the whole global batch: the user's process is the master ordinal
and no process is a streamer, and get_streaming_batch_size gives the
effective batch size back, as the real API does on the user's node. A
script that shards its data by streaming rank would shard it twice here.

    cluster_resolver.py  the tasks of a job as the real API describes them
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ..backends import ClusterConfig, current_backend
from ..nn import CsTorchError
from . import cluster_resolver  # noqa: F401 (cstorch.distributed.cluster_resolver)

__all__ = ["ClusterConfig", "get_ordinal", "get_streaming_batch_size", "get_streaming_rank", "get_worker_state",
           "is_master_ordinal", "is_streamer", "num_streamers", "num_tasks"]


def get_ordinal() -> int:
    """This task's rank: the user's process is 0."""
    return 0


def is_master_ordinal(local: bool = False) -> bool:
    return True


def num_tasks() -> int:
    """The tasks that run the script: the user's process alone (the input workers run input_fn only)."""
    return 1


def is_streamer() -> bool:
    """Whether this process streams a share of the input: none does (see above)."""
    return False


def num_streamers() -> int:
    """The input workers of the job: num_csx * num_workers_per_csx of the backend's cluster config."""
    config = current_backend().cluster_config
    return config.num_csx * max(1, config.num_workers_per_csx or 1)


def get_streaming_rank() -> int:
    raise CsTorchError("distributed.get_streaming_rank: no process of the emulated job is a streamer (the input "
                       "workers take their share of the global batch themselves)")


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
