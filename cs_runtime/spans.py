"""Timeline spans, recorded in this process (the bottom half of cs_runtime/trace.py).

    with spans.span("fwd", step=step, layer=index):
        out = layer_forward(...)

The maths (numerics/) records spans too, so the recorder sits at the bottom
of the layers and knows nothing of sockets; trace.py sends the spans to the
chief (TRACE) and writes the merged timeline.
"""
from __future__ import annotations

import time

from cs_runtime import env

# Spans a process keeps for one job; a TRACE message carries at most this many (protocol.py).
MAX_SPANS = 500_000

TRACE_ENV = env.TRACE.name

now_ns = time.monotonic_ns   # CLOCK_MONOTONIC on Linux: one clock for every process of a host


class Recorder:
    """The process's spans, in the order they ended."""

    def __init__(self) -> None:
        self.enabled = False
        self.spans: list[tuple] = []
        self.dropped = 0

    def reset(self, enabled: bool) -> None:
        """Start a job's recording (or stop recording), forgetting earlier spans."""
        self.enabled, self.spans, self.dropped = bool(enabled), [], 0

    def add(self, name: str, start_ns: int, end_ns: int, step: int = -1, layer: int = -1) -> None:
        if len(self.spans) >= MAX_SPANS:
            self.dropped += 1
            return
        self.spans.append((name, start_ns, end_ns - start_ns, step, layer))

    def take(self) -> list[tuple]:
        spans, self.spans = self.spans, []
        return spans


RECORDER = Recorder()


class _Span:
    __slots__ = ("name", "step", "layer", "start")

    def __init__(self, name: str, step: int, layer: int):
        self.name, self.step, self.layer = name, step, layer

    def __enter__(self):
        self.start = now_ns()
        return self

    def __exit__(self, *exc) -> bool:
        RECORDER.add(self.name, self.start, now_ns(), self.step, self.layer)
        return False


class _NoSpan:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


_NO_SPAN = _NoSpan()


def span(name: str, step: int = -1, layer: int = -1):
    """Context manager recording `name` (with the step and layer) when tracing is on."""
    if not RECORDER.enabled:
        return _NO_SPAN
    return _Span(name, step, layer)


def enabled_from_env() -> bool:
    return env.TRACE.get()
