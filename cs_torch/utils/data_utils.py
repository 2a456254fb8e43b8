"""cstorch.utils.data.utils: the step schedule of an executor and a batch's size.

    Schedule([Schedule.Range(start=4, step=5, end=20, include_last=True)])
        holds the 0-based loop steps 4, 9, 14 and 19 (the last, 19, because include_last).

The model zoo's trainer hands a DataExecutor its checkpoint steps as a Schedule
(or as one integer, every N steps); `step in schedule` is what the executor asks.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Range:
    start: int
    end: int | None = None
    step: int = 1
    include_last: bool = False

    def __post_init__(self):
        if not isinstance(self.step, int) or self.step < 1:
            raise ValueError(f"Schedule.Range: step must be a positive integer, got {self.step!r}")
        if not isinstance(self.start, int) or self.start < 0:
            raise ValueError(f"Schedule.Range: start must be a non-negative integer, got {self.start!r}")

    def __contains__(self, index: int) -> bool:
        if self.end is not None and index >= self.end:
            return False
        if self.include_last and self.end is not None and index == self.end - 1:
            return True
        return index >= self.start and (index - self.start) % self.step == 0

    def range(self) -> range:
        """The steps start, start + step, ... below end (the last step not added)."""
        if self.end is None:
            raise ValueError("Schedule.Range: an open range (no end) has no range()")
        return range(self.start, self.end, self.step)

    def __iter__(self):
        steps = self.range()
        yield from steps
        if self.include_last and self.end - 1 >= self.start and self.end - 1 not in steps:
            yield self.end - 1

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def next_immediate_step(self, index: int) -> int:
        """The first step of the range at or after `index` (ignoring end)."""
        if index <= self.start:
            return self.start
        return self.start + -(-(index - self.start) // self.step) * self.step


@dataclass
class Schedule:
    """Loop steps (0-based): integers and ranges; `index in schedule`."""
    ranges: list = field(default_factory=list)

    Range = _Range

    def __post_init__(self):
        for item in self.ranges:
            if isinstance(item, bool) or not isinstance(item, (int, _Range)):
                raise ValueError(f"Schedule: expected step integers and Schedule.Range, got {item!r}")

    def __contains__(self, index: int) -> bool:
        return any(index == item if isinstance(item, int) else index in item for item in self.ranges)


def infer_batch_size(batch) -> int | None:
    """The samples of a nested batch: the dim 0 every tensor in it shares (None when it holds no
    tensor with a dim); tensors that disagree are an error. Inside a captured step the size is the
    capture's symbolic batch, kept as it is (int() of it would fix the program to one batch size)."""
    sizes: list = []
    _collect_rows(batch, sizes)
    known = [size for size in sizes if isinstance(size, int)]   # comparing symbolic sizes would fix them
    if any(size != known[0] for size in known[1:]):
        raise ValueError(f"infer_batch_size: the batch's tensors disagree on dim 0: {sizes}")
    symbolic = [size for size in sizes if not isinstance(size, int)]
    return (symbolic or sizes or [None])[0]


def _collect_rows(obj, sizes: list) -> None:
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for item in obj:
            _collect_rows(item, sizes)
        return
    shape = getattr(obj, "shape", None)
    if shape is not None and len(shape) > 0:
        sizes.append(shape[0])
