"""The jobs this user runs on this machine without a shared CS system, for csctl.

On the real system every job goes through the cluster's management, so
`csctl get jobs` lists it and `csctl cancel job ID` stops it from any shell.
A job here without --cs_ip (csrun_wse, a cstorch CSX backend, run.py CSX)
has a CS system of its own instead, so it writes itself into a registry
only its user can read or write: a folder, mode 0700, under the user's
runtime folder ($XDG_RUNTIME_DIR/cs_emulator/jobs, else
~/.cs_emulator/jobs), one JSON file per job named for it (wsjob-N). The
entry holds the process that runs the job (its launcher, or the user's
process for a cstorch job) and that process's start time, so a reused pid
is never taken for it. `csctl cancel job` sends that process SIGTERM,
on which both stop the job as on Ctrl-C (launcher.Supervisor,
cs_torch.Session). The job removes its entry when it ends; an entry whose
process is gone is dropped when read. Every entry is checked before
anything acts on it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cs_runtime.errors import CsError
from cs_runtime.launch.front_door import user_dir, user_name
from cs_runtime.wire.protocol import JOB_NAME, check_labels

MAX_ENTRY_BYTES = 64 * 1024
MAX_TRIES = 1000    # names to try when other jobs take them at the same moment


class LocalJobError(CsError, RuntimeError):
    """A local job that cannot be listed, found or stopped: one line."""


def registry_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "cs_emulator" if runtime and os.path.isdir(runtime) else user_dir()
    return base / "jobs"


def _private_dir() -> Path:
    """The registry folder, made if missing; refused unless it is this user's alone."""
    folder = registry_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise LocalJobError(f"{folder} must be a folder of this user's only (mode 0700): it lists and stops jobs")
    return folder


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


JOB_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass
class LocalJob:
    name: str      # what csctl shows and takes (wsjob-N)
    job_id: str    # the job's own id (its processes' CS_JOB_ID, its segments' names)
    pid: int
    pid_start: int
    started: float
    num_csx: int
    user: str
    labels: dict = field(default_factory=dict)

    def alive(self) -> bool:
        return process_start(self.pid) == self.pid_start

    def row(self, now: float) -> dict:
        """The job as csctl lists a CS system's jobs."""
        return {"name": self.name, "age_s": now - self.started, "duration_s": now - self.started,
                "phase": "RUNNING", "systems": [f"cs{i}" for i in range(self.num_csx)], "user": self.user,
                "labels": dict(self.labels), "reason": ""}


def _checked(data, source: str) -> LocalJob:
    """An entry read from the registry, each field checked; LocalJobError naming what is wrong."""
    kinds = {"name": str, "job_id": str, "pid": int, "pid_start": int, "started": (int, float),
             "num_csx": int, "user": str, "labels": dict}
    if not isinstance(data, dict) or set(data) != set(kinds):
        raise LocalJobError(f"{source}: not a job entry (fields {sorted(kinds)})")
    for key, kind in kinds.items():
        if isinstance(data[key], bool) or not isinstance(data[key], kind):
            raise LocalJobError(f"{source}: {key} must be of type {getattr(kind, '__name__', 'number')}")
    if not JOB_NAME.match(data["name"]) or not JOB_ID.match(data["job_id"]) or data["pid"] <= 1 \
            or data["num_csx"] < 1:
        raise LocalJobError(f"{source}: name, job_id, pid or num_csx out of range")
    check_labels(data["labels"], lambda why: LocalJobError(f"{source}: {why}"))
    return LocalJob(**data)


def _read(path: Path) -> LocalJob:
    try:
        if path.stat().st_size > MAX_ENTRY_BYTES:
            raise LocalJobError(f"{path}: larger than {MAX_ENTRY_BYTES} bytes")
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LocalJobError(f"{path}: unreadable ({type(exc).__name__})") from None
    job = _checked(data, str(path))
    if path.name != f"{job.name}.json":
        raise LocalJobError(f"{path}: holds job {job.name}")
    return job


def _number(path: Path) -> int:
    return int(path.stem.split("-", 1)[1])


def register(job_id: str, num_csx: int, labels: dict | None = None) -> LocalJob:
    """This process's job, written into the registry under a name no live entry has (wsjob-N)."""
    folder = _private_dir()
    pid = os.getpid()
    job = LocalJob("", job_id, pid, process_start(pid) or 0, time.time(), num_csx, user_name(), dict(labels or {}))
    taken = [_number(p) for p in folder.glob("wsjob-*.json") if JOB_NAME.match(p.stem)]
    number = max(taken, default=0) + 1
    for _ in range(MAX_TRIES):
        job.name = f"wsjob-{number}"
        try:
            fd = os.open(folder / f"{job.name}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            number += 1
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(job), f)
        return job
    raise LocalJobError(f"{folder}: no free job name after {MAX_TRIES} tries")


def unregister(job: LocalJob) -> None:
    (registry_dir() / f"{job.name}.json").unlink(missing_ok=True)


def jobs() -> list[LocalJob]:
    """This user's jobs running on this machine, oldest first; entries of ended processes are dropped."""
    folder = registry_dir()
    if not folder.is_dir():
        return []
    _private_dir()
    found = []
    for path in sorted(folder.glob("wsjob-*.json"), key=lambda p: (len(p.name), p.name)):
        job = _read(path)
        if job.alive():
            found.append(job)
        else:
            path.unlink(missing_ok=True)
    return found


def find(name: str) -> LocalJob:
    for job in jobs():
        if job.name == name:
            return job
    raise LocalJobError(f"no job {name} of this user on this machine (csctl get jobs lists them)")


def cancel(name: str) -> LocalJob:
    """Stop the job as Ctrl-C would: its process stops every process of the job and removes the entry."""
    job = find(name)
    try:
        os.kill(job.pid, signal.SIGTERM)
    except ProcessLookupError:
        raise LocalJobError(f"{name} ended before it could be cancelled") from None
    return job


def label(name: str, labels: dict) -> LocalJob:
    job = find(name)
    check_labels({**job.labels, **labels}, LocalJobError)
    job.labels.update(labels)
    path = registry_dir() / f"{job.name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(job)))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return job

