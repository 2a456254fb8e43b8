"""The CPU path: the whole model, the whole global batch, one process.

This is the oracle every distributed mode is tested against. It uses the same
kernels (cs_runtime.model), the same input pipeline (cs_runtime.inputs) and
the same optimizer (cs_runtime.optim) as the CS system, layer by layer.
"""
from __future__ import annotations

from cs_runtime.inputs import InputStream, eval_steps
from cs_runtime.model import ShardContext, dense_backward, layer_forward, softmax_cross_entropy
from cs_runtime.optim import Optimizer, clip_factor, global_norm, scale_grads
from cs_runtime.runner import RunArgs, UserFunctions


def build_streams(args: RunArgs, fns: UserFunctions) -> dict[str, InputStream]:
    p = args.params
    streams = {"train": InputStream.build("train", fns.train_input_fn(p), p.train_input, p.runconfig.seed)}
    if fns.eval_input_fn is not None and args.mode in ("eval", "train_and_eval"):
        streams["eval"] = InputStream.build("eval", fns.eval_input_fn(p), p.eval_input, p.runconfig.seed)
    return streams


class CpuExecutor:
    device = "CPU"

    def __init__(self, args: RunArgs, fns: UserFunctions, spec):
        from chief.trainer import optimizer_spec
        self.spec, self.params = spec, args.params
        self.streams = build_streams(args, fns)
        self.optimizer = Optimizer(**optimizer_spec(self.params))
        self.max_norm = self.params.optimizer.max_gradient_norm

    def num_eval_steps(self) -> int:
        if "eval" not in self.streams:
            raise ValueError("eval needs an eval_input_fn in run.py")
        return eval_steps(self.streams["eval"], self.params.runconfig.eval_steps)

    def load(self, weights, opt_state, phases) -> None:
        self.weights, self.opt_state = weights, opt_state

    def forward(self, stream: str, step: int, train: bool):
        shard = self.streams[stream].shard(step)
        ctx = ShardContext(self.params.runconfig.seed, step, shard.global_batch, shard.rows, train)
        x, caches = shard.x, []
        for index, layer in enumerate(self.spec.layers):
            x, cache = layer_forward(self.spec, index, x, self.weights[layer.name], ctx)
            caches.append(cache)
        return softmax_cross_entropy(x, shard.y, shard.global_batch), caches, shard

    def train_step(self, step: int, lr: float) -> tuple[float, float]:
        (loss, delta, _), caches, _ = self.forward("train", step, train=True)
        grads = {}
        for index in reversed(range(len(self.spec.layers))):
            layer = self.spec.layers[index]
            delta, grads[index] = dense_backward(layer, delta, caches[index],
                                                 self.weights[layer.name]["weight"], need_dx=index > 0)
        norm = global_norm(grads[i] for i in range(len(grads)))
        factor = clip_factor(norm, self.max_norm)
        for index, layer in enumerate(self.spec.layers):
            self.optimizer.update(self.weights[layer.name], scale_grads(grads[index], factor),
                                  self.opt_state[layer.name], lr, step)
        return loss, norm

    def eval_step(self, step: int) -> tuple[float, int, int]:
        (loss, _, correct), _, shard = self.forward("eval", step, train=False)
        return loss * shard.global_batch, correct, len(shard.y)

    def state(self):
        return self.weights, self.opt_state

    def close(self) -> None:
        pass
