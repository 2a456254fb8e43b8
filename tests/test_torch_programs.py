"""Torch is the oracle: a captured torch model trained on the CPU path (the
same model_forward / model_loss / model_backward / Optimizer calls
chief/cpu_executor.py makes) against torch eager on the same module, the
same batches and the same optimizer; loss at every step and every weight
after 50 steps within 1e-5 relative (float32)."""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="capturing a torch model needs torch (an optional extra)")
F = torch.nn.functional

from cs_runtime.numerics import kernels  # noqa: E402
from cs_runtime.numerics.model import ShardContext, init_weights, model_backward, model_forward, model_loss  # noqa: E402
from cs_runtime.numerics.optim import Optimizer, OptimizerSpec, grad_norms  # noqa: E402
from cs_torch.capture import CaptureError, load_into, model_spec  # noqa: E402
from tests import torch_models  # noqa: E402

STEPS = 50
LR = {"sgd": 0.05, "adam": 2e-3, "adamw": 2e-3}


def _batches(kind, rng, steps, batch):
    if kind == "mlp":
        return [(rng.standard_normal((batch, 12)).astype(np.float32), rng.integers(0, 5, batch))
                for _ in range(steps)]
    if kind == "cnn":
        return [(rng.standard_normal((batch, 1, 14, 14)).astype(np.float32), rng.integers(0, 10, batch))
                for _ in range(steps)]
    if kind == "two_tower":   # forward(x, y): a dict of two float features
        return [({"x": rng.standard_normal((batch, 6)).astype(np.float32),
                  "y": rng.standard_normal((batch, 3)).astype(np.float32)}, rng.integers(0, 4, batch))
                for _ in range(steps)]
    if kind.startswith("bert_inputs"):   # input_ids, attention_mask, token_type_ids
        return [_bert_inputs_batch(rng, batch) for _ in range(steps)]
    out = []
    for _ in range(steps):
        ids = rng.integers(1, 30, (batch, 12))
        if kind == "bert":
            lengths = rng.integers(5, 13, batch)
            ids[np.arange(12)[None, :] >= lengths[:, None]] = 0     # padding at the end
            labels = np.where(ids == 0, -100, rng.integers(1, 30, (batch, 12)))
        else:
            labels = np.roll(ids, -1, axis=1)
            labels[:, -1] = -1
        out.append((ids, labels))
    return out


def _bert_inputs_batch(rng, batch):
    ids = rng.integers(1, 30, (batch, 12))
    lengths = rng.integers(5, 13, batch)
    mask = (np.arange(12)[None, :] < lengths[:, None]).astype(np.int64)
    types = (np.arange(12)[None, :] >= lengths[:, None] // 2).astype(np.int64) * mask
    labels = np.where(mask == 0, -100, rng.integers(1, 30, (batch, 12)))
    return {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": types}, labels


def _model(kind):
    torch.manual_seed(0)
    if kind == "two_tower":
        return torch_models.TwoTower(), F.cross_entropy
    if kind == "bert_inputs":
        return torch_models.BertInputs(), torch_models.token_loss
    if kind == "bert_inputs_dropout":
        return torch_models.BertInputs(dropout=0.2), torch_models.token_loss
    if kind == "mlp":
        return torch_models.MLP(), F.cross_entropy
    if kind == "cnn":
        return torch_models.LeNet(), F.cross_entropy
    if kind == "bert":
        return torch_models.TinyBert(), torch_models.token_loss
    from examples.torch_gpt.model import GPT, GPTConfig, gpt_loss
    return GPT(GPTConfig(vocab_size=30, block_size=12, n_layer=2, n_head=2, n_embd=16)), gpt_loss


def _torch_optimizer(kind, params, eps=1e-8, lr=None):
    """`lr`: LR's for the kind unless given."""
    lr = LR[kind] if lr is None else lr
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, eps=eps)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, eps=eps)


def _ours(kind, eps=1e-8):
    """The rule of _torch_optimizer's: torch.optim's Adam eps (1e-8), not the Cerebras API's default."""
    return Optimizer(OptimizerSpec(kind, momentum=0.9 if kind == "sgd" else 0.0,
                                   weight_decay=0.01 if kind == "adamw" else 0.0, eps=eps))


def train_cpu_path(spec, batches, opt_kind, eps=1e-8, lr=None):
    lr = LR[opt_kind] if lr is None else lr
    weights = init_weights(spec, seed=0)
    optimizer = _ours(opt_kind, eps)
    state = {name: optimizer.init_state(w) for name, w in weights.items()}
    losses = []
    for step, (x, y) in enumerate(batches):
        ctx = ShardContext(0, step, len(y), slice(0, len(y)), True, labels=y)
        live, caches = model_forward(spec, x, weights, ctx)
        result = model_loss(spec, live, y, len(y))
        grads = model_backward(spec, result.delta, caches, weights, step)
        optimizer.update_model([l.name for l in spec.layers], weights, grads, state, lr, step, None)
        losses.append(result.loss)
    return losses, weights


def assert_weights_match_module(weights: dict, module) -> None:
    """The CPU path's final weights ({layer: {name: array}}) within 1e-5 of the module's, relative to
    each tensor's scale."""
    reference = module.state_dict()
    for layer in weights.values():
        for name, w in layer.items():
            np.testing.assert_allclose(w, reference[name].numpy(), rtol=1e-5,
                                       atol=1e-5 * float(reference[name].abs().max()), err_msg=name)


def train_torch(module, loss_fn, batches, opt_kind, dtype=np.float32, before_step=None, eps=1e-8, lr=None):
    optimizer = _torch_optimizer(opt_kind, module.parameters(), eps, lr)
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # torch's threads spin on a loaded machine: at these sizes one is faster
    try:
        for step, (x, y) in enumerate(batches):
            if before_step is not None:
                before_step(step)
            optimizer.zero_grad()
            loss = loss_fn(_call(module, x, dtype), torch.from_numpy(y))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return losses


def _call(module, x, dtype=np.float32):
    """The module on a batch's features: one array, or a dict of them by argument name."""
    def tensor(a):
        return torch.from_numpy(a.astype(dtype) if a.dtype.kind == "f" else a)
    return module(**{k: tensor(a) for k, a in x.items()}) if isinstance(x, dict) else module(tensor(x))


def _example(x):
    return {k: torch.from_numpy(a) for k, a in x.items()} if isinstance(x, dict) else (torch.from_numpy(x),)


def _torch_float_spread(module, loss_fn, batches, opt, reference32) -> dict[str, float]:
    """Per parameter, how far torch's own float64 run ends from its float32 one."""
    eager64 = copy.deepcopy(module).double()
    train_torch(eager64, loss_fn, batches, opt, dtype=np.float64)
    return {n: float(np.abs(t.detach().numpy() - reference32[n]).max()) for n, t in eager64.state_dict().items()
            if n in reference32}


def train_both(kind, module, loss_fn, batches, opt):
    """The module captured at the first batch, trained on the CPU path and by torch eager from the
    same weights: (the captured spec, our losses, torch's losses, our final weights, torch's module)."""
    x0, y0 = batches[0]
    spec = model_spec(kind, module, _example(x0), torch.from_numpy(y0), loss_fn)
    eager = copy.deepcopy(module)
    ours, weights = train_cpu_path(spec, batches, opt)
    return spec, ours, train_torch(eager, loss_fn, batches, opt), weights, eager


@pytest.mark.cluster
@pytest.mark.parametrize("kind,opt", [("mlp", "sgd"), ("cnn", "adam"), ("gpt", "adamw"), ("bert", "adam"),
                                      ("gpt", "sgd"), ("bert_inputs", "adam"), ("two_tower", "sgd")])
def test_cpu_path_matches_torch_eager(kind, opt):
    module, loss_fn = _model(kind)
    batches = _batches(kind, np.random.default_rng(1), STEPS, batch=6)
    _, ours, theirs, weights, eager = train_both(kind, module, loss_fn, batches, opt)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    final = {p: w for layer in weights.values() for p, w in layer.items()}
    reference = {n: t.detach().numpy() for n, t in eager.state_dict().items()}
    assert set(final) <= set(reference)
    assert len(final) == len(list(eager.parameters()))
    spread = _torch_float_spread(module, loss_fn, batches, opt, reference) if opt != "sgd" else {}
    for name, w in final.items():
        # Adam turns float32 noise in a gradient that is zero in exact arithmetic (the
        # attention key bias) into full steps, in torch too: such a tensor is held to
        # three times torch's own float32-vs-float64 spread (two float32 runs land
        # anywhere within twice it of each other, give or take; measured: up to 1.9x).
        tight = 1e-5 * float(np.abs(reference[name]).max())
        atol = max(tight, 3 * spread.get(name, 0.0))
        np.testing.assert_allclose(w, reference[name], rtol=1e-5, atol=atol, err_msg=name)
        if not np.allclose(w, reference[name], rtol=1e-5, atol=tight):
            # Only the key bias (the middle third of a packed q/k/v bias) needs the spread.
            assert name.endswith(("attn.c_attn.bias", "qkv.bias")), name
            q, k, v = (np.abs(w - reference[name]) - 1e-5 * np.abs(reference[name])).reshape(3, -1)
            assert q.max() <= tight and v.max() <= tight, name
    # A tied parameter is held by each unit that reads it: every copy took the same updates.
    for name in final:
        copies = [layer[name] for layer in weights.values() if name in layer]
        assert all(np.array_equal(c, copies[0]) for c in copies), name
    if kind == "gpt":
        assert sum("lm_head.weight" in layer for layer in weights.values()) == 2


def _dropout_as_drawn(seed, step, rows):
    """F.dropout with the masks the executor draws (kernels.sample_keep_mask): the k-th
    dropout of a forward pass is the program's dropout site k."""
    calls = [0]

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return x
        mask = kernels.sample_keep_mask(seed, step, calls[0], rows, tuple(x.shape), p)
        calls[0] += 1
        return x * torch.from_numpy(mask)
    return dropout


@pytest.mark.cluster
def test_dropout_in_training_matches_torch_given_the_same_masks_and_eval_drops_nothing(monkeypatch):
    """A captured model with nn.Dropout / F.dropout (p 0.2) in train mode: its masks come
    from the run's context; torch eager fed the same masks through F.dropout agrees on the
    loss of every step and the weights after 20 SGD steps (1e-5 relative)."""
    module, loss_fn = _model("bert_inputs_dropout")
    batches = _batches("bert_inputs", np.random.default_rng(2), 20, batch=6)
    x0, y0 = batches[0]
    spec = model_spec("bert_inputs", module, _example(x0), torch.from_numpy(y0), loss_fn)
    assert spec.program["context"] == "dropout_context"
    sites = [n for layer in spec.layers for n in layer.unit["unit"]["forward"] if n[0] == "dropout_mask"]
    assert len(sites) == 3   # after the embeddings, after each of the two blocks
    eager, plain = copy.deepcopy(module), copy.deepcopy(module)
    ours, weights = train_cpu_path(spec, batches, "sgd")
    theirs = train_torch(eager, loss_fn, batches, "sgd", before_step=lambda step: monkeypatch.setattr(
        F, "dropout", _dropout_as_drawn(0, step, slice(0, 6))))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert_weights_match_module(weights, eager)
    monkeypatch.undo()
    # The masks matter: torch without dropout ends elsewhere.
    without = train_torch(plain.eval(), loss_fn, batches[:3], "sgd")
    assert abs(without[1] - theirs[1]) > 1e-3
    # Eval (train 0 in the context) drops nothing: torch's eval-mode loss on fresh weights.
    x, y = batches[0]
    fresh = init_weights(spec, 0)
    live, _ = model_forward(spec, x, fresh, ShardContext(0, 0, 6, slice(0, 6), False, labels=y))
    with torch.no_grad():
        want = float(loss_fn(_call(module.eval(), x), torch.from_numpy(y)))
    assert model_loss(spec, live, y, 6).loss == pytest.approx(want, rel=1e-6)


def test_a_samples_dropout_mask_is_the_same_whichever_shard_holds_it():
    """Two WSEs each drawing their rows' masks train on what the whole batch draws."""
    module, loss_fn = _model("bert_inputs_dropout")
    x, y = _batches("bert_inputs", np.random.default_rng(5), 1, batch=6)[0]
    spec = model_spec("bert_inputs", module, _example(x), torch.from_numpy(y), loss_fn)
    weights = init_weights(spec, 0)

    def logits(rows):
        part = {k: a[rows] for k, a in x.items()}
        live, _ = model_forward(spec, part, weights, ShardContext(7, 3, 6, rows, True, labels=y[rows]))
        return live[spec.program["logits"]]
    whole = logits(slice(0, 6))
    halves = np.concatenate([logits(slice(0, 2)), logits(slice(2, 6))])
    np.testing.assert_allclose(halves, whole, rtol=1e-5, atol=1e-6)
    other_step, _ = model_forward(spec, x, weights, ShardContext(7, 4, 6, slice(0, 6), True, labels=y))
    assert not np.allclose(other_step[spec.program["logits"]], whole)   # a new step, new masks


def test_several_inputs_by_position_or_by_name_are_the_features_forward_names():
    from cs_runtime.numerics.batch_check import BadBatch, check_batch
    module, loss_fn = _model("two_tower")
    (x, y), = _batches("two_tower", np.random.default_rng(6), 1, batch=4)
    by_position = model_spec("t", module, (torch.from_numpy(x["x"]), torch.from_numpy(x["y"])),
                             torch.from_numpy(y), loss_fn)
    by_name = model_spec("t", module, {"y": torch.from_numpy(x["y"]), "x": torch.from_numpy(x["x"])},
                         torch.from_numpy(y), loss_fn)
    for spec in (by_position, by_name):
        assert spec.program["features"] == ["x", "y"]   # forward(self, x, y)'s order, either way
        assert spec.program["inputs"] == ["input0", "input1", "target"] and not spec.program["context"]
        assert spec.program["values"]["input1"][0] == [4, 3]
        check_batch(spec, x, y)
    with pytest.raises(BadBatch, match=r"features \['x'\], the model takes \['x', 'y'\] \(missing y\)"):
        check_batch(by_name, {"x": x["x"]}, y)
    with pytest.raises(BadBatch, match="one feature array, but the model takes 2 inputs"):
        check_batch(by_name, x["x"], y)
    with pytest.raises(BadBatch, match=r"feature y has shape \(4, 5\), the model needs \[batch, 3\]"):
        check_batch(by_name, {"x": x["x"], "y": np.zeros((4, 5), np.float32)}, y)
    with pytest.raises(CaptureError, match="example input 'z' is not an argument of TwoTower.forward"):
        model_spec("t", module, {"x": torch.from_numpy(x["x"]), "z": torch.from_numpy(x["y"])},
                   torch.from_numpy(y), loss_fn)


def test_a_1x_loops_capture_still_refuses_dropout_in_training():
    from cs_torch.capture import capture
    module, loss_fn = _model("bert_inputs_dropout")
    x, y = _batches("bert_inputs", np.random.default_rng(2), 1, batch=2)[0]
    with pytest.raises(CaptureError, match="dropout with p=0.2 in training: a 1.x loop draws no masks"):
        capture(module, _example(x), torch.from_numpy(y), loss_fn, dropout=False)


class _Unsupported(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.special.i0(self.fc(x))   # not in the op set


def test_unsupported_op_fails_at_capture_naming_module_op_and_line():
    with pytest.raises(CaptureError) as info:
        model_spec("bad", _Unsupported(), (torch.zeros(2, 4),), torch.zeros(2, dtype=torch.long), F.cross_entropy)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("module <root>: ") and "aten.i0" in message, message
    assert "test_torch_programs.py:" in message, message


@pytest.mark.cluster
def test_validate_only_reports_an_unsupported_op_in_one_line(tmp_path):
    import subprocess
    import sys
    script = tmp_path / "run.py"
    script.write_text(
        "import torch\nimport torch.nn.functional as F\n"
        "from cs_runtime.data.mnist import load_mnist\nfrom cs_runtime.runner import run\n"
        "from cs_torch.capture import model_spec\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.head = torch.nn.Linear(784, 10)\n"
        "    def forward(self, x):\n        return torch.special.i0(self.head(x))\n"
        "def model_fn(params):\n"
        "    return model_spec('m', M(), (torch.zeros(8, 784),), torch.zeros(8, dtype=torch.long), F.cross_entropy)\n"
        "run(model_fn, lambda p: load_mnist(None, 'train'))\n")
    params = tmp_path / "params.yaml"
    params.write_text("train_input:\n  batch_size: 8\n")
    result = subprocess.run([sys.executable, str(script), "--mode", "train", "--params", str(params), "--model_dir",
                             str(tmp_path / "m"), "--validate_only"], capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "PYTHONPATH": str(__import__("pathlib").Path(__file__).parent.parent)})
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "module <root>" in errors[0] and "aten.i0" in errors[0] and "run.py:11" in errors[0], errors


def test_program_crosses_the_wire_as_data_and_is_validated():
    import msgpack
    from cs_runtime.numerics.model import ModelSpec
    from cs_runtime.numerics.program import ProgramError, Unit
    module, loss_fn = _model("gpt")
    ids = torch.zeros(2, 12, dtype=torch.long)
    spec = model_spec("gpt", module, (ids,), ids, loss_fn)
    wire = msgpack.packb(spec.to_dict(), use_bin_type=True)
    back = ModelSpec.from_dict(msgpack.unpackb(wire, raw=False))
    assert [l.param_shapes() for l in back.layers] == [l.param_shapes() for l in spec.layers]
    x = np.random.default_rng(0).integers(0, 30, (2, 12))
    weights = init_weights(spec, 0)
    for s in (spec, back):
        ctx = ShardContext(0, 0, 2, slice(0, 2), True, labels=x)
        live, _ = model_forward(s, x, weights, ctx)
        assert np.isfinite(model_loss(s, live, x, 2).loss)
    meta = spec.layers[2].unit["unit"]
    for broken in ({**meta, "forward": [["os.system", ["x"], ["y"], {}, "", ""]]},
                   {**meta, "forward": meta["forward"][1:]},
                   {**meta, "forward": [[*meta["forward"][0][:3], {"attrs": object()}, "", ""]]}):
        with pytest.raises(ProgramError):
            Unit.from_meta(broken)


def test_a_torch_state_dict_starts_a_run_and_weights_load_back():
    module, loss_fn = _model("gpt")
    other, _ = _model("gpt")
    torch.nn.init.normal_(other.transformer.wpe.weight)
    ids = torch.zeros(2, 12, dtype=torch.long)
    spec = model_spec("gpt", module, (ids,), ids, loss_fn, state_dict=other.state_dict())
    weights = init_weights(spec, 0)
    assert np.array_equal(weights["transformer.wpe"]["transformer.wpe.weight"],
                          other.transformer.wpe.weight.detach().numpy())
    fresh, _ = _model("gpt")
    load_into(fresh, {p: w for layer in weights.values() for p, w in layer.items()},
              {"transformer.wte.weight": "lm_head.weight"})
    for name, t in other.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name


def test_units_follow_the_rule_and_the_report_shows_them(tmp_path):
    from cs_runtime.compiler.stage import compile_model
    from cs_runtime.config import params_from_dict
    from cs_runtime.run_args import RunArgs
    module, loss_fn = _model("gpt")
    ids = torch.zeros(2, 12, dtype=torch.long)
    spec = model_spec("gpt", module, (ids,), ids, loss_fn)
    assert [l.name for l in spec.layers] == ["transformer.wte", "transformer.wpe", "transformer.h.0",
                                             "transformer.h.1", "transformer.ln_f", "lm_head"]
    holders = [l.name for l in spec.layers if "lm_head.weight" in l.param_shapes()]
    assert holders == ["transformer.wte", "lm_head"]
    # A captured model's report is a built-in model's: the plan, the estimate, a row per kernel,
    # and its units.
    params = params_from_dict({"train_input": {"batch_size": 2}})
    compile_model(spec, RunArgs("train", "p.yaml", params, str(tmp_path), None, False, True))
    text = (tmp_path / "compile_report.txt").read_text()
    for section in ("Execution strategy: ", "Estimated Overall Performance", "Estimated Performance Per Kernel",
                    "Weight-streaming units"):
        assert section in text
    assert "The unit rule:" in text and "ModuleList or Sequential" in text
    assert (tmp_path / "compile" / "wafer.svg").exists() or (tmp_path / "compile" / "streaming.svg").exists()
    units = text[text.index("Weight-streaming units"):]
    rows = {line.split()[0]: line for line in units.splitlines() if line.startswith(("transformer.", "lm_head "))}
    assert rows["lm_head"].rstrip().endswith("lm_head.weight")
    block = rows["transformer.h.0"].split()
    assert int(block[2].replace(",", "")) == sum(p.numel() for p in module.transformer.h[0].parameters())
    assert float(block[4]) > 0   # forward MFLOP of a block


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_eval_counts_right_predictions_of_the_counted_labels(kind):
    module, loss_fn = _model(kind)
    x, y = _batches(kind, np.random.default_rng(3), 1, batch=6)[0]
    spec = model_spec(kind, module, (torch.from_numpy(x),), torch.from_numpy(y), loss_fn)
    ctx = ShardContext(0, 0, 6, slice(0, 6), False, labels=y)
    live, _ = model_forward(spec, x, init_weights(spec, 0), ctx)
    result = model_loss(spec, live, y, 6)
    with torch.no_grad():
        logits = module(torch.from_numpy(x)).reshape(-1, 30 if kind == "gpt" else 5).numpy()
    flat = y.reshape(-1)
    counted = flat != (-1 if kind == "gpt" else -100)
    assert result.count == int(counted.sum())
    assert counted.all() == (kind == "mlp")   # the GPT's last position has no next token
    assert result.correct == int(((logits.argmax(-1) == flat) & counted).sum())
    assert result.loss_sum == pytest.approx(float(loss_fn(torch.from_numpy(logits.reshape(*y.shape, -1)
                                                                             if kind == "gpt" else logits),
                                                          torch.from_numpy(y))) * result.count, rel=1e-5)


def test_gradient_clipping_counts_a_tied_weight_once_as_clip_grad_norm_does():
    """GPT-2's token embedding is its output head: two units read it, each layer holds a copy
    with the summed gradient, and the global norm must count it once. Five SGD steps clipped
    to a norm below the gradients' against torch eager with clip_grad_norm_."""
    from cs_runtime.numerics.program_layer import tied_copies
    module, loss_fn = _model("gpt")
    batches = _batches("gpt", np.random.default_rng(4), 5, batch=6)
    x0, y0 = batches[0]
    spec = model_spec("gpt", module, (torch.from_numpy(x0),), torch.from_numpy(y0), loss_fn)
    assert {name for _, name in tied_copies(spec)} == {"lm_head.weight"}
    eager = copy.deepcopy(module)
    torch_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    weights = init_weights(spec, seed=0)
    ours = Optimizer(OptimizerSpec("sgd"))
    state = {name: ours.init_state(w) for name, w in weights.items()}
    names = [layer.name for layer in spec.layers]
    for step, (x, y) in enumerate(batches):
        torch_opt.zero_grad()
        loss_fn(eager(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        want = float(torch.nn.utils.clip_grad_norm_(eager.parameters(), max_norm=0.5))
        torch_opt.step()
        ctx = ShardContext(0, step, len(x), slice(0, len(x)), True, labels=y)
        live, caches = model_forward(spec, x, weights, ctx)
        grads = model_backward(spec, model_loss(spec, live, y, len(x)).delta, caches, weights, step)
        twice, _ = grad_norms(grads)
        norm, applied, _ = ours.update_model(names, weights, grads, state, 0.1, step, 0.5,
                                             copies=tied_copies(spec))
        assert applied and want > 0.5                  # the clipping is active
        assert norm == pytest.approx(want, rel=1e-5)
        assert twice > norm * (1 + 1e-3)               # counted twice, the norm would be larger
    assert_weights_match_module(weights, eager)


@pytest.mark.parametrize("kind", ["bert_inputs", "cnn"])
def test_every_captured_model_compiles_to_a_report(tmp_path, kind):
    """A padding mask's -inf fill and a convolution: the plan, its key and its report hold them."""
    from cs_runtime.compiler.stage import compile_model
    from cs_runtime.config import params_from_dict
    from cs_runtime.numerics.program_layer import unit_of
    from cs_runtime.run_args import RunArgs
    module, loss_fn = _model(kind)
    x, y = _batches(kind, np.random.default_rng(1), 1, batch=4)[0]
    spec = model_spec(kind, module, _example(x), torch.from_numpy(y), loss_fn)
    args = RunArgs("train", "p.yaml", params_from_dict({"train_input": {"batch_size": 4}}), str(tmp_path), None,
                   False, True)
    first = compile_model(spec, args)
    assert first["execution_strategy"] == "weight_streaming" and first["estimate"]["samples_per_s"] > 0
    ran = [n.op for layer in spec.layers for n in unit_of(layer).forward]
    assert [op for k in first["kernels"] for op in k["ops"]] == ran   # every op planned once
    again = compile_model(spec, args)
    assert again["reused"] and again["artifact_key"] == first["artifact_key"]
