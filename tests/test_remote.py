"""Launcher pieces that need no hosts: flags, hostfiles, task placement, the task wrapper,
the chief's input monitor, and the input shards (one process or a few, no cluster)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from chief.input_monitor import InputMonitor
from cs_runtime.launch import job, remote
from cs_runtime.launch.directory import DirectoryServer
from cs_runtime.data.inputs import InputStream
from cs_runtime.wire.transport import source_address_towards
from cs_runtime.cli import csrun_wse
from tests.cluster_utils import REPO, alive


# ------------------------------------------------------------------ flags
def test_dash_and_underscore_spellings_are_the_same_flag():
    a = csrun_wse.parse_args(["--tasks-per-node", "3", "--total_nodes", "2", "--cpus-per-task", "1", "python", "r.py"])
    b = csrun_wse.parse_args(["--tasks_per_node", "3", "--total-nodes", "2", "--cpus_per_task", "1", "python", "r.py"])
    assert (a.tasks_per_node, a.total_nodes, a.cpus_per_task) == (b.tasks_per_node, b.total_nodes, b.cpus_per_task) \
        == (3, 2, 1)
    assert a.launcher == b.launcher == "slurm"
    assert csrun_wse.parse_args(["-H", "h1,h2", "python", "r.py"]).launcher == "ssh"


@pytest.mark.parametrize("argv,message", [
    (["--tasks-per-nod", "2", "python", "r.py"], "unrecognized arguments: --tasks-per-nod"),
    (["--bogus", "python", "r.py"], "unrecognized arguments: --bogus"),
    (["-H", "h1", "--hostfile", "f", "python", "r.py"], "not both"),
    (["-H", "h1", "--num_workers_per_csx", "2", "python", "r.py"], "--num_workers_per_csx is for local runs"),
    (["--launcher", "local", "--tasks-per-node", "2", "python", "r.py"], "need SSH hosts or Slurm"),
    (["--tasks-per-node", "0", "python", "r.py"], "--tasks_per_node must be at least 1"),
    (["-H", "h1,h2", "--cpus-per-task", "2", "python", "r.py"], "--cpus-per-task is for Slurm"),
    (["--tasks-per-node", "2", "--services-node", "n1", "python", "r.py"], "--services-node is for jobs inside"),
])
def test_bad_flags_are_errors_that_say_what(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(SystemExit) as exc:
        csrun_wse.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ hosts
def test_hostfile_slots_comments_and_repeats(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\nnode1 slots=2\n\nnode2   # one slot\nnode1 slots=1\n")
    hosts = remote.parse_hostfile(str(path))
    assert [(h.name, h.slots) for h in hosts] == [("node1", 3), ("node2", 1)]
    assert remote.place_tasks(hosts, None, None) == ["node1", "node1", "node1", "node2"]
    assert remote.place_tasks(hosts, 2, None) == ["node1", "node1", "node2", "node2"]
    assert remote.place_tasks(hosts, 2, 1) == ["node1", "node1"]


@pytest.mark.parametrize("text,message", [
    ("node1 slots=two\n", "hosts:1: expected 'HOST [slots=N]'"),
    ("node1\nnode2 cpus=4\n", "hosts:2: expected 'HOST [slots=N]'"),
    ("# nothing\n", "no hosts in it"),
])
def test_bad_hostfile_names_file_and_line(tmp_path, text, message):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        remote.parse_hostfile(str(path))
    assert message in str(exc.value)


def test_host_list_and_too_few_slots():
    assert [(h.name, h.slots) for h in remote.parse_host_list("a,b,a")] == [("a", 2), ("b", 1)]
    with pytest.raises(SystemExit, match="at least 2"):
        remote.place_tasks(remote.parse_host_list("a"), None, None)
    with pytest.raises(SystemExit, match="--total-nodes 3 but only 2"):
        remote.place_tasks(remote.parse_host_list("a,b"), None, 3)


@pytest.mark.cluster
def test_bind_address_is_loopback_only_for_this_host():
    assert source_address_towards("127.0.0.1") == "127.0.0.1"
    assert remote.bind_address_for(["localhost", "127.0.0.1"]) == "127.0.0.1"
    with pytest.raises(SystemExit, match="does not resolve"):
        remote.bind_address_for(["no-such-host.invalid"])


def allocation(monkeypatch, tasks_per_node: str, cpus_per_node: str, nodes: int, **more: str) -> None:
    """The environment salloc/sbatch give a job (as Slurm 22.05 sets it)."""
    for name in ("SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", str(nodes))
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", tasks_per_node)
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", cpus_per_node)
    for name, value in more.items():
        monkeypatch.setenv(name, value)


def test_ssh_options_add_to_the_defaults_and_override_what_they_name():
    argv = remote.ssh_base("-p 2222 -o ConnectTimeout=3", "h1")
    # ssh keeps the first value of each option: the user's come first
    assert argv[:5] == ["ssh", "-p", "2222", "-o", "ConnectTimeout=3"] and argv[-1] == "h1"
    assert "BatchMode=yes" in argv and argv.index("ConnectTimeout=3") < argv.index("ConnectTimeout=10")


def test_services_step_roles_then_the_tasks():
    from cs_runtime.roles import service_of_index
    assert [service_of_index(i) for i in range(4)] == [("memoryx", 0), ("swarmx", 0), ("wse", 0), ("wse", 1)]


def test_slurm_counts_expand_and_compress():
    assert remote.expand_counts("2(x3),1", "X") == [2, 2, 2, 1]
    assert remote.expand_counts("4", "X") == [4]
    assert remote.compress_counts([2, 2, 2, 1]) == "2(x3),1"
    with pytest.raises(SystemExit, match=r"X='2\(3\)': expected counts like"):
        remote.expand_counts("2(3)", "X")


def test_slurm_shape_outside_an_allocation_from_flags_else_two_tasks(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun: shape and argv need none
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert remote.slurm_shape(None, None, None) == remote.SlurmShape([2], 1)
    assert remote.slurm_shape(2, 4, 2) == remote.SlurmShape([4, 4], 2)
    argv = remote.srun_argv(remote.SlurmShape([2, 2, 2], 1), "job", ["python", "run.py"])
    assert "--kill-on-bad-exit=1" in argv and "--nodes=3" in argv and "--ntasks=6" in argv
    assert "--ntasks-per-node=2" in argv and argv[-4:] == ["--slurm", "--", "python", "run.py"]


@pytest.mark.parametrize("asked, tasks, cpus, nodes, shape", [
    ("salloc -n3", "3", "3", 1, [3]),
    ("salloc -N3 -n3", "1(x3)", "1(x3)", 3, [1, 1, 1]),
    ("salloc -n7 over 4 nodes", "2(x3),1", "2(x3),1", 4, [2, 2, 2, 1]),
    ("salloc -N2 --ntasks-per-node=2", "2(x2)", "2(x2)", 2, [2, 2]),
])
def test_slurm_shape_is_the_allocation_however_it_was_asked(monkeypatch, asked, tasks, cpus, nodes, shape):
    allocation(monkeypatch, tasks, cpus, nodes)
    assert remote.slurm_shape(None, None, None).per_node == shape, asked


def test_slurm_uneven_shape_lets_srun_lay_it_out_and_says_so(monkeypatch):
    allocation(monkeypatch, "2(x3),1", "2(x3),1", 4)
    shape = remote.slurm_shape(None, None, None)
    assert shape.describe() == "4 node(s) x 2(x3),1 task(s) x 1 cpu(s)"
    argv = remote.srun_argv(shape, "job", ["python", "run.py"])
    assert "--ntasks=7" in argv and "--nodes=4" in argv and not any("per-node" in a for a in argv)


def test_slurm_only_ntasks_is_laid_out_in_blocks(monkeypatch):
    allocation(monkeypatch, "", "4(x2)", 2, SLURM_NTASKS="5")
    assert remote.slurm_shape(None, None, None).per_node == [3, 2]


def test_slurm_flags_choose_inside_the_allocation(monkeypatch):
    allocation(monkeypatch, "2(x3)", "4(x3)", 3, SLURM_CPUS_PER_TASK="2")
    assert remote.slurm_shape(2, None, None) == remote.SlurmShape([2, 2], 2)
    assert remote.slurm_shape(None, 4, 1) == remote.SlurmShape([4, 4, 4], 1)


@pytest.mark.parametrize("flags, message", [
    ((4, None, None), r"--total-nodes 4 but the allocation has 3 node\(s\)"),
    ((None, 3, 2), r"3 task\(s\) x 2 cpu\(s\) on node 0 of the allocation, which holds 4 CPU\(s\)"),
    ((1, 1, None), r"1 task\(s\) \(1 node\(s\) x 1 task\(s\) x 1 cpu\(s\)\): a job needs at least 2"),
])
def test_slurm_shape_the_allocation_cannot_hold_is_one_line(monkeypatch, flags, message):
    allocation(monkeypatch, "2(x3)", "4(x3)", 3)
    with pytest.raises(SystemExit, match=message) as err:
        remote.slurm_shape(*flags)
    assert "\n" not in str(err.value)


def test_without_srun_the_slurm_launcher_stops_before_anything_starts(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    options = csrun_wse.parse_args(["--total-nodes", "1", "--tasks-per-node", "2", "python", "run.py"])
    assert options.launcher == "slurm"
    with pytest.raises(SystemExit, match=r"^csrun_wse: srun not found on PATH \(install Slurm's client"):
        job.plan_layout(options)


def test_slurm_preflight_checks_each_node_of_the_job_and_names_those_that_fail(monkeypatch, tmp_path):
    from cs_runtime.wire import auth
    seen = {}

    def fake_srun(argv, env, **_):   # what srun would print: one line per node it started the check on
        seen.update(argv=argv, env=env)
        out = "n1: ok\nn3: cannot keep the job's keys on this host: [Errno 28] No space left on device\n"
        return subprocess.CompletedProcess(argv, 1, out, "srun: error: n2: task 1: Exited with exit code 2\n")
    monkeypatch.setattr(remote, "require_srun", lambda: None)
    monkeypatch.setattr(remote.subprocess, "run", fake_srun)
    keys = auth.create_job_dir()
    monkeypatch.setenv(auth.KEYS_ENV, str(keys))
    try:
        with pytest.raises(SystemExit) as failed:
            remote.check_slurm_nodes(["n1", "n2", "n3"], 3)
    finally:
        auth.remove_job_dir(keys)
    line = str(failed.value)
    assert line.count("\n") == 0 and line.startswith("csrun_wse: Slurm node(s) that cannot start the job's tasks: ")
    assert "n3 (cannot keep the job's keys on this host: [Errno 28]" in line
    assert "n2 (srun: error: n2: task 1: Exited with exit code 2)" in line and "n1 (" not in line
    argv = seen["argv"]
    assert "--nodelist=n1,n2,n3" in argv and "--ntasks-per-node=1" in argv and "--ntasks=3" in argv
    assert argv[-2:] == ["--check-slurm", os.getcwd()]
    # the keys travel as the tasks' do: as text in srun's environment, not as a folder of this host
    assert auth.KEYS_ENV not in seen["env"] and json.loads(seen["env"][auth.KEYS_TEXT_ENV])


def test_slurm_node_check_says_ok_or_why_not_naming_the_node(monkeypatch, tmp_path, capsys):
    import tempfile
    from cs_runtime.launch import task
    from cs_runtime.wire import auth
    keys = auth.create_job_dir()
    try:
        text = json.dumps(auth.key_strings(auth.load_keys(str(keys))))
    finally:
        auth.remove_job_dir(keys)
    monkeypatch.setenv("SLURMD_NODENAME", "node7")
    monkeypatch.setenv(auth.KEYS_TEXT_ENV, text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    task.check_slurm_node(str(tmp_path))
    assert capsys.readouterr().out == "node7: ok\n"
    assert [p.name for p in tmp_path.iterdir()] == []          # the keys it kept, removed
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "not-on-this-node"))
    with pytest.raises(SystemExit, match="^1$"):
        task.check_slurm_node(str(tmp_path))
    assert capsys.readouterr().out.startswith("node7: cannot keep the job's keys on this host: [Errno 2]")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(SystemExit, match="^1$"):
        task.check_slurm_node("/no/such/folder")
    assert capsys.readouterr().out == f"node7: cannot work in /no/such/folder (srun started the step in {tmp_path})\n"
    monkeypatch.setenv(auth.KEYS_TEXT_ENV, "{not json")
    with pytest.raises(SystemExit, match="^1$"):
        task.check_slurm_node(str(tmp_path))
    assert capsys.readouterr().out == f"node7: the job's keys in {auth.KEYS_TEXT_ENV} are not JSON\n"
    # outside an allocation there is no pre-flight step: the task wrapper's own line names its node
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "not-on-this-node"))
    with pytest.raises(SystemExit, match=r"^cs_runtime.launch.task on node7: cannot keep the job's keys on this host"):
        task.task_keys({}, json.loads(text), "node7")


# ------------------------------------------------------------------ the task wrapper
@pytest.mark.cluster
def test_task_wrapper_stops_its_task_when_stdin_closes_and_reports_the_exit(tmp_path):
    ctx = zmq.Context()
    directory = DirectoryServer(ctx, "job-w", {"worker": 1})
    pidfile = tmp_path / "child.pid"
    child = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    spec = {"host": "hostA", "tasks": [{"role": "worker", "rank": 0, "argv": [sys.executable, "-c", child]}],
            "env": {**os.environ, "CS_JOB_ID": "job-w", "CS_RENDEZVOUS": directory.address,
                    "PYTHONPATH": str(REPO)}}
    wrapper = subprocess.Popen([sys.executable, "-m", "cs_runtime.launch.task", "--ssh"], stdin=subprocess.PIPE,
                               cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        wrapper.stdin.write((json.dumps(spec) + "\n").encode())
        wrapper.stdin.flush()
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text()):
            directory.serve_once(50)
            assert time.monotonic() < deadline and wrapper.poll() is None
        child_pid = int(pidfile.read_text())
        wrapper.stdin.close()  # what the end of an ssh connection looks like from the far side
        while ("worker", 0) not in directory.exits:
            directory.serve_once(50)
            assert time.monotonic() < deadline
        assert wrapper.wait(timeout=30) == 128 + 15
        assert not alive(child_pid)
        assert directory.exits[("worker", 0)] == {"role": "worker", "rank": 0, "host": "hostA",
                                                  "pid": child_pid, "code": -15}
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
        directory.close()
        ctx.destroy(linger=0)


@pytest.mark.cluster
@pytest.mark.parametrize("sent, answer", [
    ({"keys": None}, "ok"),
    ({"keys": {"server_public": "x"}}, "the job's keys must be server_public, server_secret, client_public"),
])
def test_task_wrapper_check_keeps_the_keys_or_says_why_not(sent, answer, tmp_path):
    from cs_runtime.wire import auth
    if sent["keys"] is None:  # fresh keys, as the launcher sends them
        folder = auth.create_job_dir()
        sent = {"keys": auth.key_strings(auth.load_keys(str(folder)))}
        auth.remove_job_dir(folder)
    result = subprocess.run([sys.executable, "-m", "cs_runtime.launch.task", "--check"], input=json.dumps(sent) + "\n",
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)})
    assert answer in (result.stdout + result.stderr), result.stderr
    assert (result.returncode == 0) == (answer == "ok")
    assert list(tmp_path.iterdir()) == []  # the check leaves nothing


@pytest.mark.cluster
@pytest.mark.parametrize("sent, message", [
    (b'{"role": 1}\n', b"task description needs host, env, tasks"),
    (b'{"host": "h", "env": {}, "tasks": [{"role": "chief", "rank": "0", "argv": ["x"]}]}\n',
     b"each task needs role, rank and argv (strings)"),
    (b'{"host": "h", "env": {}, "tasks": []}\n', b"no tasks in the description"),
])
def test_task_wrapper_refuses_a_bad_task_description(sent, message):
    result = subprocess.run([sys.executable, "-m", "cs_runtime.launch.task", "--ssh"], input=sent,
                            capture_output=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert result.returncode != 0
    assert message in result.stderr


# ------------------------------------------------------------------ input shards and the monitor
def test_shards_tile_the_global_batch_whatever_the_wse_count():
    rng = np.random.default_rng(0)
    data = (rng.normal(size=(50, 4)).astype(np.float32), rng.integers(0, 10, 50))
    from cs_runtime.config import load_params
    params = load_params(str(REPO / "examples" / "fc_mnist" / "configs" / "params.yaml"))
    section = params.train_input.model_copy(update={"batch_size": 16})
    stream = InputStream.build("train", data, section, 1)
    whole = stream.shard(3)
    for n in (1, 2, 3):
        parts = stream.shards(3, n)
        np.testing.assert_array_equal(np.concatenate([p.x for p in parts]), whole.x)
        assert [p.global_batch for p in parts] == [16] * n


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def stats(rank, batches, busy, elapsed, done=False):
    return {"rank": rank, "host": f"h{rank}", "batches": batches, "busy_s": busy, "blocked_s": 0.0,
            "elapsed_s": elapsed, "done": done}


def test_monitor_names_the_slow_worker_with_its_rate():
    clock = FakeClock()
    monitor = InputMonitor(num_csx=2, num_workers=2, clock=clock)
    monitor.on_stats(stats(0, 10, 1.0, 1.0))
    monitor.on_stats(stats(1, 2, 1.0, 1.0))
    for _ in range(8):  # 4 s, the two WSEs waiting 0.4 s each per 0.5 s step
        clock.now += 0.5
        monitor.on_step(0.8)
    assert len(monitor.warnings) == 1
    line = monitor.warnings[0]
    assert "suspected input bottleneck: the WSE(s) waited for input 80% of the last 3.0 s" in line
    assert "worker 0 on h0 10.0 batches/s (busy 100%)" in line and "worker 1 on h1 2.0 batches/s" in line


def test_monitor_quiet_once_every_worker_is_done():
    """All batches made and sent: a long last step (a checkpoint, eval) is not an input bottleneck."""
    clock = FakeClock()
    monitor = InputMonitor(num_csx=1, num_workers=2, clock=clock)
    monitor.on_stats(stats(0, 40, 0.5, 10.0, done=True))
    clock.now += 0.5
    monitor.on_step(0.0)
    monitor.on_stats(stats(1, 40, 0.5, 10.0, done=False))
    clock.now += 6.0
    monitor.on_idle()
    assert len(monitor.warnings) == 1       # one worker still working: a stall is suspected
    monitor.on_stats(stats(1, 44, 0.6, 16.0, done=True))
    for _ in range(8):                      # both done: waiting steps and long silences say nothing
        clock.now += 0.5
        monitor.on_step(0.45)
    clock.now += 20.0
    monitor.on_idle()
    assert len(monitor.warnings) == 1


def test_monitor_quiet_when_fed_and_reports_a_stall_once():
    clock = FakeClock()
    monitor = InputMonitor(num_csx=1, num_workers=2, clock=clock)
    monitor.on_idle()
    clock.now = 30.0
    monitor.on_idle()  # start-up (no step yet) is not a stall
    for _ in range(20):
        clock.now += 0.5
        monitor.on_step(0.01)
    assert monitor.warnings == []
    monitor.on_stats(stats(0, 40, 0.5, 10.0))
    clock.now += 6.0
    monitor.on_idle()
    monitor.on_idle()
    assert len(monitor.warnings) == 1
    assert "no step finished for 6.0 s" in monitor.warnings[0]
    assert "worker 0 on h0 4.0 batches/s (busy 5%) silent for 6.0 s" in monitor.warnings[0]
    assert "worker 1 has not reported" in monitor.warnings[0]
