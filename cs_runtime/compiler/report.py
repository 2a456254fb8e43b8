"""What a compile leaves for the user: compile_report.txt, plan.json, wafer.svg.

Everything here is a pure function of the plan dict (Plan.to_dict(), or the
plan stored in an artifact), so a reused artifact reports exactly what the
compile that made it did.

    model_dir/compile_report.txt    Estimated Overall Performance + one row per kernel
    model_dir/compile/plan.json     the plan, machine-readable
    model_dir/compile/wafer.svg     pipelined plans: where each kernel sits on the wafer
    model_dir/compile/graph.txt     the kernel graph before and after the rewrites
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from .hardware import HOST_FLOPS_S
from .planner import fmt_bytes, mode_name

OVERALL_FIELDS = (
    ("Samples/s", "samples_per_s"),
    ("Compute Samples/s", "compute_samples_per_s"),
    ("Transmission Samples/s", "transmission_samples_per_s"),
    ("Active PEs %", "active_pes_pct"),
    ("Compute Utilization %", "compute_utilization_pct"),
)


def _num(x: float | None) -> str:
    """Rates span many orders of magnitude: 3 significant digits, thousands separated."""
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [line(headers), line(["-" * w for w in widths]), *[line(r) for r in rows]]


def _region(k: dict[str, Any], strategy: str) -> str:
    r = k["rect"]
    return "whole wafer" if strategy == "weight_streaming" else f"x={r['x']} y={r['y']} {r['w']}x{r['h']}"


# Kernels whose operands are rounded to a 16-bit precision (numerics/mixed_ops.py's
# matmul-like ops, as the kernel graph names them); every other kernel is float32.
ROUNDED_KERNELS = frozenset({"matmul", "fused_dense", "attention"})


def kernel_precision(kernel: dict[str, Any], precision: str) -> str:
    """The format a kernel computes on: its operands' for a matmul-like kernel, else float32."""
    return precision if kernel["op"] in ROUNDED_KERNELS else "float32"


def second_target_lines(plan: dict[str, Any], width: int) -> list[str]:
    second = plan.get("second_target") or {}
    if not second:
        return []
    if "error" in second:
        return [f"{'On ' + second['system'] + ':':<{width}} cannot run this plan ({second['error']})"]
    mode = mode_name(second["execution_strategy"], second["num_replicas"])
    return [f"{'On ' + second['system'] + ':':<{width}} {_num(second['samples_per_s'])} samples/s ({mode}; "
            "the same model on the second target)"]


def gap_line(plan: dict[str, Any]) -> str:
    """Why the emulator's measured rate is far below the estimate, in numbers, in one line."""
    est = plan["estimate"]
    step_flops = sum(k["flops_per_sample"] for k in plan["kernels"]) * plan["batch_size"]
    host_s = step_flops / HOST_FLOPS_S
    return (f"Measured vs estimated: one step is {step_flops / 1e9:.3g} GFLOP, {est['step_s'] * 1e3:.3g} ms on "
            f"the {plan['target']['system']} and about {host_s * 1e3:.3g} ms of numpy on a CPU at "
            f"{HOST_FLOPS_S / 1e9:.0f} GFLOP/s, so the emulator's measured rate (GlobalRate, avg_samples_per_sec) "
            f"sits about {host_s / max(est['step_s'], 1e-30):,.0f}x below the estimate, and lower still for "
            "its messages between processes.")


def render_report(plan: dict[str, Any]) -> str:
    est, strategy, t = plan["estimate"], plan["execution_strategy"], plan["target"]
    lines = [
        f"Compile report: {plan['model']}",
        f"Execution strategy: {mode_name(strategy, plan.get('num_replicas', 1))} ({plan['strategy_reason']})",
        f"Target: {t['system']} x {t['num_csx']} system(s), compiled on {t['compiled_on']}",
        f"Mode: {plan['mode']}, batch {plan['batch_size']} ({plan['per_system_batch']} per system), "
        f"precision {plan.get('precision', 'float32')}",
        f"Wafer memory: {fmt_bytes(plan['resident_bytes'])} needed of {fmt_bytes(plan['wafer_memory_bytes'])}",
        "",
        "Estimated Overall Performance",
        "-----------------------------",
        f"(estimates for {t['system']} x {t['num_csx']} from its published figures, "
        "cs_runtime/compiler/hardware.py; nothing here is measured)",
    ]
    width = max(len(label) for label, _ in OVERALL_FIELDS) + 1
    lines += [f"{label + ':':<{width}} {_num(est[key])}" for label, key in OVERALL_FIELDS]
    lines += [f"{'Step time:':<{width}} {est['step_s'] * 1e3:.3g} ms for a batch of {plan['batch_size']}",
              *second_target_lines(plan, width), "", gap_line(plan)]
    lines += ["", "Estimated Performance Per Kernel", "--------------------------------"]
    headers = ["Kernel", "Op", "Layer", "Precision", "PEs", "Active PEs", "Region", "FLOPs/sample",
               "Memory", "Compute Samples/s", "Transmission Samples/s"]
    precision = plan.get("precision", "float32")
    rows = [[k["name"], k["op"], k["layer"], kernel_precision(k, precision), f"{k['pes']:,}",
             f"{k['active_pes']:,}", _region(k, strategy), _num(k["flops_per_sample"]), fmt_bytes(k["resident_bytes"]),
             _num(k["compute_samples_per_s"]), _num(k["transmission_samples_per_s"])]
            for k in plan["kernels"]]
    lines += _table(headers, rows)
    lines += ["", "Graph rewrites", "--------------"] + [f"- {note}" for note in plan["rewrites"] or ["none"]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the picture

COLORS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
          "#9c755f", "#bab0ac")
WAFER_PX = 800       # width of the drawn grid
MARGIN = 20
LEGEND_PX = 330


def _label_inside(x: float, y: float, w: float, h: float, text: str) -> str:
    """The kernel's name inside its region if it fits: across, or up a tall strip."""
    if w >= 7 * len(text) + 8 and h >= 16:
        return f'<text x="{x + w / 2:.1f}" y="{y + h / 2 + 4:.1f}" text-anchor="middle">{text}</text>'
    if w >= 14 and h >= 7 * len(text) + 8:
        cx, cy = x + w / 2 + 4, y + h / 2
        return (f'<text x="{cx:.1f}" y="{cy:.1f}" text-anchor="middle" '
                f'transform="rotate(-90 {cx:.1f} {cy:.1f})">{text}</text>')
    return ""


def render_svg(plan: dict[str, Any]) -> str | None:
    """The PE grid with every kernel's rectangle, labelled; None unless pipelined."""
    if plan["execution_strategy"] != "pipelined":
        return None
    grid = plan["grid"]
    s = WAFER_PX / grid["cols"]
    gw, gh = grid["cols"] * s, grid["rows"] * s
    top = 2 * MARGIN + 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{gw + LEGEND_PX + 2 * MARGIN:.0f}" '
           f'height="{gh + top + MARGIN:.0f}" font-family="sans-serif" font-size="12">',
           f'<text x="{MARGIN}" y="{MARGIN + 6}" font-size="15">{escape(plan["model"])}: pipelined on '
           f'{grid["rows"]} x {grid["cols"]} PEs, {plan["estimate"]["active_pes_pct"]:.1f}% active</text>',
           f'<rect x="{MARGIN}" y="{top}" width="{gw:.1f}" height="{gh:.1f}" fill="#eeeeee" stroke="#333"/>']
    for i, k in enumerate(plan["kernels"]):
        r, color, name = k["rect"], COLORS[i % len(COLORS)], escape(k["name"])
        x, y = MARGIN + r["x"] * s, top + r["y"] * s
        w, h = max(r["w"] * s, 1.5), max(r["h"] * s, 1.5)  # a one-PE kernel still shows
        out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{color}" '
                   f'stroke="#222" stroke-width="0.5"><title>{name}: {k["pes"]:,} PEs</title></rect>')
        label = _label_inside(x, y, w, h, name)
        lx, ly = MARGIN + gw + MARGIN, top + 10 + 20 * i
        if label:
            out.append(label)
        else:  # too small to hold its name: a leader line from its legend row finds it
            out.append(f'<line x1="{x + w / 2:.1f}" y1="{y + min(h, 20) / 2:.1f}" x2="{lx:.1f}" '
                       f'y2="{ly - 4:.1f}" stroke="{color}" stroke-width="0.8"/>')
        out.append(f'<rect x="{lx:.1f}" y="{ly - 10:.1f}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{lx + 18:.1f}" y="{ly:.1f}">{name} ({escape(k["layer"])}): '
                   f'{r["w"]}x{r["h"]} at x={r["x"]}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- files

def _write(path: Path, text: str) -> None:
    """Write via a temporary file, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_outputs(model_dir: str | os.PathLike[str], plan: dict[str, Any], graph_text: str) -> list[Path]:
    """Write the report, plan, picture and graph; returns the paths written."""
    root = Path(model_dir)
    files = {root / "compile_report.txt": render_report(plan),
             root / "compile" / "plan.json": json.dumps(plan, indent=2) + "\n",
             root / "compile" / "graph.txt": graph_text}
    svg = render_svg(plan)
    if svg is not None:
        files[root / "compile" / "wafer.svg"] = svg
    else:
        (root / "compile" / "wafer.svg").unlink(missing_ok=True)  # a stale picture would mislead
    for path, text in files.items():
        _write(path, text)
    return list(files)
