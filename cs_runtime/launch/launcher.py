"""Starting, watching and stopping the processes of a job.

`ProcessGroup` starts each process in its own session (so a Ctrl-C reaches
only the launcher, which then stops everything in order) and with a
parent-death signal (so even a `kill -9` of the launcher takes its children
with it: a task at once, a service once it has deleted the job's segments and
key folder, see orphan.py). `Supervisor` runs the launcher's loop: it serves the directory,
watches exit codes and heartbeats, and on the first failure marks the job
failed (every heartbeat answer then tells the processes to stop), stops the
group and reports one line naming the role and host that failed.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from cs_runtime.errors import CsError
from cs_runtime import env as cs_env
from cs_runtime.roles import SERVICE_ROLES
from cs_runtime.launch.directory import DirectoryServer, register_timeout
from cs_runtime.process.directory_client import EXIT_DIRECTORY_LOST, HEARTBEAT_TIMEOUT
from cs_runtime.process.orphan import SERVICE_DEATH_SIGNAL
from cs_runtime.errors import EXIT_BAD_INPUT
from cs_runtime.wire.transport import host_name

log = logging.getLogger(__name__)

FINISH_GRACE_S = 3.0  # after the chief's exit 0, how long the others get to exit by themselves
CHECK_INTERVAL_S = 0.2  # how often the supervisor looks at every task (exit codes, heartbeats)
CARRIER_GRACE_S = 10.0  # after its tasks, how long a carrier (srun, ssh) gets to end by itself
# A turn of the supervisor's loop takes milliseconds; one this long means the launcher itself
# was stopped (SIGSTOP, a suspended terminal) or starved, and its processes heard nothing meanwhile.
STALL_S = 2.0
# How long a process waits for its directory's answer before it exits (process.directory_client.Heartbeat).
DIRECTORY_PATIENCE_S = 2 * HEARTBEAT_TIMEOUT

PR_SET_PDEATHSIG = 1


# BLAS/OpenMP thread variables: the WSEs split the host's cores between them;
# every other process does no heavy linear algebra and gets one thread, so
# idle BLAS threads never spin on a core a WSE is computing on.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def numerics_env(env: dict, threads: int) -> dict:
    """env for a process of the job, with what its numerics run under: the BLAS thread count
    (unless the user set it for the job), with more than one thread OpenBLAS's short spin, and
    the allocator's settings (cs_runtime/env.py; each unless set)."""
    env = {**env, **{k: str(threads) for k in THREAD_VARS if k not in os.environ}}
    return cs_env.with_numerics_defaults(env, threaded=threads > 1)



def _die_with_parent(death_signal: int) -> None:
    """Runs in the child before exec: `death_signal` to it when the launcher dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, death_signal)
    except OSError:
        pass  # not Linux: heartbeats still stop orphans within seconds


@dataclass
class Task:
    role: str
    rank: int
    host: str
    proc: subprocess.Popen

    @property
    def label(self) -> str:
        return f"{self.role} {self.rank} on {self.host} (pid {self.proc.pid})"

    def request_stop(self) -> None:
        """Ask the process to end; `stop_all` kills it if it has not after the grace period."""
        _signal_group(self.proc, signal.SIGTERM)

    def kill(self) -> None:
        _signal_group(self.proc, signal.SIGKILL)

    def settle(self, timeout: float) -> None:
        """Wait for whatever carries the task once the task itself has ended (nothing, here)."""

    def ended_how(self, rc: int) -> str:
        """How the task ended, for the launcher's one line."""
        return f"exited with {describe_exit(rc)}"


def spawn(argv: list[str], env: dict[str, str], death_signal: int = signal.SIGKILL, **popen_args) -> subprocess.Popen:
    """A child in its own session that gets `death_signal` when the launcher dies: SIGKILL for a
    task, SERVICE_DEATH_SIGNAL for a service, which then cleans up after the job (orphan.py)."""
    return subprocess.Popen(argv, env=env, start_new_session=True,
                            preexec_fn=functools.partial(_die_with_parent, death_signal), **popen_args)


# What the launcher holds open per task: two connections to its directory (the task's
# client and its heartbeat) and, over SSH, the pipe to the host's carrier; with room to spare.
FDS_PER_TASK = 4
FDS_BASE = 256    # the launcher's own: the Python runtime, ZeroMQ's threads, the services' sockets


def check_file_limit(tasks: int) -> None:
    """Raise the soft RLIMIT_NOFILE to what `tasks` need (up to the hard limit), or say
    in one line that it cannot be, before a single process starts."""
    import resource
    need = FDS_BASE + FDS_PER_TASK * tasks
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise SystemExit(f"csrun_wse: {tasks} task(s) need about {need} open files here but the limit is "
                         f"{soft} (hard limit {hard}); raise it (ulimit -n {need}) or run fewer tasks")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


class ProcessGroup:
    def __init__(self):
        self.tasks: list[Task] = []

    def start(self, role: str, rank: int, argv: list[str], env: dict[str, str],
              host: str | None = None) -> Task:
        death_signal = SERVICE_DEATH_SIGNAL if role in SERVICE_ROLES else signal.SIGKILL
        task = self.add(Task(role, rank, host or host_name(), spawn(argv, env, death_signal)))
        log.debug("started %s: %s", task.label, " ".join(argv))
        return task

    def add(self, task: Task) -> Task:
        self.tasks.append(task)
        return task

    def exited(self) -> list[tuple[Task, int]]:
        return [(t, t.proc.returncode) for t in self.tasks if t.proc.poll() is not None]

    def stop_all(self, grace: float = 3.0) -> None:
        """SIGTERM every live process, SIGKILL what is left after `grace` seconds."""
        live = [t for t in self.tasks if t.proc.poll() is None]
        for task in live:
            task.request_stop()
        deadline = time.monotonic() + grace
        for task in live:
            try:
                task.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                task.kill()
                task.proc.wait()
        for task in self.tasks:  # srun ends its step COMPLETED only when nobody has to kill it
            task.settle(max(0.0, deadline - time.monotonic()) + CARRIER_GRACE_S)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the child and anything it started
    except (ProcessLookupError, PermissionError):
        pass


def registration_overdue(directory: DirectoryServer, tasks: list[Task], started: float,
                         ended: set = frozenset(), now: float | None = None) -> str | None:
    """One line naming the first of `tasks` that has not registered with `directory` within
    register_timeout(len(tasks)) of `started` (a task that has already ended is not waited
    for), or None: the launcher's and the CS system's deadline, scaled to the job's size."""
    timeout = register_timeout(len(tasks))
    if (time.monotonic() if now is None else now) - started <= timeout:
        return None
    for task in tasks:
        if (task.role, task.rank) not in directory.peers and (task.role, task.rank) not in ended:
            return f"{task.label} did not register within {timeout:.0f} s"
    return None


class JobFailed(CsError, RuntimeError):
    """A process of the job failed or stopped answering, or the job was interrupted or ended by
    its CS system; the message names which. The supervisor raises it (a restart may help unless
    `retryable` is False); cs_torch.Session raises it from the step that met it. `code`: the
    launcher's exit code (EXIT_BAD_INPUT when a process said its input is bad)."""

    def __init__(self, reason: str, retryable: bool = True, code: int = 1):
        super().__init__(reason)
        self.retryable, self.code = retryable, code


class Supervisor:
    """The launcher's main loop over one directory and one process group."""

    def __init__(self, directory: DirectoryServer, group: ProcessGroup, finisher_role: str | None,
                 handle_signals: bool = True):
        self.directory, self.group = directory, group
        self.finisher_role = finisher_role  # the role whose exit 0 ends the job (the chief)
        self.started = time.monotonic()
        self.interrupted = ""
        self.signal = 0  # the signal that interrupted the launcher: its exit code is then 128 + it
        self.failure: JobFailed | None = None
        self.stalled_s = 0.0   # the launcher's longest stall (its own loop not running), if any
        self._last_turn = time.monotonic()
        # Set when the chief runs in the launcher's own process (cs_torch.Session): it ends the job.
        self.finish_requested = False
        self.all_registered = False   # every task registered: no need to look at each again
        if handle_signals:  # a launcher process; in a user's process Ctrl-C stays the user's
            signal.signal(signal.SIGINT, self._on_signal)
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.interrupted = f"interrupted by {signal.Signals(signum).name}"
        self.signal = signum

    def run(self, extra_check=None) -> int:
        """Serve until the finisher exits 0 (returns 0) or anything fails (returns the failure's
        code: 1, or 2 for bad input; 128 + N when signal N interrupted the launcher: 130 for
        Ctrl-C, as a shell reports it)."""
        next_check = 0.0
        try:
            while True:
                self.directory.serve_once(100)
                self._notice_stall()   # before any check: a stall explains what the checks find
                if time.monotonic() < next_check:
                    continue  # heartbeats first: the checks below look at every task
                next_check = time.monotonic() + CHECK_INTERVAL_S
                exited = self.group.exited()
                if self._finished(exited):
                    self._let_finish(FINISH_GRACE_S)
                    return 0
                self._check(exited)
                if extra_check is not None:
                    extra_check()
        except JobFailed as failure:
            self.failure = failure
            self.directory.failure = str(failure)
            # The line first (the fault is known now), then a moment for remote processes to hear.
            # An interruption is the user's wish, not a failure; the chief then says how far the run got.
            print(f"csrun: job {'stopped' if self.signal else 'failed'}: {failure}", file=sys.stderr, flush=True)
            self._drain_status(1.0)
            return 128 + self.signal if self.signal else failure.code
        finally:
            self.group.stop_all()
            self.directory.close()

    def _notice_stall(self) -> None:
        """A long gap between two turns is the launcher's own stall: peers' silence across it is forgiven."""
        now = time.monotonic()
        gap, self._last_turn = now - self._last_turn, now
        if gap > STALL_S:
            self.stalled_s = max(self.stalled_s, gap)
            self.directory.forgive_silence()
            log.info("the launcher was stopped or stalled for %.1f s", gap)

    def _finished(self, exited: list[tuple[Task, int]]) -> bool:
        return self.finish_requested or any(t.role == self.finisher_role and rc == 0 for t, rc in exited)

    def _check(self, exited: list[tuple[Task, int]]) -> None:
        if self.interrupted:
            raise JobFailed(self.interrupted, retryable=False)
        # A process killed by a signal is the cause; exits with an error code
        # seen at the same time are usually its peers reacting to it.
        # Bad input next: it is what the other exits react to, and it must not be restarted.
        # Last, a process that exited because the launcher stopped answering: it only reacted.
        failed = sorted((rc for rc in exited if rc[1] != 0),
                        key=lambda t: (t[1] == EXIT_DIRECTORY_LOST, t[1] >= 0, t[1] != EXIT_BAD_INPUT))
        if failed:
            task, rc = failed[0]
            if rc == EXIT_DIRECTORY_LOST:
                raise JobFailed(self._lost_launcher(task))
            bad_input = rc == EXIT_BAD_INPUT
            raise JobFailed(f"{task.label} {task.ended_how(rc)}", retryable=not bad_input,
                            code=EXIT_BAD_INPUT if bad_input else 1)
        ended = {(t.role, t.rank) for t, _ in exited}
        timeout = register_timeout(len(self.group.tasks))
        for peer in self.directory.silent_peers(HEARTBEAT_TIMEOUT, first_timeout=timeout):
            if (peer.role, peer.rank) in ended:
                continue  # exited cleanly (a worker that finished its plan)
            raise JobFailed(f"{peer.role} {peer.rank} on {peer.host} (pid {peer.pid}) stopped "
                            f"answering (no heartbeat for {HEARTBEAT_TIMEOUT:.0f} s)")
        if not self.all_registered:
            now = time.monotonic()
            overdue = registration_overdue(self.directory, self.group.tasks, self.started, ended, now)
            if overdue:
                raise JobFailed(overdue)
            # past the deadline with every task there: registered tasks stay registered
            self.all_registered = now - self.started > timeout

    def _lost_launcher(self, task: Task) -> str:
        """The failure line when the processes left because this launcher went silent: it names the launcher."""
        # Any stall counts: the processes' 10 s ran from their last answer, which may predate the stall a little.
        why = f"was stopped or stalled for {self.stalled_s:.1f} s" if self.stalled_s else "did not answer them"
        return (f"the launcher (pid {os.getpid()}) {why}: its processes, which wait {DIRECTORY_PATIENCE_S:.0f} s "
                f"for it, left the job ({task.label} first)")

    def _let_finish(self, seconds: float) -> None:
        """The chief is done: heartbeat answers now say so and every process exits 0
        by itself (under srun a step that ends cleanly, not a cancelled one)."""
        self.directory.done = True
        self.directory.announce()
        end = time.monotonic() + seconds
        while time.monotonic() < end and any(t.proc.poll() is None for t in self.group.tasks):
            self.directory.serve_once(50)

    def _drain_status(self, seconds: float) -> None:
        """Answer heartbeats for a moment so remote processes learn the job failed."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.directory.serve_once(50)


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    if rc == EXIT_BAD_INPUT:
        return f"exit code {rc} (its line above says why; a restart would fail alike)"
    if rc == EXIT_DIRECTORY_LOST:
        return f"exit code {rc} (its directory stopped answering for {DIRECTORY_PATIENCE_S:.0f} s)"
    return f"exit code {rc}"
