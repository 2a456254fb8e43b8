"""A tied head (share_embedding_weights) against torch eager on the same model written as a
plain torch module: the params.yaml GPT-2 and BERT, lowered to their programs, trained a
few steps on the CPU path (forward, loss, backward, the tied gradients summed, AdamW with
clipping) against torch's autograd and torch.optim.AdamW with clip_grad_norm_, from the
same weights. Dropout off: torch's masks are not ours.

    python -m pytest tests/test_torch_tied_head.py -q
"""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch eager comparison needs PyTorch (pip install torch)")

from cs_runtime.compiler.families import lower_spec   # noqa: E402
from cs_runtime.numerics import program_layer   # noqa: E402
from cs_runtime.numerics.model import (ShardContext, init_weights, model_backward, model_forward,   # noqa: E402
                                       model_loss, transformer_spec)
from cs_runtime.numerics.optim import Optimizer, OptimizerSpec   # noqa: E402

STEPS, LR, MAX_NORM, WEIGHT_DECAY = 4, 0.01, 1.0, 0.01
LOSS_RTOL = 1e-5
VOCAB, SEQ, WIDTH, BATCH, PAD = 40, 10, 16, 4, 0


def spec_of(style: str, out_bias: bool):
    return lower_spec(transformer_spec(
        style, style=style, vocab_size=VOCAB, max_len=SEQ, hidden_size=WIDTH, num_layers=2, num_heads=2,
        ffn_features=32, dropout=0.0, attn_dropout=0.0, eps=1e-5, pad_id=PAD if style == "bert" else -1,
        tied=True, out_bias=out_bias))


def data(style: str, seed: int):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, (BATCH, SEQ))
    labels = rng.integers(0, VOCAB, (BATCH, SEQ))
    if style == "bert":   # padding at the end of one sample; most tokens unlabelled (masked LM)
        ids[1, 7:] = PAD
        labels[rng.random((BATCH, SEQ)) > 0.3] = -100
        labels[1, 7:] = -100
    return ids, labels


class Plain(torch.nn.Module):
    """The lowered program's maths, one torch op at a time, the head's decoder the token table."""

    def __init__(self, spec, weights):
        super().__init__()
        self.spec = spec
        as_param = lambda a: torch.nn.Parameter(torch.tensor(a))   # noqa: E731
        self.tables = torch.nn.ParameterDict({k: as_param(v) for k, v in weights["embed"].items()})
        self.blocks = torch.nn.ModuleList(
            torch.nn.ParameterDict({k: as_param(v) for k, v in weights[layer.name].items()})
            for layer in spec.layers[1:-1])
        head = {k: v for k, v in weights["lm_head"].items() if k != "tokens"}   # tokens: the embedding's
        self.head = torch.nn.ParameterDict({k: as_param(v) for k, v in head.items()})

    def forward(self, ids):
        bert = self.spec.layers[0].norm == "post"
        eps = self.spec.layers[0].eps
        ln = lambda x, p, k: torch.nn.functional.layer_norm(x, (WIDTH,), p[f"{k}_gain"], p[f"{k}_bias"], eps)  # noqa
        x = self.tables["tokens"][ids] + self.tables["positions"][: ids.shape[1]]
        if bert:
            x = ln(x, self.tables, "ln")
        keep = (ids != PAD)[:, None, None, :] if bert else None
        gelu = "none" if bert else "tanh"
        for p in self.blocks:
            if bert:
                x = ln(x + self.attention(x, p, keep), p, "ln1")
                x = ln(x + self.mlp(x, p, gelu), p, "ln2")
            else:
                x = x + self.attention(ln(x, p, "ln1"), p, None)
                x = x + self.mlp(ln(x, p, "ln2"), p, gelu)
        h = self.head
        if "transform_weight" in h:
            x = torch.nn.functional.gelu(x @ h["transform_weight"] + h["transform_bias"])
        return torch.nn.functional.linear(ln(x, h, "ln"), self.tables["tokens"], h.get("decoder_bias"))

    def attention(self, x, p, keep):
        b, t, _ = x.shape
        heads = self.spec.layers[1].num_heads
        q, k, v = (z.reshape(b, t, heads, -1).transpose(1, 2)
                   for z in (x @ p["qkv_weight"] + p["qkv_bias"]).split(WIDTH, dim=-1))
        causal = self.spec.layers[1].causal
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=causal)
        return out.transpose(1, 2).reshape(b, t, WIDTH) @ p["proj_weight"] + p["proj_bias"]

    def mlp(self, x, p, gelu):
        h = torch.nn.functional.gelu(x @ p["fc_weight"] + p["fc_bias"], approximate=gelu)
        return h @ p["out_weight"] + p["out_bias"]


def torch_loss(spec, logits, labels):
    """The spec's normaliser: num_tokens (GPT-2), batch_size (BERT, the model zoo's)."""
    summed = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    return summed / (int((labels != -100).sum()) if spec.loss_scaling == "num_tokens" else len(labels))


def no_decay(name: str) -> bool:
    return name.endswith(("bias", "gain"))


def torch_run(spec, weights, batches) -> list[float]:
    model = Plain(spec, weights)
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if not no_decay(n)], "weight_decay": WEIGHT_DECAY},
              {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    losses = []
    for ids, labels in batches:
        opt.zero_grad()
        loss = torch_loss(spec, model(torch.tensor(ids)), torch.tensor(labels))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        losses.append(loss.item())
    return losses


def cpu_path_run(spec, weights, batches) -> list[float]:
    """What chief/cpu_executor runs for one step, on the whole batch."""
    opt = Optimizer(OptimizerSpec("adamw", weight_decay=WEIGHT_DECAY, eps=1e-8, exclude_bias_and_norm=True))
    state = {name: opt.init_state(w) for name, w in weights.items()}
    names = [layer.name for layer in spec.layers]
    losses = []
    for step, (ids, labels) in enumerate(batches):
        ctx = ShardContext(1, step, BATCH, slice(0, BATCH), True, labels=labels)
        out, caches = model_forward(spec, ids, weights, ctx)
        result = model_loss(spec, out, labels, BATCH, int((labels != -100).sum()))
        grads = model_backward(spec, result.delta, caches, weights, step)
        opt.update_model(names, weights, grads, state, LR, step, MAX_NORM,
                         copies=program_layer.tied_copies(spec))
        losses.append(result.loss)
    return losses


@pytest.mark.parametrize("style,out_bias", [("gpt2", False), ("gpt2", True), ("bert", True)])
def test_a_tied_head_trains_as_torch_eager(style, out_bias):
    spec = spec_of(style, out_bias)
    weights = init_weights(spec, 3)
    assert np.array_equal(weights["lm_head"]["tokens"], weights["embed"]["tokens"])
    batches = [data(style, seed) for seed in range(STEPS)]
    want = torch_run(spec, {l: {p: v.copy() for p, v in ps.items()} for l, ps in weights.items()}, batches)
    got = cpu_path_run(spec, weights, batches)
    assert all(math.isfinite(v) for v in want) and want[-1] != want[0]
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= LOSS_RTOL * abs(w), f"step {step}: {g} vs torch {w}"
    # the two copies took the same updates: still one table
    assert np.array_equal(weights["lm_head"]["tokens"], weights["embed"]["tokens"])
