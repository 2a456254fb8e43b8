"""Helpers for tests that run whole jobs: params files, runs, and reading results back."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
FC_MNIST = str(REPO / "examples" / "fc_mnist" / "run.py")
BIN = Path(sys.executable).parent

# Small and in the stable regime of SGD, so float32 summation-order
# differences between data-parallel and single-process runs stay tiny.
SMALL_PARAMS = {
    "train_input": {"batch_size": 64, "shuffle": True, "drop_last_batch": True},
    "eval_input": {"batch_size": 100, "shuffle": False, "drop_last_batch": False},
    "model": {"hidden_sizes": [64, 32], "activation_fn": "relu", "dropout": 0.1},
    "optimizer": {"optimizer_type": "sgd", "learning_rate": 0.01, "momentum": 0.9},
    "runconfig": {"max_steps": 100, "log_steps": 25, "checkpoint_steps": 50, "seed": 3,
                  "execution_strategy": "weight_streaming"},
}
TOL = 1e-5


def cpu_path_in_process(script: str, argv: list[str]) -> int:
    """`csrun_cpu python script argv...` in this process: the script run as __main__ with the
    environment csrun_cpu gives it (no CS_ variable but CS_TARGET=cpu), its exit code. It
    saves a process, its torch import and (where the script keeps one per process) its
    capture; the CPU path's chief stops on SIGTERM as on Ctrl-C and logs to the stderr of
    its start, so this process's handler, logging, argv and environment are put back. Its log
    lines go to this process's logging (pytest's): model_dir/run.log holds only the run's
    header, so a test that reads the log runs csrun_cpu."""
    import logging
    import runpy
    handler, log_handlers, saved_argv = signal.getsignal(signal.SIGTERM), logging.root.handlers[:], sys.argv
    saved_env = {k: v for k, v in os.environ.items() if k.startswith("CS_")}
    for name in saved_env:
        del os.environ[name]
    os.environ["CS_TARGET"] = "cpu"
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved_argv
        del os.environ["CS_TARGET"]
        os.environ.update(saved_env)
        signal.signal(signal.SIGTERM, handler)
        logging.root.handlers[:] = log_handlers


def write_params(tmp_path: Path, name: str = "params.yaml", **sections) -> Path:
    params = {k: dict(v) for k, v in SMALL_PARAMS.items()}
    for section, values in sections.items():
        params.setdefault(section, {}).update(values)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(params))
    return path


def tool(name: str) -> str:
    found = BIN / name
    return str(found) if found.exists() else name


def run_cpu(params: Path, model_dir: Path, mode: str = "train", *extra: str, timeout: int = 120):
    cmd = [tool("csrun_cpu"), sys.executable, FC_MNIST, "--mode", mode, "--params", str(params),
           "--model_dir", str(model_dir), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def wse_command(params: Path, model_dir: Path, mode: str = "train", num_csx: int = 1, workers: int = 1,
                extra: tuple = (), extra_launcher: tuple = ()) -> list[str]:
    """csrun_wse [flags, extra_launcher] python run.py ... [extra]."""
    return [tool("csrun_wse"), "--num_csx", str(num_csx), "--num_workers_per_csx", str(workers),
            *extra_launcher, sys.executable, FC_MNIST, "--mode", mode, "--params", str(params), "--model_dir", str(model_dir),
            *extra]


def run_wse(params: Path, model_dir: Path, mode: str = "train", num_csx: int = 1, workers: int = 1,
            extra: tuple = (), timeout: int = 180, extra_launcher: tuple = ()):
    cmd = wse_command(params, model_dir, mode, num_csx, workers, extra, extra_launcher)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def train_losses(model_dir: Path) -> np.ndarray:
    """Per-step training loss, read back with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(model_dir / "train"), size_guidance={"scalars": 0})
    acc.Reload()
    events = acc.Scalars("loss")
    by_step = {e.step: e.value for e in events}  # a resumed run appends; last write wins
    return np.array([by_step[s] for s in sorted(by_step)])


def final_weights(model_dir: Path) -> dict[str, np.ndarray]:
    path = sorted(glob.glob(str(model_dir / "checkpoint_*.npz")),
                  key=lambda p: int(Path(p).stem.split("_")[1]))[-1]
    with np.load(path) as ck:
        return {k: ck[k] for k in ck.files if k.startswith("model/")}


def state_needs_table_frames(model_dir: Path) -> bool:
    """Whether the last checkpoint's weights and slots, sent as one message (as LOAD_MODEL and
    STATE send them), list more arrays than a header holds: their table takes frames of its own."""
    import msgpack
    from cs_runtime.wire.protocol import Message, Msg, encode
    path = sorted(glob.glob(str(model_dir / "checkpoint_*.npz")), key=lambda p: int(Path(p).stem.split("_")[1]))[-1]
    with np.load(path) as ck:
        state = {k: ck[k] for k in ck.files if k.startswith(("model/", "optimizer/"))}
    return "tables" in msgpack.unpackb(encode(Message(Msg.STATE, arrays=state))[0])


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(b), 1e-30))


def assert_matches_oracle(model_dir: Path, oracle) -> None:
    """Every step's loss and the final weights within TOL relative of the CPU run."""
    _, losses, weights = oracle
    got = train_losses(model_dir)
    assert len(got) == len(losses) == 100
    per_step = np.abs(got - losses) / np.abs(losses)
    assert per_step.max() < TOL, f"worst step {per_step.argmax()}: {per_step.max():.2e}"
    got_w = final_weights(model_dir)
    assert got_w.keys() == weights.keys()
    for name in weights:
        assert relative_error(got_w[name], weights[name]) < TOL, name


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, args) of every live process below `pid`."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    children: dict[int, list[tuple[int, str]]] = {}
    for line in out.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3:
            children.setdefault(int(parts[1]), []).append((int(parts[0]), parts[2]))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(condition, timeout: float, every: float = 0.05) -> bool:
    """Poll `condition` until it holds or `timeout` passes; whether it held."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def kill_tree(proc: subprocess.Popen) -> None:
    """Last-resort cleanup for a test that failed half-way."""
    for pid, _ in descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# FC-MNIST whose input worker, when GATE_FIFO is set, stops before its GATE_AT-th batch until
# the FIFO is opened for writing and closed: the job stays up (every role waits for that
# batch, heartbeats go on) however fast this machine trains, and the run's numbers are the
# ungated run's.
GATED_RUN = """
import os, runpy, sys
fc = runpy.run_path(sys.argv.pop(1))

class Gated:
    def __init__(self, x, y):
        self.x, self.y, self.fetched = x, y, 0
    def __len__(self):
        return len(self.x)
    def get(self, indices):
        self.fetched += 1
        if self.fetched == int(os.environ["GATE_AT"]):
            open(os.environ["GATE_FIFO"]).read()
        return self.x[indices], self.y[indices]

def train_input_fn(params):
    data = fc["train_input_fn"](params)
    return Gated(*data) if os.environ.get("GATE_FIFO") else data

fc["run"](fc["model_fn"], train_input_fn, fc["eval_input_fn"], model="fc_mnist")
"""


def gated_fc_mnist(cmd: list[str], script: Path) -> list[str]:
    """`cmd` (a csrun_cpu / csrun_wse command of FC-MNIST) with its run.py gated."""
    at = cmd.index(FC_MNIST)
    return [*cmd[:at], str(script), FC_MNIST, *cmd[at + 1:]]
