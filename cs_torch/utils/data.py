"""cstorch.utils.data: DataLoader(input_fn, *args) and DataExecutor(loader, num_steps=, ...).

    def input_fn(batch_size):
        return torch.utils.data.DataLoader(dataset, batch_size, shuffle=True, drop_last=True)

    loader = cstorch.utils.data.DataLoader(input_fn, 64)
    executor = cstorch.utils.data.DataExecutor(loader, num_steps=1000, checkpoint_steps=100)
    for step, batch in enumerate(executor, start=1):
        loss = training_step(*batch)

`input_fn` returns a torch DataLoader. With a CPU backend the executor
iterates it here, epoch after epoch, for num_steps batches (one epoch when
num_steps is None). With a CSX backend the loop is one job of the CS system
(cs_torch/cluster_step.py): its input workers call input_fn themselves and
stream the WSEs the torch loader's batches in its order, replayed epoch by
epoch (cs_torch/loader_replay.py); the loop gets the same batches, made here
from the same data set. input_fn must then be a top-level function with JSON
arguments (the workers import it by name).
"""
from __future__ import annotations

import inspect
import itertools
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, Union, runtime_checkable

from ..backends import ClusterConfig, current_backend, note
from ..nn import CsTorchError
from ..profiler import StepWindow
from ..recording import _current, current_executor  # noqa: F401 (current_executor: cstorch.utils.data API)
from . import data_sampler as sampler   # cstorch.utils.data.sampler (the real package's module of that name)
from . import data_utils as utils   # cstorch.utils.data.utils (likewise)
from .data_utils import Schedule, infer_batch_size  # noqa: F401 (cstorch.utils.data API)


_LOADER_IDS = itertools.count()


class DataLoader:
    """The input function and its arguments; the loader is made when an executor first iterates.
    `id`: a number no other DataLoader of this process has (the 2.3+ trainer names each validation
    loader's stage and scope by it)."""

    def __init__(self, input_fn, *args, **kwargs):
        if not callable(input_fn):
            raise CsTorchError(f"DataLoader: input_fn must be callable, got {type(input_fn).__name__}")
        self.input_fn, self.args, self.kwargs = input_fn, args, kwargs
        self.id = next(_LOADER_IDS)
        self._loader = None
        self.samples_streamed = 0    # counted by the DataExecutor, for a restartable loader's state

    @property
    def loader(self):
        if self._loader is None:
            self._loader = self.input_fn(*self.args, **self.kwargs)
            if not hasattr(self._loader, "__iter__"):
                raise CsTorchError(f"DataLoader: {getattr(self.input_fn, '__name__', 'input_fn')} returned "
                                   f"{type(self._loader).__name__}, not a torch DataLoader or an iterable")
        return self._loader

    @property
    def dataloader(self):
        """The real API's name for the loader input_fn made."""
        return self.loader

    @property
    def is_restartable(self) -> bool:
        """Whether the loader saves and restores its place (a state_dict): a torch DataLoader does
        not, so a checkpoint holds no loader state and a restart begins its data anew."""
        return callable(getattr(self.loader, "state_dict", None)) and callable(
            getattr(self.loader, "load_state_dict", None))

    def state_dict(self) -> dict:
        """A restartable loader's state (the model zoo's RestartableDataLoader): its state_dict, with
        the samples streamed so far as its worker's, aggregated as its aggregate_state_dict says."""
        from ..distributed import saving_worker_state
        if not self.is_restartable:
            raise CsTorchError(f"DataLoader.state_dict: the loader {getattr(self.input_fn, '__name__', 'input_fn')} "
                               "made has no state_dict/load_state_dict (it is not restartable)")
        with saving_worker_state(self.samples_streamed):
            state = self.loader.state_dict()
        aggregate = getattr(self.loader, "aggregate_state_dict", None)
        return aggregate([state]) if callable(aggregate) else state

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """The loader's place from a checkpoint; `strict` (check the state matches the loader) is passed
        on to a loader whose load_state_dict takes it."""
        if not self.is_restartable:
            raise CsTorchError("DataLoader.load_state_dict: the loader input_fn made is not restartable")
        deaggregate = getattr(self.loader, "deaggregate_state_dict", None)
        state = deaggregate(state) if callable(deaggregate) else state
        if "strict" in inspect.signature(self.loader.load_state_dict).parameters:
            self.loader.load_state_dict(state, strict=strict)
        else:
            self.loader.load_state_dict(state)

    @property
    def batch_size(self):
        """The batch size of the loader input_fn makes (None when it has none)."""
        return getattr(self.loader, "batch_size", None)

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        return iter(self.loader)


@dataclass
class CSConfig:
    """The cluster settings of releases before 2.3 (DataExecutor(cs_config=...)). The model zoo
    passes each runconfig key it reads, None where the file has none: None is the default."""
    mgmt_address: str | None = None
    mgmt_namespace: str | None = None
    credentials_path: str | None = None
    num_csx: int | None = 1
    max_wgt_servers: int | None = 24
    max_act_per_csx: int | None = None
    num_workers_per_csx: int | None = 0
    transfer_processes: int | None = None
    job_time_sec: int | None = None
    mount_dirs: list | None = field(default_factory=list)
    python_paths: list | None = field(default_factory=list)
    job_labels: list | None = field(default_factory=list)
    debug_args: object = None
    precision_opt_level: int | None = None
    disable_version_check: bool = False

    def cluster_config(self) -> ClusterConfig:
        keys = ("mgmt_address", "mgmt_namespace", "credentials_path", "num_csx", "max_wgt_servers",
                "max_act_per_csx", "num_workers_per_csx", "job_labels", "job_time_sec", "mount_dirs",
                "python_paths", "disable_version_check")
        given = {k: getattr(self, k) for k in keys}
        return ClusterConfig(**{k: v for k, v in given.items() if v is not None})


_EXECUTOR_NUMBERS = itertools.count()

# A DataExecutor's micro_batch_size: a size, "auto" or "explore" (searched for), or None (the batch whole).
MbsSetting = Union[None, int, Literal["auto", "explore"]]


class DataExecutor:
    def __init__(self, dataloader, num_steps: int | None = None, checkpoint_steps: int | Schedule | None = None,
                 activation_steps: int | None = None, cs_config: CSConfig | None = None, writer=None,
                 micro_batch_size=None, profiler_activities=None, listeners=None):
        steps = [("num_steps", num_steps), ("activation_steps", activation_steps)]
        if not isinstance(checkpoint_steps, Schedule):
            steps.append(("checkpoint_steps", checkpoint_steps))
        for name, value in steps:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise CsTorchError(f"DataExecutor: {name} must be a positive integer or None, got {value!r}")
        if not hasattr(dataloader, "__iter__"):
            raise CsTorchError(f"DataExecutor: expected a cstorch.utils.data.DataLoader, got "
                               f"{type(dataloader).__name__}")
        self.dataloader, self.num_steps = dataloader, num_steps
        self.checkpoint_steps, self.activation_steps, self.writer = checkpoint_steps, activation_steps, writer
        self.backend = current_backend()
        self.cs_config = cs_config if cs_config is not None else CSConfig()   # the real executor's attribute
        if cs_config is not None:
            self.backend.cluster_config = cs_config.cluster_config()
        if micro_batch_size not in (None, "auto", "explore"):
            note(f"DataExecutor: micro_batch_size={micro_batch_size!r} is not honoured: each WSE takes its "
                 "share of the batch whole")
        if profiler_activities:
            note("DataExecutor: profiler_activities is not honoured (see docs/running.md for traces)")
        self.listeners = _checked_listeners(listeners)
        self.user_iteration = 0
        self.on_cluster = False
        self._runs: dict = {}
        self.profile_window = None   # the active cstorch.profiler.profile's steps of this loop (a StepWindow)
        self._samples = None    # a CSX loop's samples (cs_torch/loader_replay.py)
        self.profiler = Profiler()
        self._artifact_dir = None

    @property
    def artifact_dir(self) -> Path:
        """This executor's own folder under the backend's artifact folder (executors/<n>, n counting the
        process's executors from 0), made on first use: what a run writes about this loop goes there."""
        if self._artifact_dir is None:
            number = next(_EXECUTOR_NUMBERS)
            self._artifact_dir = Path(self.backend.artifact_dir) / "executors" / f"{number:06d}"
            self._artifact_dir.mkdir(parents=True, exist_ok=True)
        return self._artifact_dir

    # ------------------------------------------------------------ the CS system (CSX backend)
    def cluster_run(self, traced):
        """The job that runs this traced step for this loop (started on its first step)."""
        from ..cluster_step import ClusterRun
        run = self._runs.get(traced)
        if run is None:
            if self._runs:
                raise CsTorchError("DataExecutor: one traced step per loop on the CS system (a loop is one job)")
            run = self._runs[traced] = ClusterRun.of_traced(traced, self, traced.wants_output)
        return run

    def worker_batch(self, index: int):
        from ..data import Batch
        return Batch(self._worker_loader, index)

    def _plan_batches(self):
        """The global batches the input workers stream, as torch tensors, step after step."""
        from .. import session as session_mod
        from ..cluster_step import plan_batches, worker_loader
        self._worker_loader, self._samples = worker_loader(self.dataloader, session_mod._seed, self.total_steps,
                                                           self.backend.artifact_dir)
        return plan_batches(self._worker_loader, self._samples)

    def sync_weights(self) -> None:
        """The weights (and optimizer state) of this loop's jobs into the torch module."""
        for run in self._runs.values():
            run.sync()

    def _finish_runs(self, exc) -> None:
        runs, self._runs = list(self._runs.values()), {}
        for run in runs:
            run.finish(exc)

    @property
    def total_steps(self) -> int:
        if self.backend.compile_only or self.backend.validate_only:
            return 1
        return self.num_steps if self.num_steps is not None else len(self.dataloader)

    @property
    def iteration(self) -> int:
        """The step in progress, from 0 (user_iteration counts from 1)."""
        return max(self.user_iteration - 1, 0)

    @property
    def on_final_iteration(self) -> bool:
        return self.user_iteration == self.total_steps

    @property
    def on_checkpoint_step(self) -> bool:
        if isinstance(self.checkpoint_steps, Schedule):   # its steps are 0-based, and it says of the last
            return self.user_iteration - 1 in self.checkpoint_steps
        if not self.checkpoint_steps:
            return self.on_final_iteration
        return self.user_iteration % self.checkpoint_steps == 0 or self.on_final_iteration

    def __len__(self) -> int:
        return self.total_steps

    def __iter__(self):
        total = self.total_steps
        self.user_iteration = 0
        self.on_cluster = self.backend.is_csx and not (self.backend.compile_only or self.backend.validate_only)
        if self.on_cluster and self.listeners:   # the traced tensors stay on the WSEs; no step hands them back
            raise CsTorchError(f"DataExecutor: listener {self.listeners[0].listener_name} is fed on the CPU "
                               "backend only; on CSX the traced tensors are not handed back (drop listeners)")
        _current.append(self)
        exc, window = None, None
        try:
            window = self.profile_window = StepWindow.of_loop(self.backend.is_csx, total)   # profiler's steps
            source = self._plan_batches() if self.on_cluster else self._epochs()
            self.profiler.rate_tracker.start()
            for batch in source:
                self.user_iteration += 1
                samples = _samples(batch)
                self.profiler.rate_tracker.add(samples)
                if isinstance(self.dataloader, DataLoader):
                    self.dataloader.samples_streamed += samples
                if window is not None:
                    window.before_step(self.user_iteration)
                yield batch
                if window is not None:
                    window.after_step(self.user_iteration)
                if self.user_iteration >= total:
                    break
        except GeneratorExit:   # the loop was left (break, or an exception between steps): steps done are kept
            raise
        except BaseException as error:
            exc = error
            raise
        finally:
            _current.remove(self)
            if window is not None:
                window.close()
            if self._samples is not None:   # the generators as iterating the loader would leave them
                self._samples, samples = None, self._samples
                samples.hand_back()
            try:
                self._finish_runs(exc)   # every process of the job stops, however the loop ended
            finally:
                if self.writer is not None:
                    self.writer.flush()

    def _epochs(self):
        while True:
            produced = False
            for batch in self.dataloader:
                produced = True
                yield batch
            if not produced:
                raise CsTorchError("DataExecutor: the data loader produced no batch")


def _checked_listeners(listeners) -> list:
    """DataExecutor(listeners=): tensor listeners (cstorch.experimental.listener.create_listener's)."""
    from ..experimental.listener import TensorListener
    listeners = list(listeners or [])
    for listener in listeners:
        if not isinstance(listener, TensorListener):
            raise CsTorchError(f"DataExecutor: listeners must be made by experimental.listener.create_listener, "
                               f"got {type(listener).__name__}")
    return listeners


class RateTracker:
    """Samples per second of the loop (the real API's executor.profiler.rate_tracker): `rate`
    over the last step, `global_rate` since the loop began."""

    def __init__(self):
        self.total_samples, self._began, self._last, self.rate = 0, None, None, 0.0

    def start(self) -> None:
        self.total_samples, self._began, self._last, self.rate = 0, time.monotonic(), time.monotonic(), 0.0

    def add(self, samples: int) -> None:
        now = time.monotonic()
        if self._last is not None and now > self._last:
            self.rate = samples / (now - self._last)
        self._last = now
        self.total_samples += samples

    @property
    def total_time(self) -> float:
        return (self._last - self._began) if self._began is not None else 0.0

    @property
    def global_rate(self) -> float:
        return self.total_samples / self.total_time if self.total_time > 0 else 0.0


class Profiler:
    """executor.profiler: its rate tracker (profiler activities are not emulated, see above)."""

    def __init__(self):
        self.rate_tracker = RateTracker()


def _samples(batch) -> int:
    """The rows of a batch: dim 0 of its first tensor (0 when it holds none)."""
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return next((n for n in (_samples(b) for b in batch) if n), 0)
    shape = getattr(batch, "shape", None)
    return int(shape[0]) if shape else 0


def compute_num_steps(dataloader, initial_step: int = 0, num_steps: int | None = None,
                      max_steps: int | None = None, num_epochs: int | None = None,
                      steps_per_epoch: int | None = None, grad_accum_steps: int = 1) -> int:
    """Steps to run from `initial_step`, as the real API counts them: the smallest of num_steps,
    max_steps - initial_step and num_epochs * steps_per_epoch (by default the loader's length, over
    grad_accum_steps); num_steps and num_epochs together are an error, and at least one is needed."""
    for name, value, zero_ok in (("initial_step", initial_step, True), ("num_steps", num_steps, False),
                                 ("max_steps", max_steps, False), ("num_epochs", num_epochs, False),
                                 ("steps_per_epoch", steps_per_epoch, False),
                                 ("grad_accum_steps", grad_accum_steps, False)):
        if value is None and name not in ("initial_step", "grad_accum_steps"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero_ok else 1):
            raise ValueError(f"compute_num_steps: {name} must be {'a non-negative' if zero_ok else 'a positive'} "
                             f"integer, got {value!r}")
    if num_epochs is not None and num_steps is not None:
        raise ValueError("compute_num_steps: give num_epochs or num_steps, not both")
    try:
        batches = len(dataloader)
    except TypeError:   # a loader of unknown length: steps only
        if num_epochs is not None:
            raise ValueError("compute_num_steps: num_epochs needs a data loader of known length; give "
                             "num_steps or max_steps") from None
        batches = None
    if batches is not None:
        if batches < 1:
            raise ValueError("compute_num_steps: the data loader makes no batch")
        if steps_per_epoch is not None and steps_per_epoch > batches:
            raise ValueError(f"compute_num_steps: steps_per_epoch {steps_per_epoch} exceeds the {batches} "
                             "batches of an epoch")
        per_epoch = steps_per_epoch or batches
        if grad_accum_steps > per_epoch:
            raise ValueError(f"compute_num_steps: grad_accum_steps {grad_accum_steps} exceeds the {per_epoch} "
                             "batches of an epoch")
        per_epoch //= grad_accum_steps
    candidates = []
    if num_epochs is not None:
        candidates.append(num_epochs * per_epoch)
    if num_steps is not None:
        candidates.append(num_steps)
    if max_steps is not None:
        if max_steps <= initial_step:
            raise ValueError(f"compute_num_steps: the initial step {initial_step} is already at max_steps "
                             f"{max_steps}")
        candidates.append(max_steps - initial_step)
    if not candidates:
        raise ValueError("compute_num_steps: give one of num_epochs, num_steps or max_steps")
    return min(candidates)


@runtime_checkable
class RestartableDataLoader(Protocol):
    """The real API's protocol of a loader that saves and restores its place at checkpoints. A loader
    with these methods is one; the emulator's input workers restart from the batch plan, a function of
    the step, so they call none of them."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...

    def aggregate_state_dict(self, worker_states: list) -> dict: ...

    def deaggregate_state_dict(self, aggregated_state_dict: dict) -> dict: ...


# `cerebras.pytorch.utils.data.data_executor` (where the real package defines DataExecutor) is this module.
data_executor = sys.modules[__name__]


def __getattr__(name: str):
    if name == "SyntheticDataset":   # it needs torch: loaded when asked for
        from .synthetic import SyntheticDataset
        return SyntheticDataset
    if name == "DistributedSampler":   # likewise
        from .distributed_sampler import DistributedSampler
        return DistributedSampler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
