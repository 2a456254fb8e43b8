"""Do two versions of the code train to the same bits? A check for changes that
must not move a single bit (speed work on the executor, the encoders, the wire).

    python scripts/same_bits.py record before.json    # on the old code
    python scripts/same_bits.py record after.json     # on the new code
    python scripts/same_bits.py compare before.json after.json

`record` runs FC-MNIST weight streaming for a few steps (synthetic data, dropout
on, the large preset's widths cut to keep it short) in float32 and each 16-bit
format, on 1 and 2 WSEs, by shared memory and with --no_shm, and writes the
SHA-256 of every checkpoint file the runs leave (model_dir/*.npz and the like),
keyed by run and file name. `compare` says which runs differ; exit 1 if any.
The code under test is whatever `cs_runtime` this interpreter imports (set
PYTHONPATH to the checkout to test).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
FC_MNIST = REPO / "examples" / "fc_mnist" / "run.py"
CSRUN_WSE = Path(sys.executable).parent / "csrun_wse"
FORMATS = ("float32", "float16", "bfloat16", "cbfloat16")


def write_params(folder: Path, fmt: str, steps: int) -> Path:
    params = {
        "train_input": {"batch_size": 64, "shuffle": True, "drop_last_batch": True},
        "model": {"hidden_sizes": [512, 512, 512], "activation_fn": "relu", "dropout": 0.1},
        "optimizer": {"optimizer_type": "sgd", "learning_rate": 0.01, "momentum": 0.9},
        "runconfig": {"max_steps": steps, "log_steps": steps, "checkpoint_steps": steps, "seed": 1,
                      "execution_strategy": "weight_streaming"},
    }
    if fmt != "float32":
        params["model"].update(mixed_precision=True, fp16_type=fmt)
        params["optimizer"]["loss_scaling_factor"] = "dynamic" if fmt == "float16" else 1.0
    path = folder / f"{fmt}.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def digests(model_dir: Path) -> dict[str, str]:
    """SHA-256 of every checkpoint file under model_dir (logs and event files left out)."""
    return {str(p.relative_to(model_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(model_dir.rglob("*")) if p.is_file() and p.suffix in (".npz", ".npy", ".h5", ".mdl")}


def record(out: Path, steps: int) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for fmt in FORMATS:
            params = write_params(folder, fmt, steps)
            for wses in (1, 2):
                for shm in (True, False):
                    name = f"{fmt}-{wses}wse-{'shm' if shm else 'tcp'}"
                    model_dir = folder / name
                    cmd = [str(CSRUN_WSE), "--num_csx", str(wses), *([] if shm else ["--no_shm"]), sys.executable,
                           str(FC_MNIST), "--mode", "train", "--params", str(params), "--model_dir", str(model_dir)]
                    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                    if run.returncode != 0:
                        raise SystemExit(f"same_bits: {name} failed:\n{run.stderr[-2000:]}")
                    results[name] = digests(model_dir)
                    if not results[name]:
                        raise SystemExit(f"same_bits: {name} left no checkpoint in {model_dir}")
                    print(f"{name}: {len(results[name])} checkpoint file(s)", flush=True)
    out.write_text(json.dumps(results, indent=1, sort_keys=True))


def compare(before: Path, after: Path) -> int:
    old, new = json.loads(before.read_text()), json.loads(after.read_text())
    differ = sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))
    for name in sorted(old.keys() | new.keys()):
        print(f"{name}: {'DIFFERENT' if name in differ else 'same bits'}")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run every case, write the checkpoints' digests")
    rec.add_argument("out", type=Path)
    rec.add_argument("--steps", type=int, default=6)
    cmp = sub.add_parser("compare", help="compare two records")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    ns = parser.parse_args(argv)
    if ns.command == "record":
        record(ns.out, ns.steps)
        return 0
    return compare(ns.before, ns.after)


if __name__ == "__main__":
    sys.exit(main())
