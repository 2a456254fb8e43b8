"""A captured torch GPT-2 (examples/torch_gpt) through the whole system:
the CPU path's run (made in this process, as csrun_cpu runs it) against torch
eager on the same module, batches and SGD; then
weight streaming on 1 and 2 WSEs and pipelined against the CPU run (loss
every step and the final weights within 1e-5 relative). The same for a BERT-style
encoder of three inputs (examples/torch_bert: input_ids, attention_mask,
token_type_ids) with dropout, torch eager given the executor's masks."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import yaml

from tests.cluster_utils import REPO, cpu_path_in_process, final_weights, relative_error, tool, train_losses

pytestmark = pytest.mark.cluster  # every test here starts processes (see tests/conftest.py)

torch = pytest.importorskip("torch", reason="the torch examples need torch (an optional extra)")

GPT_RUN = str(REPO / "examples" / "torch_gpt" / "run.py")
STEPS = 12
TOL = 1e-5
PARAMS = {
    "train_input": {"batch_size": 8, "max_sequence_length": 16, "shuffle": True, "drop_last_batch": True},
    "eval_input": {"batch_size": 8, "max_sequence_length": 16},
    "model": {"model_type": "gpt2", "vocab_size": 260, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2,
              "max_position_embeddings": 16, "dropout_rate": 0.0, "attention_dropout_rate": 0.0},
    # SGD with momentum here: Adam on real text is compared with torch in-process
    # (tests/test_torch_programs.py), where the spread it amplifies is measured.
    "optimizer": {"optimizer_type": "sgd", "learning_rate": 0.1, "momentum": 0.9},
    "runconfig": {"max_steps": STEPS, "log_steps": 4, "checkpoint_steps": 0, "seed": 2},
}


def _params(tmp_path, name, base=PARAMS, **runconfig):
    params = {k: dict(v) for k, v in base.items()}
    params["runconfig"].update(runconfig)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(params))
    return path


def _run(launcher, params, model_dir, *extra, script=GPT_RUN):
    cmd = [*launcher, sys.executable, script, "--mode", "train", "--params", str(params),
           "--model_dir", str(model_dir), *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def _run_cpu(params, model_dir, script=GPT_RUN):
    """The CPU path's run, as csrun_cpu runs it, in this process (no process, no second torch import)."""
    assert cpu_path_in_process(script, ["--mode", "train", "--params", str(params), "--model_dir", str(model_dir)]) == 0


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch_gpt")
    params = _params(tmp, "params.yaml")
    _run_cpu(params, tmp / "cpu")
    return params, train_losses(tmp / "cpu"), final_weights(tmp / "cpu")


def _torch_eager(params_path, double=False):
    """The same module (run.py builds it), the same global batches, torch's SGD."""
    from cs_runtime.config import load_params
    from cs_runtime.data.inputs import InputStream
    from examples.torch_gpt import run
    from examples.torch_gpt.model import gpt_loss
    params = load_params(str(params_path))
    module = run.build_module(params)
    module = module.double() if double else module
    stream = InputStream.build("train", run.train_input_fn(params), params.train_input, params.runconfig.seed)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        shard = stream.shard(step)
        opt.zero_grad()
        loss = gpt_loss(module(torch.from_numpy(shard.x.astype(np.int64))), torch.from_numpy(shard.y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return module, np.array(losses)


def test_cpu_path_equals_torch_eager_and_checkpoint_loads_into_the_module(cpu_run):
    from cs_torch.capture import load_into
    from examples.torch_gpt import run
    from cs_runtime.config import load_params
    params_path, losses, weights = cpu_run
    module, eager_losses = _torch_eager(params_path)
    module64, _ = _torch_eager(params_path, double=True)
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, eager_losses, rtol=TOL)
    fresh = run.build_module(load_params(str(params_path)))
    by_param = {key.split("/", 2)[2]: w for key, w in weights.items()}
    load_into(fresh, by_param, {"transformer.wte.weight": "lm_head.weight"})
    for name, tensor in module.state_dict().items():
        # Each tensor within 1e-5, or three times torch's own float32-vs-float64
        # spread where that is larger.
        ours, theirs = fresh.state_dict()[name].numpy(), tensor.detach().numpy()
        spread = relative_error(theirs, module64.state_dict()[name].numpy())
        assert relative_error(ours, theirs) < max(TOL, 3 * spread), name


@pytest.mark.parametrize("num_csx,strategy", [(1, "weight_streaming"), (2, "weight_streaming"), (1, "pipelined")])
def test_cluster_equals_cpu_path(tmp_path, cpu_run, num_csx, strategy):
    _, losses, weights = cpu_run
    params = _params(tmp_path, "p.yaml", execution_strategy=strategy)
    result = _run([tool("csrun_wse"), "--num_csx", str(num_csx), "--num_workers_per_csx", "1"], params,
                  tmp_path / "m")
    assert f"Mode={strategy}, Step={STEPS}," in result.stdout, result.stdout[-2000:]
    got = train_losses(tmp_path / "m")
    assert len(got) == STEPS
    got_w = final_weights(tmp_path / "m")
    assert got_w.keys() == weights.keys()
    if num_csx == 1:   # one WSE runs the CPU path's products in its order: the same bits
        np.testing.assert_array_equal(got, losses)
        for name in weights:
            np.testing.assert_array_equal(got_w[name], weights[name], err_msg=name)
        return
    assert (np.abs(got - losses) / np.abs(losses)).max() < TOL
    for name in weights:
        assert relative_error(got_w[name], weights[name]) < TOL, name


@pytest.mark.parametrize("fmt,strategy", [("float16", "weight_streaming"), ("bfloat16", "pipelined"),
                                          ("cbfloat16", "weight_streaming")])
def test_16bit_gpt_on_one_wse_equals_the_cpu_path_bit_for_bit(tmp_path, cpu_run, fmt, strategy):
    """model.mixed_precision applies to a captured model: its matmuls, attention
    included, round as dense layers do, weights stream in 16 bits, and one WSE
    computes what the CPU path does in the same order, to the bit."""
    _, float32_losses, _ = cpu_run
    params = _params(tmp_path, f"{fmt}.yaml", execution_strategy=strategy)
    text = yaml.safe_load(params.read_text())
    text["model"].update(mixed_precision=True, fp16_type=fmt)
    text["optimizer"]["loss_scaling_factor"] = "dynamic"
    params.write_text(yaml.safe_dump(text))
    _run_cpu(params, tmp_path / "cpu")
    result = _run([tool("csrun_wse"), "--num_csx", "1", "--num_workers_per_csx", "1"], params, tmp_path / "wse")
    want, got = train_losses(tmp_path / "cpu"), train_losses(tmp_path / "wse")
    assert len(got) == STEPS
    np.testing.assert_array_equal(got, want)
    w_want, w_got = final_weights(tmp_path / "cpu"), final_weights(tmp_path / "wse")
    assert w_got.keys() == w_want.keys()
    for name in w_want:
        np.testing.assert_array_equal(w_got[name], w_want[name], err_msg=name)
    # The rounding is there (not float32's numbers), and costs little over 12 steps.
    assert not np.array_equal(want, float32_losses)
    assert np.max(np.abs(want - float32_losses) / float32_losses) < 2e-2
    if strategy == "weight_streaming":
        num_params = sum(w.size for w in w_want.values())
        # every layer under 1 MiB: one group (protocol.layer_groups), whose weights go once a
        # step, forward and at once backward (fwd_bwd), 2 bytes each
        assert f"WeightBytes/step={2 * num_params} " in result.stdout


# ---------------------------------------------------------------- several inputs, dropout

BERT_RUN = str(REPO / "examples" / "torch_bert" / "run.py")
BERT_STEPS = 8
BERT_PARAMS = {
    "train_input": {"batch_size": 8, "max_sequence_length": 16, "masked_lm_prob": 0.15, "shuffle": True,
                    "drop_last_batch": True},
    "model": {"model_type": "bert", "vocab_size": 260, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2,
              "filter_size": 64, "max_position_embeddings": 16, "dropout_rate": 0.1, "attention_dropout_rate": 0.1},
    "optimizer": {"optimizer_type": "sgd", "learning_rate": 0.1, "momentum": 0.9},
    "runconfig": {"max_steps": BERT_STEPS, "log_steps": 4, "checkpoint_steps": 0, "seed": 2},
}


@pytest.fixture(scope="module")
def bert_cpu_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch_bert")
    params = _params(tmp, "params.yaml", BERT_PARAMS)
    _run_cpu(params, tmp / "cpu", script=BERT_RUN)
    return params, train_losses(tmp / "cpu"), final_weights(tmp / "cpu")


def test_three_input_bert_with_dropout_on_the_cpu_path_equals_torch_eager_given_the_same_masks(
        bert_cpu_run, monkeypatch):
    """input_ids, attention_mask and token_type_ids stream as three arrays; torch eager
    runs the same module on the same batches, its F.dropout fed the masks the executor
    draws (kernels.sample_keep_mask of seed, step, site, rows): every step's loss and
    every weight after the run within 1e-5 relative."""
    from cs_runtime.config import load_params
    from cs_runtime.data.inputs import InputStream
    from cs_runtime.numerics import kernels
    from cs_torch.capture import load_into
    from examples.torch_bert import run
    from examples.torch_bert.model import mlm_loss
    params_path, losses, weights = bert_cpu_run
    params = load_params(str(params_path))
    module = run.build_module(params)
    stream = InputStream.build("train", run.train_input_fn(params), params.train_input, params.runconfig.seed)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    eager_losses = []
    for step in range(BERT_STEPS):
        shard = stream.shard(step)
        assert set(shard.x) == {"input_ids", "attention_mask", "token_type_ids"}
        calls = iter(range(100))

        def dropout(x, p=0.5, training=True, inplace=False, step=step, calls=calls):
            if not training or p == 0:
                return x
            rows = slice(0, shard.global_batch)
            mask = kernels.sample_keep_mask(params.runconfig.seed, step, next(calls), rows, tuple(x.shape), p)
            return x * torch.from_numpy(mask)
        monkeypatch.setattr(torch.nn.functional, "dropout", dropout)
        opt.zero_grad()
        loss = mlm_loss(module(**{k: torch.from_numpy(a.astype(np.int64)) for k, a in shard.x.items()}),
                        torch.from_numpy(shard.y))
        loss.backward()
        opt.step()
        eager_losses.append(loss.item())
        assert next(calls) == 7   # the embeddings', and per block the attention probabilities' and two residuals'
    assert len(losses) == BERT_STEPS
    np.testing.assert_allclose(losses, eager_losses, rtol=TOL)
    fresh = run.build_module(params)
    load_into(fresh, {key.split("/", 2)[2]: w for key, w in weights.items()})
    for name, tensor in module.state_dict().items():
        theirs = tensor.detach().numpy()
        assert relative_error(fresh.state_dict()[name].numpy(), theirs) < TOL, name


# Pipelined mode runs here as two replicas (each a half of the shard's rows, their gradients summed
# on the wafer): one pipelined run of one replica equals the CPU path bit for bit for GPT-2 with
# dropout and BertForMaskedLM's two inputs (tests/test_torch_others.py).
@pytest.mark.parametrize("num_csx,strategy,replicas", [(1, "weight_streaming", 1), (2, "weight_streaming", 1),
                                                      (1, "pipelined", 2)])
def test_three_input_bert_with_dropout_on_the_cluster_equals_the_cpu_path(tmp_path, bert_cpu_run, num_csx,
                                                                           strategy, replicas):
    """One WSE computes what the CPU path does, to the bit (the same masks, the same
    order); two WSEs and two pipelined replicas (each a half of the shard's rows of every
    feature) within 1e-5 (only sums over shards differ)."""
    _, losses, weights = bert_cpu_run
    extra = ("--multireplica",) if replicas > 1 else ()
    params = _params(tmp_path, "p.yaml", BERT_PARAMS, execution_strategy=strategy)
    result = _run([tool("csrun_wse"), "--num_csx", str(num_csx), "--num_workers_per_csx", "1"], params,
                  tmp_path / "m", *extra, script=BERT_RUN)
    assert f"Step={BERT_STEPS}," in result.stdout, result.stdout[-2000:]
    got, got_w = train_losses(tmp_path / "m"), final_weights(tmp_path / "m")
    assert len(got) == BERT_STEPS and got_w.keys() == weights.keys()
    if extra:
        assert f"Mode={strategy} x2," in result.stdout, result.stdout[-2000:]
    if num_csx == 1 and strategy == "weight_streaming":
        np.testing.assert_array_equal(got, losses)
        for name in weights:
            np.testing.assert_array_equal(got_w[name], weights[name], err_msg=name)
        return
    assert (np.abs(got - losses) / np.abs(losses)).max() < TOL
    for name in weights:
        assert relative_error(got_w[name], weights[name]) < TOL, name
