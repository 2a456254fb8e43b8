"""cs_runtime/compiler/families.py: params.yaml's models lowered to programs.

The lowered program is what every path runs; here it is checked against
the maths of the built-in layers (float32, with dropout: the masks must be
the same bit for bit or the gradients would differ at the dropped units),
shard by shard, and for what it keeps of the layer: names, shapes, wire form.

    python -m pytest tests/test_families.py -q
"""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from cs_runtime.compiler.families import lower_spec
from cs_runtime.numerics.model import ModelSpec, ShardContext, init_weights, mlp_spec, model_forward, transformer_spec
from cs_runtime.numerics import model, program_layer
from cs_runtime.numerics.program_layer import unit_of
from cs_runtime.numerics.ops import OPS
from cs_runtime.numerics.program import ProgramError, Unit
from tests import dense_reference


def gpt(**kw):
    return transformer_spec("gpt", style="gpt2", vocab_size=50, max_len=12, hidden_size=16, num_layers=2,
                            num_heads=2, ffn_features=32, dropout=0.1, attn_dropout=0.1, eps=1e-5, **kw)


def bert(**kw):
    return transformer_spec("bert", style="bert", vocab_size=50, max_len=12, hidden_size=16, num_layers=2,
                            num_heads=2, ffn_features=32, dropout=0.1, attn_dropout=0.1, eps=1e-12, pad_id=0, **kw)


def batch(spec, rng, n=4):
    if not spec.token_model:
        return rng.standard_normal((n, spec.layers[0].in_features)).astype(np.float32), rng.integers(0, 5, n)
    ids = rng.integers(1, 50, (n, 12))
    ids[1, 8:] = 0   # padding (BERT's keys masked)
    labels = rng.integers(0, 50, (n, 12))
    labels[0, :3] = -100
    return ids, labels


def step(spec, weights, x, y, rows: slice, global_batch: int, label_count: int | None, train: bool = True):
    ctx = ShardContext(5, 3, global_batch, rows, train, labels=y)
    run = model if spec.program is not None else dense_reference   # the runtime runs only programs
    out, caches = run.model_forward(spec, x, weights, ctx)
    result = run.model_loss(spec, out, y, global_batch, label_count)
    return result, (run.model_backward(spec, result.delta, caches, weights, 3) if train else None)


MLPS = {"mlp_relu": lambda: mlp_spec("m", [20, 32, 16, 5], "relu", 0.3),
        "mlp_tanh": lambda: mlp_spec("m", [20, 32, 5], "tanh", 0.2),
        "mlp_sigmoid": lambda: mlp_spec("m", [20, 32, 5], "sigmoid", 0.2),
        "mlp_gelu": lambda: mlp_spec("m", [20, 32, 5], "gelu", 0.2)}
SPECS = {**MLPS, "gpt2": gpt, "bert": bert}


@pytest.mark.parametrize("name", sorted(MLPS))
@pytest.mark.parametrize("shard", [None, 1])
def test_lowered_mlp_equals_the_dense_layers(name, shard):
    """Loss, counts and every gradient of the program = the hand-written dense layers'
    (tests/dense_reference.py; float32 rounding apart), with dropout on, on the whole
    batch and on the second half of it."""
    spec = SPECS[name]()
    lowered = lower_spec(spec)
    x, y = batch(spec, np.random.default_rng(0))
    count = int((y != -100).sum()) if spec.token_model else None
    rows = slice(0, 4)
    if shard is not None:
        rows, x, y = slice(2, 4), x[2:], y[2:]
    weights = init_weights(spec, 1)
    for train in (True, False):
        old, old_grads = step(spec, weights, x, y, rows, 4, count, train)
        new, new_grads = step(lowered, weights, x, y, rows, 4, count, train)
        assert new.loss == pytest.approx(old.loss, rel=1e-6)
        assert new.loss_sum == pytest.approx(old.loss_sum, rel=1e-6)
        assert (new.correct, new.count) == (old.correct, old.count)
        for layer, g_old, g_new in zip(spec.layers, old_grads or [], new_grads or []):
            assert set(g_new) == set(g_old), layer.name
            for p in g_old:
                scale = np.abs(g_old[p]).max() + 1e-30
                assert np.abs(g_new[p] - g_old[p]).max() / scale < 1e-5, f"{layer.name}.{p}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_units_are_the_layers_with_their_parameter_names(name):
    spec = SPECS[name]()
    lowered = lower_spec(spec)
    assert lowered == spec   # same layers, sizes, names (the units ride along)
    assert lowered.describe() == spec.describe() == spec.to_dict()   # checkpoints record what they did
    assert lowered.num_params() == spec.num_params()
    for layer in lowered.layers:
        unit = unit_of(layer)
        assert unit.name == layer.name
        assert sorted(layer.unit["local"].values()) == sorted(layer.param_shapes())
        assert set(unit.params) == {f"{layer.name}.{p}" for p in layer.param_shapes()}
    assert lower_spec(lowered) is lowered


def test_a_lowered_spec_crosses_the_wire_as_data_and_is_validated():
    lowered = lower_spec(gpt())
    back = ModelSpec.from_dict(lowered.to_dict())
    assert [unit_of(l).forward for l in back.layers] == [unit_of(l).forward for l in lowered.layers]
    bad = lowered.to_dict()
    bad["layers"][1]["unit"]["local"] = {"block1.qkv_weight": "qkv_weight"}   # not the layer's parameters
    with pytest.raises(ValueError, match="layer block0: the unit's parameters are not the layer's"):
        ModelSpec.from_dict(bad)


@pytest.mark.parametrize("name", ["mlp_gelu", "gpt2", "bert"])
def test_residuals_are_kept_for_the_backward_and_the_gradients_keep_their_bits(name, monkeypatch):
    """A GELU's forward keeps its derivative (r:<output>, the size of its input) and layer
    norm its statistics in place of their input, attention its probabilities beside its
    inputs, a classifier's loss its gradient and a token model's cross entropy its
    log-probabilities in place of the scores; every gradient is bit
    for bit the one of the rules that recompute them (the ops without their residuals)."""
    spec = SPECS[name]()
    lowered = lower_spec(spec)
    units = [unit_of(layer) for layer in lowered.layers]
    kinds = {"gelu"} | ({"self_attention", "layer_norm", "cross_entropy"} if spec.token_model
                        else {"softmax_cross_entropy"})
    made = [(n, u) for u in units for n in u.forward if len(n.outputs) == 2]
    assert {n.op for n, _ in made} == kinds
    for node, unit in made:
        assert node.outputs[1] == "r:" + node.outputs[0] and node.outputs[1] in unit.kept
        assert (node.inputs[0] in unit.kept) == (node.op == "self_attention")
    x, y = batch(spec, np.random.default_rng(0))
    weights = init_weights(spec, 1)
    count = int((y != -100).sum()) if spec.token_model else None
    result, grads = step(lowered, weights, x, y, slice(0, 4), 4, count)
    for op in kinds:
        monkeypatch.setitem(OPS, op, dataclasses.replace(OPS[op], residual=None, residual_vjp=None))
    recomputing = lower_spec(spec)
    assert not any(len(n.outputs) > 1 for layer in recomputing.layers for n in unit_of(layer).forward)
    want, want_grads = step(recomputing, weights, x, y, slice(0, 4), 4, count)
    assert result.loss == want.loss
    for got, expected in zip(grads, want_grads):
        assert sorted(got) == sorted(expected)
        assert all(got[p].tobytes() == expected[p].tobytes() for p in got)


def test_eval_makes_no_residual():
    """Where no backward follows (eval), GELU and attention run their plain forward: the
    same output, nothing kept for a backward."""
    spec = lower_spec(bert())
    x, y = batch(spec, np.random.default_rng(0))
    weights = init_weights(spec, 1)
    runs = {}
    for train in (True, False):
        ctx = ShardContext(5, 3, 4, slice(0, 4), train, labels=y)
        runs[train] = model.model_forward(spec, x, weights, ctx)
    residuals = [[k for k in cache[0] if k.startswith("r:")] for cache in runs[False][1]]
    assert any(residuals)
    for (trained, *_), (evaluated, *_), names in zip(runs[True][1], runs[False][1], residuals):
        assert all(evaluated[k] is None and trained[k] is not None for k in names)
    # dropout is off in eval, so compare eval with a training forward without dropout
    no_drop = lower_spec(transformer_spec("bert", style="bert", vocab_size=50, max_len=12, hidden_size=16,
                                          num_layers=2, num_heads=2, ffn_features=32, dropout=0.0,
                                          attn_dropout=0.0, eps=1e-12, pad_id=0))
    outs = [model.model_forward(no_drop, x, weights, ShardContext(5, 3, 4, slice(0, 4), t, labels=y))[0]
            for t in (True, False)]
    logits = no_drop.program["logits"]
    assert outs[0][logits].tobytes() == outs[1][logits].tobytes()


def test_a_residual_only_an_op_that_makes_one_may_have():
    """A unit from the wire whose node claims a residual its op does not make is refused."""
    meta = unit_of(lower_spec(mlp_spec("m", [20, 32, 5], "gelu", 0.2)).layers[0]).to_meta()
    relu = copy.deepcopy(meta)
    node = next(n for n in relu["forward"] if n[0] == "gelu")
    node[0] = "relu"
    with pytest.raises(ProgramError, match="2 outputs; the op makes one$"):
        Unit.from_meta(relu)
    vjp = copy.deepcopy(meta)
    node = next(n for n in vjp["backward"] if n[0] == "vjp" and n[3].get("residual"))
    node[3]["of"] = "relu"
    with pytest.raises(ProgramError, match="the vjp of relu takes no residual"):
        Unit.from_meta(vjp)
    three = copy.deepcopy(meta)
    node = next(n for n in three["forward"] if n[0] == "gelu")
    node[2].append("extra")
    with pytest.raises(ProgramError, match="3 outputs; the op makes one and its residual"):
        Unit.from_meta(three)


def test_only_what_leads_to_the_loss_gets_a_gradient_seed():
    """The logits are kept for accuracy, not seeded with a zero gradient."""
    lowered = lower_spec(gpt())
    head = unit_of(lowered.layers[-1])
    assert "logits" in head.writes and head.grad_writes == ("loss",)


def test_a_layer_with_no_lowering_is_named():
    from cs_runtime.numerics.model import LayerSpec
    spec = ModelSpec("odd", (LayerSpec("conv", "conv", 4, 4),))
    with pytest.raises(ValueError, match="layer conv \\(op conv\\): unsupported op .conv.; supported: dense"):
        lower_spec(spec)


def _float64(weights):
    return {layer: {k: v.astype(np.float64) for k, v in params.items()} for layer, params in weights.items()}


@pytest.mark.parametrize("style", ["gpt2", "bert"])
def test_a_lowered_transformers_gradients_match_finite_differences(style):
    """The whole program (embedding, blocks, head, loss; dropout on) in float64: every
    parameter's gradient against central differences of the loss, on a few entries each."""
    spec = lower_spec(gpt() if style == "gpt2" else bert())
    rng = np.random.default_rng(7)
    x, y = batch(spec, rng, 2)
    count = int((y != -100).sum())
    weights = _float64(init_weights(spec, 2))
    for params in weights.values():   # away from the init's zero biases and unit gains
        for v in params.values():
            v += rng.standard_normal(v.shape) * 0.05

    def loss():
        return step(spec, weights, x, y, slice(0, 2), 2, count)[0].loss

    _, grads = step(spec, weights, x, y, slice(0, 2), 2, count)
    for layer, layer_grads in zip(spec.layers, grads):
        for name, g in layer_grads.items():
            w = weights[layer.name][name]
            assert g.shape == w.shape and g.dtype == np.float64, f"{layer.name}.{name}"
            picks = [np.unravel_index(i, w.shape) for i in rng.choice(w.size, 3, replace=False)]
            if name == "tokens":   # rows of tokens in the batch (others have no gradient)
                picks.append((int(x[0, 0]), 0))
            for idx in picks:
                old = w[idx]
                w[idx] = old + 1e-6
                up = loss()
                w[idx] = old - 1e-6
                down = loss()
                w[idx] = old
                numeric = (up - down) / 2e-6
                assert abs(g[idx] - numeric) <= 1e-6 + 1e-5 * abs(numeric), f"{layer.name}.{name}{idx}"


@pytest.mark.parametrize("style", ["gpt2", "bert"])
def test_a_transformer_runs_only_as_a_program(style):
    spec = gpt() if style == "gpt2" else bert()
    x, y = batch(spec, np.random.default_rng(0))
    with pytest.raises(ValueError, match="layer embed \\(op embedding\\) runs as a compiled program"):
        model_forward(spec, x, init_weights(spec, 0), ShardContext(0, 0, 4, slice(0, 4), True, labels=y))


def test_a_transformers_shards_add_up_to_the_whole_batch():
    """With dropout on, the two halves of a batch (two WSEs) give the whole batch's loss and
    gradients: the masks are per sample, the loss weighted for the global batch."""
    spec = lower_spec(bert())
    x, y = batch(spec, np.random.default_rng(1))
    count = int((y != -100).sum())
    weights = init_weights(spec, 4)
    whole, whole_grads = step(spec, weights, x, y, slice(0, 4), 4, count)
    parts = [step(spec, weights, x[r], y[r], r, 4, count) for r in (slice(0, 2), slice(2, 4))]
    assert sum(p[0].loss for p in parts) == pytest.approx(whole.loss, rel=1e-6)
    for i, layer in enumerate(spec.layers):
        for name, g in whole_grads[i].items():
            total = parts[0][1][i][name] + parts[1][1][i][name]
            assert np.abs(total - g).max() <= 1e-5 * (np.abs(g).max() + 1e-12), f"{layer.name}.{name}"


def test_a_lowered_models_layers_share_no_parameter():
    """Every layer names its own `weight`: none is tied to another's (no gradients summed)."""
    from cs_runtime.numerics.program_layer import has_tied, tie_grads
    spec = lower_spec(mlp_spec("m", [4, 3, 2], "relu", 0.0))
    grads = [{"weight": np.ones((4, 3), np.float32), "bias": np.ones(3, np.float32)},
             {"weight": np.full((3, 2), 2.0, np.float32), "bias": np.ones(2, np.float32)}]
    tied = tie_grads(spec, [dict(g) for g in grads])
    assert not has_tied(spec)
    assert all(np.array_equal(tied[i][p], grads[i][p]) for i in range(2) for p in grads[i])


@pytest.mark.parametrize("style", ["gpt2", "bert"])
def test_a_tied_head_reads_the_embeddings_table_as_one_parameter(style):
    """share_embedding_weights: the head's decoder is linear(h, embed.tokens), the one program
    parameter both units read; each layer holds a copy, counted once in the model's size."""
    untied = lower_spec(gpt() if style == "gpt2" else bert())
    spec = lower_spec(gpt(tied=True, out_bias=False) if style == "gpt2" else bert(tied=True))
    head = spec.layers[-1]
    assert head.unit["local"]["embed.tokens"] == "tokens" and "decoder_weight" not in head.param_shapes()
    assert "embed.tokens" in unit_of(head).params and "embed.tokens" in unit_of(spec.layers[0]).params
    assert ("decoder_bias" in head.param_shapes()) == (style == "bert")
    products = [n for n in unit_of(head).forward if n.op in ("linear", "matmul")]
    assert products[-1].op == "linear" and products[-1].inputs[1] == "embed.tokens"
    decoder = 16 * 50 + (50 if style == "gpt2" else 0)   # the untied matrix, and GPT-2's bias
    assert spec.num_params() == untied.num_params() - decoder
    assert program_layer.tied_copies(spec) == {(len(spec.layers) - 1, "tokens")}
    assert program_layer.tied_sources(spec.plain()) == program_layer.tied_sources(spec)


@pytest.mark.parametrize("style", ["gpt2", "bert"])
def test_a_tied_tables_gradient_is_the_sum_over_its_readers(style):
    """In float64, with dropout on: both copies get d loss / d table, checked against central
    differences moving the table (both copies together); and they stay one after an update."""
    spec = lower_spec(gpt(tied=True, out_bias=False) if style == "gpt2" else bert(tied=True))
    rng = np.random.default_rng(3)
    x, y = batch(spec, rng, 2)
    count = int((y != -100).sum())
    weights = _float64(init_weights(spec, 2))
    embed, head = weights["embed"], weights["lm_head"]
    head["tokens"] = embed["tokens"] = embed["tokens"] + rng.standard_normal(embed["tokens"].shape) * 0.05
    _, grads = step(spec, weights, x, y, slice(0, 2), 2, count)
    g = grads[0]["tokens"]
    assert np.array_equal(g, grads[-1]["tokens"]) and grads[0]["tokens"] is not grads[-1]["tokens"]
    table = embed["tokens"]
    for idx in [(int(x[0, 0]), 1), (int(x[1, 2]), 5), (int(np.setdiff1d(np.arange(50), x)[0]), 2)]:
        old = table[idx]
        table[idx] = old + 1e-6
        up = step(spec, weights, x, y, slice(0, 2), 2, count)[0].loss
        table[idx] = old - 1e-6
        down = step(spec, weights, x, y, slice(0, 2), 2, count)[0].loss
        table[idx] = old
        numeric = (up - down) / 2e-6
        assert abs(g[idx] - numeric) <= 1e-6 + 1e-5 * abs(numeric), idx


def test_a_tied_table_counts_once_in_the_clipping_norm():
    from cs_runtime.numerics.optim import Optimizer, OptimizerSpec
    spec = lower_spec(gpt(tied=True))
    weights = init_weights(spec, 0)
    grads = [{p: np.full(w.shape, 0.5, np.float32) for p, w in weights[l.name].items()} for l in spec.layers]
    grads = program_layer.tie_grads(spec, grads)
    once = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in
                       [v for gs in grads[:-1] for v in gs.values()] +
                       [v for k, v in grads[-1].items() if k != "tokens"]))
    opt = Optimizer(OptimizerSpec("sgd"))
    state = {name: opt.init_state(w) for name, w in weights.items()}
    norm, _, _ = opt.update_model([l.name for l in spec.layers], weights, grads, state, 0.1, 0, 1.0,
                                  copies=program_layer.tied_copies(spec))
    assert norm == pytest.approx(once, rel=1e-9)
    assert np.array_equal(weights["embed"]["tokens"], weights["lm_head"]["tokens"])


def test_a_checkpoint_stores_a_tied_table_once_and_gives_each_reader_its_copy(tmp_path):
    from cs_runtime import checkpoint as ckpt
    from cs_runtime.numerics.optim import Optimizer, OptimizerSpec
    spec = lower_spec(gpt(tied=True, out_bias=False))
    opt = Optimizer(OptimizerSpec("adamw"))
    weights = init_weights(spec, 0)
    state = {name: opt.init_state(w) for name, w in weights.items()}
    once, once_state = ckpt.stored_once(spec, weights, state)
    assert "tokens" not in once["lm_head"] and "tokens" not in once_state["lm_head"]
    path = ckpt.write_file(tmp_path / "ck.npz", ckpt.Checkpoint(1, 1, once, once_state, {}))
    loaded = ckpt.load(path)
    ckpt.with_tied_copies(spec, loaded.weights, loaded.opt_state)
    assert np.array_equal(loaded.weights["lm_head"]["tokens"], weights["embed"]["tokens"])
    assert loaded.opt_state["lm_head"]["tokens"].keys() == state["lm_head"]["tokens"].keys()
    flat = ckpt.flatten(once, once_state)   # MemoryX's restore from the stored-once arrays
    w2, _ = ckpt.unflatten_for(spec, opt, flat)
    assert np.array_equal(w2["lm_head"]["tokens"], w2["embed"]["tokens"])


def test_each_parameters_gradient_norm_counts_a_tied_parameter_once_with_its_summed_gradient():
    """What MemoryX's STEP_DONE carries as param_grad_norms (a traced step's p.grad norms on CSX):
    by the program's names, a parameter two layers read once, its gradient the sum of theirs; the
    same from the squared norms MemoryX took as the gradients landed."""
    from cs_runtime.numerics.model import LayerSpec
    from cs_runtime.numerics.optim import squared_norms
    layers = (LayerSpec("emb", "program", 0, 0, unit={"unit": {}, "param_shapes": {"head.weight": [3, 2]}}),
              LayerSpec("head", "program", 0, 0, unit={"unit": {}, "param_shapes": {"head.weight": [3, 2],
                                                                                     "head.bias": [3]}}))
    spec = ModelSpec("tied", layers, loss="program", program={"inputs": ["x", "y"]})
    grads = program_layer.tie_grads(spec, [{"head.weight": np.full((3, 2), 1.0, np.float32)},
                                           {"head.weight": np.full((3, 2), 2.0, np.float32),
                                            "head.bias": np.array([3.0, 4.0, 0.0], np.float32)}])
    want = {"head.weight": 3 * np.sqrt(6), "head.bias": 5.0}
    assert program_layer.param_grad_norms(spec, grads) == pytest.approx(want, rel=1e-12)
    squares = [squared_norms(g) for g in grads]
    assert program_layer.param_grad_norms(spec, grads, squares) == pytest.approx(want, rel=1e-12)
    assert program_layer.param_grad_norms(dataclasses.replace(spec, program=None), grads) == {}
