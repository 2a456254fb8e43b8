"""Errors a user can act on, a model_dir that belongs to one run, a run that tells its story.

Each case a new user meets, as one line and an exit code, with nothing lost and
nothing left running. Most are checked before any process starts (fast); the
few that need a run are short and carry the `cluster` marker.

    python -m pytest -q tests/test_run_errors.py
"""
from __future__ import annotations

import configparser
import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from chief import story as run_story
from chief.trainer import check_before_start, check_eval_has_checkpoint
from cs_runtime import errors, run_lock
from cs_runtime.errors import EXIT_BAD_INPUT, CsError, UserInputError
from cs_runtime.launch import job, precheck
from cs_runtime.launch.directory import DirectoryServer
from cs_runtime.process.directory_client import DirectoryClient
from cs_runtime.launch.job import BadJob, JobOptions, check_fits_host
from cs_runtime.numerics.model import mlp_spec
from cs_runtime.run_args import RunError, parse_args
from tests.cluster_utils import FC_MNIST, REPO, alive, descendants, tool, write_params

# ---------------------------------------------------------------- the taxonomy

USER_INPUT = ["cs_runtime.config.ParamsError", "cs_runtime.params_compat.CompatError",
              "cs_runtime.checkpoint.CheckpointError", "cs_runtime.checkpoint_mdl.MdlError",
              "cs_runtime.data.mnist.DataError", "cs_runtime.data.text.TextDataError",
              "cs_runtime.numerics.batch_check.BadBatch", "cs_runtime.numerics.ops.OpError",
              "cs_runtime.compiler.errors.CompileError", "cs_runtime.env.EnvError", "cs_runtime.run_args.RunError",
              "cs_runtime.torch_names.NameMapError", "cs_runtime.wire.protocol.MessageTooLarge",
              "cs_runtime.process.service.BadInput", "cs_runtime.run_lock.ModelDirInUse", "cs_runtime.launch.job.BadJob",
              "cs_runtime.cli.convert_checkpoint.ConvertError"]
FAULTS = ["cs_runtime.numerics.program.ProgramError", "cs_runtime.wire.protocol.ProtocolError",
          "cs_runtime.wire.shm.SharedMemoryError", "cs_runtime.wire.auth.AuthError",
          "cs_runtime.compiler.artifact.ArtifactError", "cs_runtime.launch.front_door.FrontDoorError",
          "cs_runtime.launch.launcher.JobFailed", "chief.cluster_executor.ServiceError"]


def error_class(dotted: str) -> type:
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("dotted", USER_INPUT)
def test_bad_input_errors_share_the_user_input_branch(dotted):
    cls = error_class(dotted)
    assert issubclass(cls, UserInputError) and issubclass(cls, CsError)
    assert issubclass(cls, ValueError)   # `except ValueError` in older code still catches them
    assert errors.report(cls("the line"), "chief on h") == EXIT_BAD_INPUT


@pytest.mark.parametrize("dotted", FAULTS)
def test_faults_of_ours_are_project_errors_that_keep_their_traceback(dotted):
    cls = error_class(dotted)
    assert issubclass(cls, CsError) and not issubclass(cls, UserInputError)
    try:
        raise cls("a fault")
    except cls as exc:
        assert errors.report(exc, "chief on h") is None   # re-raised by the caller, traceback and all


def test_an_exception_of_user_code_is_trimmed_to_the_users_frames(tmp_path, capsys):
    user = tmp_path / "my_model.py"
    user.write_text("import numpy as np\n\ndef model_fn(params):\n    return np.ones(3) @ np.ones(4)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        my_model = importlib.import_module("my_model")
        try:
            my_model.model_fn(None)
        except ValueError as exc:
            code = errors.report(exc, "worker 1 on node7")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_model", None)
    err = capsys.readouterr().err.splitlines()
    assert code == 1   # not bad input: the user's code may have met a passing fault
    assert err[0] == "error: ValueError in your code (worker 1 on node7):"
    assert f'File "{user}", line 4, in model_fn' in err[2]
    assert err[-1].startswith("ValueError: matmul: Input operand 1 has a mismatch")
    assert not any("numpy" in line and "File" in line for line in err)   # numpy's frames are not the user's


def test_an_exception_of_ours_is_not_blamed_on_the_user():
    from cs_runtime.env import count
    try:
        count("not a number")   # raised in our frames only
    except ValueError as exc:
        assert errors.user_traceback(exc, "chief on h") is None


# ---------------------------------------------------------------- no noise

def test_the_heartbeat_thread_says_nothing_when_its_context_is_destroyed_under_it(monkeypatch):
    said = []
    monkeypatch.setattr(threading, "excepthook", lambda args: said.append(args.exc_value))
    ctx = zmq.Context()
    server = DirectoryServer(ctx, "wsjob-test", {"chief": 1})
    client = DirectoryClient(ctx, server.address, "chief", 0, "wsjob-test")
    beat = client.start_heartbeats(on_failure=lambda reason: None)
    assert wait_for(lambda: server.serve_once(50) > 0, 5)   # a heartbeat arrived: the thread is in its loop
    ctx.destroy(linger=0)   # as a failing process's finally does, the thread still beating
    beat.join(5)
    assert not beat.is_alive()
    assert said == []


def wait_for(condition, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
    return False


# ---------------------------------------------------------------- before anything starts

def test_a_port_outside_1_65535_is_refused(capsys):
    from cs_runtime.cli import csrun_wse
    with pytest.raises(SystemExit) as exited:
        csrun_wse.parse_args(["--port", "70000", "python", FC_MNIST])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "csrun_wse: error: --port 70000: a port is 1-65535 (or 0: any free port)")


def test_a_job_too_big_for_this_machine_is_refused_with_the_estimate(monkeypatch):
    monkeypatch.setattr(job, "available_memory_mb", lambda: 23_000)
    with pytest.raises(BadJob) as caught:
        check_fits_host(JobOptions(command=["python", FC_MNIST], num_csx=1000))
    assert str(caught.value) == ("--num_csx 1000 with 1000 input worker(s) starts 2003 processes here, about "
                                 "140,210 MB before the model (70 MB each), but this machine has 23,000 MB "
                                 "available; use fewer WSEs or workers")
    monkeypatch.setattr(job, "available_memory_mb", lambda: 10 ** 9)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.raises(BadJob, match=r"starts 67 processes here, more than 32 per core on 2 core\(s\)"):
        check_fits_host(JobOptions(command=["python", FC_MNIST], num_csx=32))
    check_fits_host(JobOptions(command=["python", FC_MNIST], num_csx=4, num_workers_per_csx=2))   # fits


def test_a_missing_script_of_a_local_job_is_one_line_before_anything_starts(tmp_path):
    with pytest.raises(BadJob, match=rf"^{tmp_path / 'nowhere.py'}: no such file$"):
        precheck.check(JobOptions(command=["python", str(tmp_path / "nowhere.py")]))
    with pytest.raises(BadJob, match=r"^no-such-program-here: no such command$"):
        precheck.check(JobOptions(command=["no-such-program-here", "run.py"]))
    # Over SSH the script lives on the task hosts: the chief checks there.
    remote = JobOptions(command=["python", str(tmp_path / "nowhere.py")], launcher="ssh", hosts="h1")
    assert precheck.check(remote).code is None


def args_for(tmp_path, mode="train", *extra, **sections):
    params = write_params(tmp_path, **sections)
    return parse_args(["--mode", mode, "--params", str(params), "--model_dir", str(tmp_path / "md"), *extra],
                      "fc_mnist")


def test_wses_without_rows_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("CS_NUM_CSX", "6")
    with pytest.raises(RunError) as caught:
        check_before_start(args_for(tmp_path, train_input={"batch_size": 4}), writes=True)
    assert str(caught.value) == ("train_input.batch_size 4 leaves 2 of the 6 WSEs (--num_csx) without rows; "
                                 "use a batch of 6 or more, or fewer WSEs")


def test_paths_are_checked_where_the_chief_will_run(tmp_path, monkeypatch):
    monkeypatch.setenv("CS_PRECHECK_HERE", "1")
    with pytest.raises(RunError, match=rf"^train_input.data_dir {tmp_path / 'no_data'}: no such file or folder$"):
        check_before_start(args_for(tmp_path, train_input={"data_dir": str(tmp_path / "no_data")}), writes=True)
    (tmp_path / "a_file").write_text("")
    args = args_for(tmp_path, "train", "--model_dir", str(tmp_path / "a_file" / "md"))
    with pytest.raises(RunError, match=r"cannot create or write there \(Not a directory\)"):
        check_before_start(args, writes=True)
    monkeypatch.setenv("CS_PRECHECK_HERE", "0")   # a remote chief: its own host says
    check_before_start(args_for(tmp_path, train_input={"data_dir": str(tmp_path / "no_data")}), writes=True)


def test_eval_without_a_checkpoint_is_refused_unless_the_model_brings_its_weights(tmp_path):
    spec = mlp_spec("fc_mnist", [784, 16, 10], "relu", 0.0)
    with pytest.raises(RunError, match=r"^--mode eval needs trained weights: no checkpoint in .*md and no "
                                       r"--checkpoint_path \(train first, or give --checkpoint_path\)$"):
        check_eval_has_checkpoint(args_for(tmp_path, "eval"), spec)
    # A captured torch module's own weights (perhaps pretrained) are not random: evaluated as they are.
    check_eval_has_checkpoint(args_for(tmp_path, "eval"), dataclasses.replace(spec, initial_weights={}))
    check_eval_has_checkpoint(args_for(tmp_path, "train"), spec)


# ---------------------------------------------------------------- a model_dir belongs to one run

def test_a_second_run_in_a_model_dir_is_refused_naming_the_holder(tmp_path, monkeypatch):
    monkeypatch.setenv("CS_HOST_NAME", "login3")
    lock, taken_over = run_lock.hold(tmp_path, "wsjob-0123456789ab")
    assert taken_over is None
    try:
        line = (f"--model_dir {tmp_path} is in use by wsjob-0123456789ab (pid {os.getpid()} on login3); wait "
                "for that run to end, or give this one another --model_dir")
        with pytest.raises(run_lock.ModelDirInUse) as caught:
            run_lock.hold(tmp_path, "wsjob-second")
        assert str(caught.value) == line
        with pytest.raises(run_lock.ModelDirInUse):   # csrun_wse's check, before it starts anything
            run_lock.check_free(tmp_path)
    finally:
        lock.release()
    run_lock.check_free(tmp_path)
    again, taken_over = run_lock.hold(tmp_path, "wsjob-third")   # ended normally: nothing to take over
    assert taken_over is None
    again.release()


def test_the_lock_of_a_dead_run_is_taken_over_with_a_line(tmp_path):
    (tmp_path / run_lock.LOCK_NAME).write_text(json.dumps({"job": "wsjob-dead", "pid": 4242, "host": "n1\x1b[2J"}))
    lock, taken_over = run_lock.hold(tmp_path, "wsjob-new")
    lock.release()
    assert taken_over == (f"--model_dir {tmp_path}: taking over the lock of wsjob-dead (pid 4242 on n1[2J), which "
                          "is no longer running")   # what the file says, without its control characters


# ---------------------------------------------------------------- the story's lines

def test_the_story_of_a_finished_and_of_a_stopped_run(tmp_path, capsys):
    story = run_story.RunStory(tmp_path, started=time.monotonic() - 65)
    story.open_log("train", ["run.py", "--mode", "train"])
    story.begin_training(0, 200)
    story.step_done(1, 2.5)
    story.checkpoint_saved(tmp_path / "checkpoint_100.npz")
    story.step_done(120, 0.25)
    story.stopped("interrupted by SIGINT")
    story.stopped("a second time")   # said once
    story.close_log()
    out, err = capsys.readouterr()
    assert out.startswith("| First step done in 0.0 s (65.0 s after start); at this pace the 200 step(s) take about")
    assert err.splitlines() == [f"| Stopped at step 120 of 200 after 0:01:05 (interrupted by SIGINT); last "
                                f"checkpoint {tmp_path / 'checkpoint_100.npz'}; run the same command again to "
                                "resume from it"]
    log = (tmp_path / run_story.RUN_LOG).read_text().splitlines()
    assert log[0].endswith("train: run.py --mode train") and log[-1] == err.strip()


# ---------------------------------------------------------------- packaging

def test_tensorboard_comes_with_the_package_and_torch_is_a_range_holding_the_tested_release():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    requires = cfg["options"]["install_requires"]
    assert "tensorboard>=" in requires
    torch_extra = [l.strip() for l in cfg["options.extras_require"]["torch"].splitlines() if l.strip()]
    assert torch_extra == ["torch>=2.4,<=2.13.0"]
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed: the installed release's place in the range is not checked")
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:3])
    assert (2, 4) <= release <= (2, 13, 0), torch.__version__


# ---------------------------------------------------------------- runs (short)

USER_SCRIPT = """\
import sys
sys.path.insert(0, {examples!r})
from run import model_fn, train_input_fn, eval_input_fn
from cs_runtime.runner import run

def broken_input(params):
    raise OSError("my input is broken")

def broken_model(params):
    raise ValueError("my model is broken")

if __name__ == "__main__":
    run(broken_model if "--broken_model" in sys.argv else model_fn,
        broken_input if "--broken_input" in sys.argv else train_input_fn, eval_input_fn, model="fc_mnist",
        argv=[a for a in sys.argv[1:] if not a.startswith("--broken")])
"""


def user_script(tmp_path: Path) -> Path:
    script = tmp_path / "my_run.py"
    script.write_text(USER_SCRIPT.format(examples=str(REPO / "examples" / "fc_mnist")))
    return script


@pytest.mark.cluster
def test_a_broken_model_fn_on_the_cpu_path_is_its_own_traceback_on_stderr(tmp_path):
    params = write_params(tmp_path)
    result = subprocess.run([tool("csrun_cpu"), sys.executable, str(user_script(tmp_path)), "--broken_model",
                             "--mode", "train", "--params", str(params), "--model_dir", str(tmp_path / "md")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == "", result.stdout
    err = result.stderr.splitlines()
    assert err[0].startswith("error: ValueError in your code (cpu on ") and err[-1] == "ValueError: my model is broken"
    assert f'File "{tmp_path / "my_run.py"}", line 10, in broken_model' in result.stderr
    assert "cs_runtime" not in result.stderr and "chief" not in result.stderr   # none of our frames


@pytest.mark.cluster
def test_a_broken_input_fn_on_the_cluster_is_one_traceback_and_nothing_left(tmp_path):
    params = write_params(tmp_path, runconfig={"max_steps": 4, "log_steps": 2, "checkpoint_steps": 0})
    proc = subprocess.Popen([tool("csrun_wse"), sys.executable, str(user_script(tmp_path)), "--broken_input",
                             "--mode", "train", "--params", str(params), "--model_dir", str(tmp_path / "md")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = set()
    try:
        output = ""
        for line in proc.stdout:
            output += line
            seen.update(pid for pid, _ in descendants(proc.pid))
        assert proc.wait(timeout=60) == 1, output
    finally:
        if proc.poll() is None:
            proc.kill()
    assert output.count("error: OSError in your code (worker 0 on ") == 1, output
    assert "OSError: my input is broken" in output and "line 7, in broken_input" in output
    assert "Exception in thread" not in output and "ZMQError" not in output
    assert output.count("Traceback") == 1, output   # the user's, trimmed; none of ours
    assert [pid for pid in seen if alive(pid)] == []
    assert output.count("| Stopped ") == 1, output   # the chief said where the run got to


@pytest.mark.cluster
def test_a_finished_run_says_its_summary_and_leaves_run_log_and_params(tmp_path):
    params = write_params(tmp_path, runconfig={"max_steps": 4, "log_steps": 2, "checkpoint_steps": 0})
    md = tmp_path / "md"
    result = subprocess.run([tool("csrun_cpu"), sys.executable, FC_MNIST, "--mode", "train_and_eval", "--params",
                             str(params), "--model_dir", str(md), "--override", "runconfig.eval_steps=1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert [l for l in lines if l.startswith("| First step done in")]
    done = [l for l in lines if l.startswith("| Done in")]
    assert len(done) == 1 and "step 4 of 4; final train loss " in done[0] and "eval loss " in done[0]
    assert done[0].endswith(f"last checkpoint {md / 'checkpoint_4.npz'}")
    assert f"| TensorBoard: tensorboard --logdir {md}" in lines
    log = (md / "run.log").read_text()
    assert done[0] in log and "Saved checkpoint" in log
    saved = (md / "train" / "params_train_and_eval.yaml").read_text()
    assert "max_steps: 4" in saved and "eval_steps: 1" in saved
    assert not (md / run_lock.LOCK_NAME).read_text()   # released: the next run takes nothing over


@pytest.mark.cluster
def test_ctrl_c_of_csrun_cpu_says_where_it_got_and_how_to_resume(tmp_path):
    params = write_params(tmp_path, runconfig={"max_steps": 100_000, "log_steps": 1000, "checkpoint_steps": 50})
    md = tmp_path / "md"
    proc = subprocess.Popen([tool("csrun_cpu"), sys.executable, FC_MNIST, "--mode", "train", "--params",
                             str(params), "--model_dir", str(md)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        end = time.monotonic() + 60
        while not (md / "checkpoint_50.npz").exists() and time.monotonic() < end:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "Traceback" not in err
    stopped = [l for l in err.splitlines() if l.startswith("| Stopped at step")]
    assert len(stopped) == 1 and "(interrupted)" in stopped[0] and "run the same command again to resume" in stopped[0]
    last = stopped[0].split("last checkpoint ")[1].split(";")[0]
    assert Path(last).is_file() and Path(last).parent == md   # the checkpoint it names is there


def test_an_empty_data_set_names_where_it_came_from(tmp_path):
    import numpy as np
    from cs_runtime.config import InputConfig
    from cs_runtime.data.inputs import InputStream
    from cs_runtime.data.mnist import DataError
    section = InputConfig(data_dir=str(tmp_path / "mnist"), batch_size=8)
    empty = (np.zeros((0, 784), np.float32), np.zeros(0, np.int64))
    with pytest.raises(DataError) as caught:
        InputStream.build("train", empty, section, run_seed=1)
    assert str(caught.value) == f"train_input.data_dir {tmp_path / 'mnist'}: data set is empty (num_samples=0)"


@pytest.mark.parametrize("argv,line", [
    (["--num_csx", "1000", "python", FC_MNIST], "csrun_wse: --num_csx 1000 with 1000 input worker(s) starts 2003 "
     "processes here, about 140,210 MB before the model (70 MB each), but this machine has 23,000 MB available; "
     "use fewer WSEs or workers"),
    (["python", "/nowhere/run.py", "--mode", "train"], "csrun_wse: /nowhere/run.py: no such file"),
])
def test_csrun_wse_says_one_line_and_exits_2_before_starting_anything(argv, line, monkeypatch, capsys):
    from cs_runtime.cli import csrun_wse
    monkeypatch.setattr(job, "available_memory_mb", lambda: 23_000)
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))   # nothing may start
    monkeypatch.setattr(job, "run", lambda options: started.append(options))
    with pytest.raises(SystemExit) as exited:
        csrun_wse.main(argv)
    assert exited.value.code == EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    assert err.splitlines() == [line] and out == ""
    assert started == []
