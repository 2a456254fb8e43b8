"""A model_dir belongs to one run: `model_dir/.run.lock`.

The run that writes a model_dir (the chief, or the CPU path) holds an flock on
this file for as long as it runs, and writes in it who it is (job, pid, host).
A second run in the same folder is refused in one line naming the holder,
instead of both training from step 0 over each other's checkpoints and
TensorBoard files. The kernel drops the flock when its process dies, however
it dies; the holder's line stays in the file, so the next run takes the lock
over and says whose it was. A run that ends normally empties the file.

    lock, taken_over = hold(model_dir, "wsjob-1234abcd")   # ModelDirInUse if another run holds it
    ...
    lock.release()
"""
from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path

from cs_runtime.errors import UserInputError
from cs_runtime.wire.transport import host_name

LOCK_NAME = ".run.lock"
MAX_LOCK_BYTES = 4096   # what a holder writes is a short line: more is not read


class ModelDirInUse(UserInputError):
    """Another live run holds the model_dir."""


@dataclass
class RunLock:
    fd: int
    path: Path

    def release(self) -> None:
        """Empty the file (the run ended: nobody to take over from), then let it go."""
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass   # the lock still goes with the descriptor
        os.close(self.fd)
        self.fd = -1


def hold(model_dir: str | Path, holder: str) -> tuple[RunLock, str | None]:
    """Take model_dir's lock for `holder` (the job), or raise ModelDirInUse naming who has it;
    with the lock, the line that says a dead run's lock was taken over (None if none was)."""
    path = Path(model_dir) / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = _read(fd)
        os.close(fd)
        raise ModelDirInUse(in_use_line(model_dir, who)) from None
    except OSError:
        os.close(fd)
        raise
    previous = _read(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"job": holder, "pid": os.getpid(), "host": host_name()}).encode(), 0)
    taken_over = (f"--model_dir {model_dir}: taking over the lock of {describe(previous)}, which is no longer "
                  "running" if previous else None)
    return RunLock(fd, path), taken_over


def check_free(model_dir: str | Path) -> None:
    """ModelDirInUse if a live run holds model_dir; takes nothing (csrun_wse's check before it starts)."""
    path = Path(model_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return   # no lock file, or none we can read: the chief's hold() decides
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ModelDirInUse(in_use_line(model_dir, _read(fd))) from None
    finally:
        os.close(fd)


def in_use_line(model_dir, who: dict | None) -> str:
    return (f"--model_dir {model_dir} is in use by {describe(who)}; wait for that run to end, "
            "or give this one another --model_dir")


def describe(who: dict | None) -> str:
    """'wsjob-... (pid N on host)', from what a holder wrote."""
    if not who:
        return "another run"
    return f"{_clean(who.get('job')) or 'a run'} (pid {_clean(who.get('pid'))} on {_clean(who.get('host'))})"


def _clean(value) -> str:
    """A field of the file as printable text (the file is anyone's who can write the folder)."""
    return "".join(c for c in str(value if value is not None else "?")[:80] if c.isprintable())


def _read(fd: int) -> dict | None:
    try:
        who = json.loads(os.pread(fd, MAX_LOCK_BYTES, 0) or b"null")
    except (OSError, ValueError):
        return None
    return who if isinstance(who, dict) else None
