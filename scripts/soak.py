"""Soak: many short jobs back to back and in parallel; reports what leaked.

    python scripts/soak.py                      # about 3 minutes
    python scripts/soak.py --minutes 10 --parallel 3

Each round runs one job in this process (csrun_wse's own main, so a leak in
the launcher's code, a socket, a thread, a ZAP handler, shows up here as file
descriptors or threads that stay) while `--parallel` more run beside it as
csrun_wse processes. Every third job has a non-chief process killed with
SIGKILL once it trains and must recover with --max_restarts 1; every fifth
runs on 2 WSEs. Every job must exit 0 with the final weights of the CPU path.
At the end: jobs run, failures, leaked processes (anything still running
from a soak job), leaked file descriptors and threads of this process, and
leaked job key folders. Exit code 0 only if everything but the first is zero.
Not part of the test suite (it takes minutes); run it before a release.

    python scripts/soak.py --faults [--seed N]  # the chaos test's faults (scripts/chaos.py)

With --faults every job beside the in-process one gets a fault drawn from the
seed (printed; N, N+1, ... for the jobs in order): kill -9 or SIGSTOP of a
random role (the launcher included) at a random step, a rogue peer at every
port, or a full disk, with or without --max_restarts 1; each must end as
scripts/chaos.py says (bit-identical to the CPU path, or one line and its
exit code) and leave no process, segment or key folder behind.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts import chaos  # noqa: E402
from tests.cluster_utils import (FC_MNIST, TOL, final_weights, relative_error, run_cpu, tool,  # noqa: E402
                                 train_losses, write_params)

FAULT_ROLES = {"wse": "-m wse", "memoryx": "-m cs_runtime.memoryx", "swarmx": "-m cs_runtime.swarmx",
               "worker": "-m worker "}


def job_args(index: int, params: Path, model_dir: Path) -> list[str]:
    args = ["--max_restarts", "1"] if index % 3 == 0 else []
    if index % 5 == 0:
        args += ["--num_csx", "2"]
    return [*args, sys.executable, FC_MNIST, "--mode", "train", "--params", str(params),
            "--model_dir", str(model_dir)]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def processes_mentioning(text: str) -> list[int]:
    found = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            if text in Path(cmdline).read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(cmdline.split("/")[2]))
        except OSError:
            pass
    return [pid for pid in found if pid != os.getpid()]


def kill_one_role(log_path: Path, model_dir: Path, stop: threading.Event) -> None:
    """Once the job trains, SIGKILL one of its non-chief processes (found by job id)."""
    pattern = random.choice(sorted(FAULT_ROLES.values()))
    while not stop.is_set():
        if log_path.exists() and "| Train" in log_path.read_text(errors="replace"):
            chief = [p for p in processes_mentioning(str(model_dir)) if "-m chief" in _args(p)]
            job = _env(chief[0]).get("CS_JOB_ID") if chief else None
            for pid in processes_mentioning(pattern) if job else []:
                if _env(pid).get("CS_JOB_ID") == job:
                    os.kill(pid, signal.SIGKILL)
                    return
        stop.wait(0.05)


def _args(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _env(pid: int) -> dict:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


@contextlib.contextmanager
def output_to(path: Path):
    """Send fd 1 and 2 (ours and our children's) to `path` for the duration."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, target in zip(saved, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)


def run_in_process(args: list[str], log_path: Path) -> int:
    from cs_runtime.cli import csrun_wse
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with output_to(log_path):
        try:
            csrun_wse.main(args)
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    return code


def check_job(index: int, code: int, model_dir: Path, oracle: dict, log_path: Path) -> str:
    if code != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] if log_path.exists() else []
        return f"job {index}: exit code {code}: {tail}"
    got = final_weights(model_dir)
    bad = [name for name in oracle if relative_error(got[name], oracle[name]) >= TOL]
    return f"job {index}: final weights differ from the CPU path: {bad}" if bad else ""


def folder_owner(folder: str) -> int | None:
    """The pid of the launcher that made a key folder (auth's launcher.pid)."""
    try:
        return int(Path(folder, "launcher.pid").read_text())
    except (OSError, ValueError):
        return None


def draw_soak_fault(seed: int, steps: int) -> "chaos.Fault":
    """The seed's fault, redrawn from the next seeds while it is a full disk this host cannot make."""
    while True:
        fault = chaos.draw_fault(seed, max_steps=steps)
        if fault.kind != "full_disk" or not chaos.full_disk_missing():
            return fault
        seed += 1


class FaultedJob(threading.Thread):
    """One job with a chaos fault, run and judged beside the others; `problem` says what went wrong."""

    def __init__(self, index: int, fault, params: Path, model_dir: Path, losses, weights):
        super().__init__(name=f"fault-{index}", daemon=True)
        self.index, self.fault, self.params, self.model_dir = index, fault, params, model_dir
        self.losses, self.weights, self.problem, self.report = losses, weights, "", ""
        self.launcher_pid = 0

    def run(self) -> None:
        outcome = chaos.run_with_fault(self.fault, self.params, self.model_dir)
        self.launcher_pid = outcome.launcher_pid
        problems = chaos.judge(self.fault, outcome, self.losses, self.weights)
        if problems:
            self.problem = f"job {self.index} ({self.fault}): {'; '.join(problems)}"
        self.report = f"soak: job {self.index}: {self.fault}: {'; '.join(problems) or 'ended as it must'}"


def start_faulted(index, fault, params, model_dir, losses, weights) -> FaultedJob:
    job = FaultedJob(index, fault, params, model_dir, losses, weights)
    job.start()
    return job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--parallel", type=int, default=2, help="subprocess jobs beside the in-process one")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--faults", action="store_true", help="a chaos fault for every job beside the in-process one")
    parser.add_argument("--seed", type=int, default=None, help="with --faults: the first fault's seed (default: random)")
    args = parser.parse_args(argv)
    seed = random.SystemRandom().randrange(10**6) if args.seed is None else args.seed
    if args.faults:
        print(f"soak: faults from seed {seed} (replay: --faults --seed {seed})", flush=True)
        missing = chaos.full_disk_missing()
        if missing:
            print(f"soak: no full-disk faults here: {missing}", flush=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    keys_before = set(glob.glob(os.path.join(tempfile.gettempdir(), "csjob-*")))
    with tempfile.TemporaryDirectory(prefix="cs_soak_") as tmp:
        tmp = Path(tmp)
        params = write_params(tmp, runconfig={"max_steps": args.steps, "log_steps": 5, "checkpoint_steps": 10})
        cpu = run_cpu(params, tmp / "cpu")
        if cpu.returncode != 0:
            raise SystemExit(f"soak: the CPU run failed:\n{cpu.stderr[-2000:]}")
        oracle = final_weights(tmp / "cpu")
        oracle_losses = train_losses(tmp / "cpu")
        fds_before, threads_before = open_fds(), threading.active_count()
        deadline = time.monotonic() + args.minutes * 60
        jobs, failures, rounds, restarts, faulted = 0, [], 0, 0, []
        launchers = {os.getpid()}   # whose key folders count as ours (others may run jobs beside the soak)
        while time.monotonic() < deadline:
            rounds += 1
            stop = threading.Event()
            procs, killers = [], []
            for slot in range(args.parallel + 1):
                index = jobs + slot
                model_dir, log_path = tmp / f"job{index}", tmp / f"job{index}.log"
                if args.faults and slot:
                    fault = draw_soak_fault(seed, args.steps)
                    seed += 1
                    faulted.append(start_faulted(index, fault, params, tmp / f"job{index}" / "disk" / "m",
                                                 oracle_losses, oracle))
                    continue
                if index % 3 == 0 and not args.faults:
                    killer = threading.Thread(target=kill_one_role, args=(log_path, model_dir, stop), daemon=True)
                    killer.start()
                    killers.append(killer)
                if slot:
                    log = open(log_path, "w")
                    procs.append((index, model_dir, log_path, log,
                                  subprocess.Popen([tool("csrun_wse"), *job_args(index, params, model_dir)],
                                                   stdout=log, stderr=subprocess.STDOUT)))
            in_process = jobs
            code = run_in_process(job_args(in_process, params, tmp / f"job{in_process}"),
                                  tmp / f"job{in_process}.log")
            results = [(in_process, code, tmp / f"job{in_process}", tmp / f"job{in_process}.log")]
            for index, model_dir, log_path, log, proc in procs:
                results.append((index, proc.wait(timeout=600), model_dir, log_path))
                launchers.add(proc.pid)
                log.close()
            for thread in faulted:
                thread.join()
                launchers.add(thread.launcher_pid)
                print(thread.report, flush=True)   # here, not from the thread: fd 1 was the in-process job's log
                if thread.problem:
                    failures.append(thread.problem)
            jobs += len(faulted)
            faulted = []
            stop.set()
            for killer in killers:
                killer.join()
            for index, code, model_dir, log_path in results:
                restarts += "restarting the whole job" in log_path.read_text(errors="replace")
                problem = check_job(index, code, model_dir, oracle, log_path)
                if problem:
                    failures.append(problem)
            jobs += len(results)
            print(f"soak: round {rounds}: {jobs} jobs, {len(failures)} failures", flush=True)
        leaked = processes_mentioning(str(tmp))
        fds_after, threads_after = open_fds(), threading.active_count()
    keys_left = {folder for folder in set(glob.glob(os.path.join(tempfile.gettempdir(), "csjob-*"))) - keys_before
                 if folder_owner(folder) in launchers}
    print(f"soak: jobs run {jobs} ({args.parallel + 1} at a time; {restarts} recovered from a kill -9 by a restart), "
          f"failures {len(failures)}, leaked processes {len(leaked)}, "
          f"leaked file descriptors {fds_after - fds_before}, leaked threads {threads_after - threads_before}, "
          f"leaked key folders {len(keys_left)}")
    for problem in failures:
        print(f"soak: {problem}")
    for pid in leaked:
        print(f"soak: leaked pid {pid}: {_args(pid)[:200]}")
        os.kill(pid, signal.SIGKILL)
    clean = not (failures or leaked or keys_left or fds_after != fds_before or threads_after != threads_before)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
