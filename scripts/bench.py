"""Benchmark: the same model trained by each execution path, in one run.

    python scripts/bench.py                 # FC-MNIST (preset small)
    python scripts/bench.py --steps 300 --preset medium

Rows: the CPU path (single process, the baseline), csrun_wse in weight
streaming with 1 and 2 WSEs, and in layer-pipelined mode with 1 and with 2
replicas (--multireplica). Then the input-bound rows: FC-MNIST with an
expensive per-sample augmentation (examples/fc_mnist/run_augmented.py) on
one WSE fed by 1, 2 and 4 input workers, with the ratio to 1 worker
(`--rows input` runs only these; they need about 4 free cores to scale). For each: samples/sec (the chief's GlobalRate
over the whole training loop, after start-up), the ratio to the CPU path,
and for the cluster rows the bytes streamed per step. Timings drift on
shared machines: compare ratios within one run, never absolute numbers
across runs. Results also go to --json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
FC_MNIST = REPO / "examples" / "fc_mnist" / "run.py"
AUGMENTED = REPO / "examples" / "fc_mnist" / "run_augmented.py"
INPUT_WORKERS = (1, 2, 4)
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


def run_row(name: str, launcher: list[str], params: Path, model_dir: Path, extra: tuple = (),
            script: Path = FC_MNIST) -> dict:
    cmd = [*launcher, sys.executable, str(script), "--mode", "train", "--params", str(params),
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


def model_rows(tmp: Path, preset: dict, steps: int) -> list[dict]:
    params = write_params(tmp, preset, steps, "weight_streaming")
    piped = write_params(tmp, preset, steps, "pipelined")
    wse = [str(BIN / "csrun_wse")]
    rows = [run_row("cpu", [str(BIN / "csrun_cpu")], params, tmp / "cpu")]
    for n in (1, 2):
        rows.append(run_row(f"weight_streaming_{n}wse", [*wse, "--num_csx", str(n)], params, tmp / f"ws{n}"))
    rows.append(run_row("pipelined", wse, piped, tmp / "pipe"))
    rows.append(run_row("pipelined_multireplica", wse, piped, tmp / "pipe2", ("--multireplica",)))
    base = rows[0]["samples_per_sec"]
    for row in rows:
        row["ratio"] = row["samples_per_sec"] / base
    return rows


def input_rows(tmp: Path, preset: dict, steps: int) -> list[dict]:
    """One WSE, input-bound: the same run with 1, 2, 4 input workers (same numbers, more throughput)."""
    params = write_params(tmp, preset, steps, "weight_streaming")
    rows = []
    for workers in INPUT_WORKERS:
        launcher = [str(BIN / "csrun_wse"), "--num_workers_per_csx", str(workers)]
        rows.append(run_row(f"input_bound_{workers}worker", launcher, params, tmp / f"in{workers}",
                            script=AUGMENTED))
    base = rows[0]["samples_per_sec"]
    for row in rows:
        row["ratio"] = row["samples_per_sec"] / base
    return rows


def print_rows(title: str, baseline: str, rows: list[dict]) -> None:
    print(title)
    print(f"{'row':<24}{'samples/sec':>14}{'vs ' + baseline:>12}{'weight B/step':>16}{'grad B/step':>14}")
    for row in rows:
        print(f"{row['name']:<24}{row['samples_per_sec']:>14.1f}{row['ratio']:>12.2f}"
              f"{row.get('weight_bytes_per_step', 0):>16}{row.get('grad_bytes_per_step', 0):>14}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--input_steps", type=int, default=60, help="steps of each input-bound row (default 60)")
    parser.add_argument("--rows", choices=("all", "model", "input"), default="all")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    result = {"preset": args.preset, "steps": args.steps}
    with tempfile.TemporaryDirectory(prefix="cs_bench_") as tmp:
        tmp = Path(tmp)
        if args.rows in ("all", "model"):
            result["rows"] = model_rows(tmp, preset, args.steps)
            print_rows(f"preset={args.preset} model={preset['hidden_sizes']} batch={preset['batch_size']} "
                       f"steps={args.steps}", "cpu", result["rows"])
        if args.rows in ("all", "input"):
            result["input_rows"] = input_rows(tmp, preset, args.input_steps)
            print_rows(f"input-bound: {AUGMENTED.name}, 1 WSE, steps={args.input_steps}, "
                       f"{os.cpu_count()} CPUs", "1 worker", result["input_rows"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
