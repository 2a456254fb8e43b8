"""Benchmark: the same model trained by each execution path, in one run.

    python scripts/bench.py                 # FC-MNIST (preset small)
    python scripts/bench.py --steps 300 --preset medium

Rows: the CPU path (single process, the baseline), csrun_wse in weight
streaming with 1 and 2 WSEs, the 1-WSE run again with --insecure (no CURVE:
the ratio of the two is the cost of authenticated, encrypted transport),
and in layer-pipelined mode with 1 and with 2 replicas (--multireplica). For each: samples/sec (the chief's GlobalRate
over the whole training loop, after start-up), the ratio to the CPU path,
and for the cluster rows the bytes streamed per step. Timings drift on
shared machines: compare ratios within one run, never absolute numbers
across runs. Results also go to --json.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
FC_MNIST = REPO / "examples" / "fc_mnist" / "run.py"
BIN = Path(sys.executable).parent

PRESETS = {
    "small": {"hidden_sizes": [256, 128], "batch_size": 128},
    "medium": {"hidden_sizes": [1024, 1024, 1024], "batch_size": 256},
}
RATE_RE = re.compile(r"GlobalRate=([\d.]+) samples/sec")
PIPELINED_RE = re.compile(r"WeightBytes/step=(\d+) \(received by the WSE sockets\)")
TRAFFIC_RE = re.compile(r"WeightBytes/step=(\d+) .* x (\d+) hops.*GradBytes/step=(\d+)")


def write_params(folder: Path, preset: dict, steps: int, strategy: str) -> Path:
    params = {
        "train_input": {"batch_size": preset["batch_size"], "shuffle": True, "drop_last_batch": True},
        "model": {"hidden_sizes": preset["hidden_sizes"], "activation": "relu", "dropout": 0.1},
        "optimizer": {"optimizer_type": "sgd", "learning_rate": 0.01, "momentum": 0.9},
        "runconfig": {"max_steps": steps, "log_steps": steps, "checkpoint_steps": 0, "seed": 1,
                      "execution_strategy": strategy},
    }
    path = folder / f"{strategy}.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def run_row(name: str, launcher: list[str], params: Path, model_dir: Path, extra: tuple = ()) -> dict:
    cmd = [*launcher, sys.executable, str(FC_MNIST), "--mode", "train", "--params", str(params),
           "--model_dir", str(model_dir), *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"bench: {name} failed:\n{result.stderr[-2000:]}")
    rates = RATE_RE.findall(result.stdout)
    row = {"name": name, "samples_per_sec": float(rates[-1])}
    traffic = TRAFFIC_RE.search(result.stdout)
    pipelined = PIPELINED_RE.search(result.stdout)
    if pipelined:
        row.update(weight_bytes_per_step=int(pipelined.group(1)), grad_bytes_per_step=0)
    if traffic:
        weight, hops, grads = (int(g) for g in traffic.groups())
        row.update(weight_bytes_per_step=weight * hops, grad_bytes_per_step=grads * (hops - 1) + grads)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    with tempfile.TemporaryDirectory(prefix="cs_bench_") as tmp:
        tmp = Path(tmp)
        params = write_params(tmp, preset, args.steps, "weight_streaming")
        piped = write_params(tmp, preset, args.steps, "pipelined")
        wse = [str(BIN / "csrun_wse")]
        rows = [run_row("cpu", [str(BIN / "csrun_cpu")], params, tmp / "cpu")]
        for n in (1, 2):
            rows.append(run_row(f"weight_streaming_{n}wse", [*wse, "--num_csx", str(n)], params, tmp / f"ws{n}"))
        rows.append(run_row("weight_streaming_1wse_insecure", [*wse, "--insecure"], params, tmp / "ws1i"))
        rows.append(run_row("pipelined", wse, piped, tmp / "pipe"))
        rows.append(run_row("pipelined_multireplica", wse, piped, tmp / "pipe2", ("--multireplica",)))
    base = rows[0]["samples_per_sec"]
    print(f"preset={args.preset} model={preset['hidden_sizes']} batch={preset['batch_size']} steps={args.steps}")
    print(f"{'row':<24}{'samples/sec':>14}{'vs cpu':>9}{'weight B/step':>16}{'grad B/step':>14}")
    for row in rows:
        row["ratio_vs_cpu"] = row["samples_per_sec"] / base
        print(f"{row['name']:<24}{row['samples_per_sec']:>14.1f}{row['ratio_vs_cpu']:>9.2f}"
              f"{row.get('weight_bytes_per_step', 0):>16}{row.get('grad_bytes_per_step', 0):>14}")
    curve = {r["name"]: r["samples_per_sec"] for r in rows}
    print(f"CURVE cost: weight streaming (1 WSE) with CURVE runs at "
          f"{curve['weight_streaming_1wse'] / curve['weight_streaming_1wse_insecure']:.2f}x the speed of --insecure")
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "steps": args.steps, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
