"""Mixed precision end to end: kernels, loss scaling, the wire, and whole runs.

Numerics of the formats themselves are in test_precision.py; here is what
the training stack does with them.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from cs_runtime.numerics import precision as P
from cs_runtime.config import ParamsError, params_from_dict
from cs_runtime.data.mnist import load_mnist
from cs_runtime.compiler.families import lower_spec
from cs_runtime.numerics.model import ShardContext, init_weights, mlp_spec, model_backward, model_forward, model_loss
from cs_runtime.numerics.optim import Optimizer, OptimizerSpec
from cs_runtime.wire.protocol import Message, Msg, ProtocolError, decode, encode, float_arrays
from cs_runtime.errors import EXIT_BAD_INPUT
from cs_runtime.swarmx.server import reduce_messages
from tests.cluster_utils import (
    final_weights,
    relative_error,
    run_cpu,
    run_wse,
    train_losses,
    write_params,
)
from tests.dense_reference import dense_backward, dense_forward

FORMATS16 = ("float16", "bfloat16", "cbfloat16")


# ---------------------------------------------------------------- params

def test_params_precision_keys():
    assert params_from_dict({}).precision == "float32"
    assert params_from_dict({"model": {"mixed_precision": True}}).precision == "float16"
    p = params_from_dict({"model": {"mixed_precision": True, "fp16_type": "BFloat16"}})
    assert p.precision == "bfloat16"
    p = params_from_dict({"model": {"mixed_precision": True}, "csconfig": {"use_cbfloat16": True}})
    assert p.precision == "cbfloat16"
    # fp16_type alone does nothing: mixed_precision is the switch, as in the model zoo
    assert params_from_dict({"model": {"fp16_type": "cbfloat16"}}).precision == "float32"


def test_params_loss_scaling_keys():
    o = params_from_dict({}).optimizer
    assert (o.loss_scaling_mode(), o.initial_loss_scale, o.steps_per_increase) == ("none", 2.0 ** 15, 2000)
    o = params_from_dict({"optimizer": {"loss_scaling_factor": "Dynamic", "initial_loss_scale": 1024,
                                        "steps_per_increase": 10, "min_loss_scale": 1,
                                        "max_loss_scale": 4096}}).optimizer
    assert (o.loss_scaling_mode(), o.initial_loss_scale, o.max_loss_scale) == ("dynamic", 1024, 4096)
    assert params_from_dict({"optimizer": {"loss_scaling_factor": 128}}).optimizer.loss_scaling_mode() == "static"


@pytest.mark.parametrize("bad, where", [
    ({"optimizer": {"loss_scaling_factor": "dynamc"}}, "optimizer.loss_scaling_factor"),
    ({"optimizer": {"loss_scaling_factor": 0}}, "optimizer.loss_scaling_factor"),
    ({"optimizer": {"loss_scaling_factor": True}}, "optimizer.loss_scaling_factor"),
    ({"optimizer": {"steps_per_increase": 0}}, "optimizer.steps_per_increase"),
    ({"optimizer": {"min_loss_scale": 8, "max_loss_scale": 4}}, "min_loss_scale must not exceed"),
    ({"optimizer": {"loss_scaling_factor": "dynamic", "initial_loss_scale": 2.0 ** 30}}, "initial_loss_scale"),
    ({"model": {"fp16_type": "float8"}}, "model.fp16_type"),
    ({"model": {"mixed_precision": "yes"}}, "model.mixed_precision"),
    ({"model": {"mixed_precision": True, "fp16_type": "bfloat16"}, "csconfig": {"use_cbfloat16": True}},
     "use_cbfloat16 contradicts model.fp16_type"),
])
def test_bad_precision_params_name_the_key(bad, where):
    with pytest.raises(ParamsError) as err:
        params_from_dict(bad, "params.yaml")
    message = str(err.value)
    assert where in message and "\n" not in message


# ---------------------------------------------------------------- kernels

@pytest.mark.parametrize("fmt", FORMATS16)
def test_dense_layer_rounds_matmul_inputs_and_weight_gradients(fmt):
    rng = np.random.default_rng(0)
    spec = mlp_spec("m", [7, 5, 3], "relu", 0.0)   # layer 0: hidden, so relu
    layer = spec.layers[0]
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((4, 7), (7, 5), (5,)))
    out, cache = dense_forward(layer, x, w, b, None, fmt)
    expected = np.maximum(P.quantize(x, fmt) @ P.quantize(w, fmt) + P.quantize(b, fmt), 0)
    np.testing.assert_array_equal(out, expected)
    assert not np.array_equal(out, np.maximum(x @ w + b, 0))       # the rounding is really there
    dout = rng.standard_normal((4, 5)).astype(np.float32)
    dx, grads = dense_backward(layer, dout, cache, w, fmt=fmt)
    dz = P.quantize(dout * (out > 0), fmt)
    np.testing.assert_array_equal(grads["weight"], P.quantize(P.quantize(x, fmt).T @ dz, fmt))
    np.testing.assert_array_equal(dx, dz @ P.quantize(w, fmt).T)
    for g in grads.values():                                          # gradients leave as 16-bit values
        np.testing.assert_array_equal(P.quantize(g, fmt), g)


def deep_sigmoid_grads(fmt: str, loss_scale: float = 1.0) -> list[dict]:
    """Weight gradients of one step of a deep sigmoid MLP: its deltas shrink ~4x per layer."""
    x, y = load_mnist(None, "train")
    x = x.reshape(len(x), -1)[:64].astype(np.float32)
    spec = lower_spec(dataclasses.replace(mlp_spec("deep", [784] + [64] * 8 + [10], "sigmoid", 0.0), precision=fmt))
    weights = init_weights(spec, 1)
    logits, caches = model_forward(spec, x, weights, ShardContext(1, 0, 64, slice(0, 64), True, labels=y[:64]))
    delta = model_loss(spec, logits, y[:64], 64).delta
    grads = model_backward(spec, P.scaled(delta, loss_scale), caches, weights)
    assert P.unscale_and_check(grads, loss_scale)
    return grads


def zero_fraction(grads: list[dict], layer: int) -> float:
    return float((grads[layer]["weight"] == 0).mean())


def test_float16_loses_small_gradients_to_underflow_and_loss_scaling_recovers_them():
    reference = deep_sigmoid_grads("float32")
    unscaled = deep_sigmoid_grads("float16")
    scaled = deep_sigmoid_grads("float16", loss_scale=2.0 ** 15)
    cbf16 = deep_sigmoid_grads("cbfloat16")                  # no scaling: its range is wide enough
    for layer in (0, 1):
        # float32: only the rows of always-black pixels (layer 0) are zero
        assert zero_fraction(reference, layer) < 0.5
        assert zero_fraction(unscaled, layer) > 0.99, f"layer {layer}: float16 kept its gradients"
        for name, grads in (("float16 x 2**15", scaled), ("cbfloat16", cbf16)):
            assert abs(zero_fraction(grads, layer) - zero_fraction(reference, layer)) < 0.05, name
            assert relative_error(grads[layer]["weight"], reference[layer]["weight"]) < 0.02, name


# ---------------------------------------------------------------- the update

def test_update_model_skips_a_step_with_overflowed_gradients():
    opt = Optimizer(OptimizerSpec("sgd", momentum=0.9))
    w = {"fc0": {"weight": np.ones((2, 2), np.float32)}}
    state = {"fc0": opt.init_state(w["fc0"])}
    bad = [{"weight": np.array([[1, np.inf], [0, 0]], np.float32)}]
    norm, applied, _ = opt.update_model(["fc0"], w, bad, state, 0.1, 0, None, loss_scale=8.0, skip_nonfinite=True)
    assert not applied and not np.isfinite(norm)
    np.testing.assert_array_equal(w["fc0"]["weight"], 1.0)
    np.testing.assert_array_equal(state["fc0"]["weight"]["momentum"], 0.0)
    good = [{"weight": np.full((2, 2), 8.0, np.float32)}]                # scaled by 8: unscales to 1
    norm, applied, _ = opt.update_model(["fc0"], w, good, state, 0.1, 0, None, loss_scale=8.0, skip_nonfinite=True)
    assert applied and norm == pytest.approx(2.0)
    np.testing.assert_allclose(w["fc0"]["weight"], 0.9)


# ---------------------------------------------------------------- the wire

@pytest.mark.parametrize("fmt", FORMATS16)
def test_16bit_tensors_cross_the_wire_in_half_the_bytes(fmt):
    rng = np.random.default_rng(1)
    values = {"weight": P.quantize(rng.standard_normal((300, 70)), fmt), "y": np.arange(5, dtype=np.int64)}
    msg = Message(Msg.BATCH, step=3, meta={"stream": "train", "global_batch": 5, "row_start": 0, "row_stop": 5,
                                           "format": fmt},
                  arrays=P.encode_arrays(values, fmt))
    frames = encode(msg)
    assert memoryview(frames[1]).nbytes == 300 * 70 * 2
    back = float_arrays(decode(frames))
    np.testing.assert_array_equal(back["weight"], values["weight"])   # 16-bit values travel exactly
    np.testing.assert_array_equal(back["y"], values["y"])             # labels ride along untouched


def test_a_message_whose_arrays_are_not_its_formats_storage_is_refused():
    as_f16 = Message(Msg.GRADS, step=0, layer=0, meta={"format": "bfloat16"},
                     arrays={"weight": np.ones(3, np.float16)})
    with pytest.raises(ProtocolError, match="not the storage of bfloat16"):
        decode(encode(as_f16))
    # float32 rides along in any format: running statistics, which are never rounded
    with_f32 = Message(Msg.GRADS, step=0, layer=0, meta={"format": "bfloat16"},
                       arrays={"weight": np.ones(3, np.uint16), "running_var": np.full(3, 0.1, np.float32)})
    assert float_arrays(decode(encode(with_f32)))["running_var"].tolist() == np.full(3, 0.1, np.float32).tolist()
    unknown = Message(Msg.GRADS, step=0, layer=0, meta={"format": "float8"}, arrays={})
    with pytest.raises(ProtocolError, match="unknown tensor format"):
        decode(encode(unknown))


def test_swarmx_sums_16bit_gradients_in_float32_and_sends_the_sum_on_unrounded():
    fmt = "cbfloat16"
    parts = [P.quantize(np.full(4, v, np.float32), fmt) for v in (1.0, 2.0 ** -10, 3.0)]
    msgs = [decode(encode(Message(Msg.GRADS, step=1, layer=2, meta={"format": fmt},
                                  arrays=P.encode_arrays({"weight": p}, fmt)))) for p in parts]
    reduced = reduce_messages(msgs)
    assert reduced.meta["format"] == "float32" and reduced.arrays["weight"].dtype == np.float32
    expected = (parts[0] + parts[1]) + parts[2]          # float32, rank order, no second rounding
    np.testing.assert_array_equal(float_arrays(decode(encode(reduced)))["weight"], expected)
    assert not np.array_equal(expected, P.quantize(expected, fmt))   # which rounding would have changed


def test_swarmx_joins_the_wses_output_rows_of_a_loss_in_rank_order():
    rows = [np.full((2, 3), r, np.float32) for r in range(3)]
    msgs = [decode(encode(Message(Msg.LOSS, step=4, meta={"loss": 0.5 * r, "count": 2},
                                  arrays={"output": rows[r]}))) for r in range(3)]
    reduced = decode(encode(reduce_messages(msgs)))
    np.testing.assert_array_equal(reduced.arrays["output"], np.concatenate(rows))   # joined, not summed
    assert reduced.meta["loss"] == 1.5 and reduced.meta["count"] == 6


# ---------------------------------------------------------------- whole runs

def mixed(tmp_path, fmt: str, **optimizer):
    return write_params(tmp_path, name=f"{fmt}.yaml", model={"mixed_precision": True, "fp16_type": fmt},
                        optimizer={"loss_scaling_factor": "dynamic", **optimizer})


def eval_accuracy(stdout: str) -> float:
    found = re.search(r"\| Eval .*Accuracy=([0-9.]+)", stdout)
    assert found, stdout
    return float(found.group(1))


def weight_bytes_per_step(stdout: str) -> int:
    found = re.search(r"WeightBytes/step=(\d+)", stdout)
    assert found, stdout
    return int(found.group(1))


@pytest.fixture(scope="module")
def float32_accuracy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("f32")
    result = run_cpu(write_params(tmp), tmp / "cpu", "train_and_eval")
    assert result.returncode == 0, result.stdout + result.stderr
    return eval_accuracy(result.stdout)


# Accuracy on the 297 held-out digits after 100 steps: 16-bit runs land within
# 3 points of float32 (measured: within 1 point).
ACCURACY_TOLERANCE = 0.03


@pytest.mark.cluster
@pytest.mark.parametrize("fmt", FORMATS16)
def test_every_precision_matches_its_oracle_and_float32_accuracy_in_both_modes(tmp_path, fmt, float32_accuracy):
    params = mixed(tmp_path, fmt)
    cpu = run_cpu(params, tmp_path / "cpu", "train_and_eval")
    assert cpu.returncode == 0, cpu.stdout + cpu.stderr
    oracle_losses, oracle_weights = train_losses(tmp_path / "cpu"), final_weights(tmp_path / "cpu")
    num_params = sum(w.size for w in oracle_weights.values())
    for mode, num_csx in (("weight_streaming", 1), ("pipelined", 1)):
        params = mixed(tmp_path, fmt)
        params.write_text(params.read_text().replace("execution_strategy: weight_streaming",
                                                     f"execution_strategy: {mode}"))
        run = run_wse(params, tmp_path / mode, "train_and_eval", num_csx=num_csx)
        assert run.returncode == 0, run.stdout + run.stderr
        # one system: the same maths in the same order as the CPU path, bit for bit
        np.testing.assert_array_equal(train_losses(tmp_path / mode), oracle_losses)
        got = final_weights(tmp_path / mode)
        for name in oracle_weights:
            np.testing.assert_array_equal(got[name], oracle_weights[name], err_msg=f"{mode} {name}")
        assert abs(eval_accuracy(run.stdout) - float32_accuracy) <= ACCURACY_TOLERANCE, mode
        if mode == "weight_streaming":
            # one group of small layers (protocol.layer_groups): its weights go once a step,
            # forward and at once backward (fwd_bwd), 2 bytes each
            assert weight_bytes_per_step(run.stdout) == 2 * num_params


@pytest.mark.cluster
@pytest.mark.parametrize("fmt", ["float16", "cbfloat16"])
def test_two_wses_in_16_bits_stay_close_to_the_oracle(tmp_path, fmt):
    """Each WSE's partial gradient is rounded to 16 bits (once) before SwarmX sums
    it in float32, so unlike float32 this differs from the CPU path by 16-bit
    rounding, not float32's; over 100 steps the dynamics carry it along."""
    params = mixed(tmp_path, fmt)
    cpu = run_cpu(params, tmp_path / "cpu")
    assert cpu.returncode == 0, cpu.stdout + cpu.stderr
    run = run_wse(params, tmp_path / "ws", num_csx=2, workers=2)
    assert run.returncode == 0, run.stdout + run.stderr
    want, got = train_losses(tmp_path / "cpu"), train_losses(tmp_path / "ws")
    assert len(got) == len(want) == 100
    assert np.max(np.abs(got - want) / want) < 2e-2
    w_want, w_got = final_weights(tmp_path / "cpu"), final_weights(tmp_path / "ws")
    for name in w_want:
        assert relative_error(w_got[name], w_want[name]) < 2e-2, name


def train_events(model_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(model_dir / "train"), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def scalars(model_dir, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in train_events(model_dir).Scalars(tag)}


@pytest.mark.cluster
def test_dynamic_loss_scale_halves_on_overflow_grows_when_clean_and_is_logged(tmp_path):
    # Start at the top of the range: float16 gradients overflow until the scale comes down.
    params = mixed(tmp_path, "float16", initial_loss_scale=2.0 ** 24, max_loss_scale=2.0 ** 24,
                   steps_per_increase=10)
    result = run_cpu(params, tmp_path / "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    scale = scalars(tmp_path / "cpu", "loss_scale")         # the scale each step ran with (step = done + 1)
    steps = sorted(scale)
    assert scale[steps[0]] == 2.0 ** 24
    skipped = [int(m) for m in re.findall(r"step (\d+): gradients overflowed", result.stdout + result.stderr)]
    assert skipped, "no step overflowed at 2**24"
    clean_run = 0
    for before, after in zip(steps, steps[1:]):
        if before in skipped:                               # the step before `after` overflowed
            assert scale[after] == scale[before] / 2
            clean_run = 0
        else:
            clean_run += 1
            grows = clean_run == 10                         # then the count starts again
            assert scale[after] == (min(scale[before] * 2, 2.0 ** 24) if grows else scale[before]), before
            clean_run = 0 if grows else clean_run
    assert any(scale[b] > scale[a] for a, b in zip(steps, steps[1:])), "the scale never grew back"
    assert f"{len(skipped)} step(s) skipped" in result.stdout
    losses = train_losses(tmp_path / "cpu")
    assert losses[-1] < 0.6 * losses[0]                            # and it still trained


@pytest.mark.cluster
def test_memoryx_unscaling_layer_by_layer_logs_the_cpu_paths_norms_on_skipped_steps_too(tmp_path):
    """MemoryX unscales and checks each layer's gradients as they land (off the step's
    critical path), the CPU path all layers at once after the backward: every step's
    norms, the overflowed and skipped ones included, and the weights come out the same."""
    params = write_params(tmp_path, name="f16.yaml", model={"mixed_precision": True, "fp16_type": "float16"},
                          optimizer={"loss_scaling_factor": "dynamic", "initial_loss_scale": 2.0 ** 24},
                          runconfig={"max_steps": 12, "log_steps": 1, "checkpoint_steps": 12, "seed": 3,
                                     "execution_strategy": "weight_streaming"})
    runs = {"cpu": run_cpu(params, tmp_path / "cpu"), "wse": run_wse(params, tmp_path / "wse")}
    for name, result in runs.items():
        assert result.returncode == 0, (name, result.stdout + result.stderr)
    assert "gradients overflowed" in runs["cpu"].stdout + runs["cpu"].stderr, "no step overflowed at 2**24"
    tags = [t for t in train_events(tmp_path / "cpu").Tags()["scalars"] if "grad_norm" in t]
    assert len(tags) > 2, tags                                       # the global norm and each layer's
    for tag in tags:
        cpu, wse = scalars(tmp_path / "cpu", tag), scalars(tmp_path / "wse", tag)
        assert sorted(cpu) == sorted(wse) and len(cpu) == 12, tag
        assert np.array_equal([cpu[s] for s in sorted(cpu)], [wse[s] for s in sorted(wse)], equal_nan=True), tag
    for (name, want), got in zip(final_weights(tmp_path / "cpu").items(), final_weights(tmp_path / "wse").values()):
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.cluster
def test_resume_restores_the_loss_scale(tmp_path):
    kw = dict(initial_loss_scale=2.0 ** 24, max_loss_scale=2.0 ** 24, steps_per_increase=7)
    whole = run_cpu(mixed(tmp_path, "float16", **kw), tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    half = write_params(tmp_path, name="half.yaml", model={"mixed_precision": True},
                        optimizer={"loss_scaling_factor": "dynamic", **kw}, runconfig={"max_steps": 50})
    assert run_cpu(half, tmp_path / "resumed").returncode == 0
    rest = run_cpu(mixed(tmp_path, "float16", **kw), tmp_path / "resumed")
    assert rest.returncode == 0 and "resuming" in rest.stdout + rest.stderr
    want, got = final_weights(tmp_path / "whole"), final_weights(tmp_path / "resumed")
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.cluster
def test_a_nan_loss_without_loss_scaling_stops_the_job_naming_the_step(tmp_path):
    params = write_params(tmp_path, optimizer={"learning_rate": 1.0e6, "momentum": 0.9})
    result = run_cpu(params, tmp_path / "cpu")
    assert result.returncode == EXIT_BAD_INPUT      # restarting would only diverge again
    assert re.search(r"error: loss is (nan|inf|-inf) at step \d+", result.stderr), result.stderr


@pytest.mark.cluster
def test_deep_sigmoid_mlp_trains_its_first_layer_only_where_small_gradients_survive(tmp_path):
    """The underflow case as a training run. fc0's momentum buffer is the sum of every
    gradient it was given, so its zeros count the weights that never got one."""
    deep = {"hidden_sizes": [64] * 8, "activation_fn": "sigmoid", "dropout": 0.0}
    run = {"max_steps": 20, "log_steps": 10, "checkpoint_steps": 0}
    cases = {"float32": ({}, {}),
             "float16 unscaled": ({"mixed_precision": True}, {}),
             "float16 dynamic": ({"mixed_precision": True}, {"loss_scaling_factor": "dynamic"}),
             "cbfloat16 unscaled": ({"mixed_precision": True, "fp16_type": "cbfloat16"}, {})}
    zeros = {}
    for i, (name, (model, optimizer)) in enumerate(cases.items()):
        params = write_params(tmp_path, name=f"{i}.yaml", model={**deep, **model}, optimizer=optimizer,
                              runconfig=run)
        result = run_cpu(params, tmp_path / str(i))
        assert result.returncode == 0, result.stdout + result.stderr
        with np.load(tmp_path / str(i) / "checkpoint_20.npz") as ck:
            zeros[name] = float((ck["optimizer/fc0/weight/momentum"] == 0).mean())
    assert zeros["float32"] < 0.5                  # the always-black pixels' rows only
    assert zeros["float16 unscaled"] > 0.99, zeros
    assert zeros["float16 dynamic"] == pytest.approx(zeros["float32"], abs=0.02), zeros
    assert zeros["cbfloat16 unscaled"] == pytest.approx(zeros["float32"], abs=0.02), zeros


# Round to nearest: |r(x) - x| <= U * |x| + TINY (U: the unit roundoff; TINY: half
# the smallest subnormal, the error where gradients underflow).
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "cbfloat16": 2.0 ** -10}
TINY = {"float16": 2.0 ** -25, "bfloat16": 2.0 ** -134, "cbfloat16": 2.0 ** -40}


def shard_grads_16bit(params_path, num_csx: int) -> tuple[dict, list[list[dict]]]:
    """(initial weights, each WSE's 16-bit gradients of step 1), computed here from
    the same spec, weights, shards and kernels the WSEs use."""
    import examples.fc_mnist.run as fc
    from cs_runtime.config import load_params
    from cs_runtime.data.inputs import InputStream
    p = load_params(str(params_path))
    spec = lower_spec(dataclasses.replace(fc.model_fn(p), precision=p.precision))
    weights = init_weights(spec, p.runconfig.seed)
    stream = InputStream.build("train", fc.train_input_fn(p), p.train_input, p.runconfig.seed)
    per_wse = []
    for shard in stream.shards(0, num_csx):
        ctx = ShardContext(p.runconfig.seed, 0, shard.global_batch, shard.rows, True, labels=shard.y)
        logits, caches = model_forward(spec, shard.x, weights, ctx)
        delta = model_loss(spec, logits, shard.y, shard.global_batch).delta
        per_wse.append(model_backward(spec, delta, caches, weights))
    return weights, per_wse


@pytest.mark.cluster
@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_n_wses_in_16_bits_equal_one_wse_within_the_rounding_bound(tmp_path, fmt):
    """One SGD step, so the weights show the reduced gradient: w1 = w0 - lr * g.

    1 WSE: g = r(G), the whole batch's gradient rounded once. N WSEs: g = the
    float32 sum of r(G_i), each WSE's partial rounded once. Elementwise
    |sum r(G_i) - r(G)| <= U * (sum |G_i| + |G|)
    (+ (N + 1) * TINY where gradients underflow, and float32 rounding), the bound
    docs/design.md states; and the sum is exactly the rank-order float32 sum."""
    lr, n = 0.5, 3
    params = write_params(tmp_path, model={"mixed_precision": True, "fp16_type": fmt, "dropout": 0.0},
                          optimizer={"optimizer_type": "sgd", "learning_rate": lr, "momentum": 0.0},
                          runconfig={"max_steps": 1, "checkpoint_steps": 1, "log_steps": 1})
    one = run_wse(params, tmp_path / "one", num_csx=1)
    assert one.returncode == 0, one.stdout + one.stderr
    several = run_wse(params, tmp_path / "several", num_csx=n, workers=n)
    assert several.returncode == 0, several.stdout + several.stderr
    w1, wn = final_weights(tmp_path / "one"), final_weights(tmp_path / "several")
    w0, per_wse = shard_grads_16bit(params, n)
    u, f32 = UNIT_ROUNDOFF[fmt], np.float32(lr)
    for index, (layer, start) in enumerate(w0.items()):
        for pname, w in start.items():
            parts = [grads[index][pname] for grads in per_wse]
            assert all(np.array_equal(g, P.quantize(g, fmt)) for g in parts)   # each partial is 16-bit
            total = parts[0].copy()
            for g in parts[1:]:
                total += g
            key = f"model/{layer}/{pname}"
            np.testing.assert_array_equal(wn[key], w - total * f32, err_msg=key)   # summed, never re-rounded
            whole = (w - w1[key]) / f32                                             # r(G), from the 1-WSE run
            bound = u * (sum(np.abs(g) for g in parts) + np.abs(whole)) * (1 + 4 * u) + (n + 1) * TINY[fmt]
            slack = 2.0 ** -22 * (np.abs(w) / lr + sum(np.abs(g) for g in parts))  # float32 update and sums
            gap = np.abs(total - whole)
            assert np.all(gap <= bound + slack), f"{key}: worst {np.max(gap - bound - slack):.3g} over"
            assert relative_error(wn[key], w1[key]) < 1e-3, key
