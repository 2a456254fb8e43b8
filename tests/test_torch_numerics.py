"""The numerics checked against PyTorch itself (not against the project's own
oracle): Adam/AdamW under torch's GradScaler with skipped steps, exact and
tanh GELU, the MLM loss. docs/design.md (the oracle) gives each tolerance and why.

    python -m pytest tests/test_torch_numerics.py -q
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch comparisons need PyTorch (pip install torch)")

from cs_runtime import checkpoint as ckpt  # noqa: E402
from cs_runtime.numerics.optim import Optimizer, OptimizerSpec  # noqa: E402
from cs_runtime.numerics.precision import LossScaler  # noqa: E402

STEPS = 30
ADAM_RTOL = 1e-5   # float32 throughout on both sides; the rest is rounding order


# --------------------------------------------------------------------------
# Adam / AdamW with loss scaling and skipped steps
# --------------------------------------------------------------------------

def regression_problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = rng.standard_normal((16, 4)).astype(np.float32)
    w = (rng.standard_normal((8, 4)) * 0.3).astype(np.float32)
    b = np.zeros(4, np.float32)
    return x, y, {"weight": w, "bias": b}


def scaled_fp16_grads(x, y, params: dict, scale: float) -> dict:
    """The gradients of mean((x @ W + b - y)^2) times the loss scale, as a 16-bit
    wafer emits them: float16, so a large scale overflows to inf."""
    w, b = (np.asarray(params[k], np.float32) for k in ("weight", "bias"))
    d = (x @ w + b - y) * np.float32(2.0 / y.size)
    with np.errstate(over="ignore"):
        return {"weight": ((x.T @ d) * np.float32(scale)).astype(np.float16).astype(np.float32),
                "bias": (d.sum(axis=0) * np.float32(scale)).astype(np.float16).astype(np.float32)}


def run_torch(kind: str, weight_decay: float, steps: int):
    """The torch reference: torch.optim.Adam/AdamW driven by torch.amp.GradScaler
    (scaler.step skips optimizer.step on inf/nan; scaler.update moves the scale)."""
    x, y, params = regression_problem()
    tensors = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in params.items()}
    cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
    opt = cls(list(tensors.values()), lr=1e-3, weight_decay=weight_decay)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=5)
    scales = []
    for _ in range(steps):
        scale = float(scaler.scale(torch.ones(())))
        scales.append(scale)
        now = {k: t.detach().numpy() for k, t in tensors.items()}
        for k, g in scaled_fp16_grads(x, y, now, scale).items():
            tensors[k].grad = torch.from_numpy(g)
        scaler.step(opt)
        scaler.update()
    return {k: t.detach().numpy().copy() for k, t in tensors.items()}, scales


def run_ours(kind: str, weight_decay: float, steps: int, state=None, params=None, scaler=None, first=0):
    x, y, start = regression_problem()
    params = params if params is not None else start
    opt = Optimizer(OptimizerSpec(kind, weight_decay=weight_decay, eps=1e-8))   # torch.optim's eps
    state = state if state is not None else {"fc": opt.init_state(params)}
    scaler = scaler or LossScaler("dynamic", initial_scale=2.0 ** 24, steps_per_increase=5,
                                  min_scale=1.0, max_scale=2.0 ** 40)
    scales = []
    for step in range(first, first + steps):
        scales.append(scaler.scale)
        grads = [scaled_fp16_grads(x, y, params, scaler.scale)]
        _, applied, _ = opt.update_model(["fc"], {"fc": params}, grads, state, 1e-3, step, None,
                                         scaler.scale, skip_nonfinite=True)
        scaler.update(applied)
    return params, state, scaler, scales


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(np.asarray(b, np.float64)))


@pytest.mark.parametrize("kind,weight_decay", [("adam", 0.0), ("adam", 0.01), ("adamw", 0.01)])
def test_adam_with_skipped_steps_matches_torch_grad_scaler(kind, weight_decay):
    want, torch_scales = run_torch(kind, weight_decay, STEPS)
    got, state, _, scales = run_ours(kind, weight_decay, STEPS)
    assert scales == torch_scales                       # the same steps overflowed and were skipped
    skipped = sum(1 for a, b in zip(scales, scales[1:]) if b < a)
    assert skipped >= 8, "the problem must skip steps, or it tests nothing"
    for name in want:
        assert rel(got[name], want[name]) <= ADAM_RTOL, name
    # the count is the applied updates only, not the 30 steps
    assert float(state["fc"]["weight"]["step"]) == STEPS - skipped


def test_the_step_count_survives_a_checkpoint(tmp_path):
    want, _ = run_torch("adamw", 0.01, STEPS)
    params, state, scaler, _ = run_ours("adamw", 0.01, 13)
    path = ckpt.save(tmp_path, ckpt.Checkpoint(13, 13, {"fc": params}, state, {}))
    back = ckpt.load(path)
    assert float(back.opt_state["fc"]["bias"]["step"]) == float(state["fc"]["bias"]["step"])
    got, _, _, _ = run_ours("adamw", 0.01, STEPS - 13, back.opt_state, back.weights["fc"], scaler, first=13)
    for name in want:
        assert rel(got[name], want[name]) <= ADAM_RTOL, name


# --------------------------------------------------------------------------
# GELU: exact and tanh, forward and gradient
# --------------------------------------------------------------------------

# float32 both sides. Relative 1e-6 (a few ulp) where the value is not tiny; absolute
# 2**-23 * 10 for |x| <= 10 because torch's float32 exact GELU computes
# 0.5 * x * (1 + erf(x / sqrt 2)), whose 1 + erf cancels for x < -3 (it is 0 below
# about -5.4, where the true value is -3e-8): there torch, not ours, is off.
# Ours is checked against float64 erfc separately, to 3e-7 relative everywhere.
# The tanh form's derivative has 1 - tanh^2 cancel alike in float32 (both sides),
# times up to ~11 near x = -5.4 before tanh saturates: hence twice the slack.
GELU_RTOL, GELU_ATOL, GELU_GRAD_ATOL = 1e-6, 2.0 ** -23 * 10, 2.0 ** -23 * 20


@pytest.mark.parametrize("kind,approximate", [("gelu", "none"), ("gelu_new", "tanh"), ("gelu_tanh", "tanh")])
def test_gelu_forward_and_gradient_equal_torch(kind, approximate):
    from tests.dense_reference import activate, activation_grad
    x = np.concatenate([np.linspace(-10, 10, 4001), np.random.default_rng(0).standard_normal(4000) * 3])
    x = x.astype(np.float32)
    t = torch.from_numpy(x.copy()).requires_grad_(True)
    y = torch.nn.functional.gelu(t, approximate=approximate)
    y.backward(torch.ones_like(y))
    got = activate(kind, x)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, y.detach().numpy(), rtol=GELU_RTOL, atol=GELU_ATOL)
    np.testing.assert_allclose(activation_grad(kind, x, None), t.grad.numpy(), rtol=GELU_RTOL, atol=GELU_GRAD_ATOL)


def test_exact_gelu_against_float64_erfc():
    """Ours is accurate in both tails, where float32 1 + erf would cancel."""
    import math
    from cs_runtime.numerics.kernels import activate
    x = np.linspace(-12, 12, 2401).astype(np.float32)
    want = np.array([v * 0.5 * math.erfc(-v / math.sqrt(2)) for v in x.astype(np.float64)])
    np.testing.assert_allclose(activate("gelu", x), want, rtol=3e-7, atol=1e-38)


def test_exact_and_tanh_gelu_are_told_apart():
    """The two differ by far more than the tolerance, so each test above pins one."""
    from cs_runtime.numerics.kernels import activate
    x = torch.linspace(-4, 4, 801)
    exact = activate("gelu", x.numpy())
    np.testing.assert_allclose(exact, torch.nn.functional.gelu(x).numpy(), rtol=GELU_RTOL, atol=GELU_ATOL)
    assert np.abs(exact - torch.nn.functional.gelu(x, approximate="tanh").numpy()).max() > 1e-4


def test_each_model_uses_its_references_gelu():
    from cs_runtime.numerics.model import transformer_spec
    import cs_torch.nn as cnn
    shape = dict(vocab_size=50, max_len=8, hidden_size=8, num_layers=1, num_heads=2, ffn_features=16,
                 dropout=0.0, attn_dropout=0.0, eps=1e-5)
    gpt2 = transformer_spec("g", style="gpt2", **shape)
    bert = transformer_spec("b", style="bert", **shape)
    assert [l.activation for l in gpt2.layers[1:]] == ["gelu_new", "none"]   # HF GPT-2: gelu_new
    assert [l.activation for l in bert.layers[1:]] == ["gelu", "gelu"]       # HF BERT: hidden_act gelu (erf)
    assert cnn.GELU().kind == "gelu" and cnn.GELU(approximate="tanh").kind == "gelu_tanh"
    with pytest.raises(cnn.CsTorchError, match="approximate"):
        cnn.GELU(approximate="erf")


# --------------------------------------------------------------------------
# The MLM loss: the model zoo's definition (BertPretrainModelLoss) and HF's
# --------------------------------------------------------------------------

MLM_RTOL = 1e-6   # float32 logits; the loss sums in float64 here, in float32 in torch


def mlm_problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    batch, seq, vocab = 6, 10, 17
    logits = rng.standard_normal((batch, seq, vocab)).astype(np.float32) * 2
    labels = rng.integers(0, vocab, size=(batch, seq))
    masked = rng.random((batch, seq)) < 0.3
    masked[0] = False                      # a sample with nothing masked
    masked[1, :8] = True                   # and one with most of it masked
    labels = np.where(masked, labels, -100)
    return logits, labels


def modelzoo_mlm_loss(logits, labels, mlm_loss_weight=1.0, precomputed=False):
    """The model zoo's BERT MLM loss, written from its definition: per-token cross
    entropy times the mask weights [times mlm_loss_scale = batch / masked tokens,
    which its data loader precomputes], summed, / batch size [times mlm_loss_weight
    when no scale is given]. Returns (loss, d loss / d logits)."""
    t = torch.from_numpy(logits.copy()).requires_grad_(True)
    lab = torch.from_numpy(labels)
    weights = (lab != -100).to(t.dtype)
    batch = lab.shape[0]
    if precomputed:
        weights = weights * (batch / weights.sum())
    per_token = torch.nn.functional.cross_entropy(t.reshape(-1, t.shape[-1]), lab.reshape(-1).clamp(min=0),
                                                  reduction="none")
    loss = (per_token * weights.reshape(-1)).sum() / batch
    if not precomputed:
        loss = loss * mlm_loss_weight
    loss.backward()
    return float(loss.detach()), t.grad.numpy()


def ours(logits, labels, scaling, weight=1.0, shards=1):
    """Our loss and gradient, the batch split over `shards` WSEs as the cluster splits it."""
    from cs_runtime.data.batches import shard_rows
    from cs_runtime.numerics.model import ModelSpec
    from tests.dense_reference import model_loss   # the token loss's formula, as a lowered program's
    spec = ModelSpec("bert", (), loss_scaling=scaling, loss_weight=weight)
    count = int((labels != -100).sum())
    loss, grads = 0.0, []
    for rank in range(shards):
        rows = shard_rows(len(labels), rank, shards)
        part = model_loss(spec, logits[rows], labels[rows], len(labels), count)
        loss += part.loss
        grads.append(part.delta)
    return loss, np.concatenate(grads)


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("weight", [1.0, 0.058])
def test_mlm_loss_batch_size_scaling_is_the_model_zoos(shards, weight):
    logits, labels = mlm_problem()
    want, want_grad = modelzoo_mlm_loss(logits, labels, mlm_loss_weight=weight)
    got, grad = ours(logits, labels, "batch_size", weight, shards)
    assert abs(got - want) <= MLM_RTOL * want
    np.testing.assert_allclose(grad, want_grad, rtol=MLM_RTOL, atol=MLM_RTOL * np.abs(want_grad).max())


@pytest.mark.parametrize("scaling", ["num_masked", "precomputed_num_masked"])
@pytest.mark.parametrize("shards", [1, 3])
def test_mlm_loss_num_masked_scaling_is_the_model_zoos_and_hfs(scaling, shards):
    logits, labels = mlm_problem(1)
    want, want_grad = modelzoo_mlm_loss(logits, labels, precomputed=True)
    t = torch.from_numpy(logits.copy())
    hf = float(torch.nn.functional.cross_entropy(t.reshape(-1, t.shape[-1]), torch.from_numpy(labels).reshape(-1)))
    assert abs(want - hf) <= MLM_RTOL * hf          # the same definition: the mean over every masked token
    got, grad = ours(logits, labels, scaling, shards=shards)
    assert abs(got - want) <= MLM_RTOL * want
    np.testing.assert_allclose(grad, want_grad, rtol=MLM_RTOL, atol=MLM_RTOL * np.abs(want_grad).max())


def test_bert_defaults_to_the_model_zoos_normaliser_and_gpt2_to_num_tokens():
    from cs_runtime.numerics.model import transformer_spec
    shape = dict(vocab_size=50, max_len=8, hidden_size=8, num_layers=1, num_heads=2, ffn_features=16,
                 dropout=0.0, attn_dropout=0.0, eps=1e-5)
    bert = transformer_spec("b", style="bert", **shape)
    assert (bert.loss_scaling, bert.loss_weight) == ("batch_size", 1.0)   # BertForPreTrainingModel's defaults
    assert transformer_spec("g", style="gpt2", **shape).loss_scaling == "num_tokens"
    assert transformer_spec("b", style="bert", loss_scaling="num_masked", **shape).loss_scaling == "num_masked"
