"""What `python run.py CPU|CSX ...` does before any role runs (the model zoo's targets).

    python run.py CPU --mode train --params P        # this process: the CPU path
    python run.py CSX --mode train --params P        # becomes: csrun_wse python run.py CSX ...
    python run.py CSX ... --mgmt_address HOST:PORT   # becomes: csrun_wse --cs_ip HOST:PORT ...
    python run.py CSX --mode eval_all ...            # one eval per checkpoint of model_dir

`hand_over(args)` runs in the process the user started (no CS_ROLE):
it names the flags that change nothing here (once, one line; the params keys
not modelled are named by the process that runs the model), sets the
logging level, and for CSX replaces this process by csrun_wse with the same
command (so the job is started, supervised and stopped exactly as csrun_wse
does; the job's processes see CS_ROLE and carry on). It returns an exit code
when it ran the whole command itself (eval_all), else None: go on here.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from cs_runtime import env
from cs_runtime.checkpoint import list_checkpoints
from cs_runtime.run_args import RunArgs


def hand_over(args: RunArgs) -> int | None:
    role = env.ROLE.get()
    # The params keys not modelled, once a run: by the process that runs it (the CPU path, or a job's chief).
    if args.params.not_modelled and (role == "chief" or not role and args.target != "CSX"):
        print(f"{args.params_path}: accepted, not modelled: {'; '.join(args.params.not_modelled)}", file=sys.stderr)
    if role:
        return None   # a process of a job: its launcher already did the rest
    if args.unused_flags:   # once, here, before CSX hands over to csrun_wse
        print(f"run.py: accepted, no effect in the emulator: {', '.join(args.unused_flags)}", file=sys.stderr)
    if args.logging:
        os.environ[env.LOG_LEVEL.name] = args.logging.upper()
    if args.target == "GPU":
        print("run.py: GPU runs on the CPU path here", file=sys.stderr)
    if args.mode == "eval_all":
        return eval_all(args)
    if args.target == "CSX":
        command = csrun_wse_command(args)
        os.execvpe(command[0], command, job_environment(args))
    return None


def csrun_wse_command(args: RunArgs) -> list[str]:
    """csrun_wse with the cluster flags of the model zoo's command line, then this same command."""
    c = args.cluster
    command = [sys.executable, "-m", "cs_runtime.cli.csrun_wse", "--num_csx", str(c["num_csx"])]
    if c["num_workers_per_csx"]:
        command += ["--num_workers_per_csx", str(c["num_workers_per_csx"])]
    if c["mgmt_address"]:
        command += ["--cs_ip", c["mgmt_address"]]
    for label in c["job_labels"]:   # shown by csctl get jobs, on a shared CS system or this machine's
        command += ["--job_label", label]
    return command + [sys.executable, sys.argv[0], "CSX", *args.command_line]


def job_environment(args: RunArgs) -> dict[str, str]:
    """This environment, --python_paths first on PYTHONPATH (the job's processes import from there)."""
    environ = dict(os.environ)
    paths = [os.path.expanduser(p) for p in args.cluster["python_paths"]]
    if paths:
        environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [environ.get("PYTHONPATH")] if p])
    return environ


def eval_all(args: RunArgs) -> int:
    """Evaluate every checkpoint of model_dir, oldest first, each as `--mode eval --checkpoint_path C`
    (the last flag given wins), on the same target; the first failure stops it."""
    found = list_checkpoints(args.model_dir)
    if not found:
        print(f"run.py: --mode eval_all: no checkpoints in {args.model_dir}", file=sys.stderr)
        return 2
    target = [args.target] if args.target else []
    for step, path in found:
        print(f"run.py: eval_all: checkpoint {path} (step {step})", file=sys.stderr)
        code = run_to_end([sys.executable, sys.argv[0], *target, *args.command_line, "--mode", "eval",
                           "--checkpoint_path", str(path)], job_environment(args))
        if code != 0:
            return code
    return 0


def run_to_end(command: list[str], environ: dict[str, str]) -> int:
    """Run a command and wait for it; on Ctrl-C it is asked to stop (SIGINT) and waited for, so a job it
    started is stopped by its own supervisor, never left behind."""
    child = subprocess.Popen(command, env=environ)
    try:
        return child.wait()
    except KeyboardInterrupt:
        if child.poll() is None:
            child.send_signal(signal.SIGINT)
        child.wait()
        return 130
