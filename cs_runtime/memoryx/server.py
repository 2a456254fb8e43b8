"""MemoryX: the master copy of every weight and its optimizer state.

Per training step (TRAIN_STEP from the chief) it streams each layer's weights
to SwarmX for the forward pass (layer 0..L-1), then again for the backward
pass (L-1..0), small layers in a row as one message (protocol.layer_groups)
and the last group once, forward and at once backward ("fwd_bwd"); SwarmX
hands back each group's gradients summed over the WSEs, and MemoryX updates
their layers at once (or, with max_gradient_norm or loss scaling, after the
last layer, since clipping needs the global norm and a step with an
overflowed gradient anywhere is skipped whole). Then STEP_DONE to the chief,
with the step's loss when it came with the gradients (protocol.STEP_LOSS).
The chief may send TRAIN_STEPs ahead of their turn: one that comes while a
step runs is queued, and the steps run in order; STEP_DONEs go in bursts
(protocol.ANSWERS_HELD), every held one before any other answer and before
MemoryX waits for a message.

With mixed precision the master weights and optimizer state stay float32
here; weights go out, and gradients come in, in the 16-bit format. Each
layer is encoded just before its forward send (into the shared buffer it is
sent from, on one host), so the WSEs start on layer 0 while the layers after
it are encoded; the backward pass sends the same buffers again.

On one host (shm.py) the master weights, or their 16-bit copies, live in a
shared-memory arena, and WEIGHTS messages refer to them instead of carrying
them.

    python -m cs_runtime.memoryx      (started by csrun_wse or the appliance)
"""
from __future__ import annotations

import collections
import logging
import math

import numpy as np
import zmq

from cs_runtime.checkpoint import flatten, unflatten_for
from cs_runtime.numerics import program_layer
from cs_runtime.numerics.model import ModelSpec
from cs_runtime.numerics.optim import Optimizer, norms_of, squared_norms
from cs_runtime.numerics.precision import encode_arrays, from_bits, to_bits, unscale_and_check, wire_dtype
from cs_runtime.wire import shm
from cs_runtime import trace
from cs_runtime.wire.protocol import (ANSWERS_HELD, STEP_LOSS, JobSettings, KeptBuffers, Message, Msg, burst,
                                      group_message, layer_arrays, layer_groups, unburst)
from cs_runtime.process.service import ProcessEnv, join_cs_system
from cs_runtime.wire.transport import Endpoint

log = logging.getLogger("memoryx")


class MemoryX:
    def __init__(self, penv: ProcessEnv, ctx: zmq.Context):
        self.penv = penv
        self.router = Endpoint(ctx, zmq.ROUTER, "memoryx", penv.job)
        self.address = self.router.bind()
        self.peers: dict[str, bytes] = {}      # role -> identity
        self.spec: ModelSpec | None = None
        self.segments = shm.process_segments()
        if self.segments is not None:
            self.router.share_memory(self.segments)
        self.arena: shm.Arena | None = None
        self.wire: list[dict] | None = None    # 16-bit weight buffers in the arena
        self.grad_buffers: dict[tuple[int, str], np.ndarray] = {}   # 16-bit gradients widened
        self.grad_wire: KeptBuffers | None = None   # gradients as they travel (kept_grads)
        self.queued: collections.deque = collections.deque()   # (identity, TRAIN_STEP) sent ahead
        self.held: list[Message] = []   # STEP_DONEs not yet sent

    def serve(self) -> None:
        while True:
            got = self.queued.popleft() if self.queued else None
            if got is None and self.held:
                got = self.router.recv(0)
            if got is None:
                self.flush()   # about to wait: the chief hears of every step done
                got = self.router.recv()
            self.handle(*got)

    def flush(self) -> None:
        """Send the held STEP_DONEs, in step order."""
        held, self.held = self.held, []
        for msg in burst(held):   # one message (protocol.burst)
            self.router.send(msg, self.peers["chief"])

    def handle(self, identity: bytes, msg: Message) -> None:
        received_ns = trace.now_ns()
        if msg.type != Msg.TRAIN_STEP:
            self.flush()   # the held STEP_DONEs go before any other answer
        if msg.type == Msg.HELLO:
            self.peers[msg.meta["role"]] = identity
        elif msg.type == Msg.LOAD_MODEL:
            self.load_model(msg)
            self.router.send(Message(Msg.ACK, meta={"what": "load_model"}), identity)
        elif msg.type == Msg.TRAIN_STEP:
            msg, *later = unburst(msg)
            self.queued.extendleft((identity, m) for m in reversed(later))   # their turn: next
            self.train_step(msg.step, float(msg.meta["lr"]), float(msg.meta.get("loss_scale", 1.0)),
                            bool(msg.meta.get("norms", True)))
        elif msg.type == Msg.EVAL_STEP:
            self.stream_forward(msg.step, "eval")
        elif msg.type == Msg.GET_STATE:
            state = Message(Msg.STATE, step=msg.step,
                            arrays=flatten(self.weights, self.opt_state))
            self.router.send(state, identity, share=False)   # to the chief, which may be on another host
        elif msg.type == Msg.GET_TRACE:
            self.router.send(trace.reply(msg, "memoryx", self.penv.rank, received_ns), identity, share=False)
        elif msg.type == Msg.JOB_END:
            self.spec, self.queued = None, collections.deque()
            trace.RECORDER.reset(False)
            self.release_arena()
            self.router.send(Message(Msg.ACK, meta={"what": "job_end"}), identity)
        else:
            self.router.warn_once(identity, f"unexpected {msg.type.value}")

    def load_model(self, msg: Message) -> None:
        settings: JobSettings = msg.meta["spec"]     # parsed and checked by protocol.decode
        self.spec = settings.model
        self.optimizer = Optimizer(settings.optimizer)
        self.max_norm = settings.max_gradient_norm
        self.skip_nonfinite = settings.skips_nonfinite
        trace.RECORDER.reset(settings.trace)
        self.weights, self.opt_state = unflatten_for(self.spec, self.optimizer, msg.arrays)
        self.share_weights()
        self.grad_wire = KeptBuffers(self.spec)
        self.groups = layer_groups([4 * sum(math.prod(shape) for shape in layer.param_shapes().values())
                                    for layer in self.spec.layers])
        log.info("loaded %s: %d layers, %d parameters", self.spec.name, len(self.spec.layers),
                 self.spec.num_params())

    def share_weights(self) -> None:
        """On one host: move the masters (float32) or make 16-bit buffers in a shared arena
        (float32 ones for the buffers: running statistics stream unrounded)."""
        self.release_arena()
        fmt = self.spec.precision
        kept = program_layer.buffers(self.spec)
        sizes = [(w.shape, 4 if p in kept else wire_dtype(fmt).itemsize)
                 for layer in self.weights.values() for p, w in layer.items()]
        self.arena = shm.new_arena(self.penv.job, f"memoryx{self.penv.rank}",
                                   sum(shm.arena_bytes([shape], size) for shape, size in sizes))
        if self.arena is None:
            return
        if fmt == "float32":
            self.weights = {name: {p: self.arena.copy_of(w) for p, w in layer.items()}
                            for name, layer in self.weights.items()}
        else:
            self.wire = [{p: self.arena.empty(w.shape, np.float32 if p in kept else wire_dtype(fmt))
                          for p, w in self.weights[l.name].items()} for l in self.spec.layers]

    def release_arena(self) -> None:
        if self.segments is not None:
            self.segments.release(self.arena)
        self.arena, self.wire = None, None
        self.grad_buffers, self.grad_wire = {}, None

    def wire_layer(self, index: int) -> dict:
        """Layer `index`'s weights as they travel: the masters themselves in float32, else
        16-bit copies (encoded straight into the shared buffers that are sent, when shared)."""
        fmt = self.spec.precision
        masters = self.weights[self.spec.layers[index].name]
        kept = program_layer.buffers(self.spec)   # running statistics: float32 in every format
        if self.wire is None:
            return {**encode_arrays({p: w for p, w in masters.items() if p not in kept}, fmt),
                    **{p: w for p, w in masters.items() if p in kept}}
        buffers = self.wire[index]
        for name, out in buffers.items():
            if name in kept:
                np.copyto(out, masters[name])
            else:
                to_bits(masters[name], fmt, out=out)
        return buffers

    def stream_forward(self, step: int, phase: str, **extra) -> list[dict]:
        """Encode each layer just before it is sent (with its group, protocol.layer_groups), so
        that the WSEs start on the first group while the layers after it are encoded; the
        layers as sent (for the backward pass). In a training step the last group goes
        once, "fwd_bwd": the WSEs run it forward and at once backward, with the same
        weights (the backward pass's first group needs no message of its own)."""
        wire = []
        for group in self.groups:
            for index in group:
                with trace.span("encode_weights", step=step, layer=index):
                    wire.append(self.wire_layer(index))
            last = group is self.groups[-1]
            self.stream_weights(step, "fwd_bwd" if last and phase == "fwd" else phase, [group], wire, **extra)
        return wire

    def stream_weights(self, step: int, phase: str, groups, wire: list[dict], **extra) -> None:
        swarmx = self.peers["swarmx"]
        meta = {"phase": phase, "format": self.spec.precision, **extra}
        span_name = "send_" + phase
        for group in groups:
            with trace.span(span_name, step=step, layer=group[0]):
                self.router.send(group_message(Msg.WEIGHTS, step, {i: wire[i] for i in group}, meta), swarmx)

    def kept_grads(self, mtype: Msg, index: int, name: str, dtype: str, shape: tuple) -> np.ndarray | None:
        """Where a GRADS array of several frames is joined (protocol.decode's `into`): a buffer
        per parameter in the dtype it travels in (the model's 16-bit storage from one WSE,
        float32 from one WSE or SwarmX's sums), kept for the job, not fresh pages every step. Safe to
        reuse: a step's gradients are read only within train_step, which ends before the chief
        starts the next step (the optimizer reads them, never keeps them)."""
        if mtype != Msg.GRADS or self.grad_wire is None:
            return None
        return self.grad_wire.get(index, name, dtype, shape)

    def received_grads(self, index: int, arrays: dict, fmt: str) -> dict:
        """Layer `index`'s gradients as float32: 16-bit ones widened into buffers kept for
        the job (no fresh pages every step); float32 ones as they came (no copy)."""
        if fmt == "float32":
            return arrays
        grads = {}
        for name, arr in arrays.items():
            key = (index, name)
            buffer = self.grad_buffers.get(key)
            if buffer is None or buffer.shape != arr.shape:
                buffer = self.grad_buffers[key] = np.empty(arr.shape, np.float32)
            grads[name] = from_bits(arr, fmt, out=buffer) if arr.dtype == wire_dtype(fmt) else arr
        return grads

    def train_step(self, step: int, lr: float, loss_scale: float, norms: bool = True) -> None:
        """One step; the gradient norms only when the chief asks (`norms`) or clipping needs them."""
        n = len(self.spec.layers)
        sent, received = self.router.bytes_sent, self.router.bytes_received
        wire = self.stream_forward(step, "fwd", loss_scale=loss_scale)   # encoded once, sent forward and backward
        # Weights sent zero-copy must not change until they have left: a layer's
        # gradients only arrive after every WSE received its backward weights.
        self.stream_weights(step, "bwd", reversed(self.groups[:-1]), wire)
        # Without clipping or loss scaling each layer is updated as its gradients land;
        # a parameter two layers read (tied) waits for both and takes their sum. With loss
        # scaling each layer is unscaled and checked as it lands, off the step's critical
        # path, and the update waits for the last (inf or nan anywhere skips the step);
        # with tied parameters update_model unscales, after their parts are summed.
        tied = program_layer.has_tied(self.spec)
        at_once = not (self.max_norm or self.skip_nonfinite or loss_scale != 1.0 or tied)
        check_each = (self.skip_nonfinite or loss_scale != 1.0) and not tied
        finite = True
        grads, squares = {}, {}
        # the weights' norms as the step found them (what the step's forward reads): a step's weight-norm read
        started = program_layer.weight_squares(self.spec, self.weights) if norms else None
        step_loss = {}   # the step's loss, when it rides on a GRADS (protocol.STEP_LOSS): on to the chief
        def into(mtype, at_step, index, name, dtype, shape):   # never a buffer a gradient of this step lies in
            if at_step != step or index in grads:
                return None
            return self.kept_grads(mtype, index, name, dtype, shape)
        while len(grads) < n:
            identity, msg = self.router.recv(into=into)
            if msg.type == Msg.TRAIN_STEP:   # sent ahead: its turn comes after this step
                self.queued.extend((identity, m) for m in unburst(msg))
                continue
            if msg.type != Msg.GRADS or msg.step != step:
                self.handle(identity, msg)
                continue
            fmt = msg.meta.get("format", "float32")
            step_loss.update((key, msg.meta[key]) for key in STEP_LOSS if key in msg.meta)
            for index, arrays in reversed(layer_arrays(msg)):   # a group's layers as computed, top first
                # The buffers' new values (running statistics) are kept as they come; the rest are gradients.
                grads[index] = program_layer.take_buffers(self.spec, index, self.received_grads(index, arrays, fmt),
                                                          self.weights[self.spec.layers[index].name])
                if at_once:   # the norm too, while the WSEs compute the layers below
                    if norms:
                        squares[index] = squared_norms(grads[index])
                    self.update(index, grads[index], lr, step)
                elif check_each:
                    finite = unscale_and_check([grads[index]], loss_scale) and finite
                    if norms or self.max_norm:
                        squares[index] = squared_norms(grads[index])
        ordered = [grads[i] for i in range(n)]
        if at_once:
            applied = True
            norm, layer_norms = norms_of(squares[i] for i in range(n)) if norms else (math.nan, [])
        else:
            if self.spec.program is not None:
                ordered = program_layer.tie_grads(self.spec, ordered)
            names = [layer.name for layer in self.spec.layers]
            norm, applied, layer_norms = self.optimizer.update_model(
                names, self.weights, ordered, self.opt_state, lr, step, self.max_norm, loss_scale,
                self.skip_nonfinite, need_norms=norms, copies=program_layer.tied_copies(self.spec),
                found_finite=finite if check_each else None,
                squares=[squares[i] for i in range(n)] if squares else None)
        traffic = {"weight_bytes": self.router.bytes_sent - sent,
                   "grad_bytes": self.router.bytes_received - received}
        if norms and self.spec.program is not None:   # the gradients, unscaled in place, the update left
            traffic["param_grad_norms"] = program_layer.param_grad_norms(
                self.spec, ordered, [squares[i] for i in range(n)] if squares else None)
            traffic["param_norms"] = program_layer.param_norms(self.spec, started, ordered)
        self.held.append(Message(Msg.STEP_DONE, step=step,
                                 meta={"grad_norm": norm, "applied": applied, "layer_grad_norms": layer_norms,
                                       "shared_memory": self.arena is not None, **traffic, **step_loss}))
        if len(self.held) >= ANSWERS_HELD:
            self.flush()

    def update(self, index: int, grads: dict, lr: float, step: int) -> None:
        name = self.spec.layers[index].name
        with trace.span("update", step=step, layer=index):
            self.optimizer.update(self.weights[name], grads, self.opt_state[name], lr)


def main(penv: ProcessEnv, ctx: zmq.Context) -> None:
    server = MemoryX(penv, ctx)
    directory = join_cs_system(penv, ctx, {"router": server.address})  # keep: its socket sends REGISTER
    log.info("MemoryX serving at %s", server.address)
    server.serve()

