"""Train FC-MNIST with two checkouts of this project and compare the runs bit for bit.

    python scripts/compare_checkouts.py OLD_DIR NEW_DIR [--formats float16,bfloat16,cbfloat16] [--steps 20]

OLD_DIR and NEW_DIR are source trees (e.g. `git archive <commit> | tar -x -C OLD_DIR`).
Each runs examples/fc_mnist/run.py of its own tree, with its own code
(PYTHONPATH), in each format on every path: the CPU path, weight streaming
with 1 and 2 WSEs, 1 WSE with --no_shm, and pipelined; dynamic loss scaling
from 2**20, so float16's first steps overflow and are skipped. Then every
run's per-step losses (TensorBoard) and every weight and optimizer slot of its
checkpoints are compared byte for byte (not the run's description, `meta`); one
line per run, and exit 1 if any differs. This is
how a change meant to keep the numbers (lowering the dense layers to a
program, an executor optimisation) shows it does, on every path.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

FORMATS = {"float32": {}, "float16": {"mixed_precision": True},
           "bfloat16": {"mixed_precision": True, "fp16_type": "bfloat16"},
           "cbfloat16": {"mixed_precision": True, "fp16_type": "cbfloat16"}}
PATHS = {   # name: (launcher flags, execution strategy); None: the CPU path
    "cpu": (None, "weight_streaming"), "wse1": ([], "weight_streaming"),
    "wse2": (["--num_csx", "2", "--num_workers_per_csx", "2"], "weight_streaming"),
    "wse1_noshm": (["--no_shm"], "weight_streaming"), "pipelined": ([], "pipelined")}


def params_file(folder: Path, name: str, fmt: str, strategy: str, steps: int) -> Path:
    params = {"train_input": {"batch_size": 64, "shuffle": True, "drop_last_batch": True},
              "model": {"hidden_sizes": [64, 32], "activation_fn": "relu", "dropout": 0.1, **FORMATS[fmt]},
              "optimizer": {"optimizer_type": "sgd", "learning_rate": 0.01, "momentum": 0.9,
                            "loss_scaling_factor": "dynamic", "initial_loss_scale": 2.0 ** 20,
                            "steps_per_increase": 5},
              "runconfig": {"max_steps": steps, "log_steps": 1, "checkpoint_steps": steps, "seed": 3,
                            "execution_strategy": strategy}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def train(tree: Path, out: Path, name: str, fmt: str, path: str, steps: int) -> Path:
    flags, strategy = PATHS[path]
    params = params_file(out, name, fmt, strategy, steps)
    # Each tree's own command, run as a module of that tree (its console commands moved from scripts/ to
    # cs_runtime/cli/, and the installed entry points name only one of the two places).
    package = "cs_runtime.cli" if (tree / "cs_runtime" / "cli").is_dir() else "scripts"
    command = "csrun_cpu" if flags is None else "csrun_wse"
    launcher = [sys.executable, "-m", f"{package}.{command}", *(flags or [])]
    cmd = [*launcher, sys.executable, str(tree / "examples" / "fc_mnist" / "run.py"), "--mode", "train",
           "--params", str(params), "--model_dir", str(out / name)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tree, env=env)
    if result.returncode != 0:
        raise SystemExit(f"compare_checkouts: {name} with {tree} failed (exit {result.returncode}):\n"
                         f"{result.stderr[-2000:]}")
    return out / name


def losses(model_dir: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(model_dir / "train"), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in sorted(acc.Scalars("loss"), key=lambda e: e.step)]


# A checkpoint's JSON description of the run (the model and every params key): it changes whenever a
# params key is added, so it is not compared; every weight and optimizer slot is, byte for byte.
DESCRIPTION = "meta"


def same_checkpoints(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.glob("checkpoint_*.npz"))
    if not names or names != sorted(p.name for p in b.glob("checkpoint_*.npz")):
        return False
    for name in names:
        with np.load(a / name) as x, np.load(b / name) as y:
            numbers = set(x.files) - {DESCRIPTION}
            if numbers != set(y.files) - {DESCRIPTION} or any(x[k].tobytes() != y[k].tobytes() for k in numbers):
                return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--formats", default="float16,bfloat16,cbfloat16")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    formats = args.formats.split(",")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        print(f"compare_checkouts: unknown format {unknown[0]!r}; expected one of {', '.join(FORMATS)}")
        return 2
    different = 0
    with tempfile.TemporaryDirectory(prefix="cs_compare_") as tmp:
        for fmt in formats:
            for path in PATHS:
                name = f"{fmt}_{path}"
                runs = []
                for side in ("old", "new"):
                    folder = Path(tmp) / side
                    folder.mkdir(exist_ok=True)
                    runs.append(train(getattr(args, side).resolve(), folder, name, fmt, path, args.steps))
                same_losses = losses(runs[0]) == losses(runs[1])
                same = same_losses and same_checkpoints(*runs)
                different += not same
                print(f"{name:<22} losses {'equal' if same_losses else 'DIFFER'}, "
                      f"checkpoints {'equal' if same else 'DIFFER'}", flush=True)
    print(f"{different} of {len(formats) * len(PATHS)} runs differ")
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
