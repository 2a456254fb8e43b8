"""Input throughput probe, one of k run side by side by cs_input_analyzer.

The analyzer starts the user's script with CS_ROLE=input_probe,
CS_PROBE_RANK=r, CS_PROBE_WORKERS=k and CS_PROBE_SECONDS=s. The probe builds
the training input exactly as an input worker does, makes one batch (warm-up,
not timed), prints `PROBE ready`, waits for a line on stdin (so all k start
together), then makes its share of the batches (`worker_steps`) for s
seconds and prints `PROBE {json}` with what it measured.
"""
from __future__ import annotations

import sys
import time

from cs_runtime import env
from cs_runtime.data.batches import worker_steps
from cs_runtime.data.inputs import InputStream
from cs_runtime.probe_line import say
from cs_runtime.run_args import RunArgs, UserFunctions


def measure_input(args: RunArgs, fns: UserFunctions) -> None:
    rank, workers, seconds = env.PROBE_RANK.get(), env.PROBE_WORKERS.get(), env.PROBE_SECONDS.get()
    p = args.params
    stream = InputStream.build("train", fns.train_input_fn(p), p.train_input, p.runconfig.seed)
    steps = iter(worker_steps(0, 1 << 40, rank, workers))
    stream.shards(next(steps), 1)  # warm-up: first-touch costs are not throughput
    say("ready")
    sys.stdin.readline()
    batches, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        stream.shards(next(steps), 1)
        batches += 1
    elapsed = time.perf_counter() - start
    say("result", {"batches": batches, "seconds": elapsed, "batch_size": p.train_input.batch_size})
