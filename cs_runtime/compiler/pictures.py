"""The pictures a run leaves in model_dir: plain SVG, openable anywhere (no browser tools).

    compile/wafer.svg      pipelined plans: where each kernel sits on the wafer, grouped by block
    compile/streaming.svg  weight streaming: one step, which unit is on the wafer when, its
                           weights in and gradients out
    timeline.svg           a --trace run: one measured step, a row per process, from trace.json

Each is a pure function of what it draws (the plan dict, the streaming schedule, the trace
document), so a reused artifact draws exactly what the compile that made it did. Labels that do
not fit their shape are left to the legend and the shape's tooltip (<title>), never drawn over
their neighbours; legends wrap into columns so they stay on the canvas.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from .planner import fmt_bytes

# Twelve colours that stay apart (Tableau 10 and two more); a group's kernels alternate shades.
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac", "#1b9e77", "#7570b3")
CHAR_PX = 7.0        # width of a character at FONT_PX, sans-serif, generous
FONT_PX = 12
ROW_PX = 18          # a legend row
MARGIN = 20
TITLE_PX = 40


def shade(color: str, k: int) -> str:
    """`color`, lighter for odd k: neighbours in one group stay apart."""
    if k % 2 == 0:
        return color
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{int(c + (255 - c) * 0.45):02x}" for c in (r, g, b))


def text_px(text: str) -> float:
    return CHAR_PX * len(text)


def svg_open(width: float, height: float, title: str) -> list[str]:
    return [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif" font-size="{FONT_PX}">',
            f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>',
            f'<text x="{MARGIN}" y="{MARGIN + 6}" font-size="15">{escape(title)}</text>']


def label_inside(x: float, y: float, w: float, h: float, text: str) -> str:
    """`text` centred in the box if it fits across it, else nothing."""
    if w >= text_px(text) + 6 and h >= FONT_PX + 2:
        return (f'<text x="{x + w / 2:.1f}" y="{y + h / 2 + 4:.1f}" text-anchor="middle">'
                f'{escape(text)}</text>')
    return ""


@dataclass
class Legend:
    """Rows of (colour, text) wrapped into columns `height` tall."""

    rows: list[tuple[str, str]]
    height: float

    @property
    def per_column(self) -> int:
        return max(1, int(self.height // ROW_PX))

    @property
    def column_px(self) -> float:
        return 24 + max((text_px(t) for _, t in self.rows), default=0)

    @property
    def width(self) -> float:
        return math.ceil(len(self.rows) / self.per_column) * self.column_px

    def draw(self, x0: float, y0: float) -> list[str]:
        out = []
        for i, (color, text) in enumerate(self.rows):
            x = x0 + (i // self.per_column) * self.column_px
            y = y0 + (i % self.per_column) * ROW_PX
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="12" height="12" fill="{color}"/>')
            out.append(f'<text x="{x + 18:.1f}" y="{y + 10:.1f}">{escape(text)}</text>')
        return out


def groups_of(items: list[dict[str, Any]], key: str) -> list[tuple[str, list[int]]]:
    """[(group, indices)] in first-seen order: consecutive kernels of a layer form its block."""
    order: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        order.setdefault(item[key], []).append(i)
    return list(order.items())


# ---------------------------------------------------------------- the wafer (pipelined)

WAFER_PX = 760      # width of the drawn grid


def render_wafer(plan: dict[str, Any]) -> str | None:
    """The PE grid, every kernel's rectangle coloured by its block (layer), each replica drawn;
    None unless the plan is pipelined."""
    if plan["execution_strategy"] != "pipelined":
        return None
    grid, kernels = plan["grid"], plan["kernels"]
    replicas = plan.get("num_replicas", 1)
    s = WAFER_PX / grid["cols"]
    gw, gh = grid["cols"] * s, grid["rows"] * s
    top = MARGIN + TITLE_PX
    blocks = groups_of(kernels, "layer")
    colors = {name: PALETTE[i % len(PALETTE)] for i, (name, _) in enumerate(blocks)}
    legend = Legend([(colors[name], f"{b + 1}. {name}: {len(idx)} kernel(s), "
                                    f"{sum(kernels[i]['pes'] for i in idx):,} PEs")
                     for b, (name, idx) in enumerate(blocks)], gh)
    width = MARGIN + gw + MARGIN + legend.width + MARGIN
    title = (f"{plan['model']}: pipelined on {grid['rows']} x {grid['cols']} PEs "
             f"({plan['target'].get('system', 'CS-2 (WSE-2)')}), {len(kernels)} kernels in {len(blocks)} blocks"
             + (f", {replicas} replicas" if replicas > 1 else "")
             + f", {plan['estimate']['active_pes_pct']:.1f}% of PEs active")
    width = max(width, MARGIN * 2 + text_px(title) * 15 / FONT_PX)
    out = svg_open(width, top + gh + 3 * MARGIN, title)
    out.append(f'<rect x="{MARGIN}" y="{top}" width="{gw:.1f}" height="{gh:.1f}" fill="#eeeeee" stroke="#333"/>')
    part_cols = grid["cols"] // replicas
    for rep in range(replicas):
        for b, (name, idx) in enumerate(blocks):
            for k, i in enumerate(idx):
                out += kernel_rect(kernels[i], shade(colors[name], k), rep * part_cols, s, top)
            out += block_number(kernels, idx, b, rep * part_cols, s, top + gh)
    out += legend.draw(MARGIN + gw + MARGIN, top)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def kernel_rect(k: dict[str, Any], color: str, col0: int, s: float, top: float) -> list[str]:
    r = k["rect"]
    x, y = MARGIN + (col0 + r["x"]) * s, top + r["y"] * s
    w, h = max(r["w"] * s, 1.5), max(r["h"] * s, 1.5)   # a one-PE kernel still shows
    name = escape(k["name"])
    out = [f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{color}" stroke="#222" '
           f'stroke-width="0.3" data-kernel="{name}"><title>{name} ({escape(k["layer"])}): {k["pes"]:,} PEs, '
           f'{r["w"]}x{r["h"]} at x={r["x"]}</title></rect>']
    label = label_inside(x, y, w, h, k["name"].rsplit(".", 1)[-1])
    return out + ([label] if label else [])


def block_number(kernels: list[dict], idx: list[int], b: int, col0: int, s: float, y: float) -> list[str]:
    """The block's legend number under its columns, when they are wide enough to hold it."""
    x0 = MARGIN + (col0 + min(kernels[i]["rect"]["x"] for i in idx)) * s
    x1 = MARGIN + (col0 + max(kernels[i]["rect"]["x"] + kernels[i]["rect"]["w"] for i in idx)) * s
    if x1 - x0 < text_px(str(b + 1)) + 2:
        return []
    return [f'<line x1="{x0 + 1:.1f}" y1="{y + 4:.1f}" x2="{x1 - 1:.1f}" y2="{y + 4:.1f}" stroke="#555"/>',
            f'<text x="{(x0 + x1) / 2:.1f}" y="{y + 18:.1f}" text-anchor="middle">{b + 1}</text>']


# ---------------------------------------------------------------- one weight-streaming step

@dataclass
class StreamedUnit:
    """One unit of a weight-streaming step, as the estimate sees it (seconds, bytes)."""

    name: str
    forward_s: float
    backward_s: float          # 0 in eval
    weight_bytes: int          # streamed in for its forward, and again for its backward
    grad_bytes: int            # streamed out after its backward
    stream_s: float            # seconds to stream its weights in once


def schedule(units: list[StreamedUnit]) -> list[tuple[int, str, float, float]]:
    """(unit index, "forward" | "backward", start, end): units in order, then back in reverse;
    each slot as long as the slower of its compute and its weights' stream (they overlap)."""
    slots, t = [], 0.0
    order = [(i, "forward") for i in range(len(units))]
    order += [(i, "backward") for i in reversed(range(len(units))) if units[i].backward_s > 0]
    for i, phase in order:
        compute = units[i].forward_s if phase == "forward" else units[i].backward_s
        length = max(compute, units[i].stream_s if units[i].weight_bytes else 0.0)
        slots.append((i, phase, t, t + length))
        t += length
    return slots


PHASE_COLORS = {"forward": "#4e79a7", "backward": "#f28e2b", "weights in": "#59a14f", "gradients out": "#e15759"}
CHART_PX = 640
UNIT_ROW_PX = 22


def render_streaming(title: str, units: list[StreamedUnit]) -> str:
    """A Gantt chart of one step: a row per unit, its forward and backward on the wafer, the
    weights it streams in before each and the gradients it streams out after its backward."""
    slots = schedule(units)
    total = max((end for *_, end in slots), default=0.0) or 1e-30
    names = [f"{i + 1}. {u.name}" for i, u in enumerate(units)]
    label_px = max((text_px(n) for n in names), default=0) + 10
    info_px = max((text_px(unit_info(u)) for u in units), default=0) + 10
    top = MARGIN + TITLE_PX + ROW_PX
    x0 = MARGIN + label_px
    height = top + UNIT_ROW_PX * len(units) + 3 * MARGIN
    width = max(x0 + CHART_PX + MARGIN + info_px, MARGIN * 2 + text_px(title) * 15 / FONT_PX)
    out = svg_open(width, height, title)
    legend = Legend([(c, p) for p, c in PHASE_COLORS.items()], ROW_PX)
    out += legend.draw(MARGIN, MARGIN + 16)
    scale = CHART_PX / total
    for i, (name, u) in enumerate(zip(names, units)):
        y = top + i * UNIT_ROW_PX
        out.append(f'<text x="{MARGIN}" y="{y + 14}">{escape(name)}</text>')
        out.append(f'<text x="{x0 + CHART_PX + MARGIN:.1f}" y="{y + 14}">{escape(unit_info(u))}</text>')
        out.append(f'<line x1="{x0}" y1="{y + UNIT_ROW_PX:.1f}" x2="{x0 + CHART_PX}" y2="{y + UNIT_ROW_PX:.1f}" '
                   'stroke="#ddd"/>')
    for i, phase, start, end in slots:
        u, y = units[i], top + i * UNIT_ROW_PX
        x, w = x0 + start * scale, max((end - start) * scale, 1.0)
        out.append(f'<rect x="{x:.1f}" y="{y + 5:.1f}" width="{w:.1f}" height="12" fill="{PHASE_COLORS[phase]}" '
                   f'data-unit="{escape(u.name)}" data-phase="{phase}"><title>{escape(u.name)} {phase}: '
                   f'{(end - start) * 1e6:.3g} us</title></rect>')
        if u.weight_bytes:   # its weights arrive while the slot runs
            out.append(stream_bar(x, y + 1, w, "weights in", u.weight_bytes, u.name))
        if phase == "backward" and u.grad_bytes:
            out.append(stream_bar(x, y + 18, w, "gradients out", u.grad_bytes, u.name))
    axis_y = top + UNIT_ROW_PX * len(units) + 6
    out.append(f'<line x1="{x0}" y1="{axis_y}" x2="{x0 + CHART_PX}" y2="{axis_y}" stroke="#333"/>')
    for k in range(5):
        t = total * k / 4
        out.append(f'<text x="{x0 + CHART_PX * k / 4:.1f}" y="{axis_y + 16}" text-anchor="middle">'
                   f'{t * 1e6:.3g} us</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def unit_info(u: StreamedUnit) -> str:
    if not u.weight_bytes:
        return "no weights"
    return f"weights in {fmt_bytes(u.weight_bytes)} x{2 if u.backward_s else 1}" + (
        f", gradients out {fmt_bytes(u.grad_bytes)}" if u.grad_bytes else "")


def stream_bar(x: float, y: float, w: float, what: str, nbytes: int, unit: str) -> str:
    return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="3" fill="{PHASE_COLORS[what]}" '
            f'data-unit="{escape(unit)}" data-phase="{what}"><title>{escape(unit)} {what}: '
            f'{fmt_bytes(nbytes)}</title></rect>')


def streamed_units(plan: dict[str, Any], io_bytes_s: float, wire_fraction: float) -> list[StreamedUnit]:
    """A weight-streaming plan's units (its layers) for render_streaming, from the plan's own
    per-kernel rates: a kernel's forward is a third of its training FLOPs when it has weights
    (backward: an input and a weight gradient), a half without (the planner's cost rule)."""
    train, batch = plan["mode"] != "eval", plan["per_system_batch"]
    units = []
    for name, idx in groups_of(plan["kernels"], "layer"):
        fwd = bwd = 0.0
        weights = 0
        for i in idx:
            k = plan["kernels"][i]
            seconds = batch / k["compute_samples_per_s"] if k["compute_samples_per_s"] else 0.0
            share = 1.0 if not train else (1 / 3 if k["weight_bytes"] else 1 / 2)
            fwd, bwd = fwd + seconds * share, bwd + seconds * (1 - share)
            weights += k["weight_bytes"]
        wire = int(weights * wire_fraction)
        units.append(StreamedUnit(name, fwd, bwd, wire, wire if train else 0, wire / io_bytes_s))
    return units


# ---------------------------------------------------------------- one measured step (trace.json)

TIMELINE_PX = 900


def measured_step(doc: dict[str, Any]) -> int | None:
    """The step drawn: the last one every traced process took part in (steady, not the first)."""
    steps: dict[int, set] = {}
    for e in doc.get("traceEvents", []):
        step = e.get("args", {}).get("step", -1) if e.get("ph") == "X" else -1
        if step >= 0:
            steps.setdefault(step, set()).add(e["pid"])
    if not steps:
        return None
    most = max(len(p) for p in steps.values())
    return max(s for s, p in steps.items() if len(p) == most)


def lanes(spans: list[dict]) -> list[int]:
    """A sub-row per span so that spans of one process that overlap (nested) sit apart."""
    ends: list[float] = []
    out = []
    for e in spans:
        free = next((i for i, end in enumerate(ends) if end <= e["ts"]), None)
        if free is None:
            ends.append(0.0)
            free = len(ends) - 1
        ends[free] = e["ts"] + e["dur"]
        out.append(free)
    return out


STEP_SPAN = ("chief", "train_step")   # where a step starts: the chief sends it


def from_step_start(spans: list[dict], names: dict[int, str]) -> tuple[list[dict], int]:
    """The spans from the chief's start of the step on, and how many came before it (input
    workers make a step's batch ahead of time; drawn, they would stretch the step)."""
    starts = [e["ts"] for e in spans if (names.get(e["pid"]), e["name"]) == STEP_SPAN]
    if not starts:
        return spans, 0
    kept = [e for e in spans if e["ts"] >= min(starts)]
    return kept, len(spans) - len(kept)


def render_timeline(doc: dict[str, Any], step: int | None = None) -> str | None:
    """One measured step of a trace (Chrome trace format, as trace.write_chrome_trace writes it):
    a row per process, a bar per span, coloured by span name; None when it has no steps."""
    step = measured_step(doc) if step is None else step
    if step is None:
        return None
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    spans = sorted((e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("args", {}).get("step") == step),
                   key=lambda e: (e["pid"], e["ts"], -e["dur"]))
    spans, early = from_step_start(spans, names)
    t0 = min(e["ts"] for e in spans)
    t1 = max(e["ts"] + e["dur"] for e in spans)
    kinds = sorted({e["name"] for e in spans})
    colors = {k: shade(PALETTE[i % len(PALETTE)], i // len(PALETTE)) for i, k in enumerate(kinds)}
    rows: list[tuple[str, list[dict], list[int]]] = []
    for pid in sorted({e["pid"] for e in spans}):
        mine = [e for e in spans if e["pid"] == pid]
        rows.append((names.get(pid, str(pid)), mine, lanes(mine)))
    label_px = max(text_px(r[0]) for r in rows) + 10
    x0, top = MARGIN + label_px, MARGIN + TITLE_PX
    heights = [(max(l) + 1) * 8 + 8 for _, _, l in rows]
    chart_h = sum(heights)
    legend = Legend([(colors[k], k) for k in kinds], max(chart_h, 6 * ROW_PX))
    title = (f"step {step}, measured: {(t1 - t0) / 1000:.3g} ms, {len(rows)} processes, {len(spans)} spans"
             + (f" ({early} earlier spans of the step, its input made ahead, not drawn)" if early else ""))
    width = max(x0 + TIMELINE_PX + MARGIN + legend.width + MARGIN, MARGIN * 2 + text_px(title) * 15 / FONT_PX)
    out = svg_open(width, top + max(chart_h, legend.height) + 3 * MARGIN, title)
    scale = TIMELINE_PX / max(t1 - t0, 1e-9)
    y = top
    for (name, mine, lane), h in zip(rows, heights):
        out.append(f'<text x="{MARGIN}" y="{y + h / 2 + 4:.1f}">{escape(name)}</text>')
        out.append(f'<line x1="{x0}" y1="{y + h:.1f}" x2="{x0 + TIMELINE_PX}" y2="{y + h:.1f}" stroke="#ddd"/>')
        for e, k in zip(mine, lane):
            x, w = x0 + (e["ts"] - t0) * scale, max(e["dur"] * scale, 0.5)
            layer = e["args"].get("layer")
            what = e["name"] + (f" layer {layer}" if layer is not None else "")
            out.append(f'<rect x="{x:.2f}" y="{y + 4 + 8 * k:.1f}" width="{w:.2f}" height="7" '
                       f'fill="{colors[e["name"]]}" data-span="{escape(e["name"])}"><title>{escape(name)}: '
                       f'{escape(what)}, {e["dur"] / 1000:.3g} ms</title></rect>')
        y += h
    out.append(f'<line x1="{x0}" y1="{y + 4:.1f}" x2="{x0 + TIMELINE_PX}" y2="{y + 4:.1f}" stroke="#333"/>')
    for k in range(5):
        out.append(f'<text x="{x0 + TIMELINE_PX * k / 4:.1f}" y="{y + 20:.1f}" text-anchor="middle">'
                   f'{(t1 - t0) * k / 4000:.3g} ms</text>')
    out += legend.draw(x0 + TIMELINE_PX + MARGIN, top)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_timeline(trace_path: str | os.PathLike[str]) -> Path | None:
    """timeline.svg beside a trace.json: its last full step; None when the trace has no steps."""
    trace_path = Path(trace_path)
    svg = render_timeline(json.loads(trace_path.read_text()))
    if svg is None:
        return None
    path = trace_path.with_name("timeline.svg")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(svg, encoding="utf-8")
    os.replace(tmp, path)   # a reader never sees half a picture
    return path
