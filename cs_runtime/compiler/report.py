"""What a compile leaves for the user: compile_report.txt, plan.json and a picture.

Everything here is a pure function of the plan dict (Plan.to_dict(), or the
plan stored in an artifact), so a reused artifact reports exactly what the
compile that made it did.

    model_dir/compile_report.txt    Estimated Overall Performance + one row per kernel
    model_dir/compile/plan.json     the plan, machine-readable
    model_dir/compile/wafer.svg     pipelined plans: where each kernel sits on the wafer
    model_dir/compile/streaming.svg weight-streaming plans: one step, unit by unit (pictures.py)
    model_dir/compile/program.txt   the program planned, unit by unit (the one the executor runs)
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cs_runtime.numerics.mixed_ops import MATMUL_LIKE

from . import pictures
from .hardware import HOST_FLOPS_S, WAFERS
from .planner import fmt_bytes, mode_name, wire_fraction
from .units import UNIT_RULE

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


def kernel_precision(kernel: dict[str, Any], precision: str) -> str:
    """The format a kernel computes on: its operands' for a matmul-like op (numerics/mixed_ops.py
    rounds them to 16 bits), else float32."""
    return precision if kernel["op"] in MATMUL_LIKE else "float32"


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
    lines += ["", "Kernels", "-------"] + [f"- {note}" for note in plan["kernel_notes"]]
    lines += units_section(plan.get("units", []))
    return "\n".join(lines) + "\n"


def units_section(rows: list[dict[str, Any]]) -> list[str]:
    """Per weight-streaming unit (the program's, by the unit rule): its parameters, the
    activations its backward keeps and its FLOPs per sample."""
    if not rows:
        return []
    lines = ["", "Weight-streaming units", "----------------------",
             *("  " + line for line in UNIT_RULE.splitlines()), ""]
    headers = ["Unit", "Ops", "Params", "Kept KB", "Fwd MFLOP/sample", "Bwd MFLOP/sample", "Tied"]
    table = [[r["unit"], str(r["ops"]), f"{r['params']:,}", f"{r['kept_bytes'] / 1024:.1f}",
              f"{r['fwd_flops'] / 1e6:.3g}", f"{r['bwd_flops'] / 1e6:.3g}", ", ".join(r["tied"]) or "-"]
             for r in rows]
    lines += _table(headers, table)
    lines += ["", "Activations kept per unit (forward values its backward reads):"]
    lines += [f"  {r['unit']}: {', '.join(r['kept']) or '-'}" for r in rows]
    return lines


# ---------------------------------------------------------------- files

def _write(path: Path, text: str) -> None:
    """Write via a temporary file, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def pictures_of(plan: dict[str, Any]) -> dict[str, str | None]:
    """wafer.svg for a pipelined plan, streaming.svg for a weight-streaming one (None: not this mode)."""
    streaming = None
    if plan["execution_strategy"] == "weight_streaming":
        io = WAFERS[plan["target"]["device"]].io_bw_bytes_s
        units = pictures.streamed_units(plan, io, wire_fraction(plan.get("precision", "float32")))
        streaming = pictures.render_streaming(
            f"{plan['model']}: one weight-streaming step on {plan['target']['system']}, batch "
            f"{plan['per_system_batch']} per system (estimate, not measured)", units)
    return {"wafer.svg": pictures.render_wafer(plan), "streaming.svg": streaming}


def write_outputs(model_dir: str | os.PathLike[str], plan: dict[str, Any], program_text: str) -> list[Path]:
    """Write the report, plan, picture and program; returns the paths written."""
    root = Path(model_dir)
    files = {root / "compile_report.txt": render_report(plan),
             root / "compile" / "plan.json": json.dumps(plan, indent=2) + "\n",
             root / "compile" / "program.txt": program_text}
    (root / "compile" / "graph.txt").unlink(missing_ok=True)   # an older compiler's, of another IR
    for name, svg in pictures_of(plan).items():
        if svg is not None:
            files[root / "compile" / name] = svg
        else:
            (root / "compile" / name).unlink(missing_ok=True)  # a stale picture would mislead
    for path, text in files.items():
        _write(path, text)
    return list(files)
