"""Summaries to TensorBoard: cstorch.summarize_scalar and the DataExecutor's writer.

    writer = cstorch.utils.tensorboard.SummaryWriter(log_dir="model_dir/train")
    executor = cstorch.utils.data.DataExecutor(loader, num_steps=100, writer=writer)
    ...  inside the traced step:  cstorch.summarize_scalar("loss", loss)

A scalar summarized inside a traced step is written after each step at the
executor's step number; outside a step, at once.
"""
from __future__ import annotations

from .backends import note
from .recording import current_executor, probing, replaying

_said = set()


class SummaryWriter:
    """cstorch.utils.tensorboard.SummaryWriter: TensorBoard event files (tensorboardX)."""

    def __init__(self, log_dir: str | None = None, **kwargs):
        from tensorboardX import SummaryWriter as _Writer
        self.log_dir = log_dir or "runs"
        self._writer = _Writer(self.log_dir, **kwargs)

    def add_scalar(self, tag, value, global_step=None):
        self._writer.add_scalar(tag, float(value), global_step)

    def flush(self):
        self._writer.flush()

    def close(self):
        self._writer.close()


def _value(v) -> float:
    return float(v.item() if hasattr(v, "item") else v)


def summarize_scalar(name: str, value) -> None:
    probe = probing()
    if probe is not None:
        probe.record("summary", name, value)
        return
    if replaying() is None:
        write_scalar(name, value)


def write_scalar(name: str, value) -> None:
    executor = current_executor()
    writer = executor.writer if executor is not None else None
    if writer is None:
        if "no-writer" not in _said:
            _said.add("no-writer")
            note("summarize_scalar: no SummaryWriter was given to the DataExecutor (writer=); summaries are dropped")
        return
    writer.add_scalar(name, _value(value), executor.user_iteration)
