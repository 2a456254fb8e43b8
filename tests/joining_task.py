"""A job's task that only joins the job: the real launcher starts it as the chief and as every
input worker (`csrun_wse ... python tests/joining_task.py OUT`), it registers with the job's
directory and heartbeats as every task does, and nothing more, so that many tasks fit on a
small machine.

The chief waits until every input worker has registered (the directory answers its lookup
then), writes what it saw to OUT as JSON ([[rank, host, pid], ...]) and exits 0, which ends
the job: every other task hears so in its next heartbeat answer and exits 0.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import zmq

from cs_runtime.launch.directory import register_timeout
from cs_runtime.process.directory_client import DirectoryClient
from cs_runtime.process.service import ProcessEnv


def main() -> None:
    if os.environ.get("CS_ROLE") == "precheck":
        return   # csrun_wse runs the command once to check its params: this one has none
    penv = ProcessEnv.from_environ()
    ctx = zmq.Context()
    job = DirectoryClient(ctx, penv.rendezvous, penv.role, penv.rank, penv.job)
    job.register({})
    beat = job.start_heartbeats()
    if penv.role != "chief":
        threading.Event().wait()   # the heartbeat thread exits the process when the job ends
    workers = job.lookup(["worker"], timeout=register_timeout(penv.num_workers + 1))["worker"]
    Path(sys.argv[1]).write_text(json.dumps([[w["rank"], w["host"], w["pid"]] for w in workers]))
    beat.stop()
    job.close()
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
