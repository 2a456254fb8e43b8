"""csrun_wse beyond one machine, for real: hosts in network namespaces over SSH, and srun/sbatch
on a one-node Slurm cluster (fixtures in conftest.py; they skip where root or the binaries are missing)."""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from tests.cluster_utils import FC_MNIST, assert_matches_oracle, kill_tree, tool

pytestmark = pytest.mark.cluster  # every test here starts processes (see tests/conftest.py)

JOB_MARKERS = ("cs_runtime.launch.task", "-m chief", "-m worker")


def train_command(params, model_dir, *launcher: str) -> list[str]:
    return [tool("csrun_wse"), *launcher, sys.executable, FC_MNIST, "--mode", "train", "--params", str(params),
            "--model_dir", str(model_dir)]


def leftovers(hosts) -> list[tuple[int, str]]:
    return [(pid, cmd) for pid, cmd in hosts.job_processes() if any(m in cmd for m in JOB_MARKERS)]


# ------------------------------------------------------------------ SSH
def test_ssh_hosts_train_like_the_oracle_and_leave_nothing(tmp_path, oracle, netns_hosts):
    h0, h1 = netns_hosts.addresses
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"# two hosts\n{h0} slots=2\n{h1}\n")
    result = subprocess.run(train_command(oracle[0], tmp_path / "m", "--num_csx", "2", "--hostfile", str(hostfile),
                                          "--ssh_options", netns_hosts.ssh_options),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    # chief and worker 0 on h0, worker 1 on h1; MemoryX, SwarmX, WSEs here, bound to the bridge's address.
    assert f"tasks over SSH (task hosts: {h0} {h0} {h1})" in result.stderr
    assert f"WSE 0 ready, input at tcp://{netns_hosts.gateway}:" in result.stderr
    # h1 reaches the chief on h0 only through h0's real address: a loopback bind could not train.
    assert_matches_oracle(tmp_path / "m", oracle)
    assert leftovers(netns_hosts) == []


def test_ssh_preflight_names_the_host_that_does_not_answer(tmp_path, oracle, netns_hosts):
    absent = f"{netns_hosts.subnet}.250"
    t0 = time.monotonic()
    result = subprocess.run(train_command(oracle[0], tmp_path / "m", "-H", f"{netns_hosts.addresses[0]},{absent}",
                                          "--ssh_options", netns_hosts.ssh_options),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    lines = [l for l in result.stderr.splitlines() if "not reachable over SSH" in l]
    assert len(lines) == 1 and f"{absent} (" in lines[0], result.stderr
    assert f"{netns_hosts.addresses[0]} (" not in lines[0]  # the host that answers is not blamed
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "m").exists()  # nothing started


def test_ssh_dead_worker_on_a_host_stops_the_job_everywhere(tmp_path, oracle, netns_hosts):
    from tests.cluster_utils import write_params
    params = write_params(tmp_path, runconfig={"max_steps": 100000, "log_steps": 5})
    h0, h1 = netns_hosts.addresses
    proc = subprocess.Popen(train_command(params, tmp_path / "m", "-H", f"{h0},{h1},{h1}",
                                          "--ssh_options", netns_hosts.ssh_options),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "| Train" in line:
                break
        victims = [pid for pid, cmd in netns_hosts.job_processes() if "-m worker" in cmd
                   and pid in netns_hosts.pids(netns_hosts.namespaces[1])]
        assert len(victims) == 2, netns_hosts.job_processes()
        subprocess.run(["kill", "-9", str(victims[0])], check=True)
        output = proc.stdout.read()
        assert proc.wait(timeout=60) != 0
        failed = [l for l in output.splitlines() if "job failed" in l]
        assert len(failed) == 1 and re.search(rf"worker [01] on {re.escape(h1)} \(pid {victims[0]}\) exited with "
                                              r"signal SIGKILL", failed[0]), output[-3000:]
        assert leftovers(netns_hosts) == []
    finally:
        kill_tree(proc)


def wait_for_exit(pids: list[int], timeout: float) -> list[int]:
    """Wait (pidfd, no polling) until these processes have exited; returns those still alive."""
    import os
    import select
    deadline = time.monotonic() + timeout
    alive = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                alive.append(pid)
        finally:
            os.close(fd)
    return alive


def test_ssh_killing_the_launcher_stops_every_remote_process(tmp_path, netns_hosts):
    from tests.cluster_utils import write_params
    params = write_params(tmp_path, runconfig={"max_steps": 100000, "log_steps": 5})
    h0, h1 = netns_hosts.addresses
    proc = subprocess.Popen(train_command(params, tmp_path / "m", "-H", f"{h0},{h1}",
                                          "--ssh_options", netns_hosts.ssh_options),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "| Train" in line:
                break
        remote = leftovers(netns_hosts)
        assert {cmd.split(" -m ")[1].split()[0] for _, cmd in remote} >= {"chief", "worker", "cs_runtime.launch.task"}
        proc.kill()  # no chance to clean up: its ssh clients die with it, the far sides see EOF
        proc.wait()
        assert wait_for_exit([pid for pid, _ in remote], timeout=30) == []
        assert leftovers(netns_hosts) == []
    finally:
        kill_tree(proc)


# ------------------------------------------------------------------ Slurm
def slurm_leftovers(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    return [l for l in out.splitlines() if marker in l and not l.startswith("Z")]


def test_srun_tasks_train_like_the_oracle(tmp_path, oracle, slurm_cluster):
    cmd = train_command(oracle[0], tmp_path / "m", "--total-nodes", "1", "--tasks_per_node", "3",
                        "--cpus-per-task", "1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=slurm_cluster.env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 input worker(s), tasks with srun (1 node(s) x 3 task(s) x 1 cpu(s))" in result.stderr
    assert "CANCELLED" not in result.stderr and "srun: error" not in result.stderr  # a clean end of the step
    assert_matches_oracle(tmp_path / "m", oracle)
    assert slurm_leftovers(str(tmp_path)) == []


def test_sbatch_script_runs_csrun_wse_inside_the_allocation(tmp_path, oracle, slurm_cluster):
    import shlex
    script = tmp_path / "job.sh"
    command = " ".join(shlex.quote(a) for a in train_command(oracle[0], tmp_path / "m"))
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes=1 --ntasks-per-node=2 --cpus-per-task=1\n{command}\n")
    submit = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path / 'job.out'}", str(script)],
                            capture_output=True, text=True, timeout=60, env=slurm_cluster.env, cwd=tmp_path)
    assert submit.returncode == 0, submit.stderr
    state = slurm_cluster.wait_for_job(submit.stdout.strip().split(";")[0], timeout=300)
    out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert state == ("COMPLETED", "0:0"), out[-3000:]
    # no flags: the allocation's shape (1 node x 2 tasks) decides
    assert "1 input worker(s), tasks with srun (1 node(s) x 2 task(s) x 1 cpu(s))" in out, out[-3000:]
    assert_matches_oracle(tmp_path / "m", oracle)
    assert slurm_leftovers(str(tmp_path)) == []
