"""csrun_wse: run a model script on the emulated CS system.

    csrun_wse [--num_csx N] [--num_workers_per_csx W] [--cs_ip HOST:PORT] \\
        python examples/fc_mnist/run.py --mode train --params examples/fc_mnist/configs/params.yaml
    csrun_wse --hostfile hosts.txt python run.py ...                                  # tasks over SSH
    csrun_wse --total-nodes 3 --tasks-per-node 2 --cpus-per-task 1 python run.py ...  # tasks with srun

Without --cs_ip it starts a CS system for the job on this machine (one
MemoryX, one SwarmX, N WSE emulators); with --cs_ip HOST:PORT it submits the
job to a shared CS system (`cs_system serve`), waits for its turn in the
queue, and then runs the tasks against the services that system gives the job
(cs_runtime.launch.job.run_on_cs_system). It then starts the user's command as
the job's tasks: task 0 as the chief (`python -m chief run.py ...`), the
others as input workers (`python -m worker run.py ...`): on this machine
(N*W workers), over SSH on the hosts of --hostfile / -H, or with srun inside
a Slurm allocation (or when --total-nodes / --tasks-per-node /
--cpus-per-task is given without hosts). It supervises all of them: the job
ends when the chief exits 0; if any process fails or stops answering,
everything is stopped within seconds and one line names what failed; with
--max_restarts K the whole job is then restarted from its latest checkpoint,
up to K times. Traffic is authenticated and encrypted with CURVE keys made for
the job (see cs_runtime/wire/auth.py); --insecure turns that off, on loopback only.

This script is the command line only: its flags become a JobOptions,
cs_runtime.launch.precheck checks the params and the model before anything
starts (the command run once with CS_ROLE=precheck), and cs_runtime.launch.job
runs the job.
"""
from __future__ import annotations

import argparse
import sys

from cs_runtime.errors import EXIT_BAD_INPUT, UserInputError, say_error
from cs_runtime.flags import add_flag
from cs_runtime.launch import job, precheck, remote
from cs_runtime.launch.backends import LAUNCHERS
from cs_runtime.launch.job import JobOptions
from cs_runtime.process.service import setup_logging
from cs_runtime.version import version_line
from cs_runtime.wire.protocol import check_labels


def parse_args(argv: list[str]) -> JobOptions:
    parser = argparse.ArgumentParser(prog="csrun_wse", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=version_line("csrun_wse"))
    add_flag(parser, "num_csx", type=int, default=1, help="WSE emulators (default 1)")
    add_flag(parser, "num_workers_per_csx", type=int, default=None,
             help="input workers per WSE, on this machine (default 1); over SSH or Slurm every task "
                  "after the chief is an input worker")
    add_flag(parser, "cs_ip", default=None, help="HOST:PORT of a running CS system (default: start one)")
    add_flag(parser, "hostfile", default=None, help="run the tasks over SSH on these hosts ('HOST [slots=N]' a line)")
    parser.add_argument("-H", "--hosts", default=None, help="run the tasks over SSH on h1,h2,... (one slot each)")
    add_flag(parser, "ssh_options", default="",
             help=f"options for ssh, e.g. --ssh_options='-p 2222', added to (and overriding) the defaults "
                  f"{remote.DEFAULT_SSH_OPTIONS!r}")
    add_flag(parser, "total_nodes", type=int, default=None, help="nodes (Slurm: srun -N; SSH: the first N hosts)")
    add_flag(parser, "tasks_per_node", type=int, default=None,
             help="tasks per node (Slurm: default from the allocation, else 2; SSH: default the slots)")
    add_flag(parser, "cpus_per_task", type=int, default=None, help="CPUs per task (Slurm; default 1)")
    add_flag(parser, "services_node", default=None, metavar="NODE",
             help="inside a Slurm allocation: the node that runs MemoryX, SwarmX and the WSEs "
                  "(default the allocation's first)")
    add_flag(parser, "launcher", choices=("auto", *LAUNCHERS), default="auto",
             help="auto (default): ssh with --hostfile/-H; slurm inside an allocation or with "
                  "--total-nodes/--tasks-per-node/--cpus-per-task; else local")
    add_flag(parser, "max_restarts", type=int, default=0,
             help="restart a failed job from its latest checkpoint up to K times (default 0)")
    add_flag(parser, "bind_address", default=None, metavar="ADDRESS",
             help="the address of this machine the job's directory and services bind (default: the one "
                  "this machine uses to reach the task hosts; loopback for a job on this machine only)")
    add_flag(parser, "port", type=int, default=0,
             help="port of the job's directory, the address every process registers at (default: any free port)")
    add_flag(parser, "insecure", action="store_true",
             help="no CURVE authentication or encryption (debugging; loopback only)")
    add_flag(parser, "no_shm", action="store_true",
             help="stream weights over tcp even between local processes (default: shared memory)")
    add_flag(parser, "job_label", action="append", default=[], metavar="KEY=VALUE",
             help="a label of the job, shown by csctl get jobs (repeatable)")
    add_flag(parser, "trace", action="store_true",
             help="record a timeline of every process; the chief writes model_dir/trace.json (Perfetto)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="python run.py ARGS...")
    ns = parser.parse_args(argv)
    if not ns.command:
        parser.error("no command given (e.g. python examples/fc_mnist/run.py --mode train --params ...)")
    if ns.command[0].startswith("-"):
        parser.error(f"unrecognized argument: {ns.command[0]}")
    for flag in ("num_csx", "num_workers_per_csx", "total_nodes", "tasks_per_node", "cpus_per_task"):
        if getattr(ns, flag) is not None and getattr(ns, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if not 0 <= ns.port <= 65535:
        parser.error(f"--port {ns.port}: a port is 1-65535 (or 0: any free port)")
    if ns.max_restarts < 0:
        parser.error("--max_restarts must be 0 or more")
    ns.job_labels = dict(pair.partition("=")[::2] for pair in ns.job_label)
    if any("=" not in pair for pair in ns.job_label):
        parser.error("--job_label takes KEY=VALUE")
    try:
        check_labels(ns.job_labels)
    except ValueError as exc:
        parser.error(f"--job_label: {exc}")
    return JobOptions(
        command=ns.command, num_csx=ns.num_csx, num_workers_per_csx=ns.num_workers_per_csx, cs_ip=ns.cs_ip,
        launcher=choose_launcher(ns, parser), hostfile=ns.hostfile, hosts=ns.hosts, ssh_options=ns.ssh_options,
        total_nodes=ns.total_nodes, tasks_per_node=ns.tasks_per_node, cpus_per_task=ns.cpus_per_task,
        max_restarts=ns.max_restarts, port=ns.port, insecure=ns.insecure, no_shm=ns.no_shm,
        job_labels=ns.job_labels, trace=ns.trace, bind_address=ns.bind_address, services_node=ns.services_node)


def choose_launcher(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    if ns.hostfile and ns.hosts:
        parser.error("give --hostfile or -H, not both")
    slurm_flags = any(v is not None for v in (ns.total_nodes, ns.tasks_per_node, ns.cpus_per_task))
    launcher = ns.launcher
    if launcher == "auto":
        if ns.hostfile or ns.hosts:
            launcher = "ssh"
        elif remote.in_allocation() or slurm_flags:
            launcher = "slurm"
        else:
            launcher = "local"
    if launcher == "ssh" and not (ns.hostfile or ns.hosts):
        parser.error("--launcher ssh needs --hostfile or -H")
    if launcher != "local" and ns.num_workers_per_csx is not None:
        parser.error(f"--num_workers_per_csx is for local runs; with {launcher} every task after the chief "
                     "is an input worker (set the tasks with --tasks-per-node or slots=N)")
    if launcher == "ssh" and ns.cpus_per_task is not None:
        parser.error("--cpus-per-task is for Slurm; over SSH give each host the slots it can run")
    if ns.services_node is not None and not (launcher == "slurm" and remote.in_allocation()):
        parser.error("--services-node is for jobs inside a Slurm allocation")
    if launcher == "local" and slurm_flags:
        parser.error("--total-nodes, --tasks-per-node and --cpus-per-task need SSH hosts or Slurm")
    return launcher


def main(argv: list[str] | None = None) -> None:
    options = parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging("csrun_wse")
    try:
        # What cannot succeed is said before anything starts: a job too big for this machine,
        # a missing script, then the params and the model (a bad file is said once).
        job.check_fits_host(options)
        checked = precheck.check(options)
        if checked.code is not None and (checked.code != 0 or precheck.runs_nothing(options.command)):
            if checked.code != 0 and options.cs_ip:
                precheck.record_failure(options, checked)
            sys.exit(checked.code)
        code = job.run(options)
    except UserInputError as exc:
        say_error(f"csrun_wse: {exc}")
        code = EXIT_BAD_INPUT
    except KeyboardInterrupt:  # Ctrl-C before the job's supervisor took the signal over
        job.say("interrupted by SIGINT")
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
