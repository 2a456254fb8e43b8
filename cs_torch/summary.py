"""Summaries: cstorch.summarize_scalar, cstorch.summarize_tensor and the DataExecutor's writer.

    writer = cstorch.utils.tensorboard.SummaryWriter(log_dir="model_dir/train")
    executor = cstorch.utils.data.DataExecutor(loader, num_steps=100, writer=writer)
    ...  inside the traced step:  cstorch.summarize_scalar("loss", loss)
                                  cstorch.summarize_tensor("logits", logits)
    reader = cstorch.utils.tensorboard.SummaryReader("model_dir/train")
    reader.read_tensor("logits")          # [TensorDescriptor(step, utctime, tensor), ...]

A value summarized inside a traced step is written after each step at the
executor's step number, with that step's value (a tensor other than the
loss is computed from the model's output the step hands back, see
cs_torch/tracing.py); outside a step, at once. Scalars go to TensorBoard's
event file; tensors, whole, to `log_dir/tensors/NAME/STEP.npy` (numpy's
format, read back without pickle), which SummaryReader reads.
"""
from __future__ import annotations

import functools
import os
import re
import types
from typing import NamedTuple

import numpy as np

from .backends import note
from .recording import current_executor, probing, replaying

_said = set()


class SummaryWriter:
    """cstorch.utils.tensorboard.SummaryWriter: TensorBoard event files (tensorboardX)."""

    def __init__(self, log_dir: str | None = None, base_step: int = 0, **kwargs):
        from tensorboardX import SummaryWriter as _Writer
        self.log_dir = log_dir or "runs"
        # The step of the executor's first step, less one (the model zoo passes its global step
        # + 1 when it resumes): a summary of executor step n is written at base_step + n - 1.
        self.base_step = max(int(base_step) - 1, 0)
        self._writer = _Writer(self.log_dir, **kwargs)

    def add_scalar(self, tag, value, global_step=None):
        self._writer.add_scalar(tag, float(value), global_step)

    def add_tensor(self, tag, tensor, global_step=None):
        """The tensor's value at this step, whole (read back by SummaryReader.read_tensor)."""
        folder = os.path.join(self.log_dir, TENSOR_DIR, _file_name(tag))
        os.makedirs(folder, exist_ok=True)
        array = tensor.detach().cpu().numpy() if hasattr(tensor, "detach") else np.asarray(tensor)
        np.save(os.path.join(folder, f"{int(global_step or 0)}.npy"), array, allow_pickle=False)

    @property
    def cs_events_dir(self) -> str:
        """Where tensor summaries go (the real writer's name for its folder of them)."""
        return os.path.join(self.log_dir, TENSOR_DIR)

    def _get_file_writer(self):
        """torch's SummaryWriter's: the event file writer; `.event_writer._file_name` is the event
        file's path (the model zoo links it into its run's folder)."""
        events = self._writer._get_file_writer().event_writer
        return types.SimpleNamespace(event_writer=types.SimpleNamespace(_file_name=events._ev_writer._file_name))

    def flush(self):
        self._writer.flush()

    def close(self):
        self._writer.close()


TENSOR_DIR = "tensors"


def _file_name(tag: str) -> str:
    """A summary's name as a folder name (characters other than letters, digits, . - _ become _)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", str(tag)) or "_"


class TensorDescriptor(NamedTuple):
    step: int
    utctime: float
    tensor: object


class SummaryReader:
    """cstorch.utils.tensorboard.SummaryReader: the tensors summarize_tensor wrote under log_dir."""

    def __init__(self, log_dir: str, **kwargs):
        self.log_dir = log_dir

    def tensor_names(self) -> list[str]:
        root = os.path.join(self.log_dir, TENSOR_DIR)
        return sorted(os.listdir(root)) if os.path.isdir(root) else []

    def read_tensor(self, name: str, step: int | None = None) -> list[TensorDescriptor]:
        """The tensor's summaries, by step (only `step`'s when given); [] when there are none."""
        import torch
        folder = os.path.join(self.log_dir, TENSOR_DIR, _file_name(name))
        if not os.path.isdir(folder):
            return []
        found = []
        for entry in os.listdir(folder):
            stem, ext = os.path.splitext(entry)
            if ext != ".npy" or not stem.isdigit() or (step is not None and int(stem) != step):
                continue
            path = os.path.join(folder, entry)
            array = np.load(path, allow_pickle=False)
            found.append(TensorDescriptor(int(stem), os.path.getmtime(path), torch.from_numpy(array)))
        return sorted(found, key=lambda d: d.step)


def _value(v) -> float:
    return float(v.item() if hasattr(v, "item") else v)


def summarize_scalar(name: str, value) -> None:
    probe = probing()
    if probe is not None:
        probe.record("summary", name, value)
        return
    replay = replaying()
    if replay is None:
        write_scalar(name, value)
    elif replay.effects is not None:   # a step's rerun: this step's value
        replay.effects.append((value,))


def summarize_tensor(name: str, tensor) -> None:
    """Save the tensor's value at each step (cstorch.utils.tensorboard.SummaryReader reads it)."""
    probe = probing()
    if probe is not None:   # a traced step's effect: written after each step with its value
        probe.record("closure", functools.partial(write_tensor, name), (tensor,), {})
        return
    replay = replaying()
    if replay is None:
        write_tensor(name, tensor)
    elif replay.effects is not None:
        replay.effects.append(((tensor,), {}))


def write_tensor(name: str, tensor) -> None:
    writer = writer_of("summarize_tensor")
    if writer is not None:
        writer.add_tensor(name, tensor, writer.base_step + current_executor().user_iteration)


def writer_of(what: str):
    """The writer of the executor in progress (None, said once, when it has none)."""
    executor = current_executor()
    writer = executor.writer if executor is not None else None
    if writer is None and "no-writer" not in _said:
        _said.add("no-writer")
        note(f"{what}: no SummaryWriter was given to the DataExecutor (writer=); summaries are dropped")
    return writer


def write_scalar(name: str, value) -> None:
    writer = writer_of("summarize_scalar")
    if writer is not None:
        writer.add_scalar(name, _value(value), writer.base_step + current_executor().user_iteration)
