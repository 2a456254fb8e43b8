"""The batch-size study: BERT and GPT-2 (tiny) at global batch 512, 1024 and 2048.

    python scripts/batch_study.py                       # both models, 8192 samples each run
    python scripts/batch_study.py --models bert --samples 4096 --out study

The ALCF exercise on the CS-2: train BERT with batch sizes 512, 1024 and
2048 and observe the difference. Each run is csrun_wse in weight streaming
(so weights really stream per step) on the examples' tiny params.yaml with
the batch size changed, for the same number of training samples, then an
evaluation on the same held-out text. Written to --out:

  study.md     the table: estimated samples/sec (the compile's estimate for
               the CS-2 and the CS-3, from compile/plan.json, in the mode
               run) beside measured samples/sec (the chief's GlobalRate), step time,
               train loss at the last step, eval loss after the fixed number
               of samples, and bytes streamed per step (MemoryX -> SwarmX
               weights, SwarmX -> MemoryX gradients)
  study.json   the same numbers, plus every step's loss
  loss_<model>.svg  training loss against samples seen, one line per batch size

Same learning rate at every batch size (the exercise's setting): a larger
batch takes fewer, less noisy steps for the same samples. Timings drift on a
shared machine; compare rows of one run.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RATE_RE = re.compile(r"GlobalRate=([\d.]+) samples/sec")
TRAFFIC_RE = re.compile(r"WeightBytes/step=(\d+) .*GradBytes/step=(\d+)")
EVAL_RE = re.compile(r"\| Eval Device=.*Loss=([\d.]+), Accuracy=([\d.]+)")
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


class RunFailed(RuntimeError):
    pass


def tool(name: str) -> str:
    found = BIN / name
    return str(found) if found.exists() else name


def study_params(model: str, batch: int, samples: int, eval_samples: int) -> dict:
    params = yaml.safe_load((REPO / "examples" / model / "configs" / "params.yaml").read_text())
    params["train_input"]["batch_size"] = batch
    eval_batch = min(batch, eval_samples)
    params["eval_input"]["batch_size"] = eval_batch
    steps = max(1, samples // batch)
    params["runconfig"].update(max_steps=steps, log_steps=steps, checkpoint_steps=0,
                               eval_steps=max(1, eval_samples // eval_batch),
                               execution_strategy="weight_streaming")
    return params


def run_one(model: str, batch: int, args, folder: Path) -> dict:
    params = study_params(model, batch, args.samples, args.eval_samples)
    path = folder / f"{model}_{batch}.yaml"
    path.write_text(yaml.safe_dump(params))
    model_dir = folder / f"{model}_{batch}"
    cmd = [tool("csrun_wse"), "--num_csx", str(args.num_csx), sys.executable, str(REPO / "examples" / model / "run.py"),
           "--mode", "train_and_eval", "--params", str(path), "--model_dir", str(model_dir)]
    start = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if result.returncode != 0:
        raise RunFailed(f"{model} batch {batch} failed (exit {result.returncode}):\n"
                        f"{result.stdout[-2000:]}{result.stderr[-2000:]}")
    rate = float(RATE_RE.findall(result.stdout)[-1])
    weight_bytes, grad_bytes = map(int, TRAFFIC_RE.search(result.stdout).groups())
    eval_loss, eval_acc = map(float, EVAL_RE.search(result.stdout).groups())
    losses = train_losses(model_dir)
    estimate = planned_rates(model_dir)
    return {"model": model, "batch_size": batch, "steps": len(losses), "samples": len(losses) * batch,
            **estimate, "samples_per_sec": rate, "step_time_s": batch / rate, "final_train_loss": losses[-1],
            "eval_loss": eval_loss, "eval_accuracy": eval_acc, "weight_bytes_per_step": weight_bytes,
            "grad_bytes_per_step": grad_bytes, "wall_s": time.monotonic() - start, "losses": losses}


def planned_rates(model_dir: Path) -> dict:
    """The compile's estimates for the run (model_dir/compile/plan.json): its system's and the second target's."""
    plan = json.loads((model_dir / "compile" / "plan.json").read_text())
    second = plan.get("second_target", {})
    return {"execution_strategy": plan["execution_strategy"], "system": plan["target"]["system"],
            "estimated_samples_per_sec": plan["estimate"]["samples_per_s"],
            "second_system": second.get("system", ""),
            "second_estimated_samples_per_sec": second.get("samples_per_s", float("nan"))}


def train_losses(model_dir: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(model_dir / "train"), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in sorted(acc.Scalars("loss"), key=lambda e: e.step)]


def table(rows: list[dict], args) -> str:
    systems = rows[0] if rows else {"system": "CS-2 (WSE-2)", "second_system": "CS-3 (WSE-3)"}
    lines = [f"Batch-size study: {args.samples} training samples per run, csrun_wse weight streaming on "
             f"{args.num_csx} WSE(s), eval on {args.eval_samples} held-out samples.",
             f"Estimated: the compile's estimate for {systems['system']} x {args.num_csx} (and "
             f"{systems['second_system']}) from published figures; measured: this emulator's GlobalRate.", "",
             f"| model | batch | steps | estimated samples/sec {systems['system']} | estimated "
             f"{systems['second_system']} | measured samples/sec (emulator) | measured / estimated | "
             "step time (s) | train loss (last step) | eval loss | eval acc | weight bytes/step | grad bytes/step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r["samples_per_sec"] / r["estimated_samples_per_sec"]
        lines.append(f"| {r['model']} | {r['batch_size']} | {r['steps']} | {r['estimated_samples_per_sec']:,.0f} | "
                     f"{r['second_estimated_samples_per_sec']:,.0f} | {r['samples_per_sec']:.1f} | {ratio:.2e} | "
                     f"{r['step_time_s']:.2f} | {r['final_train_loss']:.4f} | {r['eval_loss']:.4f} | "
                     f"{r['eval_accuracy']:.4f} | {r['weight_bytes_per_step']:,} | {r['grad_bytes_per_step']:,} |")
    return "\n".join(lines) + "\n"


def svg_plot(model: str, rows: list[dict], width: int = 640, height: int = 400) -> str:
    """Training loss against samples seen, one polyline per batch size (hand-written SVG)."""
    left, right, top, bottom = 60, 20, 30, 50
    xs = [(i + 1) * r["batch_size"] for r in rows for i in range(len(r["losses"]))]
    ys = [v for r in rows for v in r["losses"]]
    x_max, y_lo, y_hi = max(xs), min(ys), max(ys)
    y_lo, y_hi = y_lo - 0.05 * (y_hi - y_lo + 1e-9), y_hi + 0.05 * (y_hi - y_lo + 1e-9)

    def px(x: float, y: float) -> str:
        return (f"{left + (width - left - right) * x / x_max:.1f},"
                f"{top + (height - top - bottom) * (y_hi - y) / (y_hi - y_lo):.1f}")

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="14">{model}: training loss vs samples '
           f'seen</text>',
           f'<polyline points="{px(0, y_hi)} {px(0, y_lo)} {px(x_max, y_lo)}" fill="none" stroke="black"/>']
    for i in range(5):
        y = y_lo + (y_hi - y_lo) * i / 4
        x_at, y_at = px(0, y).split(",")
        out.append(f'<text x="{float(x_at) - 6}" y="{float(y_at) + 4}" text-anchor="end">{y:.2f}</text>')
        x = x_max * i / 4
        x_at, y_at = px(x, y_lo).split(",")
        out.append(f'<text x="{x_at}" y="{float(y_at) + 16}" text-anchor="middle">{int(x)}</text>')
    out.append(f'<text x="{width / 2}" y="{height - 8}" text-anchor="middle">samples</text>')
    for k, r in enumerate(rows):
        colour = COLOURS[k % len(COLOURS)]
        points = " ".join(px((i + 1) * r["batch_size"], v) for i, v in enumerate(r["losses"]))
        out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{width - right - 110}" y="{top + 16 * (k + 1)}" fill="{colour}">batch '
                   f'{r["batch_size"]}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="BERT / GPT-2 batch-size study on the emulated CS system.")
    parser.add_argument("--models", nargs="+", default=["bert", "gpt2"], choices=["bert", "gpt2"])
    parser.add_argument("--batch_sizes", nargs="+", type=int, default=[512, 1024, 2048])
    parser.add_argument("--samples", type=int, default=8192, help="training samples per run (same for every batch)")
    parser.add_argument("--eval_samples", type=int, default=1024)
    parser.add_argument("--num_csx", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    parser.add_argument("--out", default="batch_study", help="folder for study.md, study.json, loss_*.svg")
    args = parser.parse_args(argv)
    if any(b > args.samples for b in args.batch_sizes):
        parser.error(f"--samples {args.samples} is smaller than a batch")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, failed = [], None
    for model in args.models:
        for batch in args.batch_sizes:
            print(f"running {model} at batch {batch} ({args.samples // batch} steps) ...", flush=True)
            try:
                rows.append(run_one(model, batch, args, out))
            except (RunFailed, subprocess.TimeoutExpired) as exc:
                failed = str(exc)
                break
            r = rows[-1]
            print(f"  measured {r['samples_per_sec']:.1f} samples/sec (estimated for {r['system']}: "
                  f"{r['estimated_samples_per_sec']:,.0f}), step {r['step_time_s']:.2f} s, "
                  f"eval loss {r['eval_loss']:.4f}, {r['wall_s']:.0f} s", flush=True)
        done = [r for r in rows if r["model"] == model]
        if done:
            (out / f"loss_{model}.svg").write_text(svg_plot(model, done))
        if failed:
            break
    report = table(rows, args)
    (out / "study.md").write_text(report)
    (out / "study.json").write_text(json.dumps(rows, indent=1))
    print(report)
    print(f"written: {out / 'study.md'}, {out / 'study.json'}, " +
          ", ".join(str(out / f"loss_{m}.svg") for m in args.models))
    if failed:
        print(f"error: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
