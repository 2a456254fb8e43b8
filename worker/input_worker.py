"""The input worker: runs the user's input function on its share of the batches.

Worker w of a job's K input workers (on any number of hosts) produces the
global batches s with s % K == w (`worker_steps`): it fetches each once and
sends every WSE its rows. Each WSE merges the streams of all workers in step
order (`wse.emulator.InputMerger`), so results never depend on K or on which
worker is faster. A worker runs at most protocol.BATCH_SLOTS batches ahead of
each WSE: the WSE says, in BATCHES_DONE, how many of this worker's batches it
is done with (prefetch, and no further).

On the WSEs' host (CS_SHM_DIR set) the batches' big arrays travel as shared
memory (wire/shm.py): each WSE has a ring of BATCH_SLOTS slots in this
worker's arena, batch k is copied into slot k % BATCH_SLOTS, and the message
carries references instead of bytes (no kernel copies, no encryption on the
way). A slot is written again only once the WSE said it is done with the
batch that was in it. A batch too big for its slot goes as frames.

About once a second the worker tells the chief how it is doing
(INPUT_STATS: batches made, seconds busy in the input function, seconds
blocked because a WSE had all the batches it may hold): the chief's evidence when it
suspects an input bottleneck.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import sys
import time

import numpy as np
import zmq

from cs_runtime import errors, trace
from cs_runtime.process.directory_client import DirectoryClient
from cs_runtime.data.batches import worker_steps
from cs_runtime.data.mnist import DataError
from cs_runtime.data.inputs import InputStream
from cs_runtime.numerics.precision import encode_arrays
from cs_runtime.wire import shm
from cs_runtime.wire.protocol import BATCH_SLOTS, Message, Msg, batch_arrays
from cs_runtime.errors import EXIT_BAD_INPUT
from cs_runtime.run_args import RunArgs, UserFunctions
from cs_runtime.process.service import ProcessEnv
from cs_runtime.wire.transport import Endpoint, host_name

log = logging.getLogger("worker")

PLAN_TIMEOUT_S = 300
STATS_INTERVAL_S = 1.0
SEND_POLL_MS = 250
IDLE_POLL_MS = 250


def serve_inputs(args: RunArgs, fns: UserFunctions) -> None:
    penv = ProcessEnv.from_environ("worker")
    ctx = zmq.Context()
    worker = InputWorker(args, fns, penv, ctx)
    try:
        worker.run()
    except DataError as exc:
        # One line naming the file; the launcher then stops the job (and never restarts it).
        errors.say_error(f"error: worker {penv.rank}: bad input data: {exc}")
        sys.exit(EXIT_BAD_INPUT)
    except Exception as exc:
        code = errors.report(exc, f"worker {penv.rank} on {host_name()}")
        if code is None:
            raise   # ours: with its whole traceback
        sys.exit(code)
    finally:
        worker.stop_heartbeats()   # before the context goes: the thread's socket is in it
        ctx.destroy(linger=0)


class InputWorker:
    def __init__(self, args: RunArgs, fns: UserFunctions, penv: ProcessEnv, ctx: zmq.Context):
        self.args, self.fns, self.penv, self.ctx = args, fns, penv, ctx
        self.batches = 0
        self.busy_s = self.blocked_s = 0.0
        self.started = self.last_report = time.monotonic()
        self.chief: Endpoint | None = None
        self.beat = None   # the heartbeat thread, once registered
        trace.RECORDER.reset(trace.enabled_from_env())

    def run(self) -> None:
        job_dir = DirectoryClient(self.ctx, self.penv.rendezvous, "worker", self.penv.rank, self.penv.job)
        job_dir.register({})
        self.beat = beat = job_dir.start_heartbeats()
        chief = job_dir.lookup(["chief"])["chief"][0]
        cs_system = DirectoryClient(self.ctx, self.penv.cs_ip, "worker", self.penv.rank, self.penv.job)
        wses = cs_system.lookup(["wse"])["wse"]
        phases = self.ask_plan(chief["endpoints"]["router"])
        segments = shm.process_segments()
        lanes = [self.lane_to(wse["endpoints"]["input"], segments) for wse in wses]
        self.started = time.monotonic()
        for phase in phases:
            self.stream(lanes, phase)
        self.report(done=True)
        log.info("worker %d made %d batches for %d WSE(s) in %.1f s (%.1f s in the input function)",
                 self.penv.rank, self.batches, len(wses), time.monotonic() - self.started, self.busy_s)
        # Stay registered until the job ends: the launcher stops us with the rest
        # (the heartbeat thread ends the process when the job is done).
        self.answer_chief_until_done(beat)

    def stop_heartbeats(self) -> None:
        if self.beat is not None:
            self.beat.stop()

    def answer_chief_until_done(self, beat) -> None:
        """After the last batch: hand the chief this worker's spans when it asks (--trace)."""
        while beat.is_alive():
            got = self.chief.recv(IDLE_POLL_MS)
            if got is None:
                continue
            received_ns, msg = trace.now_ns(), got[1]
            if msg.type == Msg.GET_TRACE:
                self.chief.send(trace.reply(msg, "worker", self.penv.rank, received_ns))
            else:
                self.chief.warn_once(None, f"unexpected {msg.type.value} from the chief")

    def lane_to(self, address: str, segments) -> "WseLane":
        to_wse = Endpoint(self.ctx, zmq.DEALER, f"worker{self.penv.rank}->wse", self.penv.job).connect(address)
        if segments is not None:
            to_wse.share_memory(segments)
        return WseLane(to_wse, segments, self.penv.job, f"worker{self.penv.rank}")

    def ask_plan(self, address: str) -> list[dict]:
        self.chief = Endpoint(self.ctx, zmq.DEALER, f"worker{self.penv.rank}->chief", self.penv.job)
        self.chief.connect(address)
        self.chief.send(Message(Msg.HELLO, meta={"role": "worker", "rank": self.penv.rank}))
        got = self.chief.recv(PLAN_TIMEOUT_S * 1000)
        if got is None or got[1].type != Msg.PLAN:
            raise RuntimeError(f"worker {self.penv.rank}: no plan from the chief at {address}")
        return got[1].meta["phases"]

    def open_stream(self, name: str) -> InputStream:
        p = self.args.params
        if name == "train":
            return InputStream.build("train", self.fns.train_input_fn(p), p.train_input, p.runconfig.seed)
        return InputStream.build("eval", self.fns.eval_input_fn(p), p.eval_input, p.runconfig.seed)

    def stream(self, lanes: list["WseLane"], phase: dict) -> None:
        name, p = str(phase["stream"]), self.args.params
        stream = self.open_stream(name)
        section = p.train_input if name == "train" else p.eval_input
        steps = worker_steps(int(phase["start"]), int(phase["stop"]), self.penv.rank, self.penv.num_workers)
        for step, shards in fetched_ahead(stream, steps, len(lanes), section):
            t0 = time.monotonic()
            with trace.span("make_batch", step=step):
                shards = shards()
            self.busy_s += time.monotonic() - t0
            for lane, shard in zip(lanes, shards):
                meta = {"stream": name, "global_batch": shard.global_batch, "worker": self.penv.rank,
                        "row_start": shard.rows.start, "row_stop": shard.rows.stop,
                        "label_count": shard.label_count}
                # The first layer rounds its input to the 16-bit format anyway: send it so.
                arrays = encode_arrays(batch_arrays(shard.x, shard.y), p.precision)
                self.wait_for_room(lane)
                with trace.span("send_batch", step=step):
                    lane.send(Message(Msg.BATCH, step=step, meta={**meta, "format": p.precision},
                                      arrays=lane.placed(arrays)))
            self.batches += 1
            self.maybe_report()

    def wait_for_room(self, lane: "WseLane") -> None:
        """Return once the WSE may take another batch; time spent waiting is 'blocked' (the WSE
        is the slower side)."""
        lane.hear(0)
        t0 = time.monotonic()
        while lane.full():
            lane.hear(SEND_POLL_MS)
            self.blocked_s += time.monotonic() - t0
            t0 = time.monotonic()
            self.maybe_report()

    def maybe_report(self) -> None:
        if time.monotonic() - self.last_report >= STATS_INTERVAL_S:
            self.report(done=False)

    def report(self, done: bool) -> None:
        self.last_report = time.monotonic()
        meta = {"rank": self.penv.rank, "host": host_name(), "batches": self.batches, "busy_s": self.busy_s,
                "blocked_s": self.blocked_s, "elapsed_s": self.last_report - self.started, "done": done}
        self.chief.send(Message(Msg.INPUT_STATS, meta=meta))


class WseLane:
    """This worker's batches to one WSE: the socket, how many were sent and how many the WSE
    is done with (BATCHES_DONE), and, on a shared host, the ring of slots they are copied into."""

    def __init__(self, endpoint: Endpoint, segments, job: str, owner: str):
        self.endpoint, self.segments, self.job, self.owner = endpoint, segments, job, owner
        self.sent = self.done = 0
        self.slots: list[np.ndarray] = []   # made for the first batch: BATCH_SLOTS of its size

    def full(self) -> bool:
        return self.sent - self.done >= BATCH_SLOTS

    def hear(self, timeout_ms: int) -> None:
        """Take the WSE's BATCHES_DONE that wait (the first up to timeout_ms); anything else, or a
        count that is not a running count of the batches sent, is dropped with a line."""
        while True:
            got = self.endpoint.recv(timeout_ms)
            if got is None:
                return
            msg, timeout_ms = got[1], 0
            done = msg.meta.get("done") if msg.type == Msg.BATCHES_DONE else None
            if done is None or not self.done <= done <= self.sent:
                self.endpoint.warn_once(None, f"unexpected {msg.type.value} from the WSE "
                                              f"(done {done}, {self.done} to {self.sent} possible)")
                continue
            self.done = done

    def placed(self, arrays: dict) -> dict:
        """The arrays, those that travel by reference copied into this batch's slot (the caller
        has waited for room: the WSE is done with what the slot held)."""
        if self.segments is None:
            return arrays
        shared = {name: a for name, a in arrays.items() if a.nbytes >= shm.MIN_SHARED_BYTES}
        if not shared:
            return arrays
        if not self.slots:
            self.make_slots(sum(a.nbytes + shm.ALIGN for a in shared.values()))
        slot, used, out = self.slots[self.sent % BATCH_SLOTS], 0, dict(arrays)
        for name, arr in shared.items():
            start = -(-used // shm.ALIGN) * shm.ALIGN
            if start + arr.nbytes > len(slot):
                return arrays   # bigger than the first batch: as frames
            out[name] = slot[start:start + arr.nbytes].view(arr.dtype).reshape(arr.shape)
            np.copyto(out[name], arr)
            used = start + arr.nbytes
        return out

    def make_slots(self, slot_bytes: int) -> None:
        slot_bytes = -(-slot_bytes // shm.ALIGN) * shm.ALIGN
        arena = shm.new_arena(self.job, self.owner, slot_bytes * BATCH_SLOTS)
        whole = arena.empty((slot_bytes * BATCH_SLOTS,), np.uint8)
        self.slots = [whole[i * slot_bytes:(i + 1) * slot_bytes] for i in range(BATCH_SLOTS)]

    def send(self, msg: Message) -> None:
        self.endpoint.send(msg)
        self.sent += 1


def fetched_ahead(stream, steps, num_ranks: int, section):
    """(step, a call giving that step's shards), in step order. With the params'
    num_workers > 0 (PyTorch DataLoader's worker count), that many threads fetch
    up to num_workers * prefetch_factor (default 2) batches ahead; 0 fetches each
    batch when it is asked for, in this thread. Either way the same samples."""
    workers = section.num_workers
    if not workers:
        for step in steps:
            yield step, lambda step=step: stream.shards(step, num_ranks)
        return
    ahead = workers * (section.prefetch_factor or 2)
    pending: collections.deque = collections.deque()
    steps = iter(steps)
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="fetch") as pool:
        def submit() -> None:
            step = next(steps, None)
            if step is not None:
                pending.append((step, pool.submit(stream.shards, step, num_ranks)))
        for _ in range(ahead):
            submit()
        while pending:
            step, future = pending.popleft()
            submit()
            yield step, future.result
