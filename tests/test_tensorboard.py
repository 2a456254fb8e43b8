"""TensorBoard summaries, read back with tensorboard's own reader (not tensorboardX).

Every path (csrun_cpu, csrun_wse in weight streaming and in pipelined mode)
logs the same tags at the same steps, and the per-layer gradient norms equal
the norms of the gradients recomputed here from the CPU run's checkpoint
before each logged step.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cs_runtime import checkpoint as ckpt
from cs_runtime.compiler.families import lower_spec
from cs_runtime.config import load_params
from cs_runtime.data.inputs import InputStream
from cs_runtime.numerics.model import ShardContext, model_backward, model_forward, model_loss
from examples.fc_mnist.run import model_fn, train_input_fn
from tests.cluster_utils import run_cpu, run_wse, write_params

pytestmark = pytest.mark.cluster  # every test here starts processes (see tests/conftest.py)

STEPS, LOG_STEPS = 6, 2
LAYERS = ("fc0", "fc1", "fc2")     # mlp_spec's names for hidden_sizes [64, 32] + the output layer


def read_events(model_dir, split: str) -> EventAccumulator:
    acc = EventAccumulator(str(model_dir / split), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def text(acc: EventAccumulator, tag: str) -> str:
    """A text summary as tensorboard stores it (a string tensor; tensorboardX writes it under tag/text_summary)."""
    found = [t for t in acc.Tags()["tensors"] if t == tag or t.startswith(tag + "/")]
    assert found, f"no text summary {tag!r} in {acc.Tags()['tensors']}"
    return acc.Tensors(found[0])[-1].tensor_proto.string_val[0].decode()


def oracle_layer_norms(params_path, model_dir, step: int) -> list[float]:
    """Each layer's gradient norm at 0-based step `step`, from the checkpoint written before it."""
    params = load_params(params_path)
    spec = lower_spec(model_fn(params))   # the program every path runs
    weights = ckpt.load(model_dir / f"checkpoint_{step}.npz").weights
    stream = InputStream.build("train", train_input_fn(params), params.train_input, params.runconfig.seed)
    shard = stream.shard(step)
    ctx = ShardContext(params.runconfig.seed, step, shard.global_batch, shard.rows, True, labels=shard.y)
    logits, caches = model_forward(spec, shard.x, weights, ctx)
    grads = model_backward(spec, model_loss(spec, logits, shard.y, shard.global_batch, shard.label_count).delta, caches, weights)
    return [float(np.linalg.norm(np.concatenate([g.ravel().astype(np.float64) for g in layer.values()])))
            for layer in grads]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same short run on the CPU path and on csrun_wse (a checkpoint after every step)."""
    tmp = tmp_path_factory.mktemp("tb")
    runconfig = {"max_steps": STEPS, "log_steps": LOG_STEPS, "checkpoint_steps": 1,
                 "max_checkpoints": STEPS + 1, "seed": 5, "execution_strategy": "weight_streaming"}
    params = write_params(tmp, runconfig=runconfig)
    piped = write_params(tmp, "piped.yaml", runconfig={**runconfig, "execution_strategy": "pipelined"})
    cpu = run_cpu(params, tmp / "cpu", "train_and_eval")
    assert cpu.returncode == 0, cpu.stdout + cpu.stderr
    for name, path in (("wse", params), ("pipe", piped)):
        wse = run_wse(path, tmp / name, "train_and_eval")
        assert wse.returncode == 0, wse.stdout + wse.stderr
    return params, {"cpu": tmp / "cpu", "wse": tmp / "wse", "pipe": tmp / "pipe"}


@pytest.mark.parametrize("path", ["cpu", "wse", "pipe"])
def test_per_layer_grad_norms_match_the_oracle(runs, path):
    params, dirs = runs
    acc = read_events(dirs[path], "train")
    logged = list(range(LOG_STEPS, STEPS + 1, LOG_STEPS))
    global_norm = scalars(acc, "model_wise_grad_norm")
    assert sorted(global_norm) == logged
    for global_step in logged:
        # Logged after step global_step - 1 (0-based), whose weights are checkpoint_<global_step - 1>.
        expected = oracle_layer_norms(params, dirs["cpu"], global_step - 1)
        got = [scalars(acc, f"per_layer_grad_norm/{name}")[global_step] for name in LAYERS]
        assert got == pytest.approx(expected, rel=1e-5), global_step
        assert global_norm[global_step] == pytest.approx(math.sqrt(sum(n * n for n in expected)), rel=1e-5)
        assert min(expected) > 0


def test_both_paths_log_the_same_tags_at_the_same_steps(runs):
    _, dirs = runs
    cpu = read_events(dirs["cpu"], "train")
    tags = set(cpu.Tags()["scalars"])
    assert {"loss", "lr/0", "model_wise_grad_norm", "local_samples_per_sec", "avg_samples_per_sec",
            "avg_steps_per_sec", *(f"per_layer_grad_norm/{n}" for n in LAYERS)} <= tags
    for other in ("wse", "pipe"):
        wse = read_events(dirs[other], "train")
        assert tags == set(wse.Tags()["scalars"]), other
        for tag in tags:
            assert sorted(scalars(cpu, tag)) == sorted(scalars(wse, tag)), (other, tag)
    # lr and grad_norm at the logging cadence, every loss every step
    assert sorted(scalars(cpu, "lr/0")) == list(range(LOG_STEPS, STEPS + 1, LOG_STEPS))
    assert sorted(scalars(cpu, "loss")) == list(range(1, STEPS + 1))
    assert scalars(wse, "lr/0")[STEPS] == pytest.approx(0.01)
    for split in ("cpu", "wse", "pipe"):
        ev = read_events(dirs[split], "eval")
        assert 0.0 <= scalars(ev, "accuracy")[STEPS] <= 1.0 and scalars(ev, "loss")[STEPS] > 0


@pytest.mark.parametrize("path", ["cpu", "wse"])
def test_rates_under_the_model_zoos_names(runs, path):
    """local_samples_per_sec since the last log step, avg_samples_per_sec since the start (the global
    rate), avg_steps_per_sec = the global rate / batch size; the first log step's two rates are one."""
    params, dirs = runs
    acc = read_events(dirs[path], "train")
    local, avg, steps = (scalars(acc, t) for t in ("local_samples_per_sec", "avg_samples_per_sec",
                                                   "avg_steps_per_sec"))
    logged = list(range(LOG_STEPS, STEPS + 1, LOG_STEPS))
    assert sorted(local) == sorted(avg) == sorted(steps) == logged
    batch = load_params(params).train_input.batch_size
    for step in logged:
        assert local[step] > 0 and avg[step] > 0
        assert steps[step] == pytest.approx(avg[step] / batch, rel=1e-6)
    assert local[LOG_STEPS] == pytest.approx(avg[LOG_STEPS], rel=1e-6)


@pytest.mark.parametrize("path", ["cpu", "wse"])
def test_text_summaries_of_params_and_compile_report(runs, path):
    _, dirs = runs
    acc = read_events(dirs[path], "train")
    params_text = text(acc, "params")
    assert "optimizer_type: sgd" in params_text and "max_steps: 6" in params_text
    report = text(acc, "compile_report")
    assert "Estimated Overall Performance" in report
    on_disk = (dirs[path] / "compile_report.txt").read_text()
    assert [line.strip() for line in report.splitlines()] == [line.strip() for line in on_disk.splitlines()]
