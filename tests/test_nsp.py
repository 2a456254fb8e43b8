"""BERT's next-sentence head (disable_nsp: false, the model zoo's default): the lowered
program's loss and gradients against torch autograd on the same model written as a plain
torch module, a few AdamW steps of the CPU path against torch eager; the sentence-pair
text data (the HDF5 fields: tests/test_hdf5_data.py); and the params.yaml BERT with the head on
2 WSEs and pipelined against the CPU path.

    python -m pytest tests/test_nsp.py -q
"""
from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import yaml

from cs_runtime.compiler.families import lower_spec
from cs_runtime.data import text
from cs_runtime.numerics import program_layer
from cs_runtime.numerics.batch_check import BadBatch, check_batch
from cs_runtime.numerics.model import (ShardContext, init_weights, model_backward, model_forward, model_loss,
                                       transformer_spec)
from cs_runtime.numerics.optim import Optimizer, OptimizerSpec
from tests.cluster_utils import REPO, final_weights, relative_error, tool, train_losses

VOCAB, SEQ, WIDTH, BATCH, PAD, SEGMENTS = 40, 10, 16, 6, 0, 3
STEPS, LR, MAX_NORM, WEIGHT_DECAY = 4, 0.01, 1.0, 0.01


def nsp_spec(scaling: str = "batch_size", weight: float = 1.0, pooler: str = "tanh"):
    return lower_spec(transformer_spec(
        "bert", style="bert", vocab_size=VOCAB, max_len=SEQ, hidden_size=WIDTH, num_layers=2, num_heads=2,
        ffn_features=32, dropout=0.0, attn_dropout=0.0, eps=1e-5, pad_id=PAD, tied=True, loss_scaling=scaling,
        loss_weight=weight, nsp=True, num_segments=SEGMENTS, pooler_activation=pooler))


def batch(seed: int):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, (BATCH, SEQ)).astype(np.int32)
    labels = rng.integers(0, VOCAB, (BATCH, SEQ))
    labels[rng.random((BATCH, SEQ)) > 0.3] = -100
    ids[1, 7:], labels[1, 7:] = PAD, -100
    segments = rng.integers(0, SEGMENTS, (BATCH, SEQ)).astype(np.int32)
    nsp = rng.integers(0, 2, BATCH).astype(np.int32)
    return {"input_ids": ids, "segment_ids": segments, "next_sentence_label": nsp}, labels


def torch_model(weights, pooler: str):
    """The model zoo's BertPretrainModel maths, written out in torch from the same weights."""
    torch = pytest.importorskip("torch", reason="the torch comparison needs PyTorch (pip install torch)")
    F = torch.nn.functional
    params = {f"{layer}.{name}": torch.nn.Parameter(torch.tensor(value)) for layer, ws in weights.items()
              for name, value in ws.items() if (layer, name) != ("lm_head", "tokens")}
    params["lm_head.tokens"] = params["embed.tokens"]   # tied: one table

    def ln(x, p):
        return F.layer_norm(x, (WIDTH,), params[f"{p}_gain"], params[f"{p}_bias"], 1e-5)

    def forward(features):
        ids, seg = (torch.tensor(features[k]).long() for k in ("input_ids", "segment_ids"))
        x = params["embed.tokens"][ids] + params["embed.positions"][:SEQ] + params["embed.segments"][seg]
        x = ln(x, "embed.ln")
        keep = (ids != PAD)[:, None, None, :]
        for i in range(2):
            p = lambda n: params[f"block{i}.{n}"]   # noqa: E731
            q, k, v = (z.reshape(BATCH, SEQ, 2, -1).transpose(1, 2)
                       for z in (x @ p("qkv_weight") + p("qkv_bias")).split(WIDTH, dim=-1))
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(BATCH, SEQ, WIDTH)
            x = ln(x + att @ p("proj_weight") + p("proj_bias"), f"block{i}.ln1")
            mlp = F.gelu(x @ p("fc_weight") + p("fc_bias")) @ p("out_weight") + p("out_bias")
            x = ln(x + mlp, f"block{i}.ln2")
        h = ln(F.gelu(x @ params["lm_head.transform_weight"] + params["lm_head.transform_bias"]), "lm_head.ln")
        mlm = F.linear(h, params["embed.tokens"], params["lm_head.decoder_bias"])
        act = {"tanh": torch.tanh, "relu": torch.relu}[pooler]
        pooled = act(x[:, 0] @ params["nsp_head.pooler_weight"] + params["nsp_head.pooler_bias"])
        return mlm, pooled @ params["nsp_head.classifier_weight"] + params["nsp_head.classifier_bias"]

    return params, forward


def torch_loss(mlm, nsp_logits, labels, features, scaling: str, weight: float):
    """BertPretrainModelLoss: summed MLM cross-entropy / batch * mlm_loss_weight (or the mean over
    the masked tokens) + the next-sentence cross-entropy's mean over the batch."""
    import torch
    labels = torch.tensor(labels)
    summed = torch.nn.functional.cross_entropy(mlm.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    mlm_loss = summed * weight / BATCH if scaling == "batch_size" else summed / int((labels != -100).sum())
    nsp = torch.tensor(features["next_sentence_label"]).long()
    return mlm_loss + torch.nn.functional.cross_entropy(nsp_logits, nsp)


def cpu_step(spec, weights, features, labels, step: int, shards: int = 1):
    """Forward, loss and backward of the CPU path / each WSE's shard, the shards' sums added
    (each shard's tied copies already hold the sum of their gradients)."""
    loss, total = 0.0, None
    count = int((labels != -100).sum())
    for rank in range(shards):
        rows = slice(rank * BATCH // shards, (rank + 1) * BATCH // shards)
        x = {k: v[rows] for k, v in features.items()}
        check_batch(spec, x, labels[rows])
        ctx = ShardContext(1, step, BATCH, rows, True, labels=labels[rows])
        out, caches = model_forward(spec, x, weights, ctx)
        result = model_loss(spec, out, labels[rows], BATCH, count)
        grads = model_backward(spec, result.delta, caches, weights, step)
        loss += result.loss
        total = grads if total is None else [{k: t[k] + g[k] for k in t} for t, g in zip(total, grads)]
    return loss, total


@pytest.mark.parametrize("scaling,weight,pooler,shards", [("batch_size", 1.0, "tanh", 1),
                                                          ("batch_size", 0.25, "relu", 2),
                                                          ("num_masked", 1.0, "tanh", 3)])
def test_nsp_loss_and_gradients_equal_torch_autograd(scaling, weight, pooler, shards):
    spec = nsp_spec(scaling, weight, pooler)
    weights = init_weights(spec, 5)
    features, labels = batch(0)
    loss, grads = cpu_step(spec, weights, features, labels, 0, shards)
    params, forward = torch_model(weights, pooler)
    want = torch_loss(*forward(features), labels, features, scaling, weight)
    want.backward()
    assert abs(loss - want.item()) <= 1e-5 * abs(want.item())
    for layer, g in zip(spec.layers, grads):
        for name, value in g.items():
            if (layer.name, name) == ("lm_head", "tokens"):
                continue   # the tied copy: its gradient is the embedding's, checked there
            ref = params[f"{layer.name}.{name}"].grad.numpy()
            assert relative_error(value, ref) < 1e-4, f"{layer.name}.{name}: {relative_error(value, ref)}"
    # the next-sentence head learns: its classifier's gradient is not zero
    assert np.abs(grads[-1]["classifier_weight"]).max() > 0


def test_the_cpu_path_trains_as_torch_eager_with_adamw():
    torch = pytest.importorskip("torch", reason="the torch comparison needs PyTorch (pip install torch)")
    spec = nsp_spec()
    weights = init_weights(spec, 3)
    params, forward = torch_model(weights, "tanh")
    named = [(n, p) for n, p in params.items() if n != "lm_head.tokens"]
    decay = lambda n: not n.endswith(("bias", "gain"))   # noqa: E731
    opt_t = torch.optim.AdamW([{"params": [p for n, p in named if decay(n)], "weight_decay": WEIGHT_DECAY},
                               {"params": [p for n, p in named if not decay(n)], "weight_decay": 0.0}],
                              lr=LR, eps=1e-8)
    opt = Optimizer(OptimizerSpec("adamw", weight_decay=WEIGHT_DECAY, eps=1e-8, exclude_bias_and_norm=True))
    state = {name: opt.init_state(w) for name, w in weights.items()}
    names = [layer.name for layer in spec.layers]
    losses = []
    for step in range(STEPS):
        features, labels = batch(step)
        opt_t.zero_grad()
        want = torch_loss(*forward(features), labels, features, "batch_size", 1.0)
        want.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], MAX_NORM)
        opt_t.step()
        loss, grads = cpu_step(spec, weights, features, labels, step)
        opt.update_model(names, weights, grads, state, LR, step, MAX_NORM, copies=program_layer.tied_copies(spec))
        assert abs(loss - want.item()) <= 1e-5 * abs(want.item()), f"step {step}: {loss} vs {want.item()}"
        losses.append(loss)
    assert all(math.isfinite(v) for v in losses) and losses[-1] != losses[0]
    for layer in ("embed", "nsp_head"):
        for name, value in weights[layer].items():
            ref = params[f"{layer}.{name}"].detach().numpy()
            assert relative_error(value, ref) < 1e-4, f"{layer}.{name}"


def test_bad_nsp_features_are_one_line():
    spec = nsp_spec()
    features, labels = batch(1)
    for key, value, says in (("segment_ids", SEGMENTS, "segment id 3 outside [0, 3)"),
                             ("next_sentence_label", 2, "next_sentence_label 2 is not 0 or 1")):
        bad = {k: v.copy() for k, v in features.items()}
        bad[key][2] = value
        with pytest.raises(BadBatch, match=re_escape(says)) as info:
            check_batch(spec, bad, labels)
        assert info.value.sample == 2
    with pytest.raises(BadBatch, match="the model takes input_ids, segment_ids, next_sentence_label"):
        check_batch(spec, features["input_ids"], labels)


def re_escape(s: str) -> str:
    import re
    return re.escape(s)


# ------------------------------------------------------------------ data

def test_sentence_pairs_are_deterministic_half_random_and_segmented():
    tokens = text.load_corpus(None, "train")
    data = text.BertDataset(tokens, 64, 0.15, seed=7, nsp=True)
    idx = np.arange(0, 4000, 3)
    x, y = data.get(idx)
    x2, y2 = text.BertDataset(tokens, 64, 0.15, seed=7, nsp=True).get(idx)
    assert all(np.array_equal(x[k], x2[k]) for k in x) and np.array_equal(y, y2)
    other = text.BertDataset(tokens, 64, 0.15, seed=8, nsp=True).get(idx)[0]["next_sentence_label"]
    assert not np.array_equal(other, x["next_sentence_label"])
    labels = x["next_sentence_label"]
    assert set(np.unique(labels)) == {0, 1} and 0.45 < labels.mean() < 0.55
    second, pair_labels = data.pairs(idx)
    assert np.array_equal(pair_labels, labels)
    assert np.array_equal(second[labels == 0], idx[labels == 0] + 1)          # is next: the following span
    assert not np.isin(second[labels == 1] - idx[labels == 1], (0, 1)).any()   # random: never A nor its next
    ids, segments = x["input_ids"], x["segment_ids"]
    for row in range(len(idx)):
        seps = np.flatnonzero(ids[row] == text.SEP)
        # [CLS] A [SEP] B [SEP]: segment 0 up to the first [SEP], 1 over B and its [SEP], 0 on the padding
        assert ids[row, 0] == text.CLS and len(seps) >= 2
        first, last = seps[0], np.flatnonzero(ids[row] != text.PAD)[-1]
        assert (segments[row, :first + 1] == 0).all() and (segments[row, first + 1:last + 1] == 1).all()
        assert (segments[row, last + 1:] == 0).all()
    a0, a1 = data.spans[idx[0]]
    b0, b1 = data.spans[second[0]]
    unmasked = text.BertDataset(tokens, 64, 0.0, seed=7, nsp=True)._layout(idx[:1])[0][0]
    assert text.decode(unmasked) == text.decode(tokens[a0:a1]) + text.decode(tokens[b0:b1])


# ------------------------------------------------------------------ the params.yaml BERT with the head

PARAMS = {
    "train_input": {"batch_size": 8, "max_sequence_length": 16, "shuffle": True},
    "eval_input": {"batch_size": 8, "max_sequence_length": 16},
    "model": {"model_type": "bert", "hidden_size": 16, "num_hidden_layers": 2, "num_heads": 2, "filter_size": 32,
              "max_position_embeddings": 16, "dropout_rate": 0.1, "attention_dropout_rate": 0.1},
    "optimizer": {"optimizer_type": "sgd", "learning_rate": 0.3, "momentum": 0.9, "max_gradient_norm": 1.0},
    "runconfig": {"max_steps": 8, "log_steps": 2, "checkpoint_steps": 0, "seed": 4, "eval_steps": 2},
}


def run_bert(launcher, params, model_dir, *extra):
    cmd = [*launcher, sys.executable, str(REPO / "examples" / "bert" / "run.py"), "--mode", "train_and_eval",
           "--params", str(params), "--model_dir", str(model_dir), *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def nsp_oracle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nsp")
    params = tmp / "params.yaml"
    params.write_text(yaml.safe_dump(PARAMS))
    run_bert([tool("csrun_cpu")], params, tmp / "cpu")
    return params, train_losses(tmp / "cpu"), final_weights(tmp / "cpu")


@pytest.mark.cluster
@pytest.mark.parametrize("num_csx,strategy", [(2, "weight_streaming"), (1, "pipelined")])
def test_bert_with_nsp_on_the_cluster_equals_the_cpu_path(tmp_path, nsp_oracle, num_csx, strategy):
    params, losses, weights = nsp_oracle
    assert len(losses) == PARAMS["runconfig"]["max_steps"] and np.isfinite(losses).all()
    assert {"model/embed/segments", "model/nsp_head/pooler_weight", "model/nsp_head/classifier_weight"} <= set(weights)
    result = run_bert([tool("csrun_wse"), "--num_csx", str(num_csx)], params, tmp_path / "wse",
                      "--override", f"runconfig.execution_strategy={strategy}")
    assert f"Mode={strategy}" in result.stdout
    np.testing.assert_allclose(train_losses(tmp_path / "wse"), losses, rtol=1e-5)
    got = final_weights(tmp_path / "wse")
    for key, value in weights.items():
        assert relative_error(got[key], value) < 1e-5, key
