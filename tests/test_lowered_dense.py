"""A params.yaml dense model (FC-MNIST's MLP) lowered to its program
(cs_runtime/compiler/families.py) trains to the same bits as the hand-written
dense layers of tests/dense_reference.py, in float32 and every 16-bit format:
losses, skipped steps and every weight, with dropout, dynamic loss scaling and
data-parallel shards. The CPU path, the WSE and the pipelined executor run the
program, so this is what keeps their numbers those of the dense layers (the
WSEs' own check against the CPU path: test_mixed_precision.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cs_runtime.compiler.families import lower_spec
from cs_runtime.numerics import precision as P
from cs_runtime.numerics import model
from cs_runtime.numerics.model import ShardContext, init_weights, mlp_spec
from cs_runtime.numerics.optim import Optimizer, OptimizerSpec
from tests import dense_reference

SIZES, BATCH, STEPS = [30, 24, 16, 7], 12, 16


def train(spec, batches, scaler: P.LossScaler, shards: int):
    """The CPU path's step over `shards` data-parallel shards (gradients summed in rank
    order, as SwarmX sums them): per step (loss, correct, eval sum, count, applied), weights."""
    weights = init_weights(spec, 0)
    optimizer = Optimizer(OptimizerSpec("sgd", momentum=0.9))
    state = {name: optimizer.init_state(w) for name, w in weights.items()}
    history = []
    run = model if spec.program is not None else dense_reference
    for step, (x, y) in enumerate(batches):
        total, summed = None, [0.0, 0, 0.0, 0]
        for rank in range(shards):
            rows = slice(rank * BATCH // shards, (rank + 1) * BATCH // shards)
            ctx = ShardContext(3, step, BATCH, rows, True, labels=y[rows])
            out, caches = run.model_forward(spec, x[rows], weights, ctx)
            result = run.model_loss(spec, out, y[rows], BATCH)
            grads = run.model_backward(spec, P.scaled(result.delta, scaler.scale), caches, weights, step)
            grads = [{k: np.asarray(g, np.float32) for k, g in layer.items()} for layer in grads]
            total = grads if total is None else [{k: t[k] + g[k] for k in t} for t, g in zip(total, grads)]
            summed = [a + b for a, b in zip(summed, (result.loss, result.correct, result.loss_sum, result.count))]
        _, applied, _ = optimizer.update_model([layer.name for layer in spec.layers], weights, total, state, 0.05,
                                               step, None, scaler.scale, scaler.skips_nonfinite)
        scaler.update(applied)
        history.append((*summed, applied))
    return history, weights


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("activation", ["relu", "sigmoid", "tanh", "gelu_new"])
@pytest.mark.parametrize("fmt", ["float32", "float16", "bfloat16", "cbfloat16"])
def test_a_lowered_dense_model_trains_to_the_dense_layers_bits(fmt, activation, shards):
    rng = np.random.default_rng(1)
    batches = [(rng.standard_normal((BATCH, SIZES[0])).astype(np.float32), rng.integers(0, SIZES[-1], BATCH))
               for _ in range(STEPS)]
    dense = dataclasses.replace(mlp_spec("m", SIZES, activation, 0.2), precision=fmt)
    lowered = lower_spec(dense)
    assert dense.program is None and all(layer.unit is not None for layer in lowered.layers)
    start = 2.0 ** (36 if fmt == "cbfloat16" else 20)   # past float16's and cbfloat16's range: steps skipped
    scaler = lambda: P.LossScaler("dynamic", initial_scale=start, steps_per_increase=3,  # noqa: E731
                                  max_scale=start)
    want, want_w = train(dense, batches, scaler(), shards)
    got, got_w = train(lowered, batches, scaler(), shards)
    assert got == want
    if fmt in ("float16", "cbfloat16"):
        assert not all(h[-1] for h in got), "the first scale should overflow the format's gradients"
    for layer, params in want_w.items():
        for name, w in params.items():
            assert got_w[layer][name].tobytes() == w.tobytes(), f"{layer}/{name}"
