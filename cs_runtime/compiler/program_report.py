"""compile_report.txt for a compiled program (a captured torch model): the
unit rule, then per weight-streaming unit its parameters, the activations
its backward keeps and its FLOPs for the capture's batch."""
from __future__ import annotations

from pathlib import Path

from cs_runtime.compiler.units import UNIT_RULE, unit_table


def render(spec, shapes: dict, dtypes: dict, batch: int, mode: str) -> str:
    rows = unit_table(spec, shapes, dtypes)
    lines = [f"Compiled program: {spec.name}", mode, "",
             f"{len(rows)} weight-streaming units, {spec.num_params():,} parameters "
             f"(a tied parameter counted once per unit that streams it); batch {batch}", "",
             *("  " + line for line in UNIT_RULE.splitlines()), "",
             f"{'unit':<28} {'ops':>5} {'params':>12} {'kept KB':>10} {'fwd MFLOP':>11} {'bwd MFLOP':>11}  tied"]
    for r in rows:
        lines.append(f"{r['unit']:<28} {r['ops']:>5} {r['params']:>12,} {r['kept_bytes'] / 1024:>10.1f} "
                     f"{r['fwd_flops'] / 1e6:>11.2f} {r['bwd_flops'] / 1e6:>11.2f}  {', '.join(r['tied'])}")
    total_f = sum(r["fwd_flops"] + r["bwd_flops"] for r in rows)
    lines += ["", f"FLOPs per step (forward + backward): {total_f / 1e6:,.2f} M", "",
              "Activations kept per unit (forward values its backward reads):"]
    for r in rows:
        lines.append(f"  {r['unit']}: {', '.join(r['kept']) or '-'}")
    return "\n".join(lines) + "\n"


def write(model_dir: str, spec, shapes: dict, dtypes: dict, batch: int, program_text: str, mode: str) -> Path:
    root = Path(model_dir)
    (root / "compile").mkdir(parents=True, exist_ok=True)
    report = root / "compile_report.txt"
    report.write_text(render(spec, shapes, dtypes, batch, mode))
    (root / "compile" / "program.txt").write_text(program_text)
    return report
