"""Faults thrown at whole jobs, and what each must end in (tests/test_chaos.py, scripts/soak.py --faults).

    fault = draw_fault(seed)                      # kind, role, step, restarts: all from the seed
    outcome = run_with_fault(fault, params, model_dir)
    problems = judge(fault, outcome, oracle_losses, oracle_weights)   # [] when it ended as it must

The faults, each at a random step of a one-WSE FC-MNIST job, with --max_restarts
0, 1 or 2:

- kill9:      SIGKILL of one role (chief, input worker, MemoryX, SwarmX, WSE, or the launcher
              itself); with --max_restarts 2 the same role is hit again once the restarted job
              has passed that step, so both restarts are spent;
- sigstop:    SIGSTOP of one role (never continued: the launcher must notice the silence),
              twice with --max_restarts 2, as kill9;
- rogue:      a local stranger without the job's keys at every port of the job: a huge
              pre-handshake frame, garbage, a client without CURVE, one with the wrong keys;
- handshakes: strangers at every port at once, 30 connections each streaming handshake
              frames one byte under the port's frame cap and reconnecting, for 2 s;
- early_kill: SIGKILL of the launcher at a random moment of the 1.5 s after it made the job's
              key folder (the step field is that moment in milliseconds): before, while or
              just after its services start;
- full_disk:  the model_dir's file system (a tmpfs in a mount namespace of the job's own)
              filled to the last byte.

What each must end in: bit-identical to the CPU path (every step's loss and the
final weights) when the fault can pass (a restart, or nothing landed), or one
`csrun: job failed:` line per hit naming the role and its pid with exit code 1
(2 for a full disk, which is never restarted); a killed launcher has no line and
leaves the clean-up to its services and its key folder's watcher; a process
stopped once its part was done (an input worker with every batch made) may let
the job end undisturbed. And in every case nothing of the job is left: no
process, no shared-memory segment, no key folder.

A fault is a pure function of its seed, so `python scripts/soak.py --faults --seed N`
or CHAOS_SEED=N for the test replays one that failed.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.cluster_utils import FC_MNIST, descendants, final_weights, tool, train_losses  # noqa: E402

KINDS = ("kill9", "sigstop", "rogue", "handshakes", "early_kill", "full_disk")
ROLE_ARGS = {"chief": "-m chief ", "worker": "-m worker ", "memoryx": "-m cs_runtime.memoryx",
             "swarmx": "-m cs_runtime.swarmx", "wse": "-m wse"}
KILLABLE = (*ROLE_ARGS, "launcher")
MAX_STEPS = 100            # the steps of SMALL_PARAMS, the CPU oracle's run
JOB_TIMEOUT_S = 240        # a job, restart included, ends well within this (else: a hang, reported)
SETTLE_S = 20.0            # after the launcher exits, its processes are gone within this
DISK_MIB = 64              # the full-disk fault's file system, before it is filled
STEP_RE = re.compile(r"\| Train .*Step=(\d+)")
RESTART_LINE = "restarting the whole job"
EARLY_KILL_MS = 1500       # early_kill: the launcher is killed within this of making the key folder
FLOOD_S, FLOOD_CONNECTIONS = 2.0, 30   # handshakes: how long, and how many connections per port
# A stranger's ZMTP greeting offering CURVE, then a command frame that declares 200 MB.
CURVE_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0") + b"\x00" + bytes(31)
HUGE_FRAME = b"\x06" + (200 * 2**20).to_bytes(8, "big")


@dataclass(frozen=True)
class Fault:
    kind: str
    role: str       # who is hit (kill9, sigstop); "" for the others
    step: int       # injected once the job has logged this step
    restarts: int   # --max_restarts
    seed: int

    def __str__(self) -> str:
        if self.kind == "early_kill":
            return f"early_kill-launcher@{self.step}ms-restarts{self.restarts}-seed{self.seed}"
        who = f"-{self.role}" if self.role else ""
        return f"{self.kind}{who}@step{self.step}-restarts{self.restarts}-seed{self.seed}"


    @property
    def hits(self) -> int:
        """How often the role is hit: twice when a second restart is there to spend."""
        return 2 if self.kind in ("kill9", "sigstop") and self.role != "launcher" and self.restarts == 2 else 1


def draw_fault(seed: int, kind: str | None = None, max_steps: int = MAX_STEPS, log_steps: int = 5,
               twice: bool = False) -> Fault:
    """The fault of `seed` (of `kind` when given): everything else drawn from the seed.
    twice: a kill9 or sigstop that hits a service or task twice, with --max_restarts 2."""
    rng = random.Random(seed)
    kind = kind or rng.choice(KINDS)
    role = rng.choice(KILLABLE) if kind == "kill9" and not twice else \
        rng.choice(tuple(ROLE_ARGS)) if kind in ("kill9", "sigstop") else ""
    if kind == "early_kill":
        return Fault(kind, "launcher", rng.randrange(0, EARLY_KILL_MS), rng.choice((0, 1, 2)), seed)
    # A logged step before the last fifth (the first two fifths with two hits), so the victim
    # still runs; either side of a checkpoint.
    restarts = 2 if twice else rng.choice((0, 1, 2))
    last = max(log_steps + 1, max_steps * (2 if restarts == 2 else 4) // 5)
    return Fault(kind, role, rng.randrange(log_steps, last, log_steps), restarts, seed)


@dataclass
class Outcome:
    code: int | None               # the launcher's exit code (None: it hung and was killed)
    output: str
    launcher_pid: int
    victim: int | None = None      # the pid hit (kill9, sigstop), the first time
    victims: list[int] = field(default_factory=list)   # every pid hit (two with a second hit)
    injected: bool = False         # False: the job ended before the fault's step
    watched: list[int] = field(default_factory=list)   # early_kill: the launcher's descendants then
    keys_dir: str = ""
    left: list[str] = field(default_factory=list)   # processes, segments, key folders still there
    model_dir: Path | None = None


def launcher_argv(fault: Fault, params: Path, model_dir: Path) -> list[str]:
    restarts = ["--max_restarts", str(fault.restarts)] if fault.restarts else []
    argv = [tool("csrun_wse"), *restarts, sys.executable, FC_MNIST, "--mode", "train",
            "--params", str(params), "--model_dir", str(model_dir)]
    if fault.kind != "full_disk":
        return argv
    # The model_dir on a tmpfs of the job's own: it goes when the job's last process does.
    disk = model_dir.parent
    disk.mkdir(parents=True, exist_ok=True)
    script = f'mount -t tmpfs -o size={DISK_MIB}m tmpfs "$1" && shift && exec "$@"'
    return ["unshare", "-m", "sh", "-c", script, "sh", str(disk), *argv]


def full_disk_missing() -> str:
    """Why the full-disk fault cannot run here ("" when it can)."""
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"cannot mount a tmpfs: {probe.stderr.strip()}"


def run_with_fault(fault: Fault, params: Path, model_dir: Path) -> Outcome:
    """The job of `params` with `fault` thrown at it, to its end; what it left behind."""
    proc = subprocess.Popen(launcher_argv(fault, params, model_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reached = threading.Event()
    reader = threading.Thread(target=_read, args=(proc, lines, fault.step, reached), daemon=True)
    reader.start()
    outcome = Outcome(None, "", proc.pid, model_dir=model_dir)
    try:
        if fault.kind == "early_kill":
            kill_early(fault, proc, outcome)
        elif reached.wait(JOB_TIMEOUT_S) and proc.poll() is None:
            job = _job_processes(proc.pid)
            outcome.keys_dir = _keys_dir(job)
            outcome.victim, outcome.injected = inject(fault, proc, job, outcome.keys_dir, model_dir)
            outcome.victims = [outcome.victim] if outcome.injected else []
            if outcome.injected and fault.hits == 2:
                hit_again(fault, proc, lines, outcome)
        outcome.code = proc.wait(JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
    finally:
        reader.join(10)
        proc.stdout.close()
        outcome.output = "".join(lines)
    outcome.left = leftovers(proc.pid, outcome.keys_dir, outcome.watched)
    return outcome


def kill_early(fault: Fault, proc: subprocess.Popen, outcome: Outcome) -> None:
    """SIGKILL of the launcher `fault.step` ms after it made the job's key folder (its params
    and model checked, its services about to start), whatever it is doing then."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not _key_folders_of(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)   # a fresh look each time: the folder is made by another process
    deadline = time.monotonic() + fault.step / 1000
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.005)   # the moment the fault was drawn for, not a synchronisation
    if proc.poll() is not None:
        return
    outcome.watched = [pid for pid, _ in descendants(proc.pid)]
    outcome.keys_dir = _keys_dir(_job_processes(proc.pid))
    os.kill(proc.pid, signal.SIGKILL)
    outcome.victim, outcome.victims, outcome.injected = proc.pid, [proc.pid], True


def hit_again(fault: Fault, proc: subprocess.Popen, lines: list[str], outcome: Outcome) -> None:
    """The second hit: the same role, once the restarted job has passed the first hit's step."""
    restarted = _wait_line(proc, lines, 0, lambda line: RESTART_LINE in line)
    if restarted is None or _wait_line(proc, lines, restarted, lambda line: _step_of(line) >= fault.step) is None:
        return   # the job ended first
    victim = _job_processes(proc.pid).get(fault.role)
    if victim is None:
        return
    try:
        os.kill(victim, signal.SIGKILL if fault.kind == "kill9" else signal.SIGSTOP)
    except ProcessLookupError:
        return
    outcome.victims.append(victim)


def _step_of(line: str) -> int:
    found = STEP_RE.search(line)
    return int(found.group(1)) if found else -1


def _wait_line(proc: subprocess.Popen, lines: list[str], start: int, wanted) -> int | None:
    """The index after the first of lines[start:] that is `wanted`, as the reader appends them;
    None once the job has ended without one."""
    seen = start
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        while seen < len(lines):
            seen += 1
            if wanted(lines[seen - 1]):
                return seen
        if proc.poll() is not None and seen >= len(lines):
            return None
        time.sleep(0.02)   # the reader thread appends; a fresh look each time
    return None


def _read(proc: subprocess.Popen, lines: list[str], step: int, reached: threading.Event) -> None:
    for line in proc.stdout:
        lines.append(line)
        found = STEP_RE.search(line)
        if found and int(found.group(1)) >= step:
            reached.set()
    reached.set()   # ended (or failed) before the step: nothing to inject


def inject(fault: Fault, proc: subprocess.Popen, job: dict[str, int], keys_dir: str,
           model_dir: Path) -> tuple[int | None, bool]:
    """Throw the fault; (the pid hit, whether anything was thrown)."""
    if fault.kind in ("kill9", "sigstop"):
        victim = proc.pid if fault.role == "launcher" else job.get(fault.role)
        if victim is None:
            return None, False
        try:
            os.kill(victim, signal.SIGKILL if fault.kind == "kill9" else signal.SIGSTOP)
        except ProcessLookupError:
            return victim, False   # it had already finished its part: an undisturbed run
        return victim, True
    if fault.kind == "rogue":
        return None, rogue_peer(job, keys_dir) > 0
    if fault.kind == "handshakes":
        return None, handshake_flood(job, keys_dir) > 0
    return None, fill_disk(proc.pid, model_dir.parent)


def handshake_flood(job: dict[str, int], keys_dir: str) -> int:
    """Near-cap handshakes at every address of the job at once; how many connections were made."""
    from cs_runtime.wire.protocol import MAX_FRAME_BYTES
    from cs_runtime.wire.transport import CONTROL_MAX_FRAME, CURVE_FRAME_OVERHEAD
    addresses = job_addresses(job, keys_dir)
    made = []
    # The first address is the directory's, a control socket with the smaller cap.
    caps = [CONTROL_MAX_FRAME] + [MAX_FRAME_BYTES] * (len(addresses) - 1)
    floods = [threading.Thread(target=lambda a=address, c=cap: made.append(
        near_cap_handshakes(a, FLOOD_CONNECTIONS, FLOOD_S, c + CURVE_FRAME_OVERHEAD - 1)), daemon=True)
        for address, cap in zip(addresses, caps)]
    for flood in floods:
        flood.start()
    for flood in floods:
        flood.join(FLOOD_S + 10)
    return sum(made)


def near_cap_handshakes(address: str, connections: int, seconds: float, size: int) -> int:
    """`connections` threads, each greeting as a CURVE client, sending a command frame of `size`
    bytes but its last, holding until the server hangs up and reconnecting, for `seconds`: the
    handshakes libzmq buffers whole. How many connections were made."""
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    until = time.monotonic() + seconds
    made = []

    def attacker():
        while time.monotonic() < until:
            try:
                with socket.create_connection((host, int(port)), timeout=2) as conn:
                    made.append(1)
                    conn.sendall(CURVE_GREETING + b"\x06" + size.to_bytes(8, "big") + bytes(size - 1))
                    conn.settimeout(max(0.05, until - time.monotonic()))
                    while conn.recv(65536):
                        pass
            except OSError:
                pass   # refused, reset or timed out: connect again
    threads = [threading.Thread(target=attacker, daemon=True) for _ in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 5)
    return len(made)


def _job_processes(launcher: int) -> dict[str, int]:
    """role -> pid of the job's processes now (the first of each role)."""
    found: dict[str, int] = {}
    for pid, args in descendants(launcher):
        for role, pattern in ROLE_ARGS.items():
            if pattern in args + " ":
                found.setdefault(role, pid)
    return found


def _keys_dir(job: dict[str, int]) -> str:
    for pid in job.values():
        folder = process_env(pid).get("CS_KEYS_DIR")
        if folder:
            return folder
    return ""


def fill_disk(launcher: int, disk: Path) -> bool:
    """Fill the job's file system (seen through the launcher's mount namespace) to the last byte."""
    filler = Path(f"/proc/{launcher}/root") / str(disk).lstrip("/") / "filler"
    try:
        with open(filler, "wb") as out:
            chunk = bytes(1 << 20)
            while True:
                out.write(chunk)
                out.flush()
    except OSError:   # ENOSPC: full (or the job is gone)
        return filler.exists()


def rogue_peer(job: dict[str, int], keys_dir: str) -> int:
    """A stranger at every address of the job (learned as an insider would); how many it tried."""
    addresses = job_addresses(job, keys_dir)
    for address in addresses:
        host, port = address.split("://", 1)[1].rsplit(":", 1)
        _raw(host, int(port), CURVE_GREETING + HUGE_FRAME + bytes(4 << 20))
        _raw(host, int(port), os.urandom(4096))
        _zmq_stranger(address, curve=False)
        _zmq_stranger(address, curve=True)
    return len(addresses)


def job_addresses(job: dict[str, int], keys_dir: str) -> list[str]:
    import zmq
    from cs_runtime.wire import auth
    from cs_runtime.wire.protocol import Message, Msg
    from cs_runtime.wire.transport import Endpoint
    env = process_env(job["chief"])
    ctx = zmq.Context()
    ask = Endpoint(ctx, zmq.DEALER, "chaos-lookup", env["CS_JOB_ID"], keys=auth.load_keys(keys_dir))
    try:
        ask.connect(env["CS_RENDEZVOUS"]).send(Message(Msg.LOOKUP, meta={"roles": ["memoryx", "swarmx", "wse"]}))
        got = ask.recv(10_000)
        peers = got[1].meta["peers"] if got else []
    finally:
        ask.close()
        auth.stop_authenticator(ctx)
        ctx.destroy(linger=0)
    return [env["CS_RENDEZVOUS"], *(a for p in peers for a in p["endpoints"].values())]


def _raw(host: str, port: int, data: bytes) -> None:
    try:
        with socket.create_connection((host, port), timeout=5) as conn:
            conn.sendall(data)
    except OSError:
        pass   # reset: the server dropped us, as it should


def _zmq_stranger(address: str, curve: bool) -> None:
    """A ZeroMQ client without the job's keys (none at all, or a key pair of its own) sending a step."""
    import zmq
    from cs_runtime.wire.protocol import Message, Msg, encode
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if curve:
            public, secret = zmq.curve_keypair()
            server_public, _ = zmq.curve_keypair()
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_public
        sock.connect(address)
        sock.send_multipart(encode(Message(Msg.TRAIN_STEP, step=0, meta={"lr": 10.0})), zmq.NOBLOCK)
        sock.poll(300)
    except zmq.ZMQError:
        pass
    finally:
        sock.close(0)
        ctx.destroy(linger=0)


def leftovers(launcher: int, keys_dir: str, watched: list[int] = ()) -> list[str]:
    """What of the job is still there once its processes have had SETTLE_S to go: its processes
    (by their key folder, and `watched`: pids seen under the launcher), segments and key folders
    (the one its processes named, and any its launcher made)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        procs = [pid for pid in _pids() if _alive(pid) and (
            pid in watched or keys_dir and process_env(pid).get("CS_KEYS_DIR") == keys_dir)]
        folders = _key_folders_of(launcher)
        if not procs and not folders or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    segments = sorted(p.name for p in Path("/dev/shm").glob(f"cs-*-l{launcher}")) if Path("/dev/shm").is_dir() else []
    left = [f"process {pid}: {_args(pid)[:120]}" for pid in procs] + [f"segment {s}" for s in segments]
    left += [f"key folder {folder}" for folder in folders]
    if keys_dir and Path(keys_dir).exists() and Path(keys_dir) not in folders:
        left.append(f"key folder {keys_dir}")
    return left


def _key_folders_of(launcher: int) -> list[Path]:
    """The job key folders `launcher` made that are still there."""
    import tempfile
    from cs_runtime.wire.auth import JOB_DIR_PREFIX, OWNER_FILE
    found = []
    for folder in Path(tempfile.gettempdir()).glob(f"{JOB_DIR_PREFIX}*"):
        try:
            if (folder / OWNER_FILE).read_text() == str(launcher):
                found.append(folder)
        except OSError:
            continue
    return found


def judge(fault: Fault, outcome: Outcome, losses: np.ndarray, weights: dict[str, np.ndarray]) -> list[str]:
    """What is wrong with how the job ended ([] when nothing is)."""
    problems = [f"left behind: {item}" for item in outcome.left]
    out = outcome.output
    failed = [line for line in out.splitlines() if line.startswith("csrun: job failed:")]
    if outcome.code is None:
        return problems + [f"hung (no end within {JOB_TIMEOUT_S} s)"]
    if "Traceback" in out:
        problems.append("a traceback in the output")
    if "dropped bad message" in out:
        problems.append("a 'dropped bad message' line (a stranger's message landed, or ours was taken for one)")
    if not outcome.injected:   # the job ended before the step: an undisturbed run
        return problems + _against_oracle(outcome, losses, weights)
    if fault.role == "launcher":   # kill9 at a step, or early_kill
        return problems + ([] if outcome.code == -signal.SIGKILL else [f"exit code {outcome.code}, not -9"])
    if fault.kind == "full_disk":
        return problems + _full_disk(out, outcome.code, failed)
    if fault.kind in ("rogue", "handshakes"):
        return problems + _against_oracle(outcome, losses, weights)
    if fault.kind == "sigstop" and outcome.code == 0 and len(failed) < len(outcome.victims):
        # Stopped once its part was done (an input worker with every batch made): the job ended
        # without it, and must then be the undisturbed run.
        return problems + _against_oracle(outcome, losses, weights)
    why = "stopped answering" if fault.kind == "sigstop" else "exited with signal SIGKILL"
    named = [f"(pid {victim}) {why}" for victim in outcome.victims]
    if len(failed) != len(named) or not all(f"{fault.role} 0 on " in line and said in line
                                            for line, said in zip(failed, named)):
        problems.append(f"not one failure line per hit naming {fault.role} {named}: {failed}")
    if fault.restarts >= len(outcome.victims):
        return problems + _against_oracle(outcome, losses, weights)
    return problems + ([] if outcome.code == 1 else [f"exit code {outcome.code}, not 1"])


def _full_disk(out: str, code: int, failed: list[str]) -> list[str]:
    problems = [] if code == 2 else [f"exit code {code}, not 2"]
    said = [line for line in out.splitlines() if "no space left on the device (ENOSPC)" in line]
    if not said:
        problems.append("no line saying the disk is full (ENOSPC)")
    if "restarting" in out:
        problems.append("a restart was spent on a full disk")
    if len(failed) != 1 or "exit code 2" not in failed[0]:
        problems.append(f"not one failure line with exit code 2: {failed}")
    return problems


def _against_oracle(outcome: Outcome, losses: np.ndarray, weights: dict[str, np.ndarray]) -> list[str]:
    """Bit-identical to the CPU path: every step's loss and every final weight."""
    if outcome.code != 0:
        tail = outcome.output.strip().splitlines()[-3:]
        return [f"exit code {outcome.code}, not 0: {tail}"]
    got = train_losses(outcome.model_dir)
    if len(got) != len(losses) or not np.array_equal(got, losses):
        return [f"losses differ from the CPU path ({len(got)} steps)"]
    final = final_weights(outcome.model_dir)
    differ = [name for name in weights if not np.array_equal(final.get(name), weights[name])]
    return [f"final weights differ from the CPU path: {differ}"] if differ else []


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def _args(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def process_env(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def _kill_session(proc: subprocess.Popen) -> None:
    """A hung job: everything it started (its own session and the ones its processes made)."""
    for pid, _ in descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.wait()
