"""Tests for cs_runtime.optim against plain float64 references written from
PyTorch's documented update rules (torch.optim.SGD / Adam / AdamW,
torch.nn.utils.clip_grad_norm_).

    python -m pytest tests/test_optim.py -q
"""
from __future__ import annotations


import numpy as np
import pytest

from cs_runtime.config import OptimizerConfig
from cs_runtime.numerics import optim as optim_module
from cs_runtime.numerics import parallel
from cs_runtime.numerics.optim import Optimizer, OptimizerSpec, clip_factor, global_norm

STEPS = 6
LRS = [0.1, 0.05, 0.05, 0.02, 0.01, 0.01]  # the lr changes between steps, as schedules do


# --------------------------------------------------------------------------
# references (float64, one parameter, straight from the PyTorch docs)
# --------------------------------------------------------------------------

def ref_sgd(w, grads, lrs, momentum=0.0, weight_decay=0.0):
    w, buf = w.astype(np.float64), None
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        g = g.astype(np.float64)
        if weight_decay:
            g = g + weight_decay * w
        if momentum:
            buf = g.copy() if t == 1 else momentum * buf + g   # dampening 0
            g = buf
        w = w - lr * g
    return w, {"momentum": buf} if momentum else {}


def ref_adam(w, grads, lrs, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False):
    b1, b2 = betas
    w = w.astype(np.float64)
    m, v = np.zeros_like(w), np.zeros_like(w)
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        g = g.astype(np.float64)
        if decoupled:
            w = w - lr * weight_decay * w                       # AdamW
        elif weight_decay:
            g = g + weight_decay * w                            # Adam (L2)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1 ** t)
        v_hat = v / (1 - b2 ** t)
        w = w - lr * m_hat / (np.sqrt(v_hat) + eps)
    return w, {"exp_avg": m, "exp_avg_sq": v, "step": np.float64(len(grads))}


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------

def problem(seed=0):
    rng = np.random.default_rng(seed)
    params = {"weight": rng.standard_normal((5, 4)).astype(np.float32),
              "bias": rng.standard_normal(4).astype(np.float32)}
    grads = [{k: (rng.standard_normal(v.shape) * 0.5).astype(np.float32) for k, v in params.items()}
             for _ in range(STEPS)]
    return params, grads


def run(opt: Optimizer, params, grads):
    params = {k: v.copy() for k, v in params.items()}
    state = opt.init_state(params)
    for g, lr in zip(grads, LRS):
        opt.update(params, g, state, lr)
    return params, state


def assert_rel(actual, expected, rtol=1e-5, what=""):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    err = np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30)
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


def check_against(opt, ref, params, grads, **ref_kwargs):
    got, state = run(opt, params, grads)
    for name in params:
        want_w, want_slots = ref(params[name], [g[name] for g in grads], LRS, **ref_kwargs)
        assert got[name].dtype == np.float32
        assert_rel(got[name], want_w, what=f"{name} weight")
        assert set(state[name]) == set(want_slots)
        for slot, want in want_slots.items():
            assert_rel(state[name][slot], want, what=f"{name} {slot}")


# --------------------------------------------------------------------------
# update rules
# --------------------------------------------------------------------------

@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_sgd_matches_pytorch_rule(momentum, weight_decay):
    params, grads = problem(1)
    opt = Optimizer(OptimizerSpec("sgd", momentum=momentum, weight_decay=weight_decay))
    check_against(opt, ref_sgd, params, grads, momentum=momentum, weight_decay=weight_decay)


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("betas,eps", [((0.9, 0.999), 1e-8), ((0.8, 0.99), 1e-6)])
def test_adam_matches_pytorch_rule(weight_decay, betas, eps):
    params, grads = problem(2)
    opt = Optimizer(OptimizerSpec("adam", weight_decay=weight_decay, betas=betas, eps=eps))
    check_against(opt, ref_adam, params, grads, betas=betas, eps=eps, weight_decay=weight_decay)


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("betas,eps", [((0.9, 0.999), 1e-8), ((0.8, 0.99), 1e-6)])
def test_adamw_matches_pytorch_rule(weight_decay, betas, eps):
    params, grads = problem(3)
    opt = Optimizer(OptimizerSpec("adamw", weight_decay=weight_decay, betas=betas, eps=eps))
    check_against(opt, ref_adam, params, grads, betas=betas, eps=eps, weight_decay=weight_decay,
                  decoupled=True)


def test_adam_and_adamw_differ_only_with_weight_decay():
    params, grads = problem(4)
    a, _ = run(Optimizer(OptimizerSpec("adam", weight_decay=0.1)), params, grads)
    w, _ = run(Optimizer(OptimizerSpec("adamw", weight_decay=0.1)), params, grads)
    assert not np.allclose(a["weight"], w["weight"])
    a0, _ = run(Optimizer(OptimizerSpec("adam")), params, grads)
    w0, _ = run(Optimizer(OptimizerSpec("adamw")), params, grads)
    np.testing.assert_array_equal(a0["weight"], w0["weight"])


def test_bias_correction_goes_on_from_the_saved_step_count():
    """Resuming after k updates must continue the bias correction from k, not from 0:
    the count is in the state, which a checkpoint saves."""
    params, grads = problem(5)
    opt = Optimizer(OptimizerSpec("adam"))
    full, full_state = run(opt, params, grads)
    first, state = run(opt, params, grads[:3])
    assert all(float(state[name]["step"]) == 3 for name in params)
    for g, lr in zip(grads[3:], LRS[3:]):
        opt.update(first, g, state, lr)
    for name in params:
        np.testing.assert_array_equal(first[name], full[name])
        np.testing.assert_array_equal(state[name]["exp_avg_sq"], full_state[name]["exp_avg_sq"])
        assert float(state[name]["step"]) == STEPS


def test_a_checkpoint_without_step_counts_goes_on_from_its_global_step():
    """Checkpoints written before the count was state: every step counted then."""
    params, grads = problem(5)
    opt = Optimizer(OptimizerSpec("adam"))
    full, _ = run(opt, params, grads)
    first, state = run(opt, params, grads[:3])
    old = {name: {k: v for k, v in slots.items() if k != "step"} for name, slots in state.items()}
    opt.fill_missing(old, first, steps_done=3)
    for g, lr in zip(grads[3:], LRS[3:]):
        opt.update(first, g, old, lr)
    for name in params:
        np.testing.assert_array_equal(first[name], full[name])


def test_update_is_in_place_and_leaves_grads_alone():
    params, grads = problem(6)
    weight = params["weight"]
    g = {k: v.copy() for k, v in grads[0].items()}
    for v in g.values():
        v.flags.writeable = False  # as decoded from the wire
    before = {k: v.copy() for k, v in g.items()}
    opt = Optimizer(OptimizerSpec("sgd", momentum=0.9, weight_decay=0.1))
    state = opt.init_state(params)
    opt.update(params, g, state, 0.1)
    assert params["weight"] is weight and not np.array_equal(weight, problem(6)[0]["weight"])
    for k in g:
        np.testing.assert_array_equal(g[k], before[k])


# --------------------------------------------------------------------------
# state, norms, clipping
# --------------------------------------------------------------------------

@pytest.mark.parametrize("kind,momentum,slots", [
    ("sgd", 0.0, ()),
    ("sgd", 0.9, ("momentum",)),
    ("adam", 0.0, ("exp_avg", "exp_avg_sq", "step")),
    ("adamw", 0.0, ("exp_avg", "exp_avg_sq", "step")),
])
def test_state_initialisation_slot_names(kind, momentum, slots):
    opt = Optimizer(OptimizerSpec(kind, momentum=momentum))
    assert opt.slot_names() == slots
    params, _ = problem()
    state = opt.init_state(params)
    assert set(state) == set(params)
    for name, p in params.items():
        assert tuple(state[name]) == slots
        for slot, value in state[name].items():
            shape = () if slot == "step" else p.shape   # the count is a scalar, as in torch
            assert value.shape == shape and value.dtype == p.dtype and not value.any()
            assert not np.shares_memory(value, p)


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="rmsprop"):
        Optimizer(OptimizerSpec("rmsprop"))


def test_spec_from_params_round_trips_the_wire():
    """params.yaml's section, the spec, its wire form and the optimizer agree field by field."""
    cfg = OptimizerConfig(optimizer_type="adamw", weight_decay=0.01, betas=[0.8, 0.95], eps=1e-7)
    spec = cfg.optimizer_spec()
    assert OptimizerSpec.from_dict(spec.to_dict()) == spec
    opt = Optimizer(spec)
    assert (opt.kind, opt.weight_decay, opt.beta1, opt.beta2, opt.eps) == ("adamw", 0.01, 0.8, 0.95, 1e-7)


def test_one_default_per_parameter():
    """params.yaml's defaults are the spec's: Adam's eps is the Cerebras API's 1e-6 everywhere."""
    cfg, spec = OptimizerConfig(optimizer_type="adam"), OptimizerSpec("adam")
    assert spec.eps == 1e-6
    assert (cfg.eps, tuple(cfg.betas)) == (spec.eps, spec.betas)
    assert cfg.optimizer_spec() == OptimizerSpec("adam", exclude_bias_and_norm=True)


@pytest.mark.parametrize("wire", [
    {"momentum": 0.9},                                   # no kind
    {"kind": "sgd", "lr": 0.1},                          # not a field
    {"kind": "sgd", "momentum": -1},
    {"kind": "sgd", "momentum": True},
    {"kind": "adam", "betas": [0.9]},
    {"kind": "adam", "betas": [0.9, 1.5]},
    {"kind": "adam", "eps": float("nan")},
    {"kind": "sgd", "nesterov": 1, "momentum": 0.9},
])
def test_spec_refuses_bad_wire_forms(wire):
    with pytest.raises(ValueError):
        OptimizerSpec.from_dict(wire)


def test_global_norm_against_numpy():
    rng = np.random.default_rng(7)
    layers = [{"weight": rng.standard_normal((30, 20)).astype(np.float32),
               "bias": rng.standard_normal(20).astype(np.float32)},
              {"weight": rng.standard_normal((20, 3)).astype(np.float32) * 1e3,
               "bias": np.zeros(3, np.float32)}]
    flat = np.concatenate([g.ravel().astype(np.float64) for layer in layers for g in layer.values()])
    assert global_norm(layers) == pytest.approx(np.linalg.norm(flat), rel=1e-12)
    assert global_norm(iter(layers)) == pytest.approx(np.linalg.norm(flat), rel=1e-12)  # a generator
    assert global_norm([]) == 0.0
    # float64 accumulation: no float32 overflow for large values
    huge = [{"g": np.full(4, 3e20, np.float32)}]
    assert global_norm(huge) == pytest.approx(6e20, rel=1e-6)


@pytest.mark.parametrize("norm,max_norm", [(5.0, 1.0), (0.5, 1.0), (1.0, 1.0), (3.0, None), (3.0, 0.0),
                                           (1e6, 2.5)])
def test_clip_factor_against_clip_grad_norm_formula(norm, max_norm):
    if not max_norm:
        expected = 1.0
    else:
        expected = min(1.0, max_norm / (norm + 1e-6))  # torch: clamp(max_norm / (norm + 1e-6), max=1)
    # exactly 1.0 where torch gives max_norm / (max_norm + 1e-6): within 1e-6, and no clipping
    assert clip_factor(norm, max_norm) == pytest.approx(expected, rel=1e-6)


def test_clipped_gradients_have_the_max_norm():
    rng = np.random.default_rng(8)
    layers = [{"w": rng.standard_normal((10, 10)).astype(np.float32)} for _ in range(3)]
    norm = global_norm(layers)
    factor = clip_factor(norm, 1.0)
    clipped = [{k: v * factor for k, v in layer.items()} for layer in layers]
    assert global_norm(clipped) == pytest.approx(1.0, rel=1e-5)


def test_norms_are_skipped_when_not_wanted_unless_clipping_needs_them():
    rng = np.random.default_rng(9)
    grads = [{"w": rng.standard_normal((6, 5)).astype(np.float32)} for _ in range(2)]
    results = {}
    for need, max_norm in ((True, None), (False, None), (False, 0.5)):
        opt = Optimizer(OptimizerSpec("sgd", momentum=0.9))
        weights = {f"l{i}": {"w": np.ones((6, 5), np.float32)} for i in range(2)}
        state = {name: opt.init_state(w) for name, w in weights.items()}
        got = opt.update_model(["l0", "l1"], weights, [dict(g) for g in grads], state, 0.1, 0, max_norm,
                               need_norms=need)
        results[(need, max_norm)] = got, weights
    (norm, applied, per_layer), weights = results[(True, None)]
    assert norm == pytest.approx(global_norm(grads)) and len(per_layer) == 2 and applied
    (skipped, applied, none), same = results[(False, None)]
    assert np.isnan(skipped) and none == [] and applied
    for name in weights:
        np.testing.assert_array_equal(same[name]["w"], weights[name]["w"])   # the update does not need them
    (clip_norm, _, _), _ = results[(False, 0.5)]
    assert clip_norm == pytest.approx(norm)                                 # clipping does


@pytest.mark.parametrize("momentum,dampening,nesterov,weight_decay", [
    (0.9, 0.0, True, 0.0), (0.9, 0.0, True, 0.01), (0.5, 0.1, False, 0.0), (0.8, 0.5, False, 0.01)])
def test_sgd_nesterov_and_dampening_match_torch_optim_sgd(momentum, dampening, nesterov, weight_decay):
    torch = pytest.importorskip("torch", reason="the oracle is torch.optim.SGD; torch is an optional extra")
    params, grads = problem(5)
    opt = Optimizer(OptimizerSpec("sgd", momentum=momentum, weight_decay=weight_decay, nesterov=nesterov, dampening=dampening))
    got, state = run(opt, params, grads)
    tensors = {name: torch.tensor(p.copy(), requires_grad=True) for name, p in params.items()}
    ref = torch.optim.SGD(list(tensors.values()), lr=LRS[0], momentum=momentum, dampening=dampening,
                          nesterov=nesterov, weight_decay=weight_decay)
    for lr, step_grads in zip(LRS, grads):
        for group in ref.param_groups:
            group["lr"] = lr
        for name, t in tensors.items():
            t.grad = torch.from_numpy(np.asarray(step_grads[name], dtype=np.float32).copy())
        ref.step()
    for name, t in tensors.items():
        assert_rel(got[name], t.detach().numpy(), what=f"{name} weight")
        assert_rel(state[name]["momentum"], ref.state[t]["momentum_buffer"].numpy(), what=f"{name} momentum")


def test_nesterov_and_dampening_are_checked():
    with pytest.raises(ValueError, match="nesterov: true requires a momentum and zero dampening"):
        Optimizer(OptimizerSpec("sgd", momentum=0.9, nesterov=True, dampening=0.1))
    with pytest.raises(ValueError, match="nesterov and dampening are SGD's"):
        Optimizer(OptimizerSpec("adam", nesterov=True))


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_the_momentum_loop_gives_the_numpy_passes_bits(weight_decay):
    """SGD with momentum's C loop (_optim.c) against optim.py's numpy passes, bit for bit,
    over several steps: awkward values (tiny, huge, negative zero, a denormal) included, on
    one parameter above a chunk (cut into pieces) and a 2-d one below, with weight decay."""
    if optim_module._optim_loops is None:
        pytest.skip("the optimizer's C loop is not built (no C compiler at install)")
    rng = np.random.default_rng(3)
    shapes = {"big": (parallel.CHUNK + 37,), "small": (33, 7)}
    weights = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    weights["small"].reshape(-1)[:4] = [1e-42, -0.0, 3e38, -1e-30]
    runs = []
    for fused in (True, False):
        opt = Optimizer(OptimizerSpec("sgd", momentum=0.9, weight_decay=weight_decay))
        assert opt._fused_momentum is optim_module._optim_loops
        if not fused:
            opt._fused_momentum = None
        w = {k: v.copy() for k, v in weights.items()}
        state = opt.init_state(w)
        for step in range(3):
            grads = {k: np.random.default_rng(step).standard_normal(s).astype(np.float32) for k, s in shapes.items()}
            opt.update(w, grads, state, 0.1)
        runs.append((w, state))
    (w1, s1), (w2, s2) = runs
    for k in shapes:
        assert w1[k].tobytes() == w2[k].tobytes() and s1[k]["momentum"].tobytes() == s2[k]["momentum"].tobytes()


def test_the_momentum_loop_is_taken_only_for_plain_momentum():
    """Dampening or Nesterov (or no momentum, or Adam) take the numpy passes."""
    loops = optim_module._optim_loops
    assert Optimizer(OptimizerSpec("sgd", momentum=0.9))._fused_momentum is loops
    for spec in (OptimizerSpec("sgd", momentum=0.9, dampening=0.1), OptimizerSpec("sgd", momentum=0.9, nesterov=True),
                 OptimizerSpec("sgd"), OptimizerSpec("adamw")):
        assert Optimizer(spec)._fused_momentum is None


def test_a_sum_of_squares_is_exact_up_to_its_lanes_and_the_c_loop_gives_numpys_bits(monkeypatch):
    """optim.sum_squares (the gradient norms): within float64 rounding of the exact sum (math.fsum
    of the exact squares) at every size around the lanes and the numpy chunk; the C loop
    (_optim.c) and the numpy path give the same bits."""
    import math
    rng = np.random.default_rng(5)
    loops = optim_module._optim_loops
    lanes, chunk = optim_module.SQUARE_LANES, optim_module.SQUARE_CHUNK
    for n in (0, 1, lanes - 1, lanes, lanes + 1, 1000, chunk - 1, chunk + 3, 2 * chunk + lanes + 5):
        g = (rng.standard_normal(n) * 10.0 ** rng.integers(-15, 15)).astype(np.float32)
        if n > 4:
            g[:4] = [1e-42, -0.0, 3e38, -1e-30]
        exact = math.fsum(float(v) * float(v) for v in g)
        ours = optim_module.sum_squares(g)
        assert abs(ours - exact) <= 1e-15 * n * exact
        if loops is not None:
            monkeypatch.setattr(optim_module, "_optim_loops", None)
            assert optim_module.sum_squares(g) == ours, n   # numpy's path, the same bits
            monkeypatch.setattr(optim_module, "_optim_loops", loops)
    if loops is None:
        pytest.skip("the optimizer's C loop is not built (no C compiler at install): numpy's path checked alone")
