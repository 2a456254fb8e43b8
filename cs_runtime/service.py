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

import logging
import os
import sys
from dataclasses import dataclass

import zmq

from .auth import stop_authenticator

ROLES = ("chief", "worker", "memoryx", "swarmx", "wse")


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
    from .cluster import DirectoryClient
    directory = DirectoryClient(ctx, penv.cs_ip, penv.role, penv.rank, penv.job)
    directory.register(endpoints)
    directory.start_heartbeats()
    return directory


def service_main(role: str, body) -> None:
    """Run `body(penv, ctx)` as the process `role`; exit non-zero on any error."""
    penv = ProcessEnv.from_environ(role)
    setup_logging(role, penv.rank)
    ctx = zmq.Context()
    try:
        body(penv, ctx)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # the one place a service turns an error into an exit code
        logging.getLogger(role).error("%s %d failed: %s", role, penv.rank, exc, exc_info=True)
        logging.shutdown()
        os._exit(1)
    finally:
        stop_authenticator(ctx)
        ctx.destroy(linger=0)
