"""What every process of a job shares: its identity from the environment the
launcher sets, logging, and a main wrapper that turns any error into one
logged line and a non-zero exit.

Environment (set by csrun_wse / the appliance, read here only):
    CS_JOB_ID      job id, stamped on every message
    CS_ROLE        chief | worker | memoryx | swarmx | wse
    CS_RANK        rank within the role
    CS_RENDEZVOUS  the job's directory (chief and workers register there)
    CS_IP          the CS system's directory (MemoryX, SwarmX, WSEs)
    CS_NUM_CSX     WSEs of the job
    CS_NUM_WORKERS input workers of the job (on all hosts)
    CS_BIND_HOST   the address this process binds (set per host by the launcher)
"""
from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass

import zmq

from cs_runtime.wire.auth import stop_authenticator

# A process exits with this when its input is bad (params, data, checkpoint, a
# full disk): the launcher fails the job at once and never restarts it, since
# a restart would fail alike (cs_runtime/launch/restart.py).
EXIT_BAD_INPUT = 2


class BadInput(Exception):
    """Input a restart would only meet again (a bad sample): one line, exit EXIT_BAD_INPUT."""


ROLES = ("chief", "worker", "memoryx", "swarmx", "wse")

# A CS system (cs_runtime/appliance/server.py) starts its services ahead of time with
# AWAIT_JOB_ENV set: each imports what it needs, then waits for the one job it
# will serve, given as one JSON line on stdin (the variables below, nothing else).
AWAIT_JOB_ENV = "CS_AWAIT_JOB"
ASSIGNED_VARS = ("CS_JOB_ID", "CS_IP", "CS_ROLE", "CS_RANK", "CS_NUM_CSX", "CS_KEYS_DIR", "CS_SHM_DIR",
                 "CS_BIND_HOST")


@dataclass(frozen=True)
class ProcessEnv:
    job: str
    role: str
    rank: int
    rendezvous: str
    cs_ip: str
    num_csx: int
    num_workers: int

    @classmethod
    def from_environ(cls, role: str | None = None) -> "ProcessEnv":
        env = os.environ
        missing = [k for k in ("CS_JOB_ID", "CS_IP") if not env.get(k)]
        if missing:
            raise SystemExit(f"{role or 'process'}: {', '.join(missing)} not set; start jobs with csrun_wse")
        return cls(job=env["CS_JOB_ID"], role=role or env.get("CS_ROLE", ""),
                   rank=int(env.get("CS_RANK", "0")), rendezvous=env.get("CS_RENDEZVOUS", env["CS_IP"]),
                   cs_ip=env["CS_IP"], num_csx=int(env.get("CS_NUM_CSX", "1")),
                   num_workers=int(env.get("CS_NUM_WORKERS", "1")))


def setup_logging(role: str, rank: int | None = None) -> None:
    level = os.environ.get("CS_LOG_LEVEL", "INFO").upper()
    name = role if rank is None else f"{role}{rank}"
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s", datefmt="%H:%M:%S")


def join_cs_system(penv: ProcessEnv, ctx: zmq.Context, endpoints: dict):
    """Register a service's addresses with the CS system's directory and start heartbeats.

    Keep the returned client alive: its socket closes with LINGER 0 when it is
    garbage collected, which would drop a REGISTER not yet sent.
    """
    from cs_runtime.launch.directory import DirectoryClient
    directory = DirectoryClient(ctx, penv.cs_ip, penv.role, penv.rank, penv.job)
    directory.register(endpoints)
    directory.start_heartbeats()
    return directory


def take_assignment() -> None:
    """Wait for this process's job on stdin and put it in the environment; EOF: exit 0."""
    line = sys.stdin.buffer.readline(1 << 16)
    if not line:
        sys.exit(0)   # the CS system stopped before it had a job for us
    try:
        assigned = json.loads(line)
    except ValueError:
        raise SystemExit("service: the job assignment on stdin is not JSON") from None
    if not isinstance(assigned, dict) or not all(
            k in ASSIGNED_VARS and isinstance(v, str) for k, v in assigned.items()):
        raise SystemExit(f"service: a job assignment sets only {', '.join(ASSIGNED_VARS)}, as strings")
    os.environ.update(assigned)


def service_main(role: str, body) -> None:
    """Run `body(penv, ctx)` as the process `role`; exit non-zero on any error."""
    if os.environ.pop(AWAIT_JOB_ENV, None):
        take_assignment()
    penv = ProcessEnv.from_environ(role)
    setup_logging(role, penv.rank)
    ctx = zmq.Context()
    try:
        body(penv, ctx)
    except KeyboardInterrupt:
        sys.exit(130)
    except BadInput as exc:
        logging.getLogger(role).error("%s", exc)   # the line names the input; no traceback
        logging.shutdown()
        os._exit(EXIT_BAD_INPUT)
    except Exception as exc:  # the one place a service turns an error into an exit code
        logging.getLogger(role).error("%s %d failed: %s", role, penv.rank, exc, exc_info=True)
        logging.shutdown()
        os._exit(1)
    finally:
        stop_authenticator(ctx)
        ctx.destroy(linger=0)
