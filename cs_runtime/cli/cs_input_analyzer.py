"""cs_input_analyzer: how many input workers (nodes, tasks, cpus) does a model need?

    cs_input_analyzer --available-nodes 3 python examples/fc_mnist/run.py --mode train --params ...

Measures, on this machine, the throughput of the script's training input
function with 1..k workers running side by side (the same code path as
csrun_wse's input workers), and how fast one WSE emulator consumes batches
of the compiled model (`--num_csx` of them share each batch). It then
recommends the smallest number of input workers whose measured throughput
covers the consumption with HEADROOM to spare, and lays them out as
`--total-nodes / --tasks-per-node / --cpus-per-task` (task 0 is the chief).

It writes nothing into the current folder unless asked: everything it
measured goes to a YAML report with --report FILE, or to
DIR/input_analysis.yaml with --output_dir DIR, where the probes' compile
output (DIR/model_dir) goes too; without either, the probes compile into a
temporary folder that is removed afterwards (a --model_dir in the command
is the user's and is used as given).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from cs_runtime.flags import add_flag
from cs_runtime.version import version_line

HEADROOM = 1.2            # input must outrun the WSE by this factor: a worker's rate varies
PROBE_START_TIMEOUT_S = 300


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cs_input_analyzer", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=version_line("cs_input_analyzer"))
    cpus = os.cpu_count() or 1
    flag = functools.partial(add_flag, parser)
    flag("available_nodes", type=int, default=1, help="nodes you can use for input (default 1)")
    flag("cpus_per_node", type=int, default=cpus, help=f"CPUs per node (default this machine's: {cpus})")
    flag("max_workers", type=int, default=min(4, cpus), help="measure 1..k workers here (default min(4, CPUs))")
    flag("seconds", type=float, default=3.0, help="seconds each measurement runs (default 3)")
    flag("num_csx", type=int, default=1, help="WSEs the job will use (default 1)")
    flag("report", default=None, help="write the YAML report to this file (default: none, or DIR/input_analysis.yaml "
                                      "with --output_dir)")
    flag("output_dir", default=None, help="folder for the report and the probes' compile output (default: no report, "
                                          "the compile output in a temporary folder)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="python run.py --params ... [ARGS]")
    ns = parser.parse_args(argv)
    if not ns.command or ns.command[0].startswith("-"):
        parser.error("expected the run command, e.g. python examples/fc_mnist/run.py --mode train --params ...")
    for name in ("available_nodes", "cpus_per_node", "max_workers", "num_csx"):
        if getattr(ns, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if ns.seconds <= 0:
        parser.error("--seconds must be positive")
    if "--mode" not in ns.command:
        ns.command = [*ns.command, "--mode", "train"]
    if ns.report is None and ns.output_dir is not None:
        ns.report = str(Path(ns.output_dir) / "input_analysis.yaml")
    return ns


def gives_model_dir(command: list[str]) -> bool:
    return any(arg == "--model_dir" or arg.startswith("--model_dir=") for arg in command)


def with_model_dir(command: list[str], scratch: str) -> list[str]:
    """The probes' command: their compile output in --output_dir or a scratch folder, never the current one."""
    return command if gives_model_dir(command) else [*command, "--model_dir", scratch]


def probe_env(role: str, **values) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CS_")}
    env.update(CS_ROLE=role, PYTHONUNBUFFERED="1", **{k: str(v) for k, v in values.items()})
    return env


def read_probe_line(proc: subprocess.Popen, kind: str) -> dict | None:
    """Next `PROBE kind ...` line (other output, e.g. the compile stage, is passed through to stderr)."""
    for line in proc.stdout:
        if line.startswith(f"PROBE {kind}"):
            rest = line[len(f"PROBE {kind}"):].strip()
            return json.loads(rest) if rest else {}
        sys.stderr.write(line)
    raise SystemExit(f"cs_input_analyzer: the {kind} probe exited with code {proc.wait()} before reporting "
                     "(see its output above)")


def measure_workers(command: list[str], workers: int, seconds: float) -> dict:
    """k input workers side by side: their summed batches/s."""
    procs = [subprocess.Popen(command, env=probe_env("input_probe", CS_PROBE_RANK=r, CS_PROBE_WORKERS=workers,
                                                     CS_PROBE_SECONDS=seconds),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for r in range(workers)]
    try:
        for proc in procs:
            read_probe_line(proc, "ready")
        for proc in procs:  # all start together
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = [read_probe_line(proc, "result") for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    rates = [r["batches"] / r["seconds"] for r in results]
    batch = results[0]["batch_size"]
    return {"workers": workers, "batches_per_sec": round(sum(rates), 3),
            "samples_per_sec": round(sum(rates) * batch, 1),
            "per_worker_batches_per_sec": [round(r, 3) for r in rates]}


def measure_wse(command: list[str], seconds: float, num_csx: int) -> dict:
    proc = subprocess.Popen(command, env=probe_env("wse_probe", CS_PROBE_SECONDS=seconds, CS_NUM_CSX=num_csx),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        result = read_probe_line(proc, "result")
    finally:
        proc.kill()
        proc.wait()
    rate = result["steps"] / result["seconds"]
    return {"num_csx": num_csx, "batch_size": result["batch_size"], "execution_strategy": result["execution_strategy"],
            "emulator_batches_per_sec": round(rate, 3), "emulator_samples_per_sec": round(rate * result["batch_size"], 1),
            "compiler_estimated_samples_per_sec": round(result["estimated_samples_per_s"], 1)}


def workers_needed(measured: list[dict], need: float) -> tuple[int, str]:
    """Smallest measured k that covers `need` batches/s; beyond what was measured, extrapolate
    linearly from the k that made the most (its per-worker rate already shows how this machine scales)."""
    for row in measured:
        if row["batches_per_sec"] >= need:
            return row["workers"], f"measured: {row['workers']} worker(s) make {row['batches_per_sec']:.1f} batches/s"
    last = max(measured, key=lambda row: row["batches_per_sec"])
    per_worker = last["batches_per_sec"] / last["workers"]
    k = math.ceil(need / per_worker) if per_worker > 0 else last["workers"]
    return k, (f"extrapolated: {last['workers']} worker(s) make {last['batches_per_sec']:.1f} batches/s "
               f"({per_worker:.1f} each)")


def layout(workers: int, available_nodes: int, cpus_per_node: int) -> dict:
    tasks = workers + 1  # task 0 is the chief
    nodes = min(available_nodes, max(1, math.ceil(tasks / cpus_per_node)))
    tasks_per_node = math.ceil(tasks / nodes)
    return {"total_nodes": nodes, "tasks_per_node": tasks_per_node,
            "cpus_per_task": max(1, cpus_per_node // tasks_per_node),
            "enough_cpus": tasks_per_node <= cpus_per_node}


def recommend(ns: argparse.Namespace, measured: list[dict], wse: dict) -> dict:
    consume = wse["emulator_batches_per_sec"]
    workers, basis = workers_needed(measured, consume * HEADROOM)
    shape = layout(workers, ns.available_nodes, ns.cpus_per_node)
    flags = (f"--total-nodes {shape['total_nodes']} --tasks-per-node {shape['tasks_per_node']} "
             f"--cpus-per-task {shape['cpus_per_task']}")
    reason = (f"the WSE(s) consume up to {consume:.1f} batches/s; with {HEADROOM:.1f}x headroom the input must "
              f"make {consume * HEADROOM:.1f} batches/s; {basis}")
    if not shape["enough_cpus"]:
        reason += (f"; {workers + 1} tasks need more than {ns.available_nodes} node(s) x {ns.cpus_per_node} CPUs: "
                   "expect the input to stay the bottleneck")
    return {"input_workers": workers, **{k: v for k, v in shape.items() if k != "enough_cpus"},
            "enough_cpus": shape["enough_cpus"], "csrun_wse_flags": flags,
            "command": f"csrun_wse --num_csx {ns.num_csx} {flags} {' '.join(ns.command)}", "reason": reason}


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    if ns.output_dir is not None:
        try:
            Path(ns.output_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SystemExit(f"cs_input_analyzer: cannot create --output_dir {ns.output_dir}: {exc.strerror}") from None
        analyze(ns, with_model_dir(ns.command, str(Path(ns.output_dir) / "model_dir")))
        return
    with tempfile.TemporaryDirectory(prefix="cs_input_analyzer.") as scratch:
        analyze(ns, with_model_dir(ns.command, str(Path(scratch) / "model_dir")))


def analyze(ns: argparse.Namespace, command: list[str]) -> None:
    started = time.time()
    print(f"cs_input_analyzer: measuring the WSE's consumption ({ns.seconds:g} s)", flush=True)
    wse = measure_wse(command, ns.seconds, ns.num_csx)
    print(f"  WSE emulator: {wse['emulator_batches_per_sec']:.1f} batches/s "
          f"({wse['emulator_samples_per_sec']:.0f} samples/s)", flush=True)
    measured = []
    for k in range(1, ns.max_workers + 1):
        print(f"cs_input_analyzer: measuring {k} input worker(s) ({ns.seconds:g} s)", flush=True)
        measured.append(measure_workers(command, k, ns.seconds))
        print(f"  {k} worker(s): {measured[-1]['batches_per_sec']:.1f} batches/s "
              f"({measured[-1]['samples_per_sec']:.0f} samples/s)", flush=True)
    advice = recommend(ns, measured, wse)
    report = {"command": " ".join(ns.command), "measured_on": {"host": os.uname().nodename, "cpus": os.cpu_count(),
                                                                "seconds_per_measurement": ns.seconds},
              "available_nodes": ns.available_nodes, "cpus_per_node": ns.cpus_per_node,
              "wse": wse, "input": measured, "recommendation": advice,
              "elapsed_s": round(time.time() - started, 1)}
    print(f"recommendation: {advice['input_workers']} input worker(s): {advice['csrun_wse_flags']}")
    print(f"  because {advice['reason']}")
    if ns.report is None:
        print("report: not written (--report FILE or --output_dir DIR writes one)")
        return
    try:
        Path(ns.report).write_text(yaml.safe_dump(report, sort_keys=False))
    except OSError as exc:
        raise SystemExit(f"cs_input_analyzer: cannot write the report {ns.report}: {exc.strerror}") from None
    print(f"report: {ns.report}")


if __name__ == "__main__":
    main()
