"""Restart a failed job from its latest checkpoint, up to K times (csrun_wse --max_restarts K).

A restart is of the whole job: every process is stopped, a fresh cluster is
started, and the chief resumes from the newest complete checkpoint in its
model_dir (CS_RESTART tells it to prefer that over --checkpoint_path). Batches
are a pure function of the step and a checkpoint holds weights, optimizer
state and the input position, so the final weights equal those of a run that
never failed. Not restarted: a clean exit, Ctrl-C, and failures a restart
would only repeat (a process that exits with EXIT_BAD_INPUT: bad params, a
missing data file, a bad sample, a checkpoint of another model, a full or
read-only disk).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

from cs_runtime import env

RESTART_ENV = env.RESTART.name   # the restart number, set for the job's processes


@dataclass
class Outcome:
    code: int               # the launcher's exit code for this attempt
    retryable: bool = True  # False: a restart would fail the same way


def run_with_restarts(run_once: Callable[[int], Outcome], max_restarts: int) -> int:
    """Call run_once(0), then run_once(1..K) while it fails retryably; the last exit code."""
    outcome = run_once(0)
    restarts = 0
    while outcome.code != 0 and outcome.retryable and restarts < max_restarts:
        restarts += 1
        _say(f"restarting the whole job from the latest checkpoint (restart {restarts} of {max_restarts})")
        outcome = run_once(restarts)
    if outcome.code != 0 and restarts and outcome.retryable:
        _say(f"giving up after {restarts} restart(s)")
    return outcome.code


def _say(line: str) -> None:
    print(f"csrun: {line}", file=sys.stderr, flush=True)
