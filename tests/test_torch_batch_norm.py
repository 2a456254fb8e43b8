"""BatchNorm in training with running statistics (torchvision's default): the batch's
statistics normalize a train step, the running mean, variance and num_batches_tracked
are buffers the run carries from step to step (held with the parameters, in
checkpoints and the state_dict helpers), and an eval step normalizes by them. On the
CPU path every loss, weight and buffer equals torch eager's; a shard normalizes by its
own rows, and the shard holding row 0 keeps the buffers, as torch DDP does. A
SyncBatchNorm's shards normalize by the whole batch's statistics, summed over the
shards: they equal torch eager on the whole batch."""
import copy
import dataclasses
import threading
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="capturing a torch model needs torch (an optional extra)")
F = torch.nn.functional

from cs_runtime.numerics.model import (  # noqa: E402
    ShardContext, init_weights, model_backward, model_forward, model_loss)
from cs_runtime.numerics.optim import Optimizer, OptimizerSpec  # noqa: E402
from cs_torch.capture import CaptureError, capture, load_into, model_spec  # noqa: E402
from tests.cluster_utils import final_weights, tool, train_losses  # noqa: E402

BATCH, STEPS, LR, MOMENTUM = 8, 4, 0.05, 0.9


def conv_bn(momentum=0.1, sync=False):
    """A small conv + BatchNorm2d + BatchNorm1d classifier, as torch builds it; `sync`: its batch
    norms made SyncBatchNorm, as a DDP script does (torch.nn.SyncBatchNorm.convert_sync_batchnorm)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, momentum=momentum), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(),
        torch.nn.Linear(6, 5))
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(module) if sync else module


def data_set(count=64):
    """The cluster runs' samples (tests/torch_bn_run.py): seeded images and labels."""
    rng = np.random.default_rng(11)
    return rng.standard_normal((count, 3, 6, 6)).astype(np.float32) * 2 + 1, rng.integers(0, 5, count)


def images(seed=0, steps=STEPS, batch=BATCH):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, 3, 6, 6)).astype(np.float32) * 2 + 1, rng.integers(0, 5, batch))
            for _ in range(steps)]


@pytest.fixture(scope="module")
def spec():
    """conv_bn captured once (a capture takes seconds): every test trains from its weights."""
    x, y = images()[0]
    return model_spec("bn", conv_bn(), (torch.from_numpy(x),), torch.from_numpy(y), F.cross_entropy)


def shard_step(spec, step, x, y, rows, weights, reduce=None):
    """One shard's forward and backward: (its loss share, its gradients)."""
    ctx = ShardContext(0, step, len(y), rows, True, labels=y[rows], reduce=reduce)
    live, caches = model_forward(spec, x[rows], weights, ctx)
    result = model_loss(spec, live, y[rows], len(y))
    return result.loss, model_backward(spec, result.delta, caches, weights, step)


def side_by_side(spec, step, x, y, shards, weights):
    """The shards of a step each in a thread, as WSEs run them at once, their collectives
    summed in rank order as SwarmX sums ALL_REDUCE; row 0's shard keeps the buffers."""
    barrier, sent, out = threading.Barrier(len(shards), timeout=60), [None] * len(shards), [None] * len(shards)

    def reduce_of(rank):
        def reduce(values):
            sent[rank] = values
            barrier.wait()
            total = sent[0] + sent[1]
            for more in sent[2:]:
                total += more
            barrier.wait()   # every shard has its sum before the next collective is sent
            return total
        return reduce

    def run(rank):
        mine = weights if rank == 0 else {name: dict(w) for name, w in weights.items()}
        try:
            out[rank] = shard_step(spec, step, x, y, shards[rank], mine, reduce_of(rank))
        except BaseException as exc:
            barrier.abort()
            out[rank] = exc
    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(shards))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in out:
        if isinstance(result, BaseException):
            raise result
    return out


def train_ours(spec, batches, shards=None, weights=None, state=None, synced=False, lr=LR):
    """SGD with momentum (at `lr`) on the CPU path's calls; `shards`: the rows of each shard of a step,
    as WSEs take them (their gradients and loss shares summed, as SwarmX sums them), one after
    another, or with `synced` side by side, their collectives summed."""
    weights = weights or init_weights(spec, seed=0)
    optimizer = Optimizer(OptimizerSpec("sgd", momentum=MOMENTUM))
    state = state or {name: optimizer.init_state(w) for name, w in weights.items()}
    losses = []
    for step, (x, y) in enumerate(batches):
        loss, grads = 0.0, None
        rows_of = shards or [slice(0, len(y))]
        parts = side_by_side(spec, step, x, y, rows_of, weights) if synced else \
            (shard_step(spec, step, x, y, rows, weights) for rows in rows_of)
        for part, shard in parts:
            grads = shard if grads is None else [{k: g[k] + s[k] for k in g} for g, s in zip(grads, shard)]
            loss += part
        optimizer.update_model([l.name for l in spec.layers], weights, grads, state, lr, step, None)
        losses.append(loss)
    return losses, weights, state


def train_torch(module, batches, shards=None):
    """Torch eager; with `shards`, as DDP runs them: each shard's forward on its own rows
    (its batch statistics), the gradients summed, rank 0's buffers kept (broadcast_buffers)."""
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        rows_of = shards or [slice(0, len(y))]
        total, kept = 0.0, None
        for rows in rows_of:
            before = {k: b.clone() for k, b in module.named_buffers()}
            loss = F.cross_entropy(module(torch.from_numpy(x[rows])), torch.from_numpy(y[rows]))
            share = loss * (len(y[rows]) / len(y))
            share.backward()
            total += share.item()
            if rows.start in (0, None):
                kept = {k: b.clone() for k, b in module.named_buffers()}
            for k, b in module.named_buffers():
                b.copy_(before[k])
        for k, b in module.named_buffers():
            b.copy_(kept[k])
        optimizer.step()
        losses.append(total)
    return losses


def flat(weights):
    return {p: w for layer in weights.values() for p, w in layer.items()}


def assert_same_state(ours: dict, module):
    reference = module.state_dict()
    assert set(ours) == set(reference)
    for name, t in reference.items():
        want = t.detach().numpy().astype(np.float32)
        np.testing.assert_allclose(ours[name], want, rtol=1e-5, atol=1e-5 * max(float(np.abs(want).max()), 1.0),
                                   err_msg=name)


def test_the_running_statistics_are_buffers_without_gradient(spec):
    buffers = spec.program["buffers"]
    assert set(buffers) == {f"{i}.{b}" for i in (1, 5) for b in ("running_mean", "running_var", "num_batches_tracked")}
    units = {layer.name: layer.unit["unit"] for layer in spec.layers}
    for name in buffers:   # streamed with its unit's parameters; no gradient leaves the unit for it
        unit = next(u for u in units.values() if name in u["params"])
        assert name not in unit["param_grads"]


def test_the_cpu_path_trains_with_torchs_loss_weights_and_running_statistics(spec):
    batches = images()
    eager = conv_bn()
    ours, weights, _ = train_ours(spec, batches)
    theirs = train_torch(eager, batches)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert flat(weights)["1.num_batches_tracked"] == STEPS
    assert np.abs(flat(weights)["1.running_var"] - 1).max() > 0.1      # the statistics moved
    assert_same_state(flat(weights), eager)


def test_an_eval_step_normalizes_by_the_running_statistics(spec):
    batches = images()
    module = conv_bn()
    _, weights, _ = train_ours(spec, batches)
    load_into(module, flat(weights))       # the state_dict helper carries the buffers back
    assert int(module[1].num_batches_tracked) == STEPS and module[1].num_batches_tracked.dtype == torch.int64
    x, y = images(seed=9, steps=1)[0]
    before = copy.deepcopy(flat(weights))
    live, _ = model_forward(spec, x, weights, ShardContext(0, 0, BATCH, slice(0, BATCH), False, labels=y))
    with torch.no_grad():
        want = float(F.cross_entropy(module.eval()(torch.from_numpy(x)), torch.from_numpy(y)))
    assert model_loss(spec, live, y, BATCH).loss == pytest.approx(want, rel=1e-6)
    assert all(np.array_equal(before[k], w) for k, w in flat(weights).items())   # eval leaves them


def test_shards_normalize_by_their_own_rows_and_row_0s_shard_keeps_the_buffers(spec):
    """What two WSEs of uneven shards compute, against torch DDP without SyncBatchNorm (each
    rank's batch statistics, the gradients summed, rank 0's buffers broadcast); the cluster
    test below runs two WSEs of 4 rows each."""
    shards = [slice(0, 3), slice(3, 8)]
    batches = images()
    eager = conv_bn()
    ours, weights, _ = train_ours(spec, batches, shards)
    theirs = train_torch(eager, batches, shards)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    whole, _, _ = train_ours(spec, batches)
    assert np.abs(np.array(ours) - np.array(whole)).max() > 1e-4   # per-shard statistics differ from the batch's
    assert_same_state(flat(weights), eager)


def test_a_run_resumed_from_its_saved_state_carries_the_buffers(spec, tmp_path):
    from cs_runtime import checkpoint as ckpt
    batches = images(steps=4)
    straight, final, _ = train_ours(spec, batches)
    first, weights, state = train_ours(spec, batches[:2])
    path = ckpt.save(tmp_path, ckpt.Checkpoint(2, 2, weights, state, {}))
    loaded = ckpt.load(path)
    assert loaded.weights["1"]["1.running_mean"].shape == (4,)
    then, resumed, _ = train_ours(spec, batches[2:], weights=loaded.weights, state=loaded.opt_state)
    assert first + then == pytest.approx(straight, rel=1e-6)
    for name, w in flat(final).items():
        np.testing.assert_array_equal(flat(resumed)[name], w, err_msg=name)


@pytest.fixture(scope="module")
def sync_spec(spec):
    """conv_bn with SyncBatchNorm: `spec` with its batch norms marked synchronized, as capture marks
    a SyncBatchNorm module's (a second capture would cost seconds; the runs below capture it)."""
    layers = []
    for layer in spec.layers:
        unit = copy.deepcopy(layer.unit)
        for op, _, _, attrs, *_ in unit["unit"]["forward"]:
            if op in ("batch_norm", "batch_norm_running"):
                attrs["sync"] = True
        for op, _, _, attrs, *_ in unit["unit"]["backward"]:
            if op == "vjp" and attrs["of"] == "batch_norm":
                attrs["attrs"]["sync"] = True
        layers.append(dataclasses.replace(layer, unit=unit))
    return dataclasses.replace(spec, layers=layers)


def test_sync_batch_norm_on_uneven_shards_takes_torchs_whole_batch_step(spec, sync_spec):
    """Shards of 3 and 5 rows side by side, the statistics and the backward's per-channel sums
    summed over them: torch eager's BatchNorm on the whole batch, within float32 reordering. As
    one shard (the CPU path, one WSE: nothing to sum) the synchronized model is BatchNorm's bit for bit."""
    batches = images(steps=2)
    eager = conv_bn()
    ours, weights, _ = train_ours(sync_spec, batches, [slice(0, 3), slice(3, 8)], synced=True)
    np.testing.assert_allclose(ours, train_torch(eager, batches), rtol=1e-5)
    assert_same_state(flat(weights), eager)
    alone, weights_alone, _ = train_ours(sync_spec, batches)
    plain, weights_plain, _ = train_ours(spec, batches)
    assert alone == plain
    for name, w in flat(weights_plain).items():
        np.testing.assert_array_equal(flat(weights_alone)[name], w, err_msg=name)


def test_sync_batch_norm_with_pipelined_replicas_is_refused_naming_the_module(spec, sync_spec):
    """--multireplica's replicas run one after another in one WSE: their statistics cannot be summed."""
    from cs_runtime.compiler.errors import CompileError
    from cs_runtime.compiler.stage import refuse_synced_replicas
    with pytest.raises(CompileError, match=r"^module 1: SyncBatchNorm in training with --multireplica") as info:
        refuse_synced_replicas(sync_spec, 2)
    assert "\n" not in str(info.value)
    refuse_synced_replicas(sync_spec, 1)   # one replica: its shard is the WSE's
    refuse_synced_replicas(spec, 2)        # BatchNorm: per-replica statistics, as DDP


def test_a_cumulative_average_batch_norm_is_refused_naming_the_module():
    module = conv_bn(momentum=None)
    x, y = images(steps=1)[0]
    with pytest.raises(CaptureError, match=r"^module 1: BatchNorm2d with momentum=None") as info:
        capture(module, (torch.from_numpy(x),), torch.from_numpy(y), F.cross_entropy)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- every path (processes)

BN_RUN = str(Path(__file__).resolve().parent / "torch_bn_run.py")
RUN_STEPS = 6
RUN_PARAMS = {
    "train_input": {"batch_size": BATCH, "shuffle": False, "drop_last_batch": True},
    "eval_input": {"batch_size": BATCH},
    "model": {},
    "optimizer": {"optimizer_type": "sgd", "learning_rate": LR, "momentum": MOMENTUM},
    "runconfig": {"max_steps": RUN_STEPS, "log_steps": 3, "checkpoint_steps": 0, "seed": 1},
}


def _run(tmp_path, name, launcher, model_dir=None, sync=False, model=None, **runconfig):
    """`launcher` None: the CPU path's run, made in this process as csrun_cpu runs it (no process,
    no second torch import); `sync`: the model's batch norms as SyncBatchNorm (torch_bn_run.py's
    BN_SYNC); `model`: the params' model section (mixed precision)."""
    import os
    import subprocess
    import sys
    import yaml
    from tests.cluster_utils import cpu_path_in_process
    params = tmp_path / f"{name}.yaml"
    params.write_text(yaml.safe_dump({**RUN_PARAMS, "model": model or {},
                                      "runconfig": {**RUN_PARAMS["runconfig"], **runconfig}}))
    model_dir = tmp_path / (model_dir or name)
    argv = ["--mode", "train", "--params", str(params), "--model_dir", str(model_dir)]
    if launcher is None:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("BN_SYNC", "1" if sync else "0")
            assert cpu_path_in_process(BN_RUN, argv) == 0
    else:
        env = {**os.environ, "BN_SYNC": "1" if sync else "0"}
        result = subprocess.run([*launcher, sys.executable, BN_RUN, *argv], capture_output=True, text=True,
                                timeout=300, env=env)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return train_losses(model_dir), {k[len("model/"):].split("/", 1)[1]: w for k, w in final_weights(model_dir).items()}


def _run_batches():
    x, y = data_set()
    return [(x[s * BATCH:(s + 1) * BATCH], y[s * BATCH:(s + 1) * BATCH]) for s in range(RUN_STEPS)]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """The CPU path's losses and final state (weights and buffers), checked against torch eager."""
    tmp_path = tmp_path_factory.mktemp("bn_cpu")
    losses, state = _run(tmp_path, "cpu", None)
    eager = conv_bn()
    np.testing.assert_allclose(losses, train_torch(eager, _run_batches()), rtol=1e-5)
    assert_same_state(state, eager)
    return losses, state


@pytest.mark.cluster
def test_the_cpu_path_run_resumed_from_its_checkpoint_ends_on_the_straight_runs_bits(tmp_path, cpu_run):
    _run(tmp_path, "first", [tool("csrun_cpu")], model_dir="resumed", max_steps=3, checkpoint_steps=3)
    _, resumed = _run(tmp_path, "then", [tool("csrun_cpu")], model_dir="resumed")
    assert "at global step 3" in (tmp_path / "resumed" / "run.log").read_text()
    for key, w in cpu_run[1].items():   # the buffers too: the resumed run started from the checkpoint's
        np.testing.assert_array_equal(resumed[key], w, err_msg=key)


@pytest.mark.cluster
@pytest.mark.parametrize("strategy", ["weight_streaming", "pipelined"])
def test_one_wse_carries_the_running_statistics_as_the_cpu_path_bit_for_bit(tmp_path, cpu_run, strategy):
    losses, state = _run(tmp_path, strategy, [tool("csrun_wse")], execution_strategy=strategy)
    np.testing.assert_array_equal(losses, cpu_run[0])
    for key, w in cpu_run[1].items():
        np.testing.assert_array_equal(state[key], w, err_msg=key)


@pytest.mark.cluster
def test_two_wses_keep_per_shard_statistics_as_torch_ddp(tmp_path, cpu_run):
    """Each WSE's 4 rows normalized by their own statistics, rank 0's running statistics kept."""
    losses, state = _run(tmp_path, "wse2", [tool("csrun_wse"), "--num_csx", "2", "--num_workers_per_csx", "1"],
                         execution_strategy="weight_streaming")
    ddp = conv_bn()
    np.testing.assert_allclose(losses, train_torch(ddp, _run_batches(), [slice(0, 4), slice(4, 8)]), rtol=1e-5)
    assert_same_state(state, ddp)
    assert np.abs(state["1.running_mean"] - cpu_run[1]["1.running_mean"]).max() > 1e-3   # rank 0's rows only


@pytest.mark.cluster
def test_two_wses_synchronize_a_sync_batch_norm_through_swarmx_as_torch_on_the_whole_batch(tmp_path, cpu_run):
    """SyncBatchNorm on two WSEs of 4 rows: every statistic and backward sum over all 8 rows
    (ALL_REDUCE through SwarmX), so the run is torch eager's BatchNorm on the whole batch and the
    CPU path's, within float32 reordering."""
    losses, state = _run(tmp_path, "sync2", [tool("csrun_wse"), "--num_csx", "2", "--num_workers_per_csx", "1"],
                         sync=True, execution_strategy="weight_streaming")
    eager = conv_bn()
    np.testing.assert_allclose(losses, train_torch(eager, _run_batches()), rtol=1e-5)
    assert_same_state(state, eager)
    np.testing.assert_allclose(losses, cpu_run[0], rtol=1e-5)


@pytest.mark.cluster
def test_one_wse_in_bfloat16_trains_a_sync_batch_norm_as_the_cpu_paths_batch_norm_bit_for_bit(tmp_path, spec):
    """One WSE has nothing to sum: its SyncBatchNorm is the CPU path's BatchNorm. In bfloat16, where
    the weights stream in 16 bits and the running statistics in float32 (MemoryX -> WSE -> MemoryX).
    The CPU path's BatchNorm run is its step run here (csrun_cpu's bits, one process less)."""
    from cs_runtime.compiler.stage import runnable
    bf16 = {"mixed_precision": True, "fp16_type": "bfloat16"}
    cpu_losses, cpu_weights, _ = train_ours(runnable(dataclasses.replace(spec, precision="bfloat16")),
                                            _run_batches())
    losses, state = _run(tmp_path, "sync16", [tool("csrun_wse")], sync=True, model=bf16,
                         execution_strategy="weight_streaming")
    np.testing.assert_array_equal(losses, cpu_losses)
    for key, w in flat(cpu_weights).items():
        np.testing.assert_array_equal(state[key], w, err_msg=key)
    from cs_runtime.numerics.precision import quantize
    assert not np.array_equal(quantize(state["1.running_var"], "bfloat16"), state["1.running_var"])   # float32
    assert state["1.num_batches_tracked"] == RUN_STEPS


def test_running_statistics_under_mixed_precision_stay_float32_as_torch_autocast_keeps_them(spec):
    """bfloat16: the conv rounds its operands (x, weight, bias) and accumulates in float32; the batch
    norm after it computes in float32 and its running statistics stay float32 values from step to
    step, never rounded to 16 bits, as torch's autocast keeps them: each step's equal torch eager's
    BatchNorm2d update from the step's running statistics on the same conv output."""
    from cs_runtime.compiler.stage import runnable
    from cs_runtime.numerics.precision import quantize
    sixteen = runnable(dataclasses.replace(spec, precision="bfloat16"))
    as_bf16 = lambda a: torch.from_numpy(np.asarray(a)).to(torch.bfloat16).to(torch.float32)   # noqa: E731
    weights = state = None
    for x, y in images(steps=2):
        before = {k: np.array(w) for k, w in flat(weights or init_weights(sixteen, seed=0)).items()}
        _, weights, state = train_ours(sixteen, [(x, y)], weights=weights, state=state)
        norm = conv_bn()[1]
        for name in ("running_mean", "running_var"):
            getattr(norm, name).copy_(torch.from_numpy(before[f"1.{name}"]))
        with torch.no_grad():
            norm(F.conv2d(as_bf16(x), as_bf16(before["0.weight"]), as_bf16(before["0.bias"])))
        for name in ("running_mean", "running_var"):
            ours = flat(weights)[f"1.{name}"]
            np.testing.assert_allclose(ours, getattr(norm, name).numpy(), rtol=1e-5, atol=1e-7, err_msg=name)
            assert not np.array_equal(quantize(ours, "bfloat16"), ours)   # float32 values, not 16-bit ones
    assert flat(weights)["1.num_batches_tracked"] == 2
