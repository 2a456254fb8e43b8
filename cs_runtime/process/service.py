"""What every process of a job shares: its identity from the environment the
launcher sets, logging, and a main wrapper that turns any error into one
logged line and a non-zero exit.

The identity comes from the environment csrun_wse or the CS system sets
(cs_runtime/env.py: CS_JOB_ID, CS_ROLE, CS_RANK, CS_RENDEZVOUS, CS_IP,
CS_NUM_CSX, CS_NUM_WORKERS); `setup_logging` is every process's one logging
set-up (CS_LOG_LEVEL).
"""
from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass

import zmq

from cs_runtime.errors import EXIT_BAD_INPUT, UserInputError
from cs_runtime import env
from cs_runtime.process import orphan
from cs_runtime.process.directory_client import DirectoryClient, stop_heartbeats
from cs_runtime.wire.auth import stop_authenticator



class BadInput(UserInputError):
    """Input a restart would only meet again (a bad sample): one line, exit EXIT_BAD_INPUT."""


# A CS system (cs_runtime/appliance/server.py) starts its services ahead of time with
# AWAIT_JOB_ENV set: each imports what it needs, then waits for the one job it
# will serve, given as one JSON line on stdin (the variables below, nothing else).
AWAIT_JOB_ENV = env.AWAIT_JOB.name
ASSIGNED_VARS = env.SERVICE_VARS


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
        missing = [v.name for v in (env.JOB_ID, env.IP) if not v.is_set()]
        if missing:
            raise SystemExit(f"{role or 'process'}: {', '.join(missing)} not set; start jobs with csrun_wse")
        try:
            return cls(job=env.JOB_ID.get(), role=role or env.ROLE.get(), rank=env.RANK.get(),
                       rendezvous=env.RENDEZVOUS.get() or env.IP.get(), cs_ip=env.IP.get(),
                       num_csx=env.NUM_CSX.get(), num_workers=env.NUM_WORKERS.get())
        except env.EnvError as exc:
            raise SystemExit(f"{role or 'process'}: {exc}") from None


def setup_logging(role: str, rank: int | None = None) -> None:
    """Log lines to stderr as `12:00:00 wse0 INFO ...`, at CS_LOG_LEVEL (every process, every role)."""
    level = env.LOG_LEVEL.get()
    name = role if rank is None else f"{role}{rank}"
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s", datefmt="%H:%M:%S")


def join_cs_system(penv: ProcessEnv, ctx: zmq.Context, endpoints: dict):
    """Register a service's addresses with the CS system's directory and start heartbeats.

    Keep the returned client alive: its socket closes with LINGER 0 when it is
    garbage collected, which would drop a REGISTER not yet sent.
    """
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
    if env.AWAIT_JOB.get():
        os.environ.pop(AWAIT_JOB_ENV)
        take_assignment()
    penv = ProcessEnv.from_environ(role)
    orphan.watch_parent()   # from here on, a launcher's death is cleaned up after, not just died of
    setup_logging(role, penv.rank)
    ctx = zmq.Context()
    try:
        body(penv, ctx)
    except KeyboardInterrupt:
        sys.exit(130)
    except UserInputError as exc:   # a restart would meet it again (BadInput, MessageTooLarge, ...)
        logging.getLogger(role).error("%s", exc)   # the line names the input; no traceback
        logging.shutdown()
        os._exit(EXIT_BAD_INPUT)
    except Exception as exc:  # the one place a service turns an error into an exit code
        logging.getLogger(role).error("%s %d failed: %s", role, penv.rank, exc, exc_info=True)
        logging.shutdown()
        os._exit(1)
    finally:
        stop_heartbeats()   # their sockets are in ctx: closed by their own thread, not under it
        stop_authenticator(ctx)
        ctx.destroy(linger=0)
