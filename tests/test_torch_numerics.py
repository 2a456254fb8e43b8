"""The numerics checked against PyTorch itself (not against the project's own
oracle): Adam/AdamW under torch's GradScaler with skipped steps, exact and
tanh GELU, the MLM loss. docs/numerics.md gives each tolerance and why.

    python -m pytest tests/test_torch_numerics.py -q
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch comparisons need PyTorch (pip install torch)")

from cs_runtime import checkpoint as ckpt  # noqa: E402
from cs_runtime.numerics.optim import Optimizer  # noqa: E402
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
    opt = Optimizer(kind, weight_decay=weight_decay)
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
