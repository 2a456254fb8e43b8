"""WSE consumption probe for cs_input_analyzer: how fast one WSE emulator eats batches.

Started as the user's script with CS_ROLE=wse_probe, CS_PROBE_SECONDS=s and
CS_NUM_CSX=n: compiles the model (the compile stage every run has, which
also gives the hardware model's estimate), then runs the WSE's kernels
(forward, loss, backward, update) on its 1/n shard of one global batch for s
seconds, with no input cost, and prints `PROBE result {json}`. Streaming
weights between processes costs more, so this is an upper bound of what a
weight-streaming cluster consumes: enough workers for it are enough.
"""
from __future__ import annotations

import time

from cs_runtime.compiler.stage import build_spec, compile_model
from cs_runtime import env
from cs_runtime.data.inputs import InputStream
from cs_runtime.numerics.local_step import apply_update, forward_backward
from cs_runtime.numerics.model import ShardContext, init_weights
from cs_runtime.numerics.optim import Optimizer
from cs_runtime.probe_line import say
from cs_runtime.run_args import RunArgs, UserFunctions


def measure_consumption(args: RunArgs, fns: UserFunctions) -> None:
    seconds, num_csx = env.PROBE_SECONDS.get(), env.NUM_CSX.get()
    spec = build_spec(args, fns)
    plan = compile_model(spec, args)
    p = args.params
    stream = InputStream.build("train", fns.train_input_fn(p), p.train_input, p.runconfig.seed)
    shard = stream.shards(0, num_csx)[0]
    optimizer = Optimizer(p.optimizer.optimizer_spec())
    weights = init_weights(spec, p.runconfig.seed)
    opt_state = {name: optimizer.init_state(w) for name, w in weights.items()}
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or steps < 3:
        ctx = ShardContext(p.runconfig.seed, steps, shard.global_batch, shard.rows, True, labels=shard.y)
        _, grads, _ = forward_backward(spec, shard.x, shard.y, weights, ctx, shard.label_count, step=steps)
        apply_update(optimizer, spec, weights, grads, opt_state, 1e-6, steps)
        steps += 1
    elapsed = time.perf_counter() - start
    say("result", {"steps": steps, "seconds": elapsed, "batch_size": shard.global_batch, "num_csx": num_csx,
                   "execution_strategy": plan.get("execution_strategy", "weight_streaming"),
                   "estimated_samples_per_s": float(plan.get("estimate", {}).get("samples_per_s", 0.0))})
