"""The input worker: runs the user's input function on its share of the batches.

Worker w of a job with N WSEs and W workers per WSE feeds WSE w // W and
produces the steps s with s % W == w % W: for each, the rows of global batch
s that belong to its WSE. The chief's PLAN says which steps of which stream
(train, eval) to produce. The PUSH socket's high-water mark bounds how far a
worker runs ahead (prefetch) of its WSE.
"""
from __future__ import annotations

import logging
import sys
import time

import zmq

from cs_runtime.cluster import DirectoryClient
from cs_runtime.data import DataError, worker_steps
from cs_runtime.inputs import InputStream
from cs_runtime.precision import encode_arrays
from cs_runtime.protocol import Message, Msg
from cs_runtime.restart import EXIT_BAD_INPUT
from cs_runtime.runner import RunArgs, UserFunctions
from cs_runtime.service import ProcessEnv
from cs_runtime.transport import Endpoint

log = logging.getLogger("worker")

PREFETCH = 4
PLAN_TIMEOUT_S = 300


def serve_inputs(args: RunArgs, fns: UserFunctions) -> None:
    penv = ProcessEnv.from_environ("worker")
    ctx = zmq.Context()
    try:
        InputWorker(args, fns, penv, ctx).run()
    except DataError as exc:
        # One line naming the file; the launcher then stops the job (and never restarts it).
        log.error("worker %d: bad input data: %s", penv.rank, exc)
        logging.shutdown()
        sys.exit(EXIT_BAD_INPUT)
    finally:
        ctx.destroy(linger=0)


class InputWorker:
    def __init__(self, args: RunArgs, fns: UserFunctions, penv: ProcessEnv, ctx: zmq.Context):
        self.args, self.fns, self.penv, self.ctx = args, fns, penv, ctx
        self.wse_rank = penv.rank // penv.workers_per_csx
        self.local = penv.rank % penv.workers_per_csx
        self.sent = 0

    def run(self) -> None:
        job_dir = DirectoryClient(self.ctx, self.penv.rendezvous, "worker", self.penv.rank, self.penv.job)
        job_dir.register({})
        beat = job_dir.start_heartbeats()
        chief = job_dir.lookup(["chief"])["chief"][0]
        wse = DirectoryClient(self.ctx, self.penv.cs_ip, "worker", self.penv.rank, self.penv.job)
        target = wse.lookup(["wse"])["wse"][self.wse_rank]
        phases = self.ask_plan(chief["endpoints"]["router"])
        push = Endpoint(self.ctx, zmq.PUSH, f"worker{self.penv.rank}", self.penv.job)
        push.sock.setsockopt(zmq.SNDHWM, PREFETCH)
        push.connect(target["endpoints"]["input"])
        t0 = time.monotonic()
        for phase in phases:
            self.stream(push, phase)
        log.info("worker %d streamed %d batches to WSE %d in %.1f s", self.penv.rank, self.sent,
                 self.wse_rank, time.monotonic() - t0)
        # Stay registered until the job ends: the launcher stops us with the rest.
        beat.join()

    def ask_plan(self, address: str) -> list[dict]:
        chief = Endpoint(self.ctx, zmq.DEALER, f"worker{self.penv.rank}->chief", self.penv.job)
        chief.connect(address)
        chief.send(Message(Msg.HELLO, meta={"role": "worker", "rank": self.penv.rank}))
        got = chief.recv(PLAN_TIMEOUT_S * 1000)
        if got is None or got[1].type != Msg.PLAN:
            raise RuntimeError(f"worker {self.penv.rank}: no plan from the chief at {address}")
        chief.close()
        return got[1].meta["phases"]

    def stream(self, push: Endpoint, phase: dict) -> None:
        name = str(phase["stream"])
        p = self.args.params
        if name == "train":
            stream = InputStream.build("train", self.fns.train_input_fn(p), p.train_input, p.runconfig.seed)
        else:
            stream = InputStream.build("eval", self.fns.eval_input_fn(p), p.eval_input, p.runconfig.seed)
        for step in worker_steps(int(phase["start"]), int(phase["stop"]), self.local,
                                 self.penv.workers_per_csx):
            shard = stream.shard(step, self.wse_rank, self.penv.num_csx)
            meta = {"stream": name, "global_batch": shard.global_batch,
                    "row_start": shard.rows.start, "row_stop": shard.rows.stop}
            # The first layer rounds its input to the 16-bit format anyway: send it so.
            arrays = encode_arrays({"x": shard.x, "y": shard.y}, p.precision)
            push.send(Message(Msg.BATCH, step=step, meta={**meta, "format": p.precision}, arrays=arrays))
            self.sent += 1
