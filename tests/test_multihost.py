"""csrun_wse beyond one machine, for real: hosts in network namespaces over SSH, and srun/sbatch
on a one-node Slurm cluster (fixtures in conftest.py; they skip where root or the binaries are missing)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

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


def start_training_over_ssh(tmp_path, hosts, host_list: str) -> subprocess.Popen:
    """A job that runs until stopped, over SSH on `host_list`, returned once it is training."""
    from tests.cluster_utils import write_params
    params = write_params(tmp_path, runconfig={"max_steps": 100000, "log_steps": 5})
    proc = subprocess.Popen(train_command(params, tmp_path / "m", "-H", host_list, "--ssh_options", hosts.ssh_options),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "| Train" in line:
                break
    except BaseException:   # a timeout while waiting: the caller's cleanup never runs
        proc.kill()
        raise
    return proc


def test_ssh_killing_the_launcher_stops_every_remote_process(tmp_path, netns_hosts):
    h0, h1 = netns_hosts.addresses
    proc = start_training_over_ssh(tmp_path, netns_hosts, f"{h0},{h1}")
    try:
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
    job_id = re.search(r"srun: job (\d+) ", result.stderr)
    if job_id:  # srun made its own allocation: its one step ended by itself
        assert steps_when_ended(slurm_cluster, job_id.group(1)) == {"0": "done"}


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


def steps_when_ended(cluster, job_id: str, timeout: float = 15.0) -> dict[str, str]:
    """The job's steps as slurmd logged their ends, once none is still running."""
    deadline = time.monotonic() + timeout
    while True:
        ends = cluster.step_ends(job_id)
        if "running" not in ends.values() or time.monotonic() > deadline:
            return ends
        time.sleep(0.2)  # polling slurmd's log: there is nothing to wait on


def test_salloc_n3_runs_three_tasks_and_the_services_as_steps_that_complete(tmp_path, oracle, slurm_cluster):
    import socket
    cmd = ["salloc", "-n3", *train_command(oracle[0], tmp_path / "m")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=slurm_cluster.env)
    assert result.returncode == 0, result.stderr[-3000:]
    # -n3 alone: three tasks (the chief and two input workers), not the old default of two per node;
    # MemoryX, SwarmX and the WSE on the allocation's first node, as a step of the allocation
    assert (f"2 input worker(s), tasks with srun (1 node(s) x 3 task(s) x 1 cpu(s)), services on "
            f"{socket.gethostname()} (srun)") in result.stderr
    assert_matches_oracle(tmp_path / "m", oracle)
    job_id = re.search(r"Granted job allocation (\d+)", result.stderr).group(1)
    # three steps (the nodes' pre-flight, services, tasks); csrun_wse waited for each: each ended by
    # itself, none cancelled
    assert steps_when_ended(slurm_cluster, job_id) == {"0": "done", "1": "done", "2": "done"}, \
        result.stderr[-2000:]
    assert slurm_leftovers(str(tmp_path)) == []


def test_services_node_must_be_a_node_of_the_allocation(tmp_path, oracle, slurm_cluster):
    cmd = ["salloc", "-n3", *train_command(oracle[0], tmp_path / "m", "--services-node", "no-such-node")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=slurm_cluster.env)
    assert result.returncode != 0
    ours = [l for l in result.stderr.splitlines() if l.startswith("csrun_wse:")]
    assert len(ours) == 1 and "--services-node no-such-node is not a node of the allocation" in ours[0], \
        result.stderr
    assert not (tmp_path / "m").exists()


def test_shape_the_allocation_cannot_hold_is_one_line_before_anything_starts(tmp_path, oracle, slurm_cluster):
    cmd = ["salloc", "-n3", *train_command(oracle[0], tmp_path / "m", "--tasks-per-node", "4")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=slurm_cluster.env)
    assert result.returncode != 0
    ours = [l for l in result.stderr.splitlines() if l.startswith("csrun_wse:")]
    assert len(ours) == 1 and "4 task(s) x 1 cpu(s) on node 0 of the allocation, which holds 3 CPU(s)" in ours[0], \
        result.stderr
    job_id = re.search(r"Granted job allocation (\d+)", result.stderr).group(1)
    assert slurm_cluster.step_ends(job_id) == {}  # no step was started
    assert not (tmp_path / "m").exists()


def test_slurm_preflight_names_the_node_that_cannot_start_the_tasks(tmp_path, oracle, slurm_cluster):
    """The node's /tmp is not this machine's: a working folder in ours is not there (srun would go
    on in /tmp). That the keys can be kept is the same check's other half (tests/test_remote.py:
    slurmstepd makes a missing TMPDIR itself, so it cannot fail that way here)."""
    import socket
    import tempfile
    with tempfile.TemporaryDirectory(prefix="cs-only-here-") as here:
        result = subprocess.run(["salloc", "-n3", *train_command(oracle[0], tmp_path / "m")], capture_output=True,
                                text=True, timeout=180, env=slurm_cluster.env, cwd=here)
    assert result.returncode != 0
    ours = [l for l in result.stderr.splitlines() if l.startswith("csrun_wse:")]
    assert ours == [f"csrun_wse: Slurm node(s) that cannot start the job's tasks: {socket.gethostname()} (cannot "
                    f"work in {here} (srun started the step in /tmp))"], result.stderr[-3000:]
    job_id = re.search(r"Granted job allocation (\d+)", result.stderr).group(1)
    assert len(slurm_cluster.step_ends(job_id)) == 1   # the check's step only: neither services nor tasks
    assert not (tmp_path / "m").exists()
    assert slurm_leftovers(str(tmp_path)) == []


def test_ctrl_c_stops_the_srun_job_and_exits_130(tmp_path, slurm_cluster):
    import signal
    from tests.cluster_utils import write_params
    params = write_params(tmp_path, runconfig={"max_steps": 100000, "log_steps": 5})
    proc = subprocess.Popen(train_command(params, tmp_path / "m", "--total-nodes", "1", "--tasks-per-node", "2"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=slurm_cluster.env)
    try:
        for line in proc.stdout:
            if "| Train" in line:
                break
        proc.send_signal(signal.SIGINT)
        output = proc.stdout.read()
        assert proc.wait(timeout=60) == 130, output[-3000:]
        assert "job stopped: interrupted by SIGINT" in output
        assert slurm_leftovers(str(tmp_path)) == []
    finally:
        kill_tree(proc)


# ------------------------------------------------------------------ hosts without this machine's /tmp
def ssh(hosts, host: str, command: str) -> subprocess.CompletedProcess:
    import shlex
    return subprocess.run(["ssh", *shlex.split(hosts.ssh_options), host, command], capture_output=True, text=True,
                          timeout=30)


def test_keys_reach_hosts_that_do_not_share_this_machines_tmp(tmp_path, oracle, isolated_hosts):
    import tempfile
    h0, h1 = isolated_hosts.addresses
    with tempfile.NamedTemporaryFile(prefix="cs-only-here-") as only_here:  # in this machine's /tmp
        assert ssh(isolated_hosts, h0, f"test -e {only_here.name}").returncode == 1  # not seen there
    result = subprocess.run(train_command(oracle[0], tmp_path / "m", "-H", f"{h0},{h1},{h1}",
                                          "--ssh_options", isolated_hosts.ssh_options),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_matches_oracle(tmp_path / "m", oracle)
    assert leftovers(isolated_hosts) == []
    for host in (h0, h1):  # each task wrapper removed the keys it wrote there
        assert ssh(isolated_hosts, host, "ls /tmp").stdout.split() == [tmp_path.parents[1].name], host


def test_preflight_names_the_hosts_that_cannot_start_tasks(tmp_path, oracle, isolated_hosts):
    import tempfile
    h0, h1 = isolated_hosts.addresses
    with tempfile.TemporaryDirectory(prefix="cs-only-here-") as here:  # the working folder, not on the hosts
        result = subprocess.run(train_command(oracle[0], tmp_path / "m", "-H", f"{h0},{h1}",
                                              "--ssh_options", isolated_hosts.ssh_options),
                                capture_output=True, text=True, timeout=120, cwd=here)
    assert result.returncode != 0
    lines = [l for l in result.stderr.splitlines() if l.startswith("csrun_wse:")]
    assert len(lines) == 1 and "host(s) that cannot start the job's tasks: " in lines[0], result.stderr
    assert all(f"{h} (" in lines[0] for h in (h0, h1)) and lines[0].count(here) == 2, lines[0]
    assert not (tmp_path / "m").exists()


def test_loopback_bind_is_refused_for_tasks_on_other_hosts(tmp_path, oracle, isolated_hosts):
    h0, h1 = isolated_hosts.addresses
    result = subprocess.run(train_command(oracle[0], tmp_path / "m", "-H", f"{h0},{h1}", "--bind_address",
                                          "127.0.0.1", "--ssh_options", isolated_hosts.ssh_options),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert f"csrun_wse: the job's services would bind 127.0.0.1 (loopback), which its tasks on {h0}, {h1} " \
           "cannot reach" in result.stderr
    assert not (tmp_path / "m").exists()


def test_bind_address_sets_where_the_services_listen(tmp_path, oracle, isolated_hosts):
    h0, h1 = isolated_hosts.addresses
    result = subprocess.run(train_command(oracle[0], tmp_path / "m", "-H", f"{h0},{h1}", "--bind_address",
                                          isolated_hosts.gateway, "--ssh_options", isolated_hosts.ssh_options),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"WSE 0 ready, input at tcp://{isolated_hosts.gateway}:" in result.stderr
    assert_matches_oracle(tmp_path / "m", oracle)
    assert leftovers(isolated_hosts) == []


# ------------------------------------------------------------------ SSH at scale
def sshd_sessions(hosts, index: int) -> list[int]:
    """The sshd processes serving a connection on host `index` (not its listener)."""
    listener = int(hosts.sshd_pidfiles[index].read_text().split()[0])
    return [pid for pid in hosts.pids(hosts.namespaces[index])
            if pid != listener and Path(f"/proc/{pid}/comm").exists()
            and Path(f"/proc/{pid}/comm").read_text().strip() == "sshd"]


def test_24_tasks_on_one_host_start_over_one_ssh_connection(tmp_path, oracle, netns_hosts):
    h0, _ = netns_hosts.addresses
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{h0} slots=24\n")
    proc = subprocess.Popen(train_command(oracle[0], tmp_path / "m", "--hostfile", str(hostfile),
                                          "--ssh_options", netns_hosts.ssh_options),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "| Train" in line:
                break
        # 24 tasks, one connection: sshd's MaxStartups (10 by default) never sees more than one
        sessions = sshd_sessions(netns_hosts, 0)
        workers = [pid for pid, cmd in netns_hosts.job_processes() if "-m worker" in cmd]
        output = proc.stdout.read()
        assert proc.wait(timeout=300) == 0, output[-3000:]
        assert 1 <= len(sessions) <= 2, sessions  # the privileged monitor and its session child
        assert len(workers) == 23
        assert_matches_oracle(tmp_path / "m", oracle)
        assert leftovers(netns_hosts) == []
    finally:
        kill_tree(proc)


def test_ssh_config_alias_is_resolved_by_ssh(tmp_path, oracle, isolated_hosts):
    h0, h1 = isolated_hosts.addresses
    config = tmp_path / "ssh_config"
    config.write_text(f"Host cs-alias-a\n  HostName {h0}\nHost cs-alias-b\n  HostName {h1}\n")
    options = isolated_hosts.ssh_options.replace("-F /dev/null", f"-F {config}")
    result = subprocess.run(train_command(oracle[0], tmp_path / "m", "-H", "cs-alias-a,cs-alias-b",
                                          "--ssh_options", options),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "task hosts: cs-alias-a cs-alias-b" in result.stderr
    assert f"WSE 0 ready, input at tcp://{isolated_hosts.gateway}:" in result.stderr  # the bridge, not loopback
    assert_matches_oracle(tmp_path / "m", oracle)
    assert leftovers(isolated_hosts) == []


def test_a_lost_ssh_connection_is_reported_as_such(tmp_path, netns_hosts):
    import signal
    h0, h1 = netns_hosts.addresses
    proc = start_training_over_ssh(tmp_path, netns_hosts, f"{h0},{h1}")
    try:
        for pid in sshd_sessions(netns_hosts, 1):
            os.kill(pid, signal.SIGKILL)  # the connection to h1 drops
        output = proc.stdout.read()
        assert proc.wait(timeout=60) == 1
        failed = [l for l in output.splitlines() if "job failed" in l]
        assert len(failed) == 1 and f"lost its ssh connection to {h1}" in failed[0], output[-3000:]
        assert "SIGTERM" not in failed[0]
        assert wait_for_exit([pid for pid, _ in leftovers(netns_hosts)], timeout=30) == []
    finally:
        kill_tree(proc)


def test_a_dead_host_mid_run_is_named_and_nothing_is_left(tmp_path, netns_hosts):
    from tests.netns_hosts import sh
    h0, h1 = netns_hosts.addresses
    link = f"{netns_hosts.tag}v1"   # host 1's cable into the bridge
    proc = start_training_over_ssh(tmp_path, netns_hosts, f"{h0},{h1},{h1}")
    try:
        on_h1 = [pid for pid, _ in leftovers(netns_hosts) if pid in netns_hosts.pids(netns_hosts.namespaces[1])]
        sh("ip", "link", "set", link, "down")
        t0 = time.monotonic()
        output = proc.stdout.read()
        assert proc.wait(timeout=60) == 1
        failed = [l for l in output.splitlines() if "job failed" in l]
        assert len(failed) == 1 and re.search(rf"worker [01] on {re.escape(h1)} \(pid \d+\) stopped answering",
                                              failed[0]), output[-3000:]
        assert time.monotonic() - t0 < 30
        # cut off, host 1's processes hear nothing from the directory and stop by themselves
        assert wait_for_exit(on_h1, timeout=40) == []
        assert leftovers(netns_hosts) == []
    finally:
        sh("ip", "link", "set", link, "up")
        kill_tree(proc)


# ------------------------------------------------------------------ many tasks (tasks that only join the job)
def joining_job(tmp_path, hosts, slots: dict[str, int], timeout: float) -> tuple[subprocess.CompletedProcess, list]:
    """Run tests/joining_task.py as a job over SSH with `slots` tasks per host: the launcher's
    result, and what the chief saw of the input workers once every one had registered."""
    from tests.cluster_utils import REPO
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("".join(f"{host} slots={count}\n" for host, count in slots.items()))
    seen = tmp_path / "seen.json"
    result = subprocess.run([tool("csrun_wse"), "--hostfile", str(hostfile), "--ssh_options", hosts.ssh_options,
                             sys.executable, str(REPO / "tests" / "joining_task.py"), str(seen)],
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, json.loads(seen.read_text())


def test_64_tasks_on_one_host_all_register(tmp_path, netns_hosts):
    h0, _ = netns_hosts.addresses
    result, workers = joining_job(tmp_path, netns_hosts, {h0: 64}, timeout=500)
    assert "63 input worker(s), tasks over SSH" in result.stderr
    assert sorted(rank for rank, _, _ in workers) == list(range(63))
    assert {host for _, host, _ in workers} == {h0} and len({pid for _, _, pid in workers}) == 63
    assert leftovers(netns_hosts) == []


def test_16_hosts_x_16_tasks_all_register(tmp_path, sixteen_hosts):
    hosts = sixteen_hosts.addresses
    result, workers = joining_job(tmp_path, sixteen_hosts, {h: 16 for h in hosts}, timeout=590)
    assert "255 input worker(s), tasks over SSH" in result.stderr
    # task t on host t // 16: the chief and workers 0..14 on the first host, and so on
    assert sorted((rank, host) for rank, host, _ in workers) == [(r, hosts[(r + 1) // 16]) for r in range(255)]
    assert leftovers(sixteen_hosts) == []
