"""The model zoo's command line on the project's own examples: the target
(CPU, CSX), its flags as the ALCF guide types them, eval_all.

    python -m pytest tests/test_zoo_cli.py -q
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cs_runtime.launch import target
from cs_runtime.run_args import parse_args
from tests.cluster_utils import FC_MNIST, final_weights, train_losses

REPO = Path(__file__).resolve().parents[1]
PARAMS = REPO / "examples/fc_mnist/configs/params.yaml"
GPT2_TRAINER = REPO / "tests/modelzoo_params/gpt2_tiny_trainer.yaml"
# The ALCF guide's command line, on the project's own FC-MNIST.
ALCF = ["--job_labels", "name=bert_pt", "--params", str(PARAMS), "--num_workers_per_csx=1", "--mode", "train",
        "--model_dir", "md", "--mount_dirs", "/home/", "/software/", "--python_paths", "~/R_2.1.1/modelzoo",
        "--compile_dir", "someone"]


def test_the_alcf_command_line_parses_and_names_what_it_ignores() -> None:
    args = parse_args(["CSX", *ALCF], "fc_mnist")
    assert (args.target, args.mode, args.model_dir) == ("CSX", "train", "md")
    assert args.cluster == {"num_csx": 1, "num_workers_per_csx": 1, "mgmt_address": None,
                            "job_labels": ["name=bert_pt"], "python_paths": ["~/R_2.1.1/modelzoo"]}
    assert args.unused_flags == ["--compile_dir (compiles are in model_dir)",
                                 "--mount_dirs (the job's processes share this file system)"]
    assert args.command_line == ALCF   # what the job's processes are started with, after CSX


def test_without_a_target_the_command_line_is_as_before() -> None:
    args = parse_args(["--mode", "train", "--params", str(PARAMS)], "fc_mnist")
    assert args.target is None and args.unused_flags == [] and args.cluster["num_csx"] == 1
    cpu = parse_args(["CPU", "-m", "eval_all", "-p", str(PARAMS), "--num_csx", "2"], "fc_mnist")
    assert cpu.mode == "eval_all" and cpu.unused_flags == ["--num_csx (for CSX; this run is CPU)"]


def test_max_steps_and_eval_steps_override_either_layout() -> None:
    old = parse_args(["CPU", "--mode", "train", "--params", str(PARAMS), "--max_steps", "7", "--eval_steps", "3"],
                     "fc_mnist")
    assert (old.params.runconfig.max_steps, old.params.runconfig.eval_steps) == (7, 3)
    new = parse_args(["CPU", "--mode", "train", "--params", str(GPT2_TRAINER), "--max_steps", "9"], "gpt2")
    assert new.params.runconfig.max_steps == 9


def test_csx_becomes_csrun_wse_with_the_same_command() -> None:
    args = parse_args(["CSX", *ALCF, "--num_csx", "2", "--mgmt_address", "localhost:7000"], "fc_mnist")
    command = target.csrun_wse_command(args)
    assert command[:8] == [sys.executable, "-m", "cs_runtime.cli.csrun_wse", "--num_csx", "2", "--num_workers_per_csx",
                           "1", "--cs_ip"]
    assert command[8:11] == ["localhost:7000", "--job_label", "name=bert_pt"]
    assert command[11:] == [sys.executable, sys.argv[0], "CSX", *args.command_line]
    # Without a CS system the job is this machine's, still listed by csctl with its labels.
    local = target.csrun_wse_command(parse_args(["CSX", *ALCF], "fc_mnist"))
    assert local[5:9] == ["--num_workers_per_csx", "1", "--job_label", "name=bert_pt"] and "--cs_ip" not in local
    environ = target.job_environment(args)
    assert environ["PYTHONPATH"].split(os.pathsep)[0] == os.path.expanduser("~/R_2.1.1/modelzoo")


def run_py(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CS_")}
    return subprocess.run([sys.executable, FC_MNIST, *argv], capture_output=True, text=True, timeout=240,
                          cwd=cwd, env=env)


@pytest.mark.cluster
def test_run_py_cpu_and_csx_train_alike_then_eval_all(tmp_path: Path) -> None:
    common = ["--params", str(PARAMS), "--max_steps", "4", "--override", "runconfig.checkpoint_steps=2",
              "--override", "runconfig.log_steps=1"]
    cpu = run_py("CPU", "--mode", "train", "--model_dir", "cpu", *common, cwd=tmp_path)
    assert cpu.returncode == 0, cpu.stderr
    csx = run_py("CSX", *ALCF[:7], "--model_dir", "csx", "--num_csx", "2", "--mount_dirs", "/home/", *common,
                 cwd=tmp_path)
    assert csx.returncode == 0, csx.stderr
    assert csx.stderr.count("accepted, no effect in the emulator") == 1
    assert "Device=WSE" in csx.stdout + csx.stderr
    np.testing.assert_allclose(train_losses(tmp_path / "csx"), train_losses(tmp_path / "cpu"), rtol=1e-5)
    for name, w in final_weights(tmp_path / "cpu").items():
        np.testing.assert_allclose(final_weights(tmp_path / "csx")[name], w, rtol=0, atol=1e-5)
    every = run_py("CPU", "--mode", "eval_all", "--model_dir", "cpu", "--params", str(PARAMS), "--eval_steps", "2",
                   cwd=tmp_path)
    assert every.returncode == 0, every.stderr
    out = every.stdout + every.stderr
    assert out.index("Eval Device=CPU, Step=2") < out.index("Eval Device=CPU, Step=4")
    nothing = run_py("CPU", "--mode", "eval_all", "--model_dir", "empty", "--params", str(PARAMS), cwd=tmp_path)
    assert nothing.returncode == 2 and "eval_all: no checkpoints in empty" in nothing.stderr


def test_the_precheck_knows_the_short_mode_flag() -> None:
    from cs_runtime.launch.precheck import runs_nothing
    assert runs_nothing(["python", "run.py", "CSX", "-m", "validate_only", "-p", "p.yaml"])
    assert runs_nothing(["python", "run.py", "--mode=compile_only"])
    assert not runs_nothing(["python", "run.py", "CSX", "-m", "train", "-p", "p.yaml"])
