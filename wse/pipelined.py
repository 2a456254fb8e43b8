"""Layer-pipelined executor: the whole model lives on the wafer.

At LOAD_MODEL every weight and its optimizer state are loaded once; from then
on a training step is TRAIN_STEP in, LOSS out: the WSE takes its batch,
runs every layer forward and backward, and applies the learning rule to its
own weights in place. No weight crosses a socket until a checkpoint asks for
them (GET_STATE).

Several minibatches are in flight: the input workers stream ahead of the
compute (the PULL socket's queue is filled by ZeroMQ's I/O thread while numpy
computes), so input transfer overlaps compute. The maths stays that of
sequential minibatch SGD: step s+1 sees the weights step s updated, as on the
real wafer where each layer's update lands before the next sample reaches it.

Steps come ahead of their turn and losses go up in bursts (protocol.ANSWERS_HELD), each burst one
message (protocol.burst): a step's LOSS is held while further TRAIN_STEPs wait, and every held one
goes before anything else is sent and before the WSE waits for a message (`flush`).

Multi-replica: with k replicas the WSE's shard is split in k parts, each
"copy" of the model computes its own gradients, and the copies' gradients are
summed on the wafer (in replica order) before the one update.
"""
from __future__ import annotations

import numpy as np

from cs_runtime.data.batches import shard_rows
from cs_runtime.checkpoint import flatten, unflatten_for
from cs_runtime.numerics.local_step import apply_update, forward_backward
from cs_runtime.numerics.model import ShardContext, model_forward, model_loss
from cs_runtime.numerics.optim import Optimizer
from cs_runtime.numerics import program_layer
from cs_runtime.numerics.program_layer import step_outputs
from cs_runtime.data.inputs import take_rows
from cs_runtime.wire.protocol import ANSWERS_HELD, JobSettings, Message, Msg, batch_features, burst, float_arrays


class PipelinedExecutor:
    def __init__(self, settings: JobSettings, arrays: dict, up, inputs):
        self.spec, self.up, self.inputs = settings.model, up, inputs
        self.seed = settings.seed
        self.replicas = settings.replicas
        self.max_norm = settings.max_gradient_norm
        self.skip_nonfinite = settings.skips_nonfinite
        self.optimizer = Optimizer(settings.optimizer)
        self.weights, self.opt_state = unflatten_for(self.spec, self.optimizer, arrays)
        self.held: list[Message] = []   # LOSS messages not yet sent (see above)

    def flush(self) -> None:
        """Send the held LOSS messages, in step order: one message (protocol.burst)."""
        held, self.held = self.held, []
        for msg in burst(held):
            self.up.send(msg)

    def hold(self, loss: Message) -> None:
        self.held.append(loss)
        if len(self.held) >= ANSWERS_HELD:
            self.flush()

    def handle(self, msg: Message) -> bool:
        """Handle a step-level message; False if it is not one of ours."""
        if msg.type == Msg.TRAIN_STEP:
            self.train_step(msg.step, float(msg.meta["lr"]), float(msg.meta.get("loss_scale", 1.0)),
                            bool(msg.meta.get("norms", True)))
        elif msg.type == Msg.EVAL_STEP:
            self.eval_step(msg.step)
        elif msg.type == Msg.GET_STATE:
            self.up.send(Message(Msg.STATE, step=msg.step,
                                 arrays=flatten(self.weights, self.opt_state)))
        else:
            return False
        return True

    def replica_contexts(self, batch: Message, train: bool):
        """(x rows, labels, ShardContext) for each replica's part of this WSE's shard."""
        meta = batch.meta
        start, stop = int(meta["row_start"]), int(meta["row_stop"])
        for r in range(self.replicas):
            part = shard_rows(stop - start, r, self.replicas)
            rows = slice(start + part.start, start + part.stop)
            x, y = batch_features(batch, float_arrays(batch))
            ctx = ShardContext(self.seed, batch.step, int(meta["global_batch"]), rows, train, labels=y[part])
            yield take_rows(x, part), y[part], ctx

    def train_step(self, step: int, lr: float, loss_scale: float, norms: bool = True) -> None:
        batch = self.inputs.take("train", step)
        loss, count, total, outputs = 0.0, 0, None, []
        for x, y, ctx in self.replica_contexts(batch, train=True):
            part, grads, logits = forward_backward(self.spec, x, y, self.weights, ctx, batch.meta.get("label_count"),
                                                   loss_scale, step)
            outputs.append(step_outputs(self.spec, logits))
            loss, count = loss + part.loss, count + len(y)
            total = grads if total is None else [add_into(t, g) for t, g in zip(total, grads)]
        started = program_layer.weight_squares(self.spec, self.weights) if norms else None   # as the step found them
        norm, applied, layer_norms = apply_update(
            self.optimizer, self.spec, self.weights, total, self.opt_state, lr, step, self.max_norm, loss_scale,
            self.skip_nonfinite, need_norms=norms)
        # bytes_in: every array byte this WSE received from above during the step (0: no weights)
        meta = {"loss": loss, "count": count, "grad_norm": norm, "applied": applied, "layer_grad_norms": layer_norms,
                "bytes_in": self.up.take_received(), "input_wait_s": self.inputs.take_wait()}
        if norms and self.spec.program is not None:   # the summed gradients, unscaled in place by the update
            meta["param_grad_norms"] = program_layer.param_grad_norms(self.spec, total)
            meta["param_norms"] = program_layer.param_norms(self.spec, started, total)
        self.hold(Message(Msg.LOSS, step=step, meta=meta, arrays=joined(outputs)))

    def eval_step(self, step: int) -> None:
        batch = self.inputs.take("eval", step)
        loss_sum, correct, count, outputs = 0.0, 0, 0, []
        for x, y, ctx in self.replica_contexts(batch, train=False):
            logits, _ = model_forward(self.spec, x, self.weights, ctx)
            outputs.append(step_outputs(self.spec, logits))
            part = model_loss(self.spec, logits, y, ctx.global_batch, batch.meta.get("label_count"))
            loss_sum, correct, count = loss_sum + part.loss_sum, correct + part.correct, count + part.count
        self.up.send(Message(Msg.EVAL_RESULT, step=step,
                             meta={"loss_sum": loss_sum, "correct": correct, "count": count},
                             arrays=joined(outputs)))


def joined(parts: list[dict]) -> dict:
    """The replicas' step outputs, their rows in replica order."""
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]} if parts else {}


def add_into(total: dict, grads: dict) -> dict:
    for name, g in grads.items():
        total[name] += g
    return total
