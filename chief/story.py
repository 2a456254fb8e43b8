"""What a run tells its user besides the step lines: that it started, how it ended.

    | First step done in 1.2 s (4.5 s after start); at this pace the 200 steps take about 0:00:40
    | Done: 200 steps in 0:00:38; final train loss 0.05556, eval loss 0.21 ...; last checkpoint ...
    | Stopped at step 120 of 200 after 0:00:21 (interrupted by SIGINT); last checkpoint ...; run the same command again to resume

A run's lines go to stdout and to model_dir/run.log (with the chief's log
records), so a run started with `> out.txt` or long finished still has its
story where its checkpoints are. The effective params (after --override and
the model zoo's layouts) are written as model_dir/train/params_<mode>.yaml
(eval/params_eval.yaml for --mode eval), as the model zoo writes them.
"""
from __future__ import annotations

import logging
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import yaml

RUN_LOG = "run.log"
# Between log_steps lines, a progress line at least this often: a step of minutes must not look hung.
PROGRESS_EVERY_S = 30.0


def process_age() -> float:
    """Seconds since this process started (Linux /proc); 0 where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def clock(seconds: float) -> str:
    """0:01:05."""
    seconds = int(round(max(seconds, 0.0)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class RunStory:
    """The run's progress as the user is told it: the trainer updates it, and it says it."""

    def __init__(self, model_dir: Path, started: float | None = None):
        self.model_dir = model_dir
        self.started = time.monotonic() if started is None else started
        self.step = self.max_steps = self.first_step = 0
        self.train_loss: float | None = None
        self.eval_line: str | None = None
        self.last_checkpoint: Path | None = None
        self.last_line = self.started
        self.log_file = None
        self.ended = False

    # ------------------------------------------------------------ where lines go
    def open_log(self, mode: str, argv: list[str]) -> None:
        """model_dir/run.log, appended: a header per run, then its lines and the chief's log records."""
        self.log_file = open(self.model_dir / RUN_LOG, "a", buffering=1)
        self.log_file.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {mode}: {shlex.join(argv)}\n")
        handler = logging.StreamHandler(self.log_file)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        logging.getLogger().addHandler(handler)
        self._handler = handler

    def close_log(self) -> None:
        if self.log_file is not None:
            logging.getLogger().removeHandler(self._handler)
            self.log_file.close()
            self.log_file = None

    def say(self, line: str, stream=None) -> None:
        print(line, file=stream or sys.stdout, flush=True)
        self.last_line = time.monotonic()
        if self.log_file is not None:
            try:
                self.log_file.write(line + "\n")
            except (OSError, ValueError):
                self.log_file = None   # a full disk stops the copy, never the run

    # ------------------------------------------------------------ the run's lines
    def begin_training(self, step: int, max_steps: int) -> None:
        self.step = self.first_step = step
        self.max_steps = max_steps
        self.train_started = time.monotonic()

    def step_done(self, step: int, loss: float) -> None:
        self.step, self.train_loss = step, loss
        if step == self.first_step + 1:
            now = time.monotonic()
            took = now - self.train_started
            steps = self.max_steps - self.first_step
            self.say(f"| First step done in {took:.1f} s ({now - self.started:.1f} s after start); at this pace "
                     f"the {steps} step(s) take about {clock(took * steps)}")

    def progress_due(self) -> bool:
        """A progress line is due by time (none for PROGRESS_EVERY_S)."""
        return time.monotonic() - self.last_line >= PROGRESS_EVERY_S

    def eta(self) -> str:
        done = self.step - self.first_step
        spent = time.monotonic() - self.train_started
        return clock((self.max_steps - self.step) * spent / done) if done else "?"

    def checkpoint_saved(self, path: Path) -> None:
        self.last_checkpoint = path

    def evaluated(self, line: str) -> None:
        self.eval_line = line

    def summary(self, trace_path: Path | None) -> None:
        """The end of a run that finished: what it did and where to look."""
        self.ended = True
        parts = [f"| Done in {clock(time.monotonic() - self.started)}"]
        if self.max_steps:
            parts.append(f"step {self.step} of {self.max_steps}")
        if self.train_loss is not None:
            parts.append(f"final train loss {self.train_loss:.5f}")
        if self.eval_line:
            parts.append(self.eval_line)
        parts.append(f"last checkpoint {self.last_checkpoint}" if self.last_checkpoint else "no checkpoint written")
        self.say("; ".join(parts))
        missing = "" if shutil.which("tensorboard") else " (not installed here: pip install tensorboard)"
        self.say(f"| TensorBoard: tensorboard --logdir {self.model_dir}{missing}")
        if trace_path is not None:
            self.say(f"| Timeline: {trace_path} (https://ui.perfetto.dev)")
        self.say(f"| Log: {self.model_dir / RUN_LOG}")

    def stopped(self, why: str) -> None:
        """The end of a run that did not finish: how far it got and how to go on (stderr)."""
        if self.ended:
            return
        self.ended = True
        where = f"at step {self.step} of {self.max_steps}" if self.max_steps else "before training"
        resume = (f"last checkpoint {self.last_checkpoint}; run the same command again to resume from it"
                  if self.last_checkpoint else "no checkpoint yet: a rerun starts from the beginning")
        self.say(f"| Stopped {where} after {clock(time.monotonic() - self.started)} ({why}); {resume}",
                 stream=sys.stderr)


def write_effective_params(model_dir: Path, mode: str, params: dict) -> Path:
    """model_dir/train/params_<mode>.yaml (eval/ for --mode eval): the params as this run read
    them, checked and filled in, beside that split's TensorBoard files."""
    folder = model_dir / ("eval" if mode == "eval" else "train")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"params_{mode}.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


# The story of the run in this process, for a failure noticed off the main thread (the heartbeat's).
CURRENT: RunStory | None = None


def tell_stopped(reason: str) -> None:
    """Before the process leaves because the job stopped: the step reached and how to resume."""
    if CURRENT is not None:
        CURRENT.stopped(reason.removeprefix("job failed: "))
