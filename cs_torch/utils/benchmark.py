"""cstorch.utils.benchmark: benchmark_dataloader, how fast an input function's loader makes batches.

    metrics = cstorch.utils.benchmark.benchmark_dataloader(input_fn, num_epochs=2, steps_per_epoch=100)
    metrics.global_rate, metrics.total_steps, metrics.batch_specs, metrics.global_sample_rate

As the real API: the loader is built once (timed), then iterated epoch by epoch (a new iterator each
epoch, its making timed apart), for steps_per_epoch batches or the whole epoch; rates are sampled at
each epoch's first step and every `sampling_frequency` steps; every batch's structure (the tree of
containers, each tensor's shape and dtype) is counted, since a CSX run needs one. Rates are in
batches (steps) a second, wall clock. The optional profiling activities (process memory and I/O)
are not emulated and are refused by name.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta

from .nest import visit_structure
from .tracker import RateTracker

_log = logging.getLogger(__name__)
DEFAULT_SAMPLING_FREQUENCY = 100


@dataclass(frozen=True)
class TensorSpec:
    scope: tuple
    shape: tuple
    dtype: str


@dataclass(frozen=True)
class BatchSpec:
    """A batch's structure: each tensor's place in it, shape and dtype."""
    tensors: tuple

    @staticmethod
    def from_batch(batch) -> "BatchSpec":
        leaves = visit_structure(batch, lambda item: hasattr(item, "shape") and hasattr(item, "dtype"))
        return BatchSpec(tuple(TensorSpec(tuple(scope), tuple(t.shape), str(t.dtype)) for scope, t in leaves))


@dataclass
class BatchSpecOccurence:
    epoch_step: int   # where the structure was first seen
    epoch: int
    count: int        # how often, over all epochs


@dataclass
class BatchMetrics:
    epoch_step: int
    global_step: int
    local_rate: float    # steps a second since the step before
    global_rate: float   # steps a second since the first epoch began
    profile_activities: dict = field(default_factory=dict)
    sampling_time_ns: int = field(default_factory=time.time_ns)


@dataclass
class EpochMetrics:
    iterator_creation: timedelta = timedelta(0)
    iteration_time: timedelta = timedelta(0)
    total_steps: int = 0
    batch_metrics: list = field(default_factory=list)
    start_time_ns: int = field(default_factory=time.time_ns)
    end_time_ns: int = 0

    @property
    def total_time(self) -> timedelta:
        return self.iterator_creation + self.iteration_time


@dataclass
class Metrics:
    dataloader_build_time: timedelta = timedelta(0)
    epoch_metrics: list = field(default_factory=list)
    batch_specs: dict = field(default_factory=dict)
    total_time: timedelta = timedelta(0)
    global_rate: float = 0.0
    is_partial: bool = True   # until every epoch ran (an interrupted benchmark keeps what it measured)
    start_time_ns: int = field(default_factory=time.time_ns)
    end_time_ns: int = 0

    @property
    def total_steps(self) -> int:
        return sum(epoch.total_steps for epoch in self.epoch_metrics)

    @property
    def global_sample_rate(self) -> float | None:
        """Samples a second: only when every batch has one structure whose tensors share a batch size."""
        if len(self.batch_specs) != 1:
            return None
        sizes = {t.shape[0] if t.shape else None for t in next(iter(self.batch_specs)).tensors}
        if len(sizes) != 1 or None in sizes:
            return None
        return self.global_rate * sizes.pop()


def _elapsed(since: float) -> timedelta:
    return timedelta(seconds=time.monotonic() - since)


def _checked(num_epochs, steps_per_epoch, sampling_frequency, profile_activities) -> tuple[int, int]:
    if profile_activities:
        if not isinstance(profile_activities, (list, tuple, set)):
            raise TypeError(f"benchmark_dataloader: profile_activities must be a list, got {profile_activities!r}")
        raise ValueError(f"benchmark_dataloader: profiling activities {sorted(profile_activities)} are not "
                         "emulated (the rates and batch structures are measured)")
    num_epochs = 1 if num_epochs is None else num_epochs
    if num_epochs <= 0:
        raise ValueError(f"benchmark_dataloader: num_epochs must be positive, got {num_epochs}")
    sampling_frequency = DEFAULT_SAMPLING_FREQUENCY if sampling_frequency is None else sampling_frequency
    if sampling_frequency < 0:
        raise ValueError(f"benchmark_dataloader: sampling_frequency must be non-negative, got {sampling_frequency}")
    if steps_per_epoch is not None and steps_per_epoch <= 0:
        raise ValueError(f"benchmark_dataloader: steps_per_epoch must be positive, got {steps_per_epoch}")
    return num_epochs, sampling_frequency


def benchmark_dataloader(input_fn, num_epochs: int | None = None, steps_per_epoch: int | None = None,
                         sampling_frequency: int | None = None, profile_activities=None,
                         print_metrics: bool = True) -> Metrics:
    """Iterate input_fn()'s loader num_epochs times (one by default) and measure it (the module's docstring)."""
    num_epochs, sampling_frequency = _checked(num_epochs, steps_per_epoch, sampling_frequency, profile_activities)
    metrics = Metrics()
    start = time.monotonic()
    try:
        loader = input_fn()
    except Exception as e:
        raise RuntimeError("benchmark_dataloader: failed to create the dataloader") from e
    metrics.dataloader_build_time = _elapsed(start)
    overall = RateTracker()
    try:
        for epoch in range(1, num_epochs + 1):
            metrics.epoch_metrics.append(_run_epoch(loader, epoch, steps_per_epoch, sampling_frequency, metrics,
                                                    overall))
        metrics.is_partial = False
    except KeyboardInterrupt:
        _log.warning("benchmark_dataloader: interrupted; the metrics are partial")
    finally:
        metrics.total_time = timedelta(seconds=overall.elapsed_seconds())
        metrics.global_rate = overall.global_rate()
        metrics.end_time_ns = time.time_ns()
    if print_metrics and metrics.total_steps:
        print(summary(metrics))
    if len(metrics.batch_specs) > 1:
        _log.warning(f"benchmark_dataloader: {len(metrics.batch_specs)} batch structures; a CSX run needs "
                     "every batch to have one structure, shapes and dtypes")
    return metrics


def _run_epoch(loader, epoch, steps_per_epoch, sampling_frequency, metrics, overall) -> EpochMetrics:
    result, began = EpochMetrics(), time.monotonic()
    iterator = iter(loader)
    result.iterator_creation, began = _elapsed(began), time.monotonic()
    local = RateTracker()
    while steps_per_epoch is None or result.total_steps < steps_per_epoch:
        try:
            batch = next(iterator)
        except StopIteration:
            if result.total_steps == 0:
                raise RuntimeError(f"benchmark_dataloader: no batches at epoch {epoch}") from None
            break
        result.total_steps += 1
        local.add(1)
        overall.add(1)
        step = result.total_steps
        if step == 1 or (sampling_frequency > 0 and step % sampling_frequency == 0):
            result.batch_metrics.append(BatchMetrics(step, metrics.total_steps + step, local.global_rate(),
                                                     overall.global_rate()))
        _count_spec(metrics, BatchSpec.from_batch(batch), step, epoch)
        result.iteration_time = _elapsed(began)
        local.reset()
    result.end_time_ns = time.time_ns()
    return result


def _count_spec(metrics: Metrics, spec: BatchSpec, step: int, epoch: int) -> None:
    if spec in metrics.batch_specs:
        metrics.batch_specs[spec].count += 1
    else:
        metrics.batch_specs[spec] = BatchSpecOccurence(step, epoch, 1)


def summary(metrics: Metrics) -> str:
    """The benchmark in a few lines: build time, steps, rates, and each epoch."""
    lines = [f"Dataloader build time: {metrics.dataloader_build_time}",
             f"Total steps: {metrics.total_steps}, total time: {metrics.total_time}",
             f"Global rate: {metrics.global_rate:.2f} steps/s"
             + (f", {metrics.global_sample_rate:.2f} samples/s" if metrics.global_sample_rate else ""),
             f"Batch structures: {len(metrics.batch_specs)}"]
    lines += [f"Epoch {i}: {e.total_steps} steps, iterator made in {e.iterator_creation}, iterated in "
              f"{e.iteration_time}" for i, e in enumerate(metrics.epoch_metrics, start=1)]
    return "\n".join(lines)


__all__ = ["BatchSpec", "Metrics", "benchmark_dataloader"]
