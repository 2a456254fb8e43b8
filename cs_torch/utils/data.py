"""cstorch.utils.data: DataLoader(input_fn, *args) and DataExecutor(loader, num_steps=, ...).

    def input_fn(batch_size):
        return torch.utils.data.DataLoader(dataset, batch_size, shuffle=True, drop_last=True)

    loader = cstorch.utils.data.DataLoader(input_fn, 64)
    executor = cstorch.utils.data.DataExecutor(loader, num_steps=1000, checkpoint_steps=100)
    for step, batch in enumerate(executor, start=1):
        loss = training_step(*batch)

`input_fn` returns a torch DataLoader (or any iterable of batches). The
executor iterates it, epoch after epoch, for num_steps batches (one epoch
when num_steps is None), and knows which steps are checkpoint steps.
Batches are made in this process: the traced step's program runs here on
the one executor (see docs/cstorch.md for what a CSX backend does).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..backends import ClusterConfig, current_backend, note
from ..nn import CsTorchError

_current: list = []


def current_executor():
    return _current[-1] if _current else None


class DataLoader:
    """The input function and its arguments; the loader is made when an executor first iterates."""

    def __init__(self, input_fn, *args, **kwargs):
        if not callable(input_fn):
            raise CsTorchError(f"DataLoader: input_fn must be callable, got {type(input_fn).__name__}")
        self.input_fn, self.args, self.kwargs = input_fn, args, kwargs
        self._loader = None

    @property
    def loader(self):
        if self._loader is None:
            self._loader = self.input_fn(*self.args, **self.kwargs)
            if not hasattr(self._loader, "__iter__"):
                raise CsTorchError(f"DataLoader: {getattr(self.input_fn, '__name__', 'input_fn')} returned "
                                   f"{type(self._loader).__name__}, not a torch DataLoader or an iterable")
        return self._loader

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        return iter(self.loader)


@dataclass
class CSConfig:
    """The cluster settings of releases before 2.3 (DataExecutor(cs_config=...))."""
    mgmt_address: str | None = None
    credentials_path: str | None = None
    num_csx: int = 1
    max_wgt_servers: int = 24
    num_workers_per_csx: int = 0
    mount_dirs: list = field(default_factory=list)
    python_paths: list = field(default_factory=list)
    transfer_processes: int | None = None
    job_time_sec: int | None = None
    precision_opt_level: int | None = None

    def cluster_config(self) -> ClusterConfig:
        keys = ("mgmt_address", "credentials_path", "num_csx", "max_wgt_servers", "num_workers_per_csx",
                "mount_dirs", "python_paths", "job_time_sec")
        return ClusterConfig(**{k: getattr(self, k) for k in keys})


class DataExecutor:
    def __init__(self, dataloader, num_steps: int | None = None, checkpoint_steps: int | None = None,
                 activation_steps: int | None = None, cs_config: CSConfig | None = None, writer=None,
                 micro_batch_size=None, profiler_activities=None):
        for name, value in (("num_steps", num_steps), ("checkpoint_steps", checkpoint_steps),
                            ("activation_steps", activation_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise CsTorchError(f"DataExecutor: {name} must be a positive integer or None, got {value!r}")
        if not hasattr(dataloader, "__iter__"):
            raise CsTorchError(f"DataExecutor: expected a cstorch.utils.data.DataLoader, got "
                               f"{type(dataloader).__name__}")
        self.dataloader, self.num_steps = dataloader, num_steps
        self.checkpoint_steps, self.activation_steps, self.writer = checkpoint_steps, activation_steps, writer
        self.backend = current_backend()
        if cs_config is not None:
            self.backend.cluster_config = cs_config.cluster_config()
        if micro_batch_size not in (None, "auto", "explore"):
            note(f"DataExecutor: micro_batch_size={micro_batch_size!r} is not honoured: each WSE takes its "
                 "share of the batch whole")
        if profiler_activities:
            note("DataExecutor: profiler_activities is not honoured (see docs/running.md for traces)")
        self.user_iteration = 0

    @property
    def total_steps(self) -> int:
        if self.backend.compile_only or self.backend.validate_only:
            return 1
        return self.num_steps if self.num_steps is not None else len(self.dataloader)

    @property
    def on_final_iteration(self) -> bool:
        return self.user_iteration == self.total_steps

    @property
    def on_checkpoint_step(self) -> bool:
        if not self.checkpoint_steps:
            return self.on_final_iteration
        return self.user_iteration % self.checkpoint_steps == 0 or self.on_final_iteration

    def __len__(self) -> int:
        return self.total_steps

    def __iter__(self):
        total = self.total_steps
        self.user_iteration = 0
        _current.append(self)
        try:
            while self.user_iteration < total:
                produced = False
                for batch in self.dataloader:
                    produced = True
                    self.user_iteration += 1
                    yield batch
                    if self.user_iteration >= total:
                        break
                if not produced:
                    raise CsTorchError("DataExecutor: the data loader produced no batch")
        finally:
            _current.remove(self)
            if self.writer is not None:
                self.writer.flush()
