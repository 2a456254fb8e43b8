"""A service whose launcher died cleans up after the job, then exits.

The launcher (csrun_wse, the per-host task wrapper, or a CS system) owns its
job's shared-memory segments and key folder and deletes them when the job
ends. A launcher killed with SIGKILL cannot: its services can. Each service is
started with SIGHUP as its parent-death signal (prctl PR_SET_PDEATHSIG, set by
`launcher.spawn`), where the job's own tasks get SIGKILL; `watch_parent`
makes that SIGHUP mean "the launcher is gone": the service deletes the job's
segments (CS_SHM_DIR) and, when the launcher made it, the job's key folder
(CS_KEYS_DIR, whose launcher.pid names the dead parent), then exits. Its
heartbeat thread checks the parent too (`leave_if_orphaned`), for a signal
that came before the handler was set or that the main thread cannot run yet.
A sibling service that is stopped (SIGSTOP) cannot act on its signal until it
is continued, which nobody will do: the first service to leave kills the
job's other services on this host (found by the CS_JOB_ID and CS_ROLE they
were started with), a stopped one included. Nothing is left for the next
launcher to find.
"""
from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from cs_runtime import env
from cs_runtime.roles import SERVICE_ROLES
from cs_runtime.wire.auth import OWNER_FILE, remove_job_dir
from cs_runtime.wire.shm import remove_job_segments

log = logging.getLogger(__name__)

# What a service gets when its launcher dies (the job's tasks get SIGKILL): catchable, so it
# can clean up; its default action (terminate) still ends a service that has not set its handler.
SERVICE_DEATH_SIGNAL = signal.SIGHUP
EXIT_ORPHANED = 1

_launcher_pid: int | None = None   # set by watch_parent: the parent that started this service


def watch_parent() -> None:
    """From now on, the death of this process's parent makes it clean up and exit."""
    global _launcher_pid
    _launcher_pid = os.getppid()
    signal.signal(SERVICE_DEATH_SIGNAL, _on_parent_death)


def parent_gone() -> bool:
    """Whether the parent `watch_parent` saw has died (this process was handed to another)."""
    return _launcher_pid is not None and os.getppid() != _launcher_pid


def leave_if_orphaned() -> None:
    if parent_gone():
        leave()


def _on_parent_death(_signum, _frame) -> None:
    if parent_gone():   # a stray SIGHUP while the launcher lives is not its death
        leave()


def leave() -> None:
    """Delete what the dead launcher would have deleted, then exit at once."""
    job = env.JOB_ID.get()
    removed = clean_up(job, env.SHM_DIR.get(), env.KEYS_DIR.get(), _launcher_pid)
    killed = kill_sibling_services(job)
    log.debug("the launcher (pid %s) is gone: removed %s, killed %s; exiting", _launcher_pid, removed, killed)
    logging.shutdown()
    os._exit(EXIT_ORPHANED)


def clean_up(job: str, shm_dir: str, keys_dir: str, launcher_pid: int | None) -> str:
    """The job's segments and, if `launcher_pid` made it, its key folder; says what went."""
    gone = []
    if job and shm_dir:
        gone.append(f"{remove_job_segments(Path(shm_dir), job)} segment(s)")
    if keys_dir and launcher_pid is not None and _owner(Path(keys_dir)) == launcher_pid:
        remove_job_dir(Path(keys_dir))
        gone.append(f"key folder {keys_dir}")
    return ", ".join(gone) or "nothing"


def kill_sibling_services(job: str) -> list[int]:
    """SIGKILL every other service process of `job` on this host (a stopped one would stay forever).

    The stopped ones go first: every running service of the job does the same at the same time,
    and two that kill each other before they reach a stopped sibling would leave it for good.
    """
    if not job:
        return []
    siblings = _sibling_services(job)
    killed = []
    for pid in sorted(siblings, key=lambda pid: not _stopped(pid)):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def _sibling_services(job: str) -> list[int]:
    """The other service processes started for `job` (found by the CS_JOB_ID and CS_ROLE they got)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        started_with = _environ(entry)
        if started_with.get(env.JOB_ID.name) == job and started_with.get(env.ROLE.name) in SERVICE_ROLES:
            found.append(int(entry.name))
    return found


def _stopped(pid: int) -> bool:
    """Whether `pid` is stopped (state T) or stopped under a tracer (t)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:][:1] in ("T", "t")   # the name in parentheses may hold spaces


def _environ(proc: Path) -> dict[str, str]:
    """The environment a process was started with (another user's: unreadable, empty)."""
    try:
        raw = (proc / "environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)
    return dict(pairs)


def _owner(folder: Path) -> int | None:
    try:
        return int((folder / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
