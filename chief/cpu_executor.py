"""The CPU path: the whole model, the whole global batch, one process.

This is the oracle every distributed mode is tested against. It uses the same
kernels (cs_runtime.model), the same input pipeline (cs_runtime.inputs) and
the same optimizer (cs_runtime.optim) as the CS system, layer by layer.
"""
from __future__ import annotations

from cs_runtime import trace
from cs_runtime.data.inputs import InputStream, eval_steps
from cs_runtime.numerics.batch_check import BadBatch, bad_input_line, check_batch
from cs_runtime.numerics.local_step import apply_update, forward_backward
from cs_runtime.numerics.model import ShardContext, model_forward, model_loss
from cs_runtime.numerics.optim import Optimizer
from cs_runtime.run_args import RunArgs, RunError, UserFunctions


def build_streams(args: RunArgs, fns: UserFunctions) -> dict[str, InputStream]:
    p = args.params
    streams = {"train": InputStream.build("train", fns.train_input_fn(p), p.train_input, p.runconfig.seed)}
    if fns.eval_input_fn is not None and args.mode in ("eval", "train_and_eval"):
        streams["eval"] = InputStream.build("eval", fns.eval_input_fn(p), p.eval_input, p.runconfig.seed)
    return streams


class CpuExecutor:
    device = "CPU"

    def __init__(self, args: RunArgs, fns: UserFunctions, spec):
        self.spec, self.params = spec, args.params
        self.streams = build_streams(args, fns)
        self.optimizer = Optimizer(self.params.optimizer.optimizer_spec())
        self.max_norm = self.params.optimizer.max_gradient_norm
        self.skip_nonfinite = self.params.optimizer.loss_scaling_mode() != "none"
        self.layer_grad_norms: list[float] = []   # of the last training step, for TensorBoard

    def num_eval_steps(self) -> int:
        if "eval" not in self.streams:
            raise RunError("eval needs an eval_input_fn in run.py")
        return eval_steps(self.streams["eval"], self.params.runconfig.eval_steps)

    def load(self, weights, opt_state, phases) -> None:
        self.weights, self.opt_state = weights, opt_state

    def shard(self, stream: str, step: int, train: bool):
        """This step's batch (checked) and its ShardContext: the whole global batch."""
        with trace.span("make_batch", step=step):
            shard = self.streams[stream].shard(step)
        self.check(stream, step, shard)
        ctx = ShardContext(self.params.runconfig.seed, step, shard.global_batch, shard.rows, train,
                           labels=shard.y)
        return ctx, shard

    def check(self, stream: str, step: int, shard) -> None:
        """Bad data stops the run (a RunError: one line, exit 2) naming the sample and its data set index."""
        try:
            check_batch(self.spec, shard.x, shard.y)
        except BadBatch as exc:
            line = bad_input_line(exc, stream, step, shard.rows.start)
            if exc.sample is not None:
                index = self.streams[stream].plan.global_indices(step)[shard.rows.start + exc.sample]
                line += f" (data set index {int(index)})"
            raise RunError(line) from None

    def train_step(self, step: int, lr: float, loss_scale: float = 1.0,
                   norms: bool = True, ahead=None) -> tuple[float, float, bool]:
        """(loss, gradient norm (nan unless `norms`), whether the update was applied).
        `ahead` (the next steps' arguments, for a cluster to send ahead): nothing to do here."""
        ctx, shard = self.shard("train", step, train=True)
        result, grads, _ = forward_backward(self.spec, shard.x, shard.y, self.weights, ctx, shard.label_count,
                                            loss_scale, step)
        norm, applied, self.layer_grad_norms = apply_update(
            self.optimizer, self.spec, self.weights, grads, self.opt_state, lr, step, self.max_norm, loss_scale,
            self.skip_nonfinite, need_norms=norms)
        return result.loss, norm, applied

    def eval_step(self, step: int) -> tuple[float, int, int]:
        ctx, shard = self.shard("eval", step, train=False)
        logits, _ = model_forward(self.spec, shard.x, self.weights, ctx)
        result = model_loss(self.spec, logits, shard.y, shard.global_batch, shard.label_count)
        return result.loss_sum, result.correct, result.count

    def state(self):
        return self.weights, self.opt_state

    def traffic_summary(self) -> str:
        return ""  # nothing crosses a socket

    def collect_traces(self) -> list:
        return []   # every span of the CPU path is the chief's own

    def close(self) -> None:
        pass
