"""cstorch.profiler: where a range of training steps spends its time, by the model's modules.

    with cstorch.profiler.profile(schedule=cstorch.profiler.schedule(start_step=2, end_step=3)) as prof:
        for step, batch in enumerate(executor, start=1):
            training_step(batch)
    prof.export_chrome_trace("chrome_trace.json"); print(prof.get_summary())

As the real API: `schedule(start_step=, end_step=)` names the steps profiled (1-based, both
included; -1 asks for none), one `profile` is active at a time, and a DataExecutor started inside
it checks the range against its steps (between 1 and num_steps). The real API profiles the ops on
the CS system (a CSX run only; a CPU run refuses). Here the CS system's maths runs on the CPU
backend, so that is where steps are profiled: each unit of the captured program (a module of the
model, forward and backward) is timed on the executor in the steps of the range, and the times
become the chrome trace (`export_chrome_trace`, opened by Perfetto or chrome://tracing) and the
summary (the ten modules that took longest). On CSX the loop's job records the timeline of
every process (as `csrun_wse --trace` does, docs/running.md), and when the job ends the first WSE's
per-layer forward and backward spans of the steps asked for become the same events (a layer is a
unit of the captured program: a module). `host_activities` (the real API's ACT/WGT/CSX hosts) name
hosts the emulator has not, and are checked and kept only.
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
from typing import Callable

from cs_runtime import spans


NOT_ASKED = -1   # the model zoo's default start and end step: no profiling
_HOST = re.compile(r"(ACT|WGT|CSX)-(\d+|\*)$")


class ProfilerRegistry:
    """The one active profile."""
    _profiler = None

    @classmethod
    def set_profiler(cls, profiler) -> None:
        if cls._profiler is not None:
            raise RuntimeError("cstorch.profiler: a profiler is already active; only one is allowed")
        cls._profiler = profiler

    @classmethod
    def get_profiler(cls):
        return cls._profiler

    @classmethod
    def unset_profiler(cls) -> None:
        cls._profiler = None


def schedule(*, start_step: int, end_step: int) -> Callable[[], list[int]]:
    """The steps to profile, start_step to end_step, both included."""
    if start_step > end_step:
        raise ValueError(f"cstorch.profiler.schedule: start_step ({start_step}) must not be after end_step "
                         f"({end_step})")
    return lambda: [start_step, end_step]


def tensorboard_trace_handler(dir_name: str, worker_name: str | None = None, use_gzip: bool = False):
    """An on_trace_ready that writes the trace into dir_name as `<worker>.<ns>.pt.trace.json`."""
    def handler(prof) -> None:
        os.makedirs(dir_name, exist_ok=True)
        name = f"{worker_name or f'{socket.gethostname()}_{os.getpid()}'}.{time.time_ns()}.pt.trace.json"
        prof.export_chrome_trace(os.path.join(dir_name, name + (".gz" if use_gzip else "")))
    return handler


class profile:  # noqa: N801 (the real API's name)
    def __init__(self, *, schedule: Callable[[], list[int]], host_activities: list[str] | None = None,
                 on_trace_ready: Callable | None = None):
        for host in host_activities or []:
            if not _HOST.match(host):
                raise ValueError(f"cstorch.profiler: host {host!r} is not ACT-<n>, WGT-<n> or CSX-<n> (or -*)")
        self.schedule, self.host_activities, self.on_trace_ready = schedule, host_activities, on_trace_ready
        self.events: list[dict] = []   # (name, start, duration) of each unit timed, in the steps profiled
        self.appliance_response = None   # the real API's recorded profile: here the events, once recorded

    def __enter__(self):
        ProfilerRegistry.set_profiler(self)
        return self

    def __exit__(self, *exc) -> None:
        ProfilerRegistry.unset_profiler()

    # ------------------------------------------------------------ what a DataExecutor calls
    def steps_for(self, is_csx: bool, num_steps: int) -> tuple[int, int] | None:
        """The (first, last) step to profile of a loop of num_steps, checked; None when none is asked."""
        start, end = self.schedule()
        if start == NOT_ASKED:
            return None
        if not 1 <= start <= end <= num_steps:
            raise ValueError(f"cstorch.profiler: the steps profiled must lie between 1 and {num_steps}, "
                             f"got {start}:{end}")
        return start, end

    def record(self, step_spans: list[tuple]) -> None:
        """The executor's spans of the steps profiled (cs_runtime/spans.py); the trace is then ready."""
        first = min((s[1] for s in step_spans), default=0)
        self.events = [{"name": name, "ts": (start - first) / 1e3, "dur": duration / 1e3}
                       for name, start, duration, _step, _unit in step_spans]
        self.appliance_response = self.events or None
        if self.on_trace_ready is not None and self.events:
            self.on_trace_ready(self)

    # ------------------------------------------------------------ the results
    def export_chrome_trace(self, path) -> None:
        """The steps profiled as Chrome trace events (microseconds); nothing is written before they ran."""
        if not self.events:
            return
        trace = {"traceEvents": [{**e, "ph": "X", "pid": 0, "tid": 0} for e in self.events],
                 "displayTimeUnit": "ns"}
        with open(path, "w") as f:
            json.dump(trace, f, indent=1)

    def get_summary(self) -> str | None:
        """The ten modules that took longest in the steps profiled (ms, and their share of the time)."""
        if not self.events:
            return None
        totals: dict[str, float] = {}
        for e in self.events:
            totals[e["name"]] = totals.get(e["name"], 0.0) + e["dur"]
        whole = max(e["ts"] + e["dur"] for e in self.events)
        rows = sorted(totals.items(), key=lambda kv: -kv[1])[:10]
        lines = [f"{'PYTORCH MODULE NAME':40} {'TIME (ms)':>10} {'% TIME':>7}"]
        lines += [f"{name[:40]:40} {us / 1e3:10.3f} {100 * us / whole:7.2f}" for name, us in rows]
        return "\n".join(lines)


# The WSE's span of a layer's forward (train or eval) and backward: the profiler's event names.
WSE_PASSES = {"fwd": "{}", "eval_fwd": "{}", "bwd": "{} (backward)"}


class StepWindow:
    """A DataExecutor loop's side of the active profile: spans recorded from the first step profiled
    through the last, then handed over. On CSX (`csx`) the loop's job records them (ClusterRun) and
    hands them over as it ends (`record_job`)."""

    def __init__(self, prof: profile, steps: tuple[int, int], csx: bool = False):
        self.prof, (self.start, self.end), self.csx = prof, steps, csx

    @classmethod
    def of_loop(cls, is_csx: bool, num_steps: int) -> "StepWindow | None":
        prof = ProfilerRegistry.get_profiler()
        steps = prof.steps_for(is_csx, num_steps) if prof is not None else None
        return cls(prof, steps, is_csx) if steps is not None else None

    def before_step(self, step: int) -> None:
        if step == self.start and not self.csx:
            spans.RECORDER.reset(True)

    def after_step(self, step: int) -> None:
        if step == self.end and not self.csx:
            self.prof.record(spans.RECORDER.take())
            spans.RECORDER.reset(False)

    def record_job(self, wse_spans: list[tuple], layer_names: list[str]) -> None:
        """A CSX job's steps asked for, from its first WSE's spans (name, start_ns, dur_ns, step, layer):
        the job's n-th step (in the order of the steps its spans name) is the loop's n-th."""
        passes = [s for s in wse_spans if s[0] in WSE_PASSES and 0 <= s[4] < len(layer_names)]
        order = {step: n for n, step in enumerate(sorted({s[3] for s in passes}), start=1)}
        self.prof.record([(WSE_PASSES[name].format(layer_names[layer]), start, duration, step, layer)
                          for name, start, duration, step, layer in passes
                          if self.start <= order[step] <= self.end])

    def close(self) -> None:
        """The loop ended (or was left): stop recording."""
        if not self.csx:
            spans.RECORDER.reset(False)


__all__ = ["ProfilerRegistry", "profile", "schedule", "tensorboard_trace_handler"]
