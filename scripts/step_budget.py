"""Where a step's CPU goes: every process of one job, thread by thread, in steady state.

    python scripts/step_budget.py [--mode weight_streaming|pipelined|cpu] [--num_csx N]
                                  [--preset small] [--window 10] [--insecure]

Starts one FC-MNIST job of the bench's preset (scripts/bench.py) with many steps, waits
until it has run --settle steps, reads every process's and thread's CPU time (user and
system, /proc/PID/task/TID/stat: Linux) at the start and the end of a window of
--window seconds, counts the steps in between from the chief's progress lines, stops
the job, and prints the CPU ms a step of each role and of its threads (main: the
role's Python; ZMQbg/IO: ZeroMQ's I/O thread, where CURVE encrypts and decrypts;
other Python threads by name). Start-up and compilation are outside the window, so
this is the steady state the bench's "a run less a shorter one" also measures, per
role. CPU time, not wall time: on a shared machine it is the figure to trust, though a
loaded machine costs each wake-up more (cold caches).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the presets and the params files)

TICKS = os.sysconf("SC_CLK_TCK")
STEP_RE = re.compile(r"Step=(\d+)")


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (the launcher starts every role itself)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                found.append(int(entry))
    return found


def role_of(pid: int, launcher: int) -> str:
    if pid == launcher:
        return "launcher"
    try:
        environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                       if "=" in item)
        cmdline = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return "gone"
    role = environ.get("CS_ROLE") or (cmdline[2] if len(cmdline) > 2 and cmdline[1] == "-m" else "helper")
    role = role.rsplit(".", 1)[-1]
    rank = environ.get("CS_RANK")
    return f"{role}{rank}" if rank is not None and role in ("wse", "worker") else role


def cpu_by_thread(launcher: int) -> dict[tuple[str, int, str], float]:
    """(role, thread id, thread name) -> CPU seconds so far, for the launcher and its children."""
    seconds = {}
    for pid in [launcher, *children(launcher)]:
        role = role_of(pid, launcher)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:
                continue
            name = "main" if int(tid) == pid else stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            seconds[(role, int(tid), name)] = (int(fields[11]) + int(fields[12])) / TICKS
    return seconds


def last_step(log: Path) -> int:
    steps = STEP_RE.findall(log.read_text(errors="replace"))
    return int(steps[-1]) if steps else 0


def measure(launcher_cmd: list[str], params: Path, folder: Path, settle: int, window: float) -> tuple[int, dict]:
    log = folder / "job.log"
    with open(log, "w") as out:
        job = subprocess.Popen([*launcher_cmd, sys.executable, str(bench.FC_MNIST), "--mode", "train",
                                "--params", str(params), "--model_dir", str(folder / "model")],
                               stdout=out, stderr=subprocess.STDOUT)
        try:
            while last_step(log) < settle:
                if job.poll() is not None:
                    raise SystemExit(f"step_budget: the job ended before step {settle}:\n{log.read_text()[-2000:]}")
                time.sleep(0.5)   # polling a log file for progress, not synchronising with it
            first, before = last_step(log), cpu_by_thread(job.pid)
            time.sleep(window)
            steps, after = last_step(log) - first, cpu_by_thread(job.pid)
        finally:
            job.terminate()
            job.wait()
    return steps, {key: after[key] - before[key] for key in after if key in before}


def report(steps: int, used: dict) -> None:
    roles: dict[str, dict[str, float]] = {}
    for (role, _, name), seconds in used.items():
        threads = roles.setdefault(role, {})
        threads[name] = threads.get(name, 0.0) + 1000 * seconds / steps
    print(f"{steps} steps in the window; CPU ms a step")
    print(f"{'process':<12}{'total':>8}  threads")
    for role, threads in sorted(roles.items(), key=lambda kv: -sum(kv[1].values())):
        shown = "  ".join(f"{name} {ms:.2f}" for name, ms in sorted(threads.items(), key=lambda kv: -kv[1])
                          if ms >= 0.005)
        print(f"{role:<12}{sum(threads.values()):>8.2f}  {shown}")
    print(f"{'job':<12}{sum(sum(t.values()) for t in roles.values()):>8.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("weight_streaming", "pipelined", "cpu"), default="weight_streaming")
    parser.add_argument("--num_csx", type=int, default=1)
    parser.add_argument("--preset", choices=sorted(p for p in bench.PRESETS if p != "transformer"),
                        default="small")
    parser.add_argument("--settle", type=int, default=200, help="steps run before the window opens")
    parser.add_argument("--window", type=float, default=10.0, help="seconds measured")
    parser.add_argument("--insecure", action="store_true", help="without CURVE (csrun_wse --insecure)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cs_budget_") as tmp:
        folder = Path(tmp)
        strategy = "weight_streaming" if args.mode == "cpu" else args.mode
        params = bench.write_params(folder, bench.PRESETS[args.preset], 1_000_000, strategy)
        if args.mode == "cpu":
            launcher = [str(bench.BIN / "csrun_cpu")]
        else:
            launcher = [str(bench.BIN / "csrun_wse"), "--num_csx", str(args.num_csx),
                        *(["--insecure"] if args.insecure else [])]
        steps, used = measure(launcher, params, folder, args.settle, args.window)
    if steps <= 0:
        raise SystemExit("step_budget: no step ended in the window; give a longer --window")
    print(f"preset={args.preset} mode={args.mode} num_csx={args.num_csx}"
          f"{' insecure' if args.insecure else ''}")
    report(steps, used)


if __name__ == "__main__":
    main()
