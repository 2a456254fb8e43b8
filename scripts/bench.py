"""Benchmark: the same model trained by each execution path, in one run.

    python scripts/bench.py                 # FC-MNIST (preset small)
    python scripts/bench.py --preset large  # 8 x 2048, batch 512: 31M parameters

Rows: the CPU path (single process), PyTorch CPU in one process and
PyTorch DistributedDataParallel (gloo, 2 ranks) on the same layers and
optimizer (the baseline; skipped with a line when torch is not installed:
`pip install torch==2.13.0`, never a dependency of the project), csrun_wse in weight
streaming with 1 and 2 WSEs, the 1-WSE run again with --insecure (no CURVE:
the ratio of the two is the cost of authenticated, encrypted transport),
in layer-pipelined mode with 1 and with 2
replicas (--multireplica), and weight streaming with 1 WSE in mixed
precision (float16 with dynamic loss scaling, bfloat16 and cbfloat16) with
1 and 2 WSEs, whose weights and gradients stream in 16 bits; then a verdict
per performance target (met, or missed by how much, on the preset the target
is defined on; elsewhere its ratio, not judged). `--rows precision`
runs only the weight streaming rows; `--quick` is a smoke test (tiny model,
4 steps, CPU path and 1-WSE float32 and float16: numbers mean nothing). Then the input-bound rows: FC-MNIST with an
expensive per-sample augmentation (examples/fc_mnist/run_augmented.py) on
one WSE fed by 1, 2 and 4 input workers, with the ratio to 1 worker
(`--rows input` runs only these; they need about 4 free cores to scale).
`--preset transformer` runs params.yaml's GPT-2 and BERT (examples/gpt2,
examples/bert) at 4 layers x 256 wide, sequence 128, batch 32, AdamW, on the CPU
path, weight streaming (1 WSE) and pipelined, beside torch eager on the
equivalent module (scripts/bench_baselines.py transformer), with a verdict
per path against the 0.9x target.
`--preset models` runs models written by others (scripts/bench_models.py: resnet18,
mobilenet_v3_small, LlamaForCausalLM, GPT2LMHeadModel, BertForMaskedLM, timm's ViT) at
sizes where a torch step takes 50-500 ms: the CPU path's calls against torch eager on one
thread in one process, by CPU time a step, then weight streaming on 1 WSE against torch's
wall clock, with a verdict per model and path against the 0.8x target.
`--rows torch_gpt` times a traced GPT-2 (examples/torch_gpt/model.py, 4 layers
x 256 wide, sequence 128, AdamW) on the CPU path's calls against torch eager
CPU training the same module on the same batches, in this process; the ratio
is ours / torch's samples/sec (needs torch). `--rows scaling` is the scaling shape:
weight streaming on 1, 2 and 4 WSEs at the preset's batch, then on 1 WSE at half and twice
the batch, with the weight bytes per step and per sample. `--rows wire` runs the transport
ceilings alone (below; and the tcp row as it was before kept buffers,
protocol_fresh) on the preset's bytes, with the two transport verdicts.
`--rows cluster` runs only the rows of the small preset's targets (the CPU path, torch, DDP,
weight streaming on 1 and 2 WSEs, pipelined). Every row of ours also gives the job's CPU a
step (every process, children included: the row's run less one with a fifth of the steps)
and the cluster's share of it (less the CPU path's); scripts/step_budget.py splits a step's
CPU by process and thread.
`--rows trace` measures the timeline's cost instead: csrun_wse (1 WSE,
weight streaming) and the CPU path, each with --trace off and on, alternated
--repeats times; the median of each, and on / off. For each: samples/sec (from
the chief's progress lines, every 2 steps, leaving out the first 2 steps as the
torch rows leave out their warm-up), the ratio to PyTorch CPU (to
the CPU path without torch), the training FLOP/s and their fraction of the
compute ceiling, and for weight streaming the bytes per step and the weight
stream's bytes/sec against the transport ceilings.

Ceilings, measured in the same run (scripts/bench_baselines.py): a numpy
float32 matmul of the largest layer at the batch size (FLOP/s); a numpy
memcpy and a raw pyzmq PUSH/PULL between two processes of one step's
weight bytes, layer by layer; and the project's own protocol path (WEIGHTS
messages through Endpoint, validated on receipt) over the same bytes, over
tcp and by shared-memory reference (what csrun_wse uses on one host); each transport
row's receiver times its own steps after the warm-up, as the memcpy row does. Timings drift on
shared machines: compare ratios within one run, never absolute numbers
across runs. Results also go to --json.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))     # this checkout's packages, scripts/ among them
from scripts.bench_models import MODELS as FOREIGN_MODELS  # noqa: E402  (the models preset's models)
from cs_runtime.env import with_numerics_defaults  # noqa: E402
FC_MNIST = REPO / "examples" / "fc_mnist" / "run.py"
AUGMENTED = REPO / "examples" / "fc_mnist" / "run_augmented.py"
BENCH_MODELS = REPO / "scripts" / "bench_models.py"
INPUT_WORKERS = (1, 2, 4)
BIN = Path(sys.executable).parent


def c_loops() -> dict:
    """Which of this checkout's optional C loops (setup.py) are built: "C loops" or "numpy"
    for the 16-bit conversions (precision.py), the exact GELU and the dense dropout masks
    (kernels.py), SGD's momentum update (optim.py), the depthwise convolution (windows.py)
    and layer norm (ops.py)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))     # this checkout's cs_runtime
    from cs_runtime.numerics import kernels, ops, optim, precision, windows
    return {"conversions": precision.conversion_path(), "exact_gelu": kernels.gelu_path(),
            "dropout_masks": kernels.mask_path(), "momentum_update": optim.momentum_path(),
            "depthwise": windows.depthwise_path(), "layer_norm": ops.norms_path()}


def c_loops_line() -> str:
    paths = c_loops()
    return (f"16-bit conversions: {paths['conversions']}; exact GELU: {paths['exact_gelu']}; "
            f"dropout masks: {paths['dropout_masks']}; momentum update: {paths['momentum_update']}; "
            f"depthwise convolution: {paths['depthwise']}; layer norm: {paths['layer_norm']}")


PRESETS = {
    "small": {"hidden_sizes": [256, 128], "batch_size": 128, "steps": 300},          # FC-MNIST
    "medium": {"hidden_sizes": [1024, 1024, 1024], "batch_size": 256, "steps": 100},
    "large": {"hidden_sizes": [2048] * 8, "batch_size": 512, "steps": 20},          # 31M parameters
    "tiny": {"hidden_sizes": [32], "batch_size": 32, "steps": 4},                     # --quick: a smoke test
    # params.yaml's GPT-2 and BERT at 4 layers x 256, sequence 128 (transformer_rows)
    "transformer": {"batch_size": 32, "steps": 20, "seq": 128, "hidden": 256, "layers": 4, "heads": 4,
                    "ffn": 1024},
    # models written by others, each at its own batch (scripts/bench_models.py: models_rows)
    "models": {"steps": 6},
}
MLP_PRESETS = ("small", "medium", "large", "tiny")
TRANSFORMERS = ("gpt2", "bert")
TRANSFORMER_PATHS = ("cpu", "weight_streaming_1wse", "pipelined")
MIXED = ("float16", "bfloat16", "cbfloat16")
# The targets of the performance issue: (what, row, baseline row, the least ratio that meets it,
# the preset it is defined on, or None: any). A target is judged when both of its rows ran on
# its preset; elsewhere its ratio is shown, not judged (16-bit weight streaming is defined on
# `large`, whose matmuls dwarf a step's messages; shared memory against memcpy on `large`'s 16 MB
# tensors, where a message's fixed cost is small beside the copy). The wire targets compare ceilings.
TARGETS = [
    *((f"{fmt} weight streaming, {n} WSE(s), vs float32", f"ws_{n}wse_{fmt}", f"weight_streaming_{n}wse", 0.9,
       "large") for n in (1, 2) for fmt in MIXED),
    ("pipelined vs torch (small preset)", "pipelined", "torch_cpu", 0.8, "small"),
    ("weight streaming 1 WSE vs torch (small preset)", "weight_streaming_1wse", "torch_cpu", 0.5, "small"),
    ("weight streaming 2 WSEs vs DDP (small preset)", "weight_streaming_2wse", "torch_ddp_2ranks", 1.0, "small"),
    ("protocol over tcp vs raw pyzmq", "ceiling:protocol", "ceiling:zmq", 0.9, None),
    ("protocol by shared memory vs memcpy", "ceiling:protocol_shm", "ceiling:memcpy", 0.8, "large"),
]
TARGETS += [(f"{m} {path} vs torch eager (transformer preset)", f"{m}_{path}", f"{m}_torch_eager", 0.9,
             "transformer") for m in TRANSFORMERS for path in TRANSFORMER_PATHS]
# The CPU path is judged by CPU time against torch's on one thread (one process, steps alternated);
# weight streaming, a cluster of processes, by the chief's rate against torch's wall clock.
TARGETS += [target for m in FOREIGN_MODELS for target in (
    (f"{m} CPU path vs torch, CPU time", f"{m}_cpu", f"{m}_torch_eager", 0.8, "models"),
    (f"{m} weight streaming vs torch, wall", f"{m}_weight_streaming_1wse",
     f"{m}_torch_eager_wall", 0.8, "models"))]
EXECUTOR_TARGET = 0.95   # the executor's speed over the hand-written dense step's (--rows executor)
RATE_RE = re.compile(r", Rate=([\d.]+) samples/sec")
# Steps left out of every rate, as bench_baselines.py leaves out the torch rows' first
# steps: the first steps fault in every fresh buffer and start the BLAS threads.
WARMUP_STEPS = 2
PIPELINED_RE = re.compile(r"WeightBytes/step=(\d+) \(received by the WSE sockets\)")
TRAFFIC_RE = re.compile(r"WeightBytes/step=(\d+) .* x (\d+) hops.*GradBytes/step=(\d+)")


def write_params(folder: Path, preset: dict, steps: int, strategy: str, precision: str = "float32") -> Path:
    params = {
        "train_input": {"batch_size": preset["batch_size"], "shuffle": True, "drop_last_batch": True},
        "model": {"hidden_sizes": preset["hidden_sizes"], "activation_fn": "relu", "dropout": 0.1},
        "optimizer": {"optimizer_type": "sgd", "learning_rate": 0.01, "momentum": 0.9},
        "runconfig": {"max_steps": steps, "log_steps": WARMUP_STEPS, "checkpoint_steps": 0, "seed": 1,
                      "execution_strategy": strategy},
    }
    if precision != "float32":
        params["model"].update(mixed_precision=True, fp16_type=precision)
        params["optimizer"]["loss_scaling_factor"] = "dynamic" if precision == "float16" else 1.0
    path = folder / f"{strategy}_{precision}.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def run_job(name: str, cmd: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """Run one job to its end: its output and its CPU seconds, every process of it (the
    launcher reaps the roles it starts, so RUSAGE_CHILDREN counts them when it is reaped)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"bench: {name} failed:\n{result.stderr[-2000:]}")
    return result, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def short_steps(steps: int) -> int:
    """The short run whose CPU is taken off a row's: start-up, compilation and the final
    checkpoint cancel, the steps in between remain."""
    return max(WARMUP_STEPS, steps // 5 // WARMUP_STEPS * WARMUP_STEPS)


def run_row(name: str, launcher: list[str], params: Path, model_dir: Path, extra: tuple = (),
            script: Path = FC_MNIST, job_cpu: bool = False) -> dict:
    """One row: samples/sec from the progress lines; with `job_cpu`, also the job's CPU a
    step (every process, children included): this run's CPU less a short run's, over the
    steps between them (the short run's params: these with fewer steps)."""
    def command(params: Path, model_dir: Path) -> list[str]:
        return [*launcher, sys.executable, str(script), "--mode", "train", "--params", str(params),
                "--model_dir", str(model_dir), *extra]
    result, cpu_s = run_job(name, command(params, model_dir))
    row = {"name": name, "samples_per_sec": steady_rate([float(r) for r in RATE_RE.findall(result.stdout)])}
    if job_cpu:
        settings = yaml.safe_load(params.read_text())
        steps = settings["runconfig"]["max_steps"]
        settings["runconfig"]["max_steps"] = short_steps(steps)
        short = params.with_name(f"{params.stem}_short.yaml")
        short.write_text(yaml.safe_dump(settings))
        _, short_cpu_s = run_job(name, command(short, model_dir.with_name(model_dir.name + "_short")))
        row["cpu_ms_per_step"] = 1000 * (cpu_s - short_cpu_s) / (steps - short_steps(steps))
    traffic = TRAFFIC_RE.search(result.stdout)
    pipelined = PIPELINED_RE.search(result.stdout)
    if pipelined:
        row.update(weight_bytes_per_step=int(pipelined.group(1)), grad_bytes_per_step=0)
    if traffic:
        weight, hops, grads = (int(g) for g in traffic.groups())
        row.update(weight_bytes_per_step=weight * hops, grad_bytes_per_step=grads * (hops - 1) + grads,
                   stream_bytes_per_step=weight)   # what reached the WSEs: one hop
    return row


SCALING_WSES = (1, 2, 4)
SCALING_BATCHES = (0.5, 1, 2)   # times the preset's batch


def scaling_rows(tmp: Path, preset: dict, steps: int) -> list[dict]:
    """The scaling shape: weight streaming on 1, 2 and 4 WSEs at the preset's batch, then on
    1 WSE at half, once and twice it; each with its weight bytes per step and per sample
    (what a step streams does not depend on the batch: per sample it halves as the batch doubles)."""
    rows = []
    wse = [str(BIN / "csrun_wse")]
    params = write_params(tmp, preset, steps, "weight_streaming")
    for n in SCALING_WSES:
        rows.append({**run_row(f"ws_{n}wse_batch{preset['batch_size']}", [*wse, "--num_csx", str(n)], params,
                               tmp / f"scale_ws{n}"), "batch": preset["batch_size"]})
    for factor in SCALING_BATCHES:
        batch = max(SCALING_WSES[-1], int(preset["batch_size"] * factor))
        if batch == preset["batch_size"]:
            continue   # the 1-WSE row above
        sized = {**preset, "batch_size": batch}
        params = write_params(tmp, sized, steps, "weight_streaming")   # run before the next one is written
        rows.append({**run_row(f"ws_1wse_batch{batch}", wse, params, tmp / f"scale_b{batch}"), "batch": batch})
    base = rows[0]["samples_per_sec"]
    for row in rows:
        row["ratio"] = row["samples_per_sec"] / base
    print_rows(f"scaling: weight streaming, {os.cpu_count()} CPUs, steps={steps}", rows[0]["name"], rows)
    print(f"{'row':<30}{'weight B/sample':>16}")
    for row in rows:
        print(f"{row['name']:<30}{row.get('weight_bytes_per_step', 0) / row['batch']:>16.0f}")
    return rows


def steady_rate(rates: list[float]) -> float:
    """samples/sec over every progress interval but the first (the warm-up steps).

    Each interval is WARMUP_STEPS steps of one batch, so its time is proportional
    to 1/rate: the overall rate is the harmonic mean of the interval rates."""
    steady = rates[1:] or rates
    return len(steady) / sum(1.0 / r for r in steady)


def baseline(what: str, *flags: str, optional: bool = False) -> dict:
    """One row of scripts/bench_baselines.py, in its own process. An `optional` one (the
    torch rows: a comparison, not ours) that fails is tried once more, then skipped with
    its last error line ({"skipped": ...}); gloo's DDP ranks now and then abort at exit."""
    cmd = [sys.executable, str(REPO / "scripts" / "bench_baselines.py"), what, *flags]
    for _ in range(2 if optional else 1):
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if result.returncode == 0:
            return json.loads(result.stdout.strip().splitlines()[-1])
    if not optional:
        raise SystemExit(f"bench: baseline {what} failed:\n{result.stderr[-2000:]}")
    last = (result.stderr.strip().splitlines() or ["no output"])[-1]
    return {"skipped": f"failed twice (exit {result.returncode}): {last}"}


def model_facts(preset: dict) -> dict:
    """Layer sizes, parameters, training FLOPs per sample, one pass's weight bytes per layer."""
    sizes = [784, *preset["hidden_sizes"], 10]
    layer_params = [(a + 1) * b for a, b in zip(sizes[:-1], sizes[1:])]
    weights = sum(a * b for a, b in zip(sizes[:-1], sizes[1:]))
    # forward 2, backward 4 FLOPs per weight per sample (the first layer needs no input gradient)
    flops = 6 * weights - 2 * sizes[0] * sizes[1]
    largest = max(zip(sizes[:-1], sizes[1:]), key=lambda ab: ab[0] * ab[1])
    return {"sizes": sizes, "params": sum(layer_params), "flops_per_sample": flops,
            "layer_bytes": [4 * n for n in layer_params], "largest": largest}


CEILING_REPEATS = 3   # each transport ceiling runs this often, alternated; the median counts


TRANSPORT_ROWS = ("memcpy", "zmq", "protocol", "protocol_shm")


def ceilings(facts: dict, batch: int, steps: int, matmul: bool = True, rows=TRANSPORT_ROWS) -> dict:
    """Transport and compute ceilings for the bytes and the largest matmul of one step.

    The transport rows share two cores with ZeroMQ's I/O threads and vary by
    tens of percent from run to run; alternating them, several times, lets a
    drift in the machine's load hit each alike."""
    # one step streams every layer forward and backward: the same bytes twice
    step_bytes = ",".join(str(b) for b in facts["layer_bytes"] * 2)
    k, n = facts["largest"]
    runs: dict[str, list[float]] = {what: [] for what in rows}
    for _ in range(CEILING_REPEATS):
        for what, values in runs.items():
            values.append(baseline(what, "--bytes", step_bytes, "--steps", str(steps))["bytes_per_sec"])
    result = {what: statistics.median(values) for what, values in runs.items()}
    if matmul:
        result["matmul"] = baseline("matmul", "--m", str(batch), "--k", str(k), "--n", str(n),
                                    "--steps", str(steps))["flops_per_sec"]
    return result


def wire_rows(name: str, preset: dict, steps: int) -> dict:
    """--rows wire: the transport ceilings alone (no training rows, no matmul), with their verdicts."""
    facts = model_facts(preset)
    # protocol_fresh: the tcp row as it was before kept buffers (fresh join, then a copy)
    ceiling = ceilings(facts, preset["batch_size"], max(5, min(steps, 50)), matmul=False,
                       rows=(*TRANSPORT_ROWS, "protocol_fresh"))
    mem, raw = ceiling["memcpy"], ceiling["zmq"]
    print(f"preset={name}: one step's weight tensors ({2 * sum(facts['layer_bytes']):,} bytes), "
          f"median of {CEILING_REPEATS} alternated runs of each row")
    for what, value in ceiling.items():
        print(f"{what:<16}{value / 1e9:>8.2f} GB/s")
    print(f"protocol over tcp {ceiling['protocol'] / raw:.2f} of raw pyzmq "
          f"(into fresh buffers: {ceiling['protocol_fresh'] / raw:.2f}); "
          f"by shared memory {ceiling['protocol_shm'] / mem:.2f} of memcpy")
    return {"model": facts, "ceilings": ceiling}


def torch_rows(facts: dict, batch: int, steps: int) -> list[dict]:
    flags = ("--sizes", ",".join(map(str, facts["sizes"])), "--batch", str(batch), "--steps", str(steps))
    rows = []
    for name, what in (("torch_cpu", "torch"), ("torch_ddp_2ranks", "ddp")):
        got = baseline(what, *flags, optional=True)
        if "skipped" in got:
            print(f"bench: {name} skipped: {got['skipped']}")
            continue
        rows.append({"name": name, "samples_per_sec": got["samples_per_sec"]})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--steps", type=int, default=None, help="training steps per row (default: the preset's)")
    parser.add_argument("--input_steps", type=int, default=60, help="steps of each input-bound row (default 60)")
    parser.add_argument("--rows", choices=("all", "model", "precision", "input", "trace", "torch_gpt", "executor",
                                           "ops", "scaling", "wire", "cluster"),
                        default="all",
                        help="precision: float32 and 16-bit weight streaming on 1 and 2 WSEs only; scaling: "
                             "weight streaming on 1, 2 and 4 WSEs, and on 1 at half, once and twice the batch; "
                             "wire: the transport ceilings alone, with their verdicts; ops: the executor's cost "
                             "per op against torch eager, in this process; cluster: the rows of the "
                             "small preset's targets (CPU path, torch, DDP, weight streaming on 1 and 2 WSEs, "
                             "pipelined), each with its job CPU a step and the cluster's share")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: a tiny model, 4 steps, the CPU path and 1-WSE float32 and float16 "
                             "weight streaming, no torch rows or ceilings (numbers only show it runs)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="--rows trace: runs of each row; --rows executor: timed steps of each; --rows ops: "
                             "timed runs of OPS_STEPS steps of each (default 3)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.rows = "tiny", "quick"
    preset = PRESETS[args.preset]
    steps = args.steps or preset["steps"]
    steps = max(2, -(-steps // WARMUP_STEPS)) * WARMUP_STEPS  # whole intervals, at least one after warm-up
    result = {"preset": args.preset, "steps": steps, **c_loops()}
    with tempfile.TemporaryDirectory(prefix="cs_bench_") as tmp:
        tmp = Path(tmp)
        if args.preset == "models":
            if args.rows in ("all", "model"):
                result.update(models_rows(tmp, steps))
        elif args.preset == "transformer" and args.rows in ("all", "model"):
            result.update(transformer_rows(tmp, preset, steps))
        elif args.rows in ("all", "model", "precision", "quick", "cluster"):
            result.update(model_rows(tmp, args.preset, preset, steps, "model" if args.rows == "all" else args.rows))
        if args.rows == "wire" and args.preset in MLP_PRESETS:
            result.update(wire_rows(args.preset, preset, steps))
            result["rows"] = []
        if args.rows == "trace" and args.preset in MLP_PRESETS:
            result["trace_rows"] = trace_rows(tmp, preset, steps, args.repeats)
            print_rows(f"timeline cost: preset {args.preset}, steps={steps}, median of {args.repeats}",
                       "--trace off", result["trace_rows"])
            result["span_cost"] = span_cost(tmp / "ws_1wse_on0", steps, preset["batch_size"],
                                            result["trace_rows"][0]["samples_per_sec"])
        if args.rows == "executor" or (args.rows == "all" and args.preset in MLP_PRESETS):   # an MLP's rows
            result["executor_rows"] = executor_rows(preset, args.repeats)
            print_rows(f"the executor vs a hand-written numpy dense step: preset {args.preset}, in this process, "
                       f"CPU time per step, median of {args.repeats} alternated", "hand-written", result["executor_rows"])
            executor_verdicts(result["executor_rows"])
        if args.rows in ("all", "ops") and args.preset in MLP_PRESETS:
            result["ops_rows"] = ops_rows(args.repeats)
        if args.rows == "scaling" and args.preset in MLP_PRESETS:
            result["scaling_rows"] = scaling_rows(tmp, preset, steps)
        if args.rows == "torch_gpt" or (args.rows == "all" and args.preset != "models"):
            result["torch_gpt_rows"] = torch_gpt_rows(args.steps or 6)
        if args.rows in ("all", "input") and args.preset in MLP_PRESETS:   # FC-MNIST rows
            result["input_rows"] = input_rows(tmp, preset, args.input_steps)
            print_rows(f"input-bound: {AUGMENTED.name}, 1 WSE, steps={args.input_steps}, "
                       f"{os.cpu_count()} CPUs", "1 worker", result["input_rows"])
    if "rows" in result:
        result["verdicts"] = verdicts(args.preset, result["rows"], result.get("ceilings", {}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def model_rows(tmp: Path, name: str, preset: dict, steps: int, which: str = "model") -> dict:
    """The execution paths on the preset's model, the baselines and the ceilings; printed as a table.

    which: model (every row), precision (weight streaming in each format on 1 and 2 WSEs),
    cluster (the CPU path, torch, DDP, weight streaming on 1 and 2 WSEs and pipelined: the rows
    of the small preset's targets), quick (a smoke test: CPU path, 1-WSE float32 and float16, no
    torch, no ceilings). Every row of ours also measures the job's CPU a step (run_row)."""
    batch = preset["batch_size"]
    facts = model_facts(preset)
    params = write_params(tmp, preset, steps, "weight_streaming")
    piped = write_params(tmp, preset, steps, "pipelined")
    wse = [str(BIN / "csrun_wse")]
    wse_counts = (1,) if which == "quick" else (1, 2)
    formats = {"quick": ("float16",), "cluster": ()}.get(which, MIXED)
    rows = []

    def row(*args, **kwargs):
        rows.append(run_row(*args, **kwargs, job_cpu=True))
    if which != "precision":
        row("cpu", [str(BIN / "csrun_cpu")], params, tmp / "cpu")
    if which in ("model", "cluster"):
        rows += torch_rows(facts, batch, steps)
    for n in wse_counts:
        row(f"weight_streaming_{n}wse", [*wse, "--num_csx", str(n)], params, tmp / f"ws{n}")
    if which == "model":
        row("weight_streaming_1wse_insecure", [*wse, "--insecure"], params, tmp / "ws1i")
    if which in ("model", "cluster"):
        row("pipelined", wse, piped, tmp / "pipe")
    if which == "model":
        row("pipelined_multireplica", wse, piped, tmp / "pipe2", ("--multireplica",))
    for n in wse_counts:
        for precision in formats:
            mixed = write_params(tmp, preset, steps, "weight_streaming", precision)
            row(f"ws_{n}wse_{precision}", [*wse, "--num_csx", str(n)], mixed, tmp / f"ws{n}_{precision}")
    ceiling = ceilings(facts, batch, max(5, min(steps, 50))) if which == "model" else {}
    report(name, preset, facts, steps, rows, ceiling)
    curve = {r["name"]: r["samples_per_sec"] for r in rows}
    if "weight_streaming_1wse_insecure" in curve:
        print(f"CURVE cost: weight streaming (1 WSE) with CURVE runs at "
              f"{curve['weight_streaming_1wse'] / curve['weight_streaming_1wse_insecure']:.2f}x the speed of --insecure")
    return {"model": facts, "ceilings": ceiling, "rows": rows}


def write_transformer_params(folder: Path, model: str, preset: dict, steps: int, strategy: str) -> Path:
    """examples/<model>/configs/params.yaml at the preset's size, AdamW, dropout 0.1."""
    params = yaml.safe_load((REPO / "examples" / model / "configs" / "params.yaml").read_text())
    params.pop("eval_input", None)
    params["train_input"].update(batch_size=preset["batch_size"], max_sequence_length=preset["seq"])
    params["model"].update(hidden_size=preset["hidden"], num_hidden_layers=preset["layers"],
                           num_heads=preset["heads"], filter_size=preset["ffn"],
                           max_position_embeddings=preset["seq"])
    params["runconfig"] = {"max_steps": steps, "log_steps": WARMUP_STEPS, "checkpoint_steps": 0, "seed": 1,
                           "execution_strategy": strategy}
    path = folder / f"{model}_{strategy}.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def transformer_rows(tmp: Path, preset: dict, steps: int) -> dict:
    """GPT-2 and BERT from params.yaml on the CPU path, weight streaming (1 WSE) and pipelined,
    beside torch eager on the equivalent module (scripts/bench_baselines.py transformer)."""
    rows = []
    for model in TRANSFORMERS:
        script = REPO / "examples" / model / "run.py"
        streamed = write_transformer_params(tmp, model, preset, steps, "weight_streaming")
        piped = write_transformer_params(tmp, model, preset, steps, "pipelined")
        torch_row = baseline("transformer", "--style", model, "--batch", str(preset["batch_size"]),
                             "--steps", str(steps), "--seq", str(preset["seq"]), "--hidden", str(preset["hidden"]),
                             "--layers", str(preset["layers"]), "--heads", str(preset["heads"]),
                             "--ffn", str(preset["ffn"]), optional=True)
        ours = [run_row(f"{model}_cpu", [str(BIN / "csrun_cpu")], streamed, tmp / f"{model}_cpu", script=script),
                run_row(f"{model}_weight_streaming_1wse", [str(BIN / "csrun_wse")], streamed, tmp / f"{model}_ws",
                        script=script),
                run_row(f"{model}_pipelined", [str(BIN / "csrun_wse")], piped, tmp / f"{model}_pipe",
                        script=script)]
        if "skipped" in torch_row:
            print(f"bench: {model}_torch_eager skipped: {torch_row['skipped']}")
            base = ours[0]["samples_per_sec"]
        else:
            ours.insert(0, {"name": f"{model}_torch_eager", "samples_per_sec": torch_row["samples_per_sec"]})
            base = torch_row["samples_per_sec"]
        for row in ours:
            row["ratio"] = row["samples_per_sec"] / base
        rows += ours
    print_rows(f"transformer preset: GPT-2 and BERT {preset['layers']} x {preset['hidden']}, sequence "
               f"{preset['seq']}, batch {preset['batch_size']}, AdamW, steps={steps}; {c_loops_line()}",
               "torch eager (or the CPU path)", rows)
    return {"rows": rows}


def models_rows(tmp: Path, steps: int) -> dict:
    """Each foreign model (scripts/bench_models.py) on the CPU path's calls beside torch eager on one
    thread, in a process of its own (CPU time a step, median; ours on one thread too), then weight
    streaming on 1 WSE (its threads as a job gets them) against torch's wall clock."""
    missing = [name for name in ("torch", "torchvision", "transformers", "timm")
               if importlib.util.find_spec(name) is None]
    if missing:
        print(f"bench: models preset skipped: {', '.join(missing)} not installed (pip install -e '.[torch]')")
        return {"rows": []}
    rows = []
    for model in FOREIGN_MODELS:
        result = subprocess.run([sys.executable, str(BENCH_MODELS), model, "--steps", str(steps)],
                                capture_output=True, text=True, timeout=1800, env=ONE_THREAD)
        if result.returncode != 0:
            raise SystemExit(f"bench: {model} in process failed:\n{result.stderr[-2000:]}")
        timed = json.loads(result.stdout.strip().splitlines()[-1])
        batch = timed["batch"]
        streamed = run_row(f"{model}_weight_streaming_1wse", [str(BIN / "csrun_wse")],
                           write_models_params(tmp, model, batch, steps), tmp / f"{model}_ws", script=BENCH_MODELS)
        torch_wall = batch / timed["torch_wall_s"]
        streamed["ratio"] = streamed["samples_per_sec"] / torch_wall
        rows += [{"name": f"{model}_torch_eager", "samples_per_sec": batch / timed["torch_cpu_s"], "ratio": 1.0},
                 {"name": f"{model}_cpu", "samples_per_sec": batch / timed["ours_cpu_s"],
                  "ratio": timed["torch_cpu_s"] / timed["ours_cpu_s"]},
                 {"name": f"{model}_torch_eager_wall", "samples_per_sec": torch_wall, "ratio": 1.0},
                 streamed]
    print_rows(f"models preset: models written by others, AdamW, {steps} steps; torch on one thread; "
               "*_torch_eager and *_cpu by CPU time a step (median, in one process), *_wall and weight streaming "
               f"by wall clock; {c_loops_line()}", "torch eager", rows)
    return {"rows": rows}


# Both sides of the in-process comparison on one thread: torch by set_num_threads(1), ours by
# OpenBLAS's count (which also turns numerics/parallel.py's pieces off), so that CPU time is work
# (a BLAS thread waiting for a core on a loaded machine spins, and its spin counts as CPU time).
# The process gets the allocator csrun_cpu gives the CPU path (env.ALLOCATOR: freed arrays
# reused, not fresh pages the kernel zeroes), torch's side included.
ONE_THREAD = with_numerics_defaults({**os.environ, "OPENBLAS_NUM_THREADS": "1"}, threaded=False)


def write_models_params(folder: Path, model: str, batch: int, steps: int) -> Path:
    params = {
        "train_input": {"batch_size": batch, "shuffle": True, "drop_last_batch": True},
        "model": {"name": model},
        "optimizer": {"optimizer_type": "adamw", "learning_rate": 1e-3, "weight_decay": 0.01},
        "runconfig": {"max_steps": steps, "log_steps": WARMUP_STEPS, "checkpoint_steps": 0, "seed": 1,
                      "execution_strategy": "weight_streaming"},
    }
    path = folder / f"{model}_weight_streaming.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def verdicts(preset: str, rows: list[dict], ceiling: dict) -> list[dict]:
    """Each target whose rows ran: the ratio measured, the target, and on the target's own preset
    met or missed and by how much (elsewhere "judged": False, and the preset it is defined on)."""
    values = {r["name"]: r["samples_per_sec"] for r in rows}
    values.update({f"ceiling:{k}": v for k, v in ceiling.items()})
    judged = []
    for what, row, base, target, defined_on in TARGETS:
        if row not in values or base not in values:
            continue
        ratio = values[row] / values[base]
        verdict = {"target": what, "row": row, "baseline": base, "ratio": ratio, "target_ratio": target,
                   "judged": defined_on in (None, preset), "defined_on": defined_on}
        if verdict["judged"]:
            verdict.update(met=ratio >= target, margin=ratio / target - 1)
        judged.append(verdict)
    if judged:
        print(f"{'target':<52}{'ratio':>7}{'target':>8}  verdict")
        for v in judged:
            if not v["judged"]:
                said = f"not judged: defined on the {v['defined_on']} preset"
            else:
                said = f"{'met' if v['met'] else 'missed'} by {abs(v['margin']) * 100:.0f}%"
            print(f"{v['target']:<52}{v['ratio']:>7.2f}{v['target_ratio']:>8.2f}  {said}")
    return judged


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


def trace_rows(tmp: Path, preset: dict, steps: int, repeats: int) -> list[dict]:
    """The same run with --trace off and on, alternated so that drifting load hits both alike."""
    params = write_params(tmp, preset, steps, "weight_streaming")
    rows = []
    for name, launcher in (("ws_1wse", [str(BIN / "csrun_wse")]), ("cpu", [str(BIN / "csrun_cpu")])):
        rates: dict[str, list[float]] = {"off": [], "on": []}
        for i in range(repeats):
            for mode, flags in (("off", []), ("on", ["--trace"])):
                row = run_row(f"{name}_trace_{mode}", [*launcher, *flags], params, tmp / f"{name}_{mode}{i}")
                rates[mode].append(row["samples_per_sec"])
        off = statistics.median(rates["off"])
        for mode in ("off", "on"):
            rate = statistics.median(rates[mode])
            rows.append({"name": f"{name}_trace_{mode}", "samples_per_sec": rate, "ratio": rate / off,
                         "runs": rates[mode]})
    return rows


def span_cost(traced_dir: Path, steps: int, batch: int, rate_off: float) -> dict:
    """ns per span site, off and on (in this process), and what the off cost is of a step, from the spans per step."""
    import timeit
    sys.path.insert(0, str(REPO))     # this checkout's cs_runtime
    from cs_runtime import trace

    def site():
        with trace.span("fwd", step=1, layer=2):
            pass

    def bare():
        pass
    n = 200_000
    empty = min(timeit.repeat(bare, number=n, repeat=5)) / n
    cost = {}
    for mode in (False, True):
        trace.RECORDER.reset(mode)
        cost["on" if mode else "off"] = (min(timeit.repeat(site, number=n, repeat=5)) / n - empty) * 1e9
    trace.RECORDER.reset(False)
    spans = sum(1 for e in json.loads((traced_dir / "trace.json").read_text())["traceEvents"] if e["ph"] == "X")
    per_step = spans / steps
    step_ns = batch / rate_off * 1e9
    result = {"ns_per_site_off": cost["off"], "ns_per_site_on": cost["on"], "spans_per_step": per_step,
              "off_fraction_of_step": per_step * cost["off"] / step_ns}
    print(f"span site: {cost['off']:.0f} ns off, {cost['on']:.0f} ns on; {per_step:.1f} spans per step "
          f"(all processes); off: {result['off_fraction_of_step'] * 100:.4f}% of a step's "
          f"{step_ns / 1e6:.2f} ms (summed over processes, an upper bound)")
    return result


def handwritten_mlp_step(sizes: list[int], weights: dict, x, y, step: int, fmt: str, dropout: float,
                         seed: int, loss_scale: float) -> list[dict]:
    """The baseline of the executor rows: a dense ReLU MLP's forward, softmax
    cross-entropy and backward written out in numpy (what the runtime's dense
    layers did before every model ran as a compiled program), with the 16-bit
    rule of docs/numerics.md: matmul inputs and weights rounded to `fmt`,
    float32 accumulation, weight gradients rounded. Returns each layer's
    gradients, scaled by `loss_scale`, as the executor's model_backward does.
    Each layer's products run on the BLAS thread count numerics/blas.py gives
    them, as the executor's do: another count may pick other kernels, other bits."""
    import numpy as np

    from cs_runtime.numerics import blas, kernels
    from cs_runtime.numerics.precision import quantize

    def q(a):
        return a if fmt == "float32" else quantize(a, fmt)

    def threads(i):
        return blas.dense_layer_threads(len(x), sizes[i], sizes[i + 1])
    n, batch = len(sizes) - 1, len(x)
    inputs, outs, masks = [], [], []
    h = x
    for i in range(n):
        h = q(h)
        inputs.append(h)
        with threads(i):
            z = h @ q(weights[f"fc{i}"]["weight"])
        z += q(weights[f"fc{i}"]["bias"])
        if i < n - 1:   # hidden: relu (in place), then dropout
            h = np.maximum(z, 0, out=z)
            masks.append(kernels.rows_keep_mask(seed, step, i, batch, sizes[i + 1], slice(0, batch), dropout)
                         if dropout else None)
            if masks[-1] is not None:
                h *= masks[-1]
            outs.append(h)
        else:
            h = z
    _, delta, _ = kernels.softmax_cross_entropy(h, y, batch)
    if loss_scale != 1.0:
        delta = delta * np.float32(loss_scale)
    grads: list = [None] * n
    for i in reversed(range(n)):
        if i < n - 1:
            if masks[i] is not None:
                delta = delta * masks[i]
            delta = delta * (outs[i] > 0)
        dz = q(delta)
        with threads(i):
            grads[i] = {"weight": q(inputs[i].T @ dz), "bias": q(delta.sum(axis=0))}
            if i:
                delta = dz @ q(weights[f"fc{i}"]["weight"]).T
    return grads


def executor_rows(preset: dict, repeats: int, formats=("float32", *MIXED)) -> list[dict]:
    """The preset's MLP trained in this process by the executor (the lowered program, the CPU
    path's calls) and by handwritten_mlp_step, the same optimizer update after each: CPU time
    per step, alternated `repeats` times after a warm-up step, the median of each. Both must end
    on the same weights to the bit (else the bench stops): the baseline computes what the
    executor computes. ratio: the executor's speed over the baseline's (1.0: as fast)."""
    import dataclasses
    import time

    import numpy as np

    sys.path.insert(0, str(REPO))     # this checkout's cs_runtime
    from cs_runtime.compiler.families import lower_spec
    from cs_runtime.numerics.model import ShardContext, init_weights, mlp_spec, model_backward, model_forward, model_loss
    from cs_runtime.numerics.optim import Optimizer, OptimizerSpec
    from cs_runtime.numerics.precision import scaled
    sizes, batch, dropout, seed = [784, *preset["hidden_sizes"], 10], preset["batch_size"], 0.1, 1
    rng = np.random.default_rng(0)
    x, y = rng.random((batch, 784), dtype=np.float32), rng.integers(0, 10, batch)
    rows = []
    for fmt in formats:
        spec = lower_spec(dataclasses.replace(mlp_spec("bench", sizes, "relu", dropout), precision=fmt))
        names = [layer.name for layer in spec.layers]
        scale = 1.0 if fmt == "float32" else 1024.0    # a static loss scale in 16 bits

        def trainer(grads_of):
            weights, optimizer = init_weights(spec, seed), Optimizer(OptimizerSpec("sgd", momentum=0.9))
            state = {name: optimizer.init_state(w) for name, w in weights.items()}

            def step(s):
                optimizer.update_model(names, weights, grads_of(weights, s), state, 0.01, s, None, scale,
                                       fmt != "float32", need_norms=False)
            return step, weights

        def by_executor(weights, s):
            ctx = ShardContext(seed, s, batch, slice(0, batch), True, labels=y)
            live, caches = model_forward(spec, x, weights, ctx)
            return model_backward(spec, scaled(model_loss(spec, live, y, batch).delta, scale), caches, weights, s)

        def by_hand(weights, s):
            return handwritten_mlp_step(sizes, weights, x, y, s, fmt, dropout, seed, scale)
        paths = {"handwritten": trainer(by_hand), "executor": trainer(by_executor)}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for r in range(repeats + 1):
            order = list(paths) if r % 2 == 0 else list(reversed(paths))
            for name in order:
                start = time.process_time()
                paths[name][0](r)
                if r:   # step 0: the warm-up, left out
                    times[name].append(time.process_time() - start)
        same = all(np.array_equal(paths["handwritten"][1][k][p], w) for k, ws in paths["executor"][1].items()
                   for p, w in ws.items())
        if not same:
            raise SystemExit(f"bench: the executor and the hand-written step disagree in {fmt}")
        base = statistics.median(times["handwritten"])
        for name in paths:
            t = statistics.median(times[name])
            rows.append({"name": f"{name}_{fmt}", "samples_per_sec": batch / t, "ratio": base / t,
                         "cpu_s_per_step": times[name]})
    return rows


def executor_verdicts(rows: list[dict]) -> None:
    """Issue 16's target: the executor within 5% of the hand-written path, each format."""
    for row in rows:
        if row["name"].startswith("executor_"):
            verdict = "met" if row["ratio"] >= EXECUTOR_TARGET else "missed"
            print(f"{row['name'] + ' vs hand-written':<52}{row['ratio']:>7.2f}{EXECUTOR_TARGET:>8.2f}  {verdict}")


# --rows ops: models of many small ops, batch 128: the small preset, and 12 hidden layers 64 wide
OPS_MODELS = {"small": [784, 256, 128, 10], "mlp_12x64": [784, *[64] * 12, 10]}
OPS_BATCH, OPS_STEPS = 128, 50


def ops_rows(repeats: int) -> list[dict]:
    """The executor's cost per op: each OPS_MODELS MLP (relu, dropout 0.1, SGD with momentum)
    trained in this process by the CPU path's calls (local_step.forward_backward and
    apply_update, as chief/cpu_executor.py makes them) and by torch eager on the same layers
    (bench_baselines.torch_model), both on one thread, alternated `repeats` times OPS_STEPS
    steps each after a warm-up; CPU time per step (process_time), the median of each. ratio:
    torch's CPU time over ours (1.0: as fast). ops: the program's nodes a step runs, forward
    and backward; us_per_op: our step over them. Then where the small preset's step goes,
    by op (budget_of_step)."""
    try:
        import torch
    except ImportError:
        print("bench: ops skipped: torch is not installed")
        return []
    torch.set_num_threads(1)   # our small products run on one BLAS thread (numerics/blas.py)
    rows = []
    for name, sizes in OPS_MODELS.items():
        paths = {"torch_eager": torch_mlp_step(torch, sizes, OPS_BATCH), "cpu_path": cpu_path_step(sizes, OPS_BATCH)}
        times = alternated_cpu_times(paths, repeats, OPS_STEPS)
        ours, theirs = statistics.median(times["cpu_path"]), statistics.median(times["torch_eager"])
        ops = paths["cpu_path"].ops
        rows.append({"name": name, "sizes": sizes, "ms_per_step": ours * 1e3, "torch_ms_per_step": theirs * 1e3,
                     "ratio": theirs / ours, "ops": ops, "us_per_op": ours / ops * 1e6,
                     "gap_us_per_op": (ours - theirs) / ops * 1e6})
    print(f"the executor's cost per op: batch {OPS_BATCH}, CPU time per step in this process, one thread each, "
          f"median of {repeats} alternated runs of {OPS_STEPS} steps")
    print(f"{'model':<12}{'ours ms':>9}{'torch ms':>10}{'vs torch':>10}{'ops':>6}{'us/op':>8}{'gap us/op':>11}")
    for row in rows:
        print(f"{row['name']:<12}{row['ms_per_step']:>9.3f}{row['torch_ms_per_step']:>10.3f}{row['ratio']:>10.2f}"
              f"{row['ops']:>6}{row['us_per_op']:>8.1f}{row['gap_us_per_op']:>11.1f}")
    budget_of_step(OPS_MODELS["small"], OPS_BATCH)
    return rows


def alternated_cpu_times(paths: dict, repeats: int, steps: int) -> dict[str, list[float]]:
    """CPU seconds per step of each path's step(s), `steps` at a time, alternated (the order
    flipped every round) after one warm-up round, so a drift in the load hits each alike."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    done = 0
    for r in range(repeats + 1):
        for name in (list(paths) if r % 2 == 0 else list(reversed(paths))):
            start = time.process_time()
            for s in range(steps):
                paths[name](done + s)
            if r:
                times[name].append((time.process_time() - start) / steps)
        done += steps
    return times


def cpu_path_step(sizes: list[int], batch: int):
    """One training step of the MLP by the CPU path's calls, on a fixed batch; .ops: its nodes."""
    import numpy as np

    sys.path.insert(0, str(REPO))     # this checkout's cs_runtime
    from cs_runtime.compiler.families import lower_spec
    from cs_runtime.numerics import local_step
    from cs_runtime.numerics.model import ShardContext, init_weights, mlp_spec
    from cs_runtime.numerics.optim import Optimizer, OptimizerSpec
    from cs_runtime.numerics.program_layer import unit_of
    spec = lower_spec(mlp_spec("ops", sizes, "relu", 0.1))
    weights, optimizer = init_weights(spec, 1), Optimizer(OptimizerSpec("sgd", momentum=0.9))
    state = {name: optimizer.init_state(w) for name, w in weights.items()}
    rng = np.random.default_rng(0)
    x, y = rng.random((batch, sizes[0]), dtype=np.float32), rng.integers(0, sizes[-1], batch)

    def step(s: int) -> None:
        ctx = ShardContext(1, s, batch, slice(0, batch), True, labels=y)
        _, grads, _ = local_step.forward_backward(spec, x, y, weights, ctx, batch, 1.0, s)
        local_step.apply_update(optimizer, spec, weights, grads, state, 0.01, s, need_norms=False)
    step.ops = sum(len(unit_of(layer).forward) + len(unit_of(layer).backward) for layer in spec.layers)
    return step


def torch_mlp_step(torch, sizes: list[int], batch: int):
    """One training step of the same MLP by torch eager (bench_baselines.torch_model's layers)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from scripts.bench_baselines import torch_model
    model = torch_model(torch, sizes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn, gen = torch.nn.CrossEntropyLoss(), torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, sizes[0], generator=gen), torch.randint(0, sizes[-1], (batch,), generator=gen)

    def step(s: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
    return step


def budget_of_step(sizes: list[int], batch: int, steps: int = 200) -> dict[str, float]:
    """Where a step of the MLP goes, CPU ms a step: each op kind's nodes (forward, in place
    or not, and vjp: its rule), the optimizer's update, and the rest (the executor's own
    work between nodes, the loss's bookkeeping); timed around every node, so the parts add
    up to a little more than an untimed step."""
    step = cpu_path_step(sizes, batch)   # (and this checkout's cs_runtime on the path)
    from cs_runtime.numerics import executor, local_step
    spent: dict[str, float] = collections.defaultdict(float)
    run_node, in_place, update = executor.run_node, executor._run_in_place, local_step.apply_update

    def timed_node(node, env, *args, **kwargs):
        start = time.process_time()
        run_node(node, env, *args, **kwargs)
        spent["vjp:" + node.attrs["of"] if node.op == "vjp" else node.op] += time.process_time() - start

    def timed_in_place(node, env):
        start = time.process_time()
        try:
            return in_place(node, env)
        finally:
            spent[node.op] += time.process_time() - start

    def timed_update(*args, **kwargs):
        start = time.process_time()
        try:
            return update(*args, **kwargs)
        finally:
            spent["optimizer update"] += time.process_time() - start
    step(0)
    # run_nodes and the step look these up as they run
    executor.run_node, executor._run_in_place, local_step.apply_update = timed_node, timed_in_place, timed_update
    try:
        spent.clear()
        start = time.process_time()
        for s in range(1, steps + 1):
            step(s)
        total = time.process_time() - start
    finally:
        executor.run_node, executor._run_in_place, local_step.apply_update = run_node, in_place, update
    budget = {k: v / steps * 1e3 for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
    budget["the rest (executor, loss)"] = total / steps * 1e3 - sum(budget.values())
    print(f"where a step of {sizes} goes (batch {batch}, CPU ms a step, {steps} steps, each node timed): "
          + ", ".join(f"{k} {v:.3f}" for k, v in budget.items()) + f"; total {total / steps * 1e3:.3f}")
    return budget


def torch_gpt_rows(steps: int, batch: int = 8, seq: int = 128) -> list[dict]:
    """A traced GPT-2 (4 x 256, sequence 128) on the CPU path's calls vs torch eager, same module and batches."""
    try:
        import torch
    except ImportError:
        print("bench: torch_gpt skipped: torch is not installed")
        return []
    import copy
    import time

    import numpy as np

    if str(REPO) not in sys.path:   # examples/ is not an installed package
        sys.path.insert(0, str(REPO))

    from cs_runtime.numerics.model import ShardContext, init_weights, model_backward, model_forward, model_loss
    from cs_runtime.numerics.optim import Optimizer, OptimizerSpec
    from cs_torch.capture import model_spec
    from examples.torch_gpt.model import GPT, GPTConfig, gpt_loss
    torch.manual_seed(0)
    module = GPT(GPTConfig(vocab_size=260, block_size=seq, n_layer=4, n_head=4, n_embd=256))
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 260, (batch, seq)), rng.integers(0, 260, (batch, seq))) for _ in range(steps + 1)]
    ids = torch.from_numpy(batches[0][0])
    spec = model_spec("torch_gpt_bench", copy.deepcopy(module), (ids,), ids, gpt_loss)
    weights, optimizer = init_weights(spec, 0), Optimizer(OptimizerSpec("adamw", weight_decay=0.01))
    state = {name: optimizer.init_state(w) for name, w in weights.items()}
    names = [layer.name for layer in spec.layers]

    def ours(step, x, y):
        ctx = ShardContext(0, step, batch, slice(0, batch), True, labels=y)
        live, caches = model_forward(spec, x, weights, ctx)
        result = model_loss(spec, live, y, batch)
        optimizer.update_model(names, weights, model_backward(spec, result.delta, caches, weights, step), state,
                               1e-3, step, None, need_norms=False)

    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01)

    def theirs(step, x, y):
        opt.zero_grad()
        gpt_loss(module(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()

    rows = []
    for name, fn in (("torch_eager_gpt", theirs), ("traced_gpt_cpu_path", ours)):
        fn(0, *batches[0])                                   # warm-up, left out
        start = time.perf_counter()
        for step, (x, y) in enumerate(batches[1:], start=1):
            fn(step, x, y)
        rows.append({"name": name, "samples_per_sec": steps * batch / (time.perf_counter() - start)})
    for row in rows:
        row["ratio"] = row["samples_per_sec"] / rows[0]["samples_per_sec"]
    print_rows(f"traced GPT-2 4 x 256, sequence {seq}, batch {batch}, AdamW, {steps} steps", "torch eager", rows)
    return rows


def print_rows(title: str, baseline: str, rows: list[dict]) -> None:
    print(title)
    ratio_width = max(12, len(baseline) + 5)   # the header 'vs <baseline>' and two spaces
    name_width = max([30] + [len(row["name"]) + 2 for row in rows])
    print(f"{'row':<{name_width}}{'samples/sec':>14}{'vs ' + baseline:>{ratio_width}}{'weight B/step':>16}"
          f"{'grad B/step':>14}")
    for row in rows:
        print(f"{row['name']:<{name_width}}{row['samples_per_sec']:>14.1f}{row['ratio']:>{ratio_width}.2f}"
              f"{row.get('weight_bytes_per_step', 0):>16}{row.get('grad_bytes_per_step', 0):>14}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def report(name: str, preset: dict, facts: dict, steps: int, rows: list[dict], ceiling: dict) -> None:
    """The table: rates, ratios to the baseline, FLOP/s and streaming against their ceilings (when measured)."""
    by_name = {r["name"]: r for r in rows}
    base = by_name.get("torch_cpu") or by_name.get("cpu") or rows[0]
    batch = preset["batch_size"]
    print(f"preset={name} layers={facts['sizes']} params={facts['params']:,} batch={batch} steps={steps}; "
          f"{c_loops_line()}")
    if ceiling:
        mem, raw = ceiling["memcpy"], ceiling["zmq"]
        print(f"ceilings: numpy matmul {batch}x{facts['largest'][0]}x{facts['largest'][1]} "
              f"{ceiling['matmul'] / 1e9:.1f} GFLOP/s; memcpy {mem / 1e9:.2f} GB/s; raw pyzmq tcp {raw / 1e9:.2f} GB/s")
        print(f"weight stream alone (one step's tensors, received into the receiver's own memory): "
              f"protocol over tcp {ceiling['protocol'] / 1e9:.2f} GB/s = {ceiling['protocol'] / raw:.2f} of raw pyzmq; "
              f"protocol by shared memory {ceiling['protocol_shm'] / 1e9:.2f} GB/s = "
              f"{ceiling['protocol_shm'] / mem:.2f} of memcpy")
    else:
        print("ceilings: not measured in this mode")
    print("CPU ms/step: the job's CPU a step, every process (a run less a shorter one); cluster ms/step: "
          "that less the CPU path's (what the roles, messages and hops add)")
    print(f"{'row':<28}{'samples/sec':>12}{'vs ' + base['name']:>28}{'CPU ms/step':>12}{'cluster ms/step':>16}"
          f"{'FLOP/s':>10}{'of matmul':>10}{'weight B/step':>15}{'stream GB/s':>12}{'of memcpy':>10}{'of zmq':>8}")
    cpu_path = by_name.get("cpu", {}).get("cpu_ms_per_step")
    for row in rows:
        rate = row["samples_per_sec"]
        row["ratio_vs_baseline"] = rate / base["samples_per_sec"]
        row["flops_per_sec"] = rate * facts["flops_per_sample"]
        cpu = row.get("cpu_ms_per_step")
        if cpu is not None and cpu_path is not None and row["name"] != "cpu":
            row["cluster_ms_per_step"] = cpu - cpu_path
        line = (f"{row['name']:<28}{rate:>12.1f}{row['ratio_vs_baseline']:>28.2f}"
                f"{_ms(cpu):>12}{_ms(row.get('cluster_ms_per_step')):>16}{row['flops_per_sec'] / 1e9:>9.1f}G")
        if ceiling:
            row["flops_fraction_of_matmul"] = row["flops_per_sec"] / ceiling["matmul"]
            line += f"{row['flops_fraction_of_matmul']:>10.2f}"
        else:
            line += f"{'-':>10}"
        if row.get("weight_bytes_per_step"):
            line += f"{row['weight_bytes_per_step']:>15}"
        if row.get("stream_bytes_per_step"):
            # bytes that reached the WSE(s) per second: one hop of the weight stream, as measured
            # (16-bit formats at 2 bytes a value; the last group of layers goes once a step)
            streamed = row["stream_bytes_per_step"] * rate / batch
            row["weight_stream_bytes_per_sec"] = streamed
            line += f"{streamed / 1e9:>12.3f}"
            if ceiling:
                line += f"{streamed / ceiling['memcpy']:>10.3f}{streamed / ceiling['zmq']:>8.3f}"
        print(line)


if __name__ == "__main__":
    main()
