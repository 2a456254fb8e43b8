"""The timeline: spans recorded in every process, merged by the chief into one trace file.

    with trace.span("fwd", step=step, layer=index):
        out = layer_forward(...)

Each process has one recorder (RECORDER). It is off unless the job asked for
a timeline (`csrun_wse --trace`: CS_TRACE=1 for the chief and the input
workers, and `"trace": true` in LOAD_MODEL for MemoryX, SwarmX and the WSEs,
so a long-lived CS system traces only the jobs that ask). Off, a span site
costs one attribute check and returns a shared do-nothing context manager.

Spans are kept in memory as (name, start_ns, dur_ns, step, layer) on the
process's monotonic clock (time.monotonic_ns). At the end of the run the
chief asks every process for them (GET_TRACE, answered by TRACE, see
protocol.py) and puts every span on its own clock. A process that names the
same kernel (boot id) as the chief reads the same CLOCK_MONOTONIC: its offset
is exactly 0. For any other, the offset is estimated from that round trip as
NTP does: the chief sends at t0 (its clock), the process receives at t1 and
answers at t2 (its clock), the chief receives at t3; the offset is
((t1 - t0) + (t2 - t3)) / 2, off by at most half the round trip whatever the
two clocks read, so processes on different hosts line up without
synchronised clocks. `write_chrome_trace` writes the Chrome trace event format (JSON,
"X" events in microseconds, one pid per process named by a process_name
metadata event), which Perfetto (https://ui.perfetto.dev) and
chrome://tracing open.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cs_runtime import spans
from cs_runtime.wire.protocol import MAX_SPAN_NAME_CHARS, MAX_SPAN_NAMES, Message, Msg

# The recorder (RECORDER, span, now_ns) is spans.py's, named here too: the timeline's one API.
TRACE_ENV, MAX_SPANS, RECORDER, Recorder, now_ns, span, enabled_from_env = (
    spans.TRACE_ENV, spans.MAX_SPANS, spans.RECORDER, spans.Recorder, spans.now_ns, spans.span, spans.enabled_from_env)


# ---------------------------------------------------------------- on the wire
def pack_spans(recorded: list[tuple]) -> tuple[list[str], dict[str, np.ndarray]]:
    """(span names, arrays) for a TRACE message: names travel once, spans as int arrays."""
    names: dict[str, int] = {}
    ids = []
    for s in recorded:
        name = s[0][:MAX_SPAN_NAME_CHARS]
        if name not in names and len(names) >= MAX_SPAN_NAMES - 1:
            name = "other"       # one name kept free for the rest
        ids.append(names.setdefault(name, len(names)))
    columns = list(zip(*recorded)) if recorded else [(), (), (), (), ()]
    arrays = {"name": np.array(ids, dtype=np.int32),
              "start_ns": np.array(columns[1], dtype=np.int64),
              "dur_ns": np.array(columns[2], dtype=np.int64),
              "step": np.array(columns[3], dtype=np.int64),
              "layer": np.array(columns[4], dtype=np.int64)}
    return list(names), arrays


def unpack_spans(names: list[str], arrays: dict) -> list[tuple]:
    """Inverse of pack_spans (the arrays were validated by protocol.decode)."""
    return [(names[int(i)], int(t), int(d), int(s), int(l)) for i, t, d, s, l in
            zip(arrays["name"], arrays["start_ns"], arrays["dur_ns"], arrays["step"], arrays["layer"])]


def reply(request: Message, role: str, rank: int, received_ns: int) -> Message:
    """TRACE: this process's spans (handed over, so a second request gets only newer ones)."""
    names, arrays = pack_spans(RECORDER.take())
    meta = {"role": role, "rank": rank, "names": names, "dropped": RECORDER.dropped, "clock": clock_id(),
            "recv_ns": received_ns, "send_ns": now_ns()}
    return Message(Msg.TRACE, step=request.step, meta=meta, arrays=arrays)


def clock_id() -> str:
    """Names this host's monotonic clock: the kernel's boot id (processes sharing it share the clock)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:64]
    except OSError:
        return ""


def clock_offset(t0: int, t1: int, t2: int, t3: int, remote_clock: str = "") -> int:
    """The remote clock minus the local one: 0 when both read the same kernel's
    monotonic clock, else estimated from one round trip (as NTP does)."""
    estimate = ((t1 - t0) + (t2 - t3)) // 2
    # With truly one clock the estimate is within half the round trip of 0; if not,
    # the same boot id hides another clock (a time namespace): trust the estimate.
    if remote_clock and remote_clock == clock_id() and abs(estimate) <= (t3 - t0) // 2 + 1000:
        return 0
    return estimate


# ---------------------------------------------------------------- the trace file
@dataclass
class ProcessTrace:
    name: str                 # the row: "chief", "worker0", "memoryx", "swarmx", "wse0"
    spans: list[tuple]        # (name, start_ns, dur_ns, step, layer) on the process's clock
    offset_ns: int = 0        # the process's clock minus the chief's
    dropped: int = 0
    args: dict = field(default_factory=dict)


ROW_ORDER = ("chief", "worker", "memoryx", "swarmx", "wse")


def _sort_key(name: str) -> tuple:
    role = name.rstrip("0123456789")
    rank = name[len(role):]
    return (ROW_ORDER.index(role) if role in ROW_ORDER else len(ROW_ORDER), int(rank or 0), name)


def chrome_events(processes: list[ProcessTrace]) -> list[dict]:
    """Trace events: per process a process_name row, then its spans on the chief's clock, in microseconds."""
    starts = [s[1] - p.offset_ns for p in processes for s in p.spans]
    origin = min(starts) if starts else 0
    events = []
    for pid, proc in enumerate(sorted(processes, key=lambda p: _sort_key(p.name)), start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": proc.name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": proc.name}})
        role = proc.name.rstrip("0123456789")
        for name, start, dur, step, layer in proc.spans:
            args = {k: v for k, v in (("step", step), ("layer", layer)) if v >= 0}
            events.append({"ph": "X", "name": name, "cat": role, "pid": pid, "tid": 0,
                           "ts": round((start - proc.offset_ns - origin) / 1000, 3),
                           "dur": round(dur / 1000, 3), "args": args})
    return events


def write_chrome_trace(path: Path, processes: list[ProcessTrace]) -> int:
    """Write the merged trace (atomically); returns the number of spans written."""
    meta = {p.name: {"offset_us": round(p.offset_ns / 1000, 3), "spans": len(p.spans),
                     "dropped": p.dropped, **p.args} for p in processes}
    doc = {"traceEvents": chrome_events(processes), "displayTimeUnit": "ms",
           "otherData": {"clock": "the chief's monotonic clock; offset 0 on the chief's host, else "
                                    "estimated from the GET_TRACE round trip",
                         "processes": meta}}
    path = Path(path)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":")))
    os.replace(tmp, path)
    return sum(len(p.spans) for p in processes)
