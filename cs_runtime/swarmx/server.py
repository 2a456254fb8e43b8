"""SwarmX: broadcast down, reduce up.

Weights (and job set-up) from MemoryX or the chief are sent on to every WSE
by explicit fan-out, forwarding the received frames without decoding the
arrays again (zero-copy). Gradients, losses, eval results and acks from the
WSEs are summed once all N have arrived, in rank order so the sum does not
depend on which WSE was faster, and handed up: gradients to MemoryX,
everything else to the chief. Sums are float32: 16-bit gradients come in at
half the bytes and their sum goes on unrounded (docs/design.md, mixed precision).
The arrays of a loss or an eval result (the model's output, when the job asked
for it) are rows of each WSE's shard: they are joined in rank order, not summed.
An ALL_REDUCE (a synchronized batch norm's per-shard sums, in float64) is summed
the same way and sent back down to every WSE.

    python -m cs_runtime.swarmx      (started by csrun_wse or the appliance)
"""
from __future__ import annotations

import logging

import numpy as np
import zmq

from cs_runtime.wire import shm
from cs_runtime import trace
from cs_runtime.numerics.precision import add_from_bits, from_bits, wire_dtype
from cs_runtime.wire.protocol import (ALL_REDUCE_ARRAY, JobSettings, Message, Msg, encode, float_arrays, grouped_name,
                                      layer_arrays)
from cs_runtime.process.service import ProcessEnv, join_cs_system
from cs_runtime.wire.transport import Endpoint

log = logging.getLogger("swarmx")

# TRAIN_STEP, EVAL_STEP and GET_STATE come from the chief in layer-pipelined
# mode, where the WSE holds the weights and MemoryX is not involved.
BROADCAST = {Msg.WEIGHTS, Msg.LOAD_MODEL, Msg.JOB_END, Msg.TRAIN_STEP, Msg.EVAL_STEP, Msg.GET_STATE}
REDUCE = {Msg.GRADS, Msg.LOSS, Msg.EVAL_RESULT, Msg.ACK, Msg.STATE, Msg.ALL_REDUCE}
GATHER = {Msg.LOSS, Msg.EVAL_RESULT}   # arrays: each WSE's rows of the batch, joined
NOT_SUMMED = {"layers"}   # numbers in meta that say what a message holds, the same from every WSE
REDUCE_SPAN = {Msg.GRADS: "reduce_grads", Msg.LOSS: "reduce_loss", Msg.EVAL_RESULT: "reduce_eval",
               Msg.ACK: "reduce_ack", Msg.STATE: "gather_state", Msg.ALL_REDUCE: "all_reduce"}


def reduce_messages(parts: list[Message], into: dict[str, np.ndarray] | None = None) -> Message:
    """Sum the arrays and the numeric meta of one message from each WSE (in rank order).

    Tensors are summed in float32 and the sum goes on in float32, whatever
    format the parts came in: a 16-bit gradient is rounded once, where the
    WSE's matmul emits it, and never again (MemoryX updates float32 masters,
    so rounding the sum to 16 bits would only add error). One part is sent on
    as it is (by reference, when it lies in shared memory). With `into` (a
    float32 buffer per tensor, in shared memory) the sums land there.
    """
    first = parts[0]
    if len(parts) == 1:
        return first
    fmt = first.meta.get("format", "float32")
    arrays = {}
    gathered = [float_arrays(p) for p in parts] if first.type in GATHER else None
    for name, arr in first.arrays.items():
        if gathered is not None:   # model outputs: each WSE's rows, in rank order
            arrays[name] = np.concatenate([g[name] for g in gathered])
            continue
        out = into[name] if into is not None else None
        if fmt != "float32" and arr.dtype == wire_dtype(fmt):
            # 16 bits: the first part widened into the sum's buffer, each other part
            # widened block by block as it is added (no float32 copy of any part)
            total = from_bits(arr, fmt, out=out)
            for other in parts[1:]:
                add_from_bits(total, other.arrays[name], fmt)
        else:
            total = np.add(arr, parts[1].arrays[name], out=out)
            for other in parts[2:]:
                total += other.arrays[name]
        arrays[name] = total
    meta = dict(first.meta)
    if "format" in meta:
        meta["format"] = "float32"
    for key, value in first.meta.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in NOT_SUMMED:
            meta[key] = sum(p.meta[key] for p in parts)
    return Message(first.type, first.job, first.step, first.layer, meta, arrays)


class SwarmX:
    def __init__(self, penv: ProcessEnv, ctx: zmq.Context):
        self.penv = penv
        self.num_wse = penv.num_csx
        self.router = Endpoint(ctx, zmq.ROUTER, "swarmx", penv.job)
        self.address = self.router.bind()
        self.segments = shm.process_segments()
        if self.segments is not None:
            self.router.share_memory(self.segments)
        self.memoryx: Endpoint | None = None
        self.wse: dict[int, bytes] = {}       # rank -> identity
        self.chief: bytes | None = None
        self.pending: dict[tuple, dict[int, Message]] = {}
        self.arena: shm.Arena | None = None
        self.sums: dict[int, dict[str, np.ndarray]] = {}   # layer -> tensor -> its summed gradient
        # Broadcasts that came before every WSE said HELLO (a chief that starts faster than the
        # WSEs connect); sent, in order, once the last one has.
        self.early: list[list] = []

    def connect_memoryx(self, ctx: zmq.Context, address: str) -> None:
        self.memoryx = Endpoint(ctx, zmq.DEALER, "swarmx->memoryx", self.penv.job).connect(address)
        if self.segments is not None:   # weights by reference from MemoryX, gradients on to it
            self.memoryx.share_memory(self.segments)
        self.memoryx.send(Message(Msg.HELLO, meta={"role": "swarmx", "rank": self.penv.rank}))

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router.sock, zmq.POLLIN)
        poller.register(self.memoryx.sock, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self.memoryx.sock in ready:
                self.from_above(*self.memoryx.recv_raw())
            if self.router.sock in ready:
                self.from_router(*self.router.recv_raw())

    def from_above(self, identity, frames) -> None:
        # Validated, but a WEIGHTS message's arrays not built: its frames go on as they came,
        # and joining a split tensor here would only copy it into fresh pages for nothing.
        msg = self.memoryx.decode_or_drop(identity, frames, build=False)
        if msg is None:
            return
        if msg.type in BROADCAST:
            with trace.span("broadcast", step=msg.step, layer=msg.layer):
                self.broadcast(frames)
        else:
            self.router.warn_once(b"memoryx", f"unexpected {msg.type.value} from MemoryX")

    def from_router(self, identity, frames) -> None:
        received_ns = trace.now_ns()
        msg = self.router.decode_or_drop(identity, frames)
        if msg is None:
            return
        if msg.type == Msg.HELLO:
            self.hello(identity, msg)
        elif identity == self.chief and msg.type == Msg.GET_TRACE:
            self.broadcast(frames)    # each WSE answers with its own TRACE, passed on below
            self.router.send(trace.reply(msg, "swarmx", self.penv.rank, received_ns), self.chief, share=False)
        elif identity == self.chief and msg.type in BROADCAST:
            if msg.type == Msg.LOAD_MODEL:
                settings: JobSettings = msg.meta["spec"]     # parsed and checked by protocol.decode
                self.prepare_sums(settings)
                trace.RECORDER.reset(settings.trace)
            if msg.type == Msg.JOB_END:
                trace.RECORDER.reset(False)
                if self.segments is not None:
                    self.release_sums()
                    self.segments.forget_peers(self.penv.job)
            self.broadcast(frames)
        elif identity in self.wse.values() and msg.type == Msg.TRACE and self.chief is not None:
            self.router.forward(frames, self.chief)
        elif identity in self.wse.values() and msg.type in REDUCE:
            self.collect(identity, msg, frames)
        elif identity in self.wse.values() and msg.type == Msg.ERROR:
            self.router.send(msg, self.chief)
        else:
            self.router.warn_once(identity, f"unexpected {msg.type.value}")

    def hello(self, identity: bytes, msg: Message) -> None:
        role, rank = msg.meta["role"], msg.meta["rank"]
        if role == "wse" and 0 <= rank < self.num_wse:
            self.wse[rank] = identity
            if len(self.wse) == self.num_wse:
                early, self.early = self.early, []
                for frames in early:
                    self.broadcast(frames)
        elif role == "chief":
            self.chief = identity
        else:
            self.router.warn_once(identity, f"hello from unexpected {role} {rank}")

    def broadcast(self, frames: list) -> None:
        if len(self.wse) < self.num_wse:
            self.early.append(frames)
            return
        for rank in range(self.num_wse):
            self.router.forward(frames, self.wse[rank])

    def prepare_sums(self, settings: JobSettings) -> None:
        """Weight streaming with several WSEs on one host: buffers in shared memory
        for the summed gradients, so they reach MemoryX by reference, not over tcp."""
        self.release_sums()
        if self.segments is None or self.num_wse < 2 or settings.pipelined:
            return
        spec = settings.model
        shapes = {(i, name): shape for i, layer in enumerate(spec.layers)
                  for name, shape in layer.param_shapes().items()}
        dtype = np.dtype(np.float32)   # sums stay float32, whatever the gradients' format
        self.arena = shm.new_arena(self.penv.job, f"swarmx{self.penv.rank}",
                                   shm.arena_bytes(shapes.values(), dtype.itemsize))
        if self.arena is not None:
            for (index, name), shape in shapes.items():
                self.sums.setdefault(index, {})[name] = self.arena.empty(shape, dtype)

    def release_sums(self) -> None:
        if self.segments is not None:
            self.segments.release(self.arena)
        self.arena, self.sums = None, {}

    def sum_buffers(self, msg: Message) -> dict[str, np.ndarray] | None:
        """Where a GRADS message's sums land (shared buffers, named as its arrays), or None."""
        if not self.sums:
            return None
        if "layers" not in msg.meta:
            return self.sums.get(msg.layer)
        return {grouped_name(index, name): buffer for index, _ in layer_arrays(msg)
                for name, buffer in self.sums.get(index, {}).items()}

    def collect(self, identity: bytes, msg: Message, frames: list) -> None:
        if self.num_wse == 1:   # nothing to sum: the validated frames go on as they came
            with trace.span(REDUCE_SPAN[msg.type], step=msg.step, layer=msg.layer):
                if msg.type == Msg.ALL_REDUCE:
                    self.router.forward(frames, identity)
                elif msg.type == Msg.GRADS:
                    self.memoryx.forward(frames)
                else:
                    self.router.forward(frames, self.chief)
            return
        rank = next(r for r, i in self.wse.items() if i == identity)
        if "then" in msg.meta:   # bursts come from a pipelined WSE, alone: summed, one would count as one step
            self.router.send(Message(Msg.ERROR, meta={"role": "swarmx", "rank": self.penv.rank, "reason": (
                f"a burst of {msg.type.value} from WSE {rank} of {self.num_wse}: only one WSE may send one")}),
                self.chief)
            return
        key = (msg.type, msg.step, msg.layer, msg.meta.get("what"))
        parts = self.pending.setdefault(key, {})
        parts[rank] = msg
        if len(parts) < self.num_wse:
            return
        del self.pending[key]
        if msg.type == Msg.ALL_REDUCE and len({p.arrays[ALL_REDUCE_ARRAY].shape for p in parts.values()}) > 1:
            # The WSEs run one program, so the n-th collective of a step has one length on all:
            # anything else is a fault, and summing it would hand every WSE wrong statistics.
            self.router.send(Message(Msg.ERROR, meta={"role": "swarmx", "rank": self.penv.rank, "reason": (
                f"all_reduce {msg.layer} of step {msg.step}: the WSEs sent vectors of different lengths "
                f"{[len(parts[r].arrays[ALL_REDUCE_ARRAY]) for r in sorted(parts)]}")}), self.chief)
            return
        # A layer's buffers are free again: MemoryX applied last step's sums before this step began.
        into = self.sum_buffers(msg) if msg.type == Msg.GRADS else None
        with trace.span(REDUCE_SPAN[msg.type], step=msg.step, layer=msg.layer):
            reduced = reduce_messages([parts[r] for r in range(self.num_wse)], into)
            if reduced.type == Msg.GRADS:
                self.memoryx.send(reduced)
            elif reduced.type == Msg.ALL_REDUCE:   # the sums back down, the same bytes to each WSE
                frames = encode(reduced)
                for r in range(self.num_wse):
                    self.router.forward(frames, self.wse[r])
            else:
                self.router.send(reduced, self.chief)


def main(penv: ProcessEnv, ctx: zmq.Context) -> None:
    server = SwarmX(penv, ctx)
    directory = join_cs_system(penv, ctx, {"router": server.address})
    memoryx = directory.lookup(["memoryx"])["memoryx"][0]
    server.connect_memoryx(ctx, memoryx["endpoints"]["router"])
    log.info("SwarmX serving at %s for %d WSE(s)", server.address, server.num_wse)
    server.serve()

