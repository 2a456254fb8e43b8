"""csrun_wse's check of a job's params and model before it starts anything.

The user's command runs once, here, with CS_ROLE=precheck: run.py reads and
validates the params (every problem a line, exit 2) and checks the model as
--validate_only does, then exits. Only then are MemoryX, SwarmX, the WSEs and
the workers started, so a bad params file is said once, by the script, and no
worker is blamed for it.

    checked = check(options)              # Checked(code, errors); code None: not checked here
    if checked.code: record_failure(options, checked)   # with cs_ip: csctl shows why
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from cs_runtime import env as cs_env
from cs_runtime.launch.front_door import FrontDoorError, SubmittedJob
from cs_runtime.launch import job
from cs_runtime.launch.job import BadJob, JobOptions
from cs_runtime.wire import auth


@dataclass
class Checked:
    """The check's exit code (None: not checked here) and the error lines it printed."""
    code: int | None
    errors: list[str]


def runs_nothing(command: list[str]) -> bool:
    """Whether the command only validates or compiles (run.py's --validate_only, --compile_only, --mode ...)."""
    args = command[1:]
    modes = {args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--mode", "-m")}
    modes |= {a.split("=", 1)[1] for a in args if a.startswith(("--mode=", "-m="))}
    return bool({"--validate_only", "--compile_only"} & set(args) or {"validate_only", "compile_only"} & modes)


def script_named(command: list[str]) -> str | None:
    """The script of `python [opts] run.py ...` (or an executable script); None for `python -m ...`."""
    if os.path.basename(command[0]).startswith("python"):
        if "-m" in command[1:2] or "-c" in command[1:2]:
            return None
        return next((a for a in command[1:] if not a.startswith("-")), None)
    return command[0]


def missing_here(command: list[str]) -> str | None:
    """What of a command to run on this machine is not there: the program, or python's script."""
    if shutil.which(command[0]) is None:
        return f"{command[0]}: no such command"
    script = script_named(command)
    if os.path.basename(command[0]).startswith("python") and script and not os.path.isfile(script):
        return f"{script}: no such file"
    return None


def local_script(command: list[str]) -> str | None:
    """script_named, if it is on this machine."""
    script = script_named(command)
    return script if script and os.path.isfile(script) else None


def check(options: JobOptions) -> Checked:
    """Run the command once with CS_ROLE=precheck. What it prints is shown when it
    fails or when checking is all the command asked for."""
    if local_script(options.command) is None:
        missing = missing_here(options.command) if job.backend_for(options).tasks_here() else None
        if missing:   # the chief would run here, and fail only once the cluster has started
            raise BadJob(missing)
        return Checked(None, [])   # the script lives on the task hosts only: the chief checks there
    env = {k: v for k, v in os.environ.items() if k not in cs_env.JOB_VARS}
    # The job's systems: the check compiles for them, so it reports the mode the job will run.
    env.update({cs_env.ROLE.name: "precheck", cs_env.TARGET.name: "wse", cs_env.TRACE.name: "0",
                cs_env.NUM_CSX.name: str(options.num_csx),
                cs_env.PRECHECK_HERE.name: "1" if job.backend_for(options).tasks_here() else "0"})
    try:
        done = subprocess.run(options.command, env=env, check=False, capture_output=True, text=True)
    except OSError as exc:
        raise SystemExit(f"csrun_wse: cannot run {options.command[0]}: {exc.strerror}") from None
    if done.returncode != 0 or runs_nothing(options.command):
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
    errors = [line.removeprefix("error: ") for line in (done.stdout + done.stderr).splitlines()
              if line.startswith("error: ") or ": error: " in line]
    return Checked(done.returncode, errors)


def record_failure(options: JobOptions, checked: Checked) -> None:
    """With cs_ip: the job is submitted and ended FAILED at once, its reason the
    params errors, so `csctl get jobs` shows why it never ran."""
    reason = "; ".join(checked.errors) or f"the params check exited {checked.code}"
    with job.job_keys(options.insecure):
        try:
            door = job.open_front_door(options)
        except SystemExit as exc:   # the CS system cannot be reached: the params errors stand alone
            print(f"csrun_wse: {exc}", file=sys.stderr, flush=True)
            return
        try:
            submitted = SubmittedJob(door, options.num_csx, options.job_labels, auth.job_keys())
            submitted.done("FAILED", f"params: {reason}")
            job.say(f"{submitted.name} failed before it started (csctl --cs_ip {options.cs_ip} get jobs)")
        except FrontDoorError as exc:
            job.say(f"the CS system at {options.cs_ip} was not told of the failure: {exc}")
        finally:
            door.close()
