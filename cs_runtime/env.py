"""Every CS_* environment variable: its name, default, parser and meaning, in one table.

    from cs_runtime import env
    rank = env.RANK.get()          # 0 when unset; EnvError naming CS_RANK when not a count

A variable unset or empty reads as its default. Who sets them: csrun_wse and
the CS system for the job's processes (scope "job": the same in every
process of a job; "process": this process's own place in it), the user
("user"), or one program for its own children ("internal").
`python -m cs_runtime.env` prints the table (docs: environment variables).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from cs_runtime.errors import UserInputError


class EnvError(UserInputError):
    """A variable's value does not parse; the message names the variable."""


def text(raw: str) -> str:
    return raw


def count(raw: str) -> int:
    """0, 1, 2, ..."""
    if not raw.isdigit():
        raise ValueError("expected a non-negative int")
    return int(raw)


def positive(raw: str) -> int:
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError("expected a positive int")
    return int(raw)


def seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ValueError("expected a positive number of seconds")
    return value


def switch(raw: str) -> bool:
    """On unless "0" (unset and empty are the default)."""
    return raw != "0"


def choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in allowed:
            raise ValueError(f"expected {' or '.join(allowed)}")
        return raw
    parse.__name__ = " or ".join(allowed)
    return parse


@dataclass(frozen=True)
class Var:
    name: str
    default: Any
    parse: Callable[[str], Any]
    meaning: str
    scope: str = "user"      # job | process | user | internal
    service: bool = False    # a CS system hands it to the service process it assigns to a job

    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        raw = (os.environ if environ is None else environ).get(self.name, "")
        if raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise EnvError(f"{self.name}={raw[:60]!r}: {exc}") from None

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        return (os.environ if environ is None else environ).get(self.name, "") != ""


# ---------------------------------------------------------------- a job's processes
JOB_ID = Var("CS_JOB_ID", "", text, "the job's id, stamped on every message", "job", service=True)
IP = Var("CS_IP", "", text, "the CS system's directory (MemoryX, SwarmX, WSEs register there)", "job", service=True)
RENDEZVOUS = Var("CS_RENDEZVOUS", "", text, "the job's directory (chief and workers; default CS_IP)", "job")
TARGET = Var("CS_TARGET", "cpu", choice("cpu", "wse"), "what the chief compiles for (csrun_cpu, csrun_wse)", "job")
NUM_CSX = Var("CS_NUM_CSX", 1, positive, "WSEs of the job", "job", service=True)
NUM_WORKERS = Var("CS_NUM_WORKERS", 1, positive, "input workers of the job, on all hosts", "job")
KEYS_DIR = Var("CS_KEYS_DIR", "", text, "folder of the job's CURVE keys (wire/auth.py); unset: no CURVE",
               "job", service=True)
JOB_KEYS = Var("CS_JOB_KEYS", "", text, "the job's CURVE keys as JSON text, for an srun step: the task wrapper "
               "writes them into a folder of its node and sets CS_KEYS_DIR (launch/task.py)", "job")
SHM_DIR = Var("CS_SHM_DIR", "", text, "folder of the job's shared-memory segments (wire/shm.py); unset: tcp",
              "job", service=True)
RESTART = Var("CS_RESTART", 0, count, "the job's restart number (--max_restarts): resume from model_dir", "job")
TRACE = Var("CS_TRACE", False, switch, "1: record a timeline (--trace)", "job")
ROLE = Var("CS_ROLE", "", text,
           "chief | worker | memoryx | swarmx | wse | input_probe | wse_probe | precheck; unset: CPU",
           "process", service=True)
RANK = Var("CS_RANK", 0, count, "rank within the role", "process", service=True)
HOST_NAME = Var("CS_HOST_NAME", "", text, "this host's name as the job knows it (default: hostname)", "process")
BIND_HOST = Var("CS_BIND_HOST", "127.0.0.1", text, "the address this process binds", "process", service=True)

# ---------------------------------------------------------------- set by the user
LOG_LEVEL = Var("CS_LOG_LEVEL", "INFO", str.upper, "logging level of every process (DEBUG, INFO, ...)")
SYSTEM = Var("CS_SYSTEM", "", text, "HOST:PORT of the CS system csctl talks to (its --cs_ip)")
SYSTEM_KEY = Var("CS_SYSTEM_KEY", "", str.strip, "the CS system's front-door public key (Z85), if not fetched")
USER_DIR = Var("CS_USER_DIR", "", text, "folder of the owner credential (default ~/.cs_emulator)")
EMULATOR_FLOAT32 = Var("CS_EMULATOR_FLOAT32", False, switch, "emulator only, not in the real API: 1 trains in "
                       "float32 even where the script enables mixed precision (cs_torch/amp.py)")

# ---------------------------------------------------------------- one program to its children
AWAIT_JOB = Var("CS_AWAIT_JOB", False, switch, "a pooled service: wait for the job on stdin (CS system)",
                "internal")
PROBE_SECONDS = Var("CS_PROBE_SECONDS", 3.0, seconds, "how long a probe measures (cs_input_analyzer)", "internal")
PROBE_RANK = Var("CS_PROBE_RANK", 0, count, "an input probe's rank (cs_input_analyzer)", "internal")
PROBE_WORKERS = Var("CS_PROBE_WORKERS", 1, positive, "input probes measured together (cs_input_analyzer)",
                    "internal")
PRECHECK_HERE = Var("CS_PRECHECK_HERE", False, switch, "csrun_wse's check runs where the chief will (a local "
                    "job): it also checks model_dir, data_dir and an eval's checkpoint", "internal")
TORCH_INPUT = Var("CS_TORCH_INPUT", "", text, "a cs_torch input worker's instructions (JSON)", "internal")

ALL: tuple[Var, ...] = tuple(v for v in globals().values() if isinstance(v, Var))
# A process's place in a job: set by the launcher, never inherited from the launcher's own environment.
JOB_VARS = tuple(v.name for v in ALL if v.scope in ("job", "process"))
# This process's own identity within the job: set per process, never passed on to another.
PROCESS_VARS = tuple(v.name for v in ALL if v.scope == "process")
# What a CS system may assign a pooled service process (cs_runtime/process/service.py).
SERVICE_VARS = tuple(v.name for v in ALL if v.service)

# Other programs' variables, set for the processes that compute (each unless the user set it).
#
# BLAS_SPIN, for a process that runs BLAS threads (csrun_cpu; a WSE given more than one core):
# after a threaded product OpenBLAS's threads spin for the next one for 2**28 cycles (about
# 0.1 s): on a 2-core host, a core taken between a WSE's products from its 16-bit conversions
# and from MemoryX (float16 weight streaming on `large`: 0.67 -> 0.74 of float32). 2**4 cycles:
# they sleep at once; waking them costs microseconds beside a product worth threading
# (milliseconds: numerics/blas.py). The products and their bits are unchanged.
BLAS_SPIN = ("OPENBLAS_THREAD_TIMEOUT", "4")
# ALLOCATOR, for every process of a job and csrun_cpu: glibc's malloc hands an array over its
# mmap threshold (at most 32 MB) fresh pages from the kernel, and gives freed memory at the top
# of its heap back (the trim threshold); every step's activations and weights were then new
# pages the kernel zeroed on first touch (10% of a GPT-2 weight-streaming run's CPU, in
# clear_page). From the heap, kept: freed arrays are reused as a caching allocator's are. The
# same peak memory on the transformer preset; GPT-2 weight streaming 36 -> 45 samples/s.
# Other C libraries ignore these names.
ALLOCATOR = (("MALLOC_MMAP_THRESHOLD_", str(1 << 30)), ("MALLOC_TRIM_THRESHOLD_", str(1 << 34)))


def with_numerics_defaults(env: dict, threaded: bool) -> dict:
    """env (changed in place, and returned) with ALLOCATOR and, for a process that runs BLAS
    threads, BLAS_SPIN: each unless set."""
    for name, value in (*ALLOCATOR, *((BLAS_SPIN,) if threaded else ())):
        env.setdefault(name, value)
    return env


def table() -> str:
    """The variables as a markdown table."""
    rows = ["| variable | default | parsed as | set by | meaning |", "|---|---|---|---|---|"]
    for v in ALL:
        default = "" if v.default in ("", None) else f"`{v.default}`"
        rows.append(f"| `{v.name}` | {default} | {v.parse.__name__} | {v.scope} | {v.meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")
