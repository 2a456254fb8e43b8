"""The WSE emulator: executes layers as their weights stream in.

Weight-streaming executor. For one training step the WSE receives, in order:
WEIGHTS(fwd, 0..L-1) then WEIGHTS(bwd, L-1..0), small layers in a row as one
message (protocol.layer_groups) and the last group once ("fwd_bwd": forward,
then at once backward). On fwd 0 it takes its shard of the step's batch from
the input workers; each forward layer keeps its activations resident; after
the last layer it computes the loss and the output delta; each backward
layer turns the delta into the layer's weight gradients (a group's go to
SwarmX as one GRADS, for the sum over WSEs; the last also carries the loss,
protocol.STEP_LOSS) and the delta for the layer below. Eval steps stream WEIGHTS(eval, ...) and end in an
EVAL_RESULT instead. With mixed precision, weights arrive and gradients
leave in the 16-bit format, and the output delta is multiplied by the step's
loss scale (sent with the forward weights); each layer's weights are widened
to float32 once a step, in the forward pass, into buffers kept for the job,
and the backward pass uses that copy. On one host (cs_runtime/wire/shm.py)
weights are read where MemoryX keeps them, and gradients are written into
this WSE's shared arena, one buffer per tensor, reused every step.

A synchronized batch norm (SyncBatchNorm) sums its statistics over the WSEs
in the middle of a layer: the op hands this WSE's per-channel sums to
`WSE.all_reduce`, which sends them to SwarmX as ALL_REDUCE (numbered in the
order the step runs them) and waits for the sums over every WSE; what
arrives meanwhile (the step's later weights) is handled after, in order.
With one WSE there is nothing to wait for: its shard is the whole batch.

Input batches arrive on a ROUTER socket from one or more input workers in any
order; `InputMerger` hands them out in (stream, step) order, so results never
depend on how many workers there are or which is faster, and checks each
before the model sees it (cs_runtime/numerics/batch_check.py): a bad sample
ends this process with one line naming the worker, step and sample, exit 2.
It tells each worker how many of its batches it is done with (BATCHES_DONE:
protocol.BATCH_SLOTS), which bounds how far the worker runs ahead and when it
may write a batch's shared-memory slot again (on one host the batches' arrays
are read where the worker put them).
"""
from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np
import zmq

from cs_runtime.wire import shm
from cs_runtime import trace
from cs_runtime.numerics.batch_check import BadBatch, bad_input_line, check_batch
from cs_runtime.numerics.model import ModelSpec, ShardContext, layer_backward, layer_forward, model_loss
from cs_runtime.numerics.program_layer import buffers_sent, step_outputs
from cs_runtime.numerics.precision import encode_arrays, from_bits, scaled, wire_dtype
from cs_runtime.wire.protocol import (ALL_REDUCE_ARRAY, BATCHES_DONE_EVERY, JobSettings, KeptBuffers, Message,
                                      Msg, ProtocolError, batch_features, float_arrays, group_message, layer_arrays,
                                      unburst)
from cs_runtime.process.service import BadInput, ProcessEnv
from cs_runtime.wire.transport import Endpoint
from wse.pipelined import PipelinedExecutor

log = logging.getLogger("wse")

class InputMerger:
    """Buffers BATCH messages and returns them in the order the WSE asks for them; tells each
    worker how many of its batches it is done with (BATCHES_DONE)."""

    def __init__(self, pull: Endpoint):
        self.pull = pull
        self.buffer: dict[tuple[str, int], tuple[bytes, Message]] = {}   # with the sending worker
        self.spec: ModelSpec | None = None   # the loaded model, which every batch is checked against
        self.waited_s = 0.0  # time the WSE sat idle for want of input (reported with each loss)
        self.forget()

    def forget(self) -> None:
        """A new job: no batch buffered, held or counted."""
        self.buffer.clear()
        self.holding: bytes | None = None    # the worker of the batch taken last (in use until the next)
        self.done: dict[bytes, int] = {}     # worker -> its batches this WSE is done with
        self.told: dict[bytes, int] = {}     # worker -> the count it was last told

    def release(self) -> None:
        """The batch taken last is done with (the WSE takes the next: steps are lockstep)."""
        worker, self.holding = self.holding, None
        if worker is not None:
            self.done[worker] = self.done.get(worker, 0) + 1
            if self.done[worker] - self.told.get(worker, 0) >= BATCHES_DONE_EVERY:
                self.tell(worker)

    def tell(self, worker: bytes) -> None:
        self.told[worker] = self.done[worker]
        self.pull.send(Message(Msg.BATCHES_DONE, meta={"done": self.done[worker]}), worker)

    def tell_all(self) -> None:
        """Before waiting for input: every worker knows all it may send (none waits on us)."""
        for worker, done in self.done.items():
            if done != self.told.get(worker):
                self.tell(worker)

    def take_wait(self) -> float:
        """Seconds waited for input since the previous call."""
        waited, self.waited_s = self.waited_s, 0.0
        return waited

    def take(self, stream: str, step: int, poll_ms: int = 1000) -> Message:
        key = (stream, step)
        t0 = time.monotonic()
        try:
            with trace.span("input_wait", step=step):
                batch = self._take(key, poll_ms)
        finally:
            self.waited_s += time.monotonic() - t0
        self.check(batch)
        return batch

    def check(self, batch: Message) -> None:
        if self.spec is None:
            return
        try:
            try:
                x, y = batch_features(batch, float_arrays(batch))
            except ProtocolError as exc:
                raise BadBatch(str(exc)) from None
            check_batch(self.spec, x, y)
        except BadBatch as exc:
            meta = batch.meta
            raise BadInput(bad_input_line(exc, str(meta["stream"]), batch.step, int(meta["row_start"]),
                                          f"input worker {meta.get('worker', '?')}")) from None

    def _take(self, key: tuple[str, int], poll_ms: int) -> Message:
        stream, step = key
        self.release()
        if key not in self.buffer:
            self.receive(0)
        if key not in self.buffer:
            self.tell_all()
        while key not in self.buffer:
            if not self.receive(poll_ms):
                log.debug("waiting for input %s step %d", stream, step)
        self.holding, batch = self.buffer.pop(key)
        return batch

    def receive(self, timeout_ms: int) -> bool:
        """Buffer the batches waiting on the socket (the first up to timeout_ms); whether any came."""
        came = False
        while True:
            got = self.pull.recv(timeout_ms)
            if got is None:
                return came
            (worker, msg), timeout_ms = got, 0
            if msg.type != Msg.BATCH:
                self.pull.warn_once(worker, f"unexpected {msg.type.value} on the input socket")
                continue
            self.buffer[(msg.meta["stream"], msg.step)] = (worker, msg)
            came = True


class WeightStreamingExecutor:
    def __init__(self, spec: ModelSpec, seed: int, up: Endpoint, inputs: InputMerger,
                 arena: shm.Arena | None = None, reduce=None):
        self.spec, self.seed, self.up, self.inputs = spec, seed, up, inputs
        self.arena = arena
        self.reduce = reduce   # ShardContext.reduce: WSE.all_reduce with several WSEs, else None
        self.grad_buffers: dict[tuple[int, str], object] = {}
        self.weight_buffers = KeptBuffers(spec)
        # 16-bit formats: each layer's weights widened to float32, into buffers reused every
        # step, once per step: the forward pass's copy serves the backward pass too.
        self.widened: dict[int, dict[str, np.ndarray]] = {}
        self.reset()

    def reset(self) -> None:
        self.step = -1
        self.x = None
        self.labels = None
        self.ctx: ShardContext | None = None
        self.caches: list = []
        self.buffers: dict[int, dict] = {}   # layer -> its buffers' new values, sent with its gradients
        self.delta = None
        self.loss_scale = 1.0
        self.step_loss: dict | None = None   # this step's LOSS fields, sent with its last GRADS

    def on_weights(self, msg: Message) -> None:
        """A WEIGHTS message: one layer, or a group of small ones (protocol.layer_groups),
        run forward lowest first, or backward highest first with one GRADS message back."""
        phase, fmt = msg.meta["phase"], msg.meta.get("format", "float32")
        layers = layer_arrays(msg)
        if phase not in ("fwd", "eval", "bwd", "fwd_bwd"):
            raise ValueError(f"unknown weights phase {phase!r} for layer {msg.layer}")
        if phase != "bwd":
            self.loss_scale = float(msg.meta.get("loss_scale", 1.0))
            for index, arrays in layers:
                with trace.span("recv_weights", step=msg.step, layer=index):
                    weights = self.widen(msg.step, index, arrays, fmt, "eval" if phase == "eval" else "fwd")
                self.forward(msg.step, index, weights, train=phase != "eval")
        if phase in ("bwd", "fwd_bwd"):   # fwd_bwd: the last group, forward then at once backward
            grads = {}
            for index, arrays in reversed(layers):
                with trace.span("recv_weights", step=msg.step, layer=index):
                    weights = self.widen(msg.step, index, arrays, fmt, "bwd")
                grads[index] = self.backward(msg.step, index, weights)
            meta = {"format": self.spec.precision}
            if msg.layer == 0 and self.step_loss is not None:   # the step's last GRADS
                meta.update(self.step_loss)
                self.step_loss = None
            with trace.span("send_grads", step=msg.step, layer=msg.layer):
                self.up.send(group_message(Msg.GRADS, msg.step, grads, meta))

    def widen(self, step: int, index: int, arrays: dict, fmt: str, phase: str) -> dict:
        """Layer `index`'s weights as float32 values. float32 arrives as it is used (no copy).
        16-bit weights are widened in the forward pass; the backward pass of the same
        step reuses them: MemoryX encodes a step's weights once and streams the same
        values forward and backward (it updates a layer only after its gradients)."""
        if fmt == "float32":
            return arrays
        if phase == "bwd":
            if step != self.step or index not in self.widened:
                raise RuntimeError(f"backward weights for layer {index} of step {step} out of order")
            return self.widened[index]
        buffers = self.widened.setdefault(index, {})
        for name, arr in arrays.items():
            if arr.dtype != wire_dtype(fmt):     # not a tensor of the format (none today): as it is
                buffers[name] = arr
                continue
            buffer = buffers.get(name)
            if buffer is None or buffer.shape != arr.shape:
                buffer = buffers[name] = np.empty(arr.shape, np.float32)
            from_bits(arr, fmt, out=buffer)
        return buffers

    def forward(self, step: int, index: int, weights: dict, train: bool) -> None:
        if index == 0:
            self.start_step(step, "train" if train else "eval", train)
        elif step != self.step or len(self.caches) != index:
            raise RuntimeError(f"forward weights for layer {index} of step {step} out of order")
        # Weights arrive in the model's format: exact values of it, nothing to round.
        with trace.span("fwd" if train else "eval_fwd", step=step, layer=index):
            out, cache = layer_forward(self.spec, index, self.x, weights, self.ctx, weights_rounded=True)
        if train:   # the buffers' new values (running statistics) go up with this layer's gradients
            self.buffers[index] = buffers_sent(self.spec, index, out, self.ctx)
        self.caches.append(cache)
        self.x = out
        if index == len(self.spec.layers) - 1:
            self.finish_forward(step, train)

    def start_step(self, step: int, stream: str, train: bool) -> None:
        batch = self.inputs.take(stream, step)
        meta = batch.meta
        self.step, self.caches, self.buffers = step, [], {}
        self.x, self.labels = batch_features(batch, float_arrays(batch))
        self.ctx = ShardContext(self.seed, step, int(meta["global_batch"]),
                                slice(int(meta["row_start"]), int(meta["row_stop"])), train, labels=self.labels,
                                reduce=self.reduce)
        self.label_count = meta.get("label_count")

    def finish_forward(self, step: int, train: bool) -> None:
        with trace.span("loss", step=step):
            result = model_loss(self.spec, self.x, self.labels, self.ctx.global_batch, self.label_count)
        outputs = step_outputs(self.spec, self.x)   # the model's output rows, when the job asked for them
        if train:
            self.delta = scaled(result.delta, self.loss_scale)
            meta = {"loss": result.loss, "count": len(self.labels), "bytes_in": self.up.take_received(),
                    "input_wait_s": self.inputs.take_wait()}
            if outputs:   # the output rows go up as LOSS, which SwarmX joins in rank order
                # share=False: for the chief, which maps no segment (an output may be a view of
                # the batch, which lies in a worker's)
                self.up.send(Message(Msg.LOSS, step=step, meta=meta, arrays=outputs), share=False)
            else:         # rides on the step's last GRADS (protocol.STEP_LOSS)
                self.step_loss = meta
        else:
            self.up.send(Message(Msg.EVAL_RESULT, step=step, meta={
                "loss_sum": result.loss_sum, "correct": result.correct, "count": result.count}, arrays=outputs),
                share=False)
            self.caches = []

    def backward(self, step: int, index: int, weights: dict) -> dict:
        """Layer `index` backward: its gradients as they travel (in this WSE's arena, when shared)."""
        if step != self.step or index != len(self.caches) - 1 or self.delta is None:
            raise RuntimeError(f"backward weights for layer {index} of step {step} out of order")
        with trace.span("bwd", step=step, layer=index):
            self.delta, grads = layer_backward(self.spec, index, self.delta, self.caches.pop(), weights,
                                               weights_rounded=True, grads_on_wire=True)
        # Buffers travel as float32 in any format: running statistics are not rounded.
        return self.shared(index, {**encode_arrays(grads, self.spec.precision), **self.buffers.pop(index, {})})

    def weight_buffer(self, index: int, name: str, dtype: str, shape: tuple) -> np.ndarray | None:
        """Layer `index`'s buffer for weight `name` as it travels (in `dtype`, the message's:
        float32 or the model's 16-bit storage), kept for the job: a WEIGHTS array that arrives
        in several frames is joined into it, not into fresh pages every message
        (protocol.decode's `into`). None for what the model does not have, or not of this
        `shape` (decoded as usual; the executor then refuses it).

        Reusing it is safe: messages are decoded one at a time, each after the previous one
        was handled, and the only earlier message of the same layer still referenced (by
        the forward cache, when layer l's backward weights arrive) carried the same bytes:
        MemoryX updates a layer only after the gradients that this backward pass sends."""
        return self.weight_buffers.get(index, name, dtype, shape)

    def grad_buffer(self, index: int, name: str, shape: tuple, dtype) -> np.ndarray:
        """Layer `index`'s buffer for gradient `name` in this WSE's arena, reused every step."""
        buffer = self.grad_buffers.get((index, name))
        if buffer is None:
            buffer = self.grad_buffers[(index, name)] = self.arena.empty(shape, dtype)
        return buffer

    def shared(self, index: int, arrays: dict) -> dict:
        """The arrays in this WSE's arena (sent by reference), or as they are without one."""
        if self.arena is None:
            return arrays
        out = {}
        for name, arr in arrays.items():
            out[name] = self.grad_buffer(index, name, arr.shape, arr.dtype)
            if out[name] is not arr:
                np.copyto(out[name], arr)
        return out


class WSE:
    def __init__(self, penv: ProcessEnv, ctx: zmq.Context):
        self.penv = penv
        self.pull = Endpoint(ctx, zmq.ROUTER, f"wse{penv.rank}-input", penv.job)
        self.input_address = self.pull.bind()
        self.inputs = InputMerger(self.pull)
        self.up: Endpoint | None = None
        self.executor: WeightStreamingExecutor | None = None
        self.segments = shm.process_segments()
        if self.segments is not None:
            self.pull.share_memory(self.segments)
        self.arena: shm.Arena | None = None
        self.backlog: deque[Message] = deque()   # what came while an all-reduce waited, handled next
        self.collective = (-1, 0)   # (step, its collectives sent so far): the next ALL_REDUCE's number

    def connect_swarmx(self, ctx: zmq.Context, address: str) -> None:
        self.up = Endpoint(ctx, zmq.DEALER, f"wse{self.penv.rank}->swarmx", self.penv.job).connect(address)
        if self.segments is not None:
            self.up.share_memory(self.segments)
        self.up.send(Message(Msg.HELLO, meta={"role": "wse", "rank": self.penv.rank}))

    def make_executor(self, msg: Message):
        """The executor of LOAD_MODEL's settings; the timeline recorder set as they say."""
        settings: JobSettings = msg.meta["spec"]     # parsed and checked by protocol.decode
        trace.RECORDER.reset(settings.trace)
        spec = settings.model
        self.inputs.spec = spec
        if settings.pipelined:
            return PipelinedExecutor(settings, msg.arrays, self.up, self.inputs)
        shapes = [s for layer in spec.layers for s in layer.param_shapes().values()]
        self.arena = shm.new_arena(self.penv.job, f"wse{self.penv.rank}",
                                   shm.arena_bytes(shapes, wire_dtype(spec.precision).itemsize))
        return WeightStreamingExecutor(spec, settings.seed, self.up, self.inputs, self.arena,
                                       self.all_reduce if self.penv.num_csx > 1 else None)

    def serve(self) -> None:
        while True:
            if self.backlog:   # what came while an all-reduce waited
                self.handle(self.backlog.popleft())
                continue
            holding = isinstance(self.executor, PipelinedExecutor) and self.executor.held
            got = self.up.recv(0, into=self.kept_weights) if holding else None
            if got is None:
                if holding:
                    self.executor.flush()   # about to wait: the chief hears of every step done
                got = self.up.recv(into=self.kept_weights)
            first, *later = unburst(got[1])
            self.backlog.extendleft(reversed(later))   # a burst's later steps: next, before anything newer
            self.handle(first)

    def all_reduce(self, values: np.ndarray) -> np.ndarray:
        """The sum over every WSE of `values` (this WSE's: a float64 vector), for the step's
        next collective (ShardContext.reduce). Every WSE runs the same program, so the n-th
        collective of a step is the same on each: SwarmX sums the n-th ALL_REDUCEs in rank order
        and sends the sum to all. The answer must be that one, of the length sent; anything
        else in the meantime waits in the backlog."""
        step = self.executor.step
        number = self.collective[1] if self.collective[0] == step else 0
        self.collective = (step, number + 1)
        sums = np.ascontiguousarray(values, dtype=np.float64)
        with trace.span("all_reduce", step=step, layer=number):
            self.up.send(Message(Msg.ALL_REDUCE, step=step, layer=number, arrays={ALL_REDUCE_ARRAY: sums}),
                         share=False)
            while True:
                _, msg = self.up.recv(into=self.kept_weights)
                if msg.type != Msg.ALL_REDUCE:
                    self.backlog.append(msg)
                    continue
                summed = msg.arrays[ALL_REDUCE_ARRAY]   # protocol.check_all_reduce: one float64 vector
                if (msg.step, msg.layer) != (step, number) or summed.shape != sums.shape:
                    raise RuntimeError(f"all_reduce {number} of step {step}: SwarmX answered collective "
                                       f"{msg.layer} of step {msg.step} with {summed.shape[0]} values, "
                                       f"not {sums.shape[0]}")
                return summed

    def kept_weights(self, mtype: Msg, step: int, index: int, name: str, dtype: str,
                     shape: tuple) -> np.ndarray | None:
        """Where a streamed weight of several frames is joined (protocol.decode's `into`)."""
        if mtype != Msg.WEIGHTS or not isinstance(self.executor, WeightStreamingExecutor):
            return None
        return self.executor.weight_buffer(index, name, dtype, shape)

    def handle(self, msg: Message) -> None:
        if isinstance(self.executor, PipelinedExecutor) and msg.type != Msg.TRAIN_STEP:
            self.executor.flush()   # the held losses go before any other answer
        if msg.type == Msg.GET_TRACE:
            received_ns = trace.now_ns()
            self.up.send(trace.reply(msg, "wse", self.penv.rank, received_ns), share=False)
        elif msg.type == Msg.LOAD_MODEL:
            self.executor = self.make_executor(msg)
            self.up.send(Message(Msg.ACK, meta={"what": "load_model"}))
        elif msg.type == Msg.WEIGHTS and isinstance(self.executor, WeightStreamingExecutor):
            self.executor.on_weights(msg)
        elif isinstance(self.executor, PipelinedExecutor) and self.executor.handle(msg):
            pass
        elif msg.type == Msg.JOB_END:
            trace.RECORDER.reset(False)
            self.executor = None
            self.inputs.forget()
            self.inputs.spec = None
            if self.segments is not None:
                self.segments.release(self.arena)
                self.segments.forget_peers(self.penv.job)
            self.arena = None
            self.up.send(Message(Msg.ACK, meta={"what": "job_end"}))
        else:
            self.up.warn_once(None, f"unexpected {msg.type.value} (model loaded: {self.executor is not None})")
