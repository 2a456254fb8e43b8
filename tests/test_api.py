"""cs_torch: a training loop of the user's own, on the emulated CS system, checked against the CPU oracle."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import cs_torch as cstorch
from cs_runtime.numerics.model import init_weights, mlp_spec
from cs_runtime.wire.auth import KEYS_ENV
from examples.fc_mnist.train_cstorch import eval_input_fn, train_input_fn
from tests.cluster_utils import (REPO, alive, assert_matches_oracle, descendants, kill_tree, run_cpu,
                                 wait_until)

pytestmark = pytest.mark.cluster  # every test here starts processes (see tests/conftest.py)

EXAMPLE = str(REPO / "examples" / "fc_mnist" / "train_cstorch.py")
# tests/cluster_utils.SMALL_PARAMS, the oracle's configuration, as the example's flags.
ORACLE_FLAGS = ["--batch_size", "64", "--hidden", "64", "32", "--dropout", "0.1", "--lr", "0.01",
                "--momentum", "0.9", "--seed", "3"]
EVAL = r"\| Eval Device=(\w+)(?:, Mode=\w+)?, Step=100, Loss=([\d.]+), Accuracy=([\d.]+) \((\d+)/(\d+)\)"
JOB_ROLES = ("-m cs_runtime.memoryx", "-m cs_runtime.swarmx", "-m wse", "-m cs_torch.input_worker")


def small_model() -> cstorch.Module:
    return cstorch.module(mlp_spec("fc_mnist", [784, 64, 32, 10], "relu", 0.1))


def job_processes(pid: int) -> list[tuple[int, str]]:
    return [(p, args) for p, args in descendants(pid) if any(role in args for role in JOB_ROLES)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The example, on 2 WSEs, with the oracle's configuration: 100 steps, then one eval pass."""
    model_dir = tmp_path_factory.mktemp("cstorch") / "m"
    cmd = [sys.executable, EXAMPLE, *ORACLE_FLAGS, "--steps", "100", "--num_csx", "2", "--model_dir", str(model_dir)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return model_dir, result


def test_example_matches_cpu_oracle(trained, oracle):
    model_dir, result = trained
    assert "step 100: loss" in result.stdout
    assert re.search(r"\| Train Device=WSE, Mode=weight_streaming, Step=100, GlobalRate=[\d.]+ samples/sec",
                     result.stdout), result.stdout
    assert_matches_oracle(model_dir, oracle)


def test_a_session_on_a_shared_cs_system_is_a_job_there_and_matches_the_oracle(tmp_path, oracle):
    from tests.test_appliance import Server
    server = Server(tmp_path)
    try:
        cmd = [sys.executable, EXAMPLE, *ORACLE_FLAGS, "--steps", "100", "--no_eval", "--cs_ip", server.address,
               "--model_dir", str(tmp_path / "m")]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO,
                                env=server.env("owner"))
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        assert "submitted wsjob-" in result.stderr
        assert_matches_oracle(tmp_path / "m", oracle)
        listed = server.csctl("get", "jobs", "-o", "json")
        phases = [job["phase"] for job in json.loads(listed.stdout)["jobs"]]
        assert phases == ["SUCCEEDED"], listed.stdout
    finally:
        assert server.stop() == 0


def test_eval_mode_matches_cpu_eval_of_the_same_checkpoint(trained, oracle, tmp_path):
    model_dir, result = trained
    got = re.search(EVAL, result.stdout)
    assert got and got.group(1) == "WSE", result.stdout
    shutil.copytree(model_dir, tmp_path / "cpu")   # the CPU path evaluates the same (the latest) checkpoint
    assert (tmp_path / "cpu" / "checkpoint_100.npz").is_file()
    cpu = run_cpu(oracle[0], tmp_path / "cpu", "eval")
    want = re.search(EVAL, cpu.stdout)
    assert cpu.returncode == 0 and want, cpu.stdout + cpu.stderr
    assert abs(float(got.group(2)) - float(want.group(2))) < 1e-5 * float(want.group(2))
    assert got.group(4, 5) == want.group(4, 5)           # the same samples right, of all 297
    assert float(got.group(3)) > 0.5


def test_an_exception_in_the_loop_stops_every_process_and_keeps_the_steps(tmp_path):
    loader = cstorch.dataloader(train_input_fn, 64, num_steps=1000)
    optimizer = cstorch.optim.SGD(lr=0.01, momentum=0.9)
    seen = {}
    with pytest.raises(RuntimeError, match="boom"):
        with cstorch.Session(small_model(), optimizer, cstorch.nn.CrossEntropyLoss(),
                             model_dir=str(tmp_path / "m")) as session:
            for step, batch in enumerate(loader, start=1):
                loss = session.step(batch)
                assert np.isfinite(loss)
                if step == 3:
                    seen = {"procs": job_processes(os.getpid()), "job": session.job.id,
                            "keys": os.environ[KEYS_ENV]}
                    raise RuntimeError("boom")
    kinds = sorted(next(r for r in JOB_ROLES if r in args) for _, args in seen["procs"])
    assert kinds == sorted(JOB_ROLES), seen["procs"]   # memoryx, swarmx, wse, input worker
    assert [pid for pid, _ in seen["procs"] if alive(pid)] == []
    assert job_processes(os.getpid()) == []
    assert not list(Path("/dev/shm").glob(f"cs-{seen['job']}-*"))
    assert not Path(seen["keys"]).exists()
    assert KEYS_ENV not in os.environ
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    # The three steps done were saved (the block was left between steps).
    assert sorted(p.name for p in (tmp_path / "m").glob("checkpoint_*.npz")) == ["checkpoint_3.npz"]


def test_ctrl_c_stops_every_process(tmp_path):
    cmd = [sys.executable, EXAMPLE, *ORACLE_FLAGS, "--steps", "100000", "--log_steps", "5",
           "--model_dir", str(tmp_path / "m")]
    # Ctrl-C as at a terminal: the script gets SIGINT's default even where pytest was started
    # with it ignored (a background job of a non-interactive shell), else Python ignores it too.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # The output is read on a thread: a process that outlived the job would hold the pipe
    # open, and the test should then name it, not wait on the pipe.
    lines, step_10, reader = [], threading.Event(), None

    def read_output():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 10:"):
                step_10.set()
        step_10.set()
    try:
        reader = threading.Thread(target=read_output, daemon=True)
        reader.start()
        assert step_10.wait(timeout=240) and proc.poll() is None, "".join(lines)[-3000:]
        procs = job_processes(proc.pid)
        assert len(procs) == 4, procs
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) != 0
        assert wait_until(lambda: not any(alive(pid) for pid, _ in procs), 30), \
            f"still running after Ctrl-C: {[(pid, args) for pid, args in procs if alive(pid)]}"
        reader.join(timeout=30)
        assert not reader.is_alive(), f"the job's output is still open: {descendants(os.getpid())}"
        assert "KeyboardInterrupt" in "".join(lines)
    finally:
        kill_tree(proc)


def test_a_failed_wse_raises_job_failed_naming_it(tmp_path):
    loader = cstorch.dataloader(train_input_fn, 64, num_steps=1000)
    optimizer = cstorch.optim.SGD(lr=0.01)
    with pytest.raises(cstorch.JobFailed, match=r"wse 0 on \S+ \(pid \d+\) exited with signal SIGKILL"):
        with cstorch.Session(small_model(), optimizer, cstorch.nn.CrossEntropyLoss(),
                             model_dir=str(tmp_path / "m")) as session:
            for step, batch in enumerate(loader):
                session.step(batch)
                if step == 1:
                    procs = job_processes(os.getpid())
                    wse = next(pid for pid, args in procs if "-m wse" in args)
                    os.kill(wse, signal.SIGKILL)
    assert [pid for pid, _ in procs if alive(pid)] == []
    assert not list((tmp_path / "m").glob("checkpoint_*.npz"))  # nothing saved from a failed cluster


def test_eval_session_in_process_matches_cpu_path(tmp_path, oracle):
    """Eval of fresh weights (no checkpoint in model_dir): the CPU path's numbers on the same
    weights, its initial checkpoint (run.py refuses --mode eval without a checkpoint)."""
    loader = cstorch.dataloader(eval_input_fn, 100, shuffle=False, drop_last=False)
    cstorch.manual_seed(3)
    try:
        with cstorch.Session(small_model(), None, cstorch.nn.CrossEntropyLoss(), mode="eval",
                             model_dir=str(tmp_path / "m")) as session:
            losses = [session.step(batch) for batch in loader]
            metrics = session.metrics
    finally:
        cstorch.manual_seed(1)
    assert len(losses) == 3 and metrics["count"] == 297
    initial = run_cpu(oracle[0], tmp_path / "cpu", "train", "--override", "runconfig.max_steps=1",
                      "--override", "runconfig.save_initial_checkpoint=true")
    assert initial.returncode == 0, initial.stderr[-2000:]
    cpu = run_cpu(oracle[0], tmp_path / "cpu", "eval", "--checkpoint_path", str(tmp_path / "cpu" / "checkpoint_0.npz"))
    want = re.search(r"Step=0, Loss=([\d.]+), Accuracy=([\d.]+)", cpu.stdout)
    assert want, cpu.stdout + cpu.stderr
    assert abs(metrics["loss"] - float(want.group(1))) < 1e-5
    assert abs(metrics["accuracy"] - float(want.group(2))) < 1e-4


# ------------------------------------------------------------------ errors, before anything starts
@pytest.mark.parametrize("make,expected", [
    (lambda: cstorch.Session(small_model(), cstorch.optim.SGD(lr=0.1), "mse"),
     "criterion str is not supported; the CS system trains with cs_torch.nn.CrossEntropyLoss()"),
    (lambda: cstorch.Session(small_model(), cstorch.optim.SGD(lr=0.1), object()),
     "criterion object is not supported"),
    (lambda: cstorch.Session(small_model(), "rmsprop", cstorch.nn.CrossEntropyLoss()),
     "optimizer str is not supported; use cs_torch.optim.SGD, Adam or AdamW"),
    (lambda: cstorch.Session(small_model(), None, cstorch.nn.CrossEntropyLoss()),
     "mode='train' needs an optimizer"),
    (lambda: cstorch.Session(small_model(), cstorch.optim.SGD(lr=0.1), cstorch.nn.CrossEntropyLoss(), mode="predict"),
     "mode must be one of train, eval"),
    (lambda: cstorch.optim.SGD(lr=0.1, nesterov=True), "SGD: nesterov momentum requires a momentum and zero dampening"),
    (lambda: cstorch.optim.Adam(lr=-1.0), "Adam: lr must be a positive number"),
    (lambda: cstorch.Session(small_model(), cstorch.optim.Adam(lr=0.1, betas=(0.9, 1.5)),
                             cstorch.nn.CrossEntropyLoss()), "optimizer.betas[1]"),
    (lambda: cstorch.nn.CrossEntropyLoss(label_smoothing=0.1), "label_smoothing is not supported"),
    (lambda: cstorch.dataloader(lambda: None, 64), "must be defined at the top level"),
    (lambda: cstorch.dataloader(train_input_fn, 0), "batch_size must be a positive integer"),
    (lambda: cstorch.dataloader(train_input_fn, 64, object()), "must be JSON values"),
    (lambda: cstorch.module("fc_mnist"), "expected a cs_runtime.model.ModelSpec"),
    (lambda: cstorch.initialize(cs_ip="nohost"), "'nohost' is not HOST:PORT"),
    (lambda: cstorch.initialize(num_csx=0), "num_csx must be a positive integer"),
    (lambda: cstorch.nn.Sequential(cstorch.nn.Linear(784, 64), cstorch.nn.Linear(32, 10)),
     "in_features 32 does not match"),
])
def test_bad_use_fails_with_one_line(make, expected):
    with pytest.raises(cstorch.CsTorchError) as info:
        make()
    message = str(info.value)
    assert expected in message and "\n" not in message, message


def test_a_session_step_takes_only_loader_batches():
    session = cstorch.Session(small_model(), cstorch.optim.SGD(lr=0.1), cstorch.nn.CrossEntropyLoss())
    with pytest.raises(cstorch.CsTorchError, match="expected a batch from a cs_torch.dataloader, got ndarray"):
        session.step(np.zeros((64, 784)))


def test_sequential_is_the_mlp_spec_with_the_same_weights():
    nn = cstorch.nn
    seq = nn.Sequential(nn.Linear(784, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 32), nn.ReLU(),
                        nn.Dropout(0.1), nn.Linear(32, 10), name="fc_mnist")
    spec = mlp_spec("fc_mnist", [784, 64, 32, 10], "relu", 0.1)
    assert cstorch.module(seq).spec == spec
    a, b = init_weights(cstorch.module(seq).spec, 3), init_weights(spec, 3)
    assert all(np.array_equal(a[l][p], b[l][p]) for l in a for p in a[l])


def test_loader_length_is_one_pass_unless_num_steps():
    assert len(cstorch.dataloader(train_input_fn, 64)) == 1500 // 64
    assert len(cstorch.dataloader(eval_input_fn, 100, drop_last=False)) == 3
    assert len(list(cstorch.dataloader(train_input_fn, 64, num_steps=50))) == 50
