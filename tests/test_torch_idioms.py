"""Models written the way others write them (tests/idiom_models.py: GPT-2, BERT with
its padding mask, Llama, ResNet, MobileNetV3 and ViT idioms) capture and train on the
CPU path with torch's numbers: the loss of every step within 1e-5 relative of torch
eager on the same module, batches and optimizer (SGD with momentum, AdamW), and every
weight after the steps within 1e-5 of its scale. What cannot run right is refused at
capture in one line: a buffer updated in place other than BatchNorm's running statistics."""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="capturing a torch model needs torch (an optional extra)")
F = torch.nn.functional

from cs_runtime.numerics.model import ShardContext, init_weights, model_forward, model_loss  # noqa: E402
from cs_torch.capture import CaptureError, capture, model_spec  # noqa: E402
from tests import idiom_models as im  # noqa: E402
from tests.test_torch_programs import (_call, _dropout_as_drawn, _example, _torch_float_spread,  # noqa: E402
                                      train_both, train_cpu_path, train_torch)

STEPS, BATCH = 4, 4


def _tokens(rng, steps):
    out = []
    for _ in range(steps):
        ids = rng.integers(0, im.VOCAB, (BATCH, im.T))
        out.append((ids, ids.copy()))       # causal LM: the loss shifts the labels itself
    return out


def _masked(rng, steps):
    out = []
    for _ in range(steps):
        ids = rng.integers(1, im.VOCAB, (BATCH, im.T))
        lengths = rng.integers(3, im.T + 1, BATCH)
        mask = (np.arange(im.T)[None, :] < lengths[:, None]).astype(np.int64)
        labels = np.where(mask == 0, -100, rng.integers(0, im.VOCAB, (BATCH, im.T)))
        out.append(({"input_ids": ids * mask, "attention_mask": mask}, labels))
    return out


def _images(rng, steps, size=8):
    return [(rng.standard_normal((BATCH, 3, size, size)).astype(np.float32), rng.integers(0, 5, BATCH))
            for _ in range(steps)]


MODELS = {
    "gpt2": (im.GPT2Style, im.causal_lm_loss, _tokens),
    "bert_padding_mask": (im.BertStyle, im.masked_lm_loss, _masked),
    "llama": (im.LlamaStyle, im.causal_lm_loss, _tokens),
    "resnet": (im.ResNetStyle, F.cross_entropy, _images),
    "mobilenet_v3": (im.MobileNetStyle, F.cross_entropy, _images),
    "vit": (im.ViTStyle, F.cross_entropy, _images),
    "unet_pieces": (im.UNetStyle, F.cross_entropy, _images),
    "resampling": (im.ResamplingStyle, F.cross_entropy, _images),
}


# Training several models for several steps takes tens of seconds: the full pass runs it.
@pytest.mark.cluster
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_a_model_written_by_others_trains_with_torchs_numbers(kind, opt):
    make, loss_fn, batches_of = MODELS[kind]
    torch.manual_seed(0)
    module = make()
    batches = batches_of(np.random.default_rng(3), STEPS)
    _, ours, theirs, weights, eager = train_both(kind, module, loss_fn, batches, opt)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert len(set(np.round(theirs, 6))) > 1          # the steps moved the loss: the weights trained
    reference = {n: t.detach().numpy() for n, t in eager.state_dict().items()}
    final = {p: w for layer in weights.values() for p, w in layer.items()}
    assert set(final) == {n for n, _ in eager.named_parameters()}
    # AdamW turns float32 noise in a gradient that is zero in exact arithmetic (an attention
    # key bias) into whole steps, in torch too: held to 3x torch's own float32-vs-float64
    # spread there, as tests/test_torch_programs.py does.
    spread = _torch_float_spread(module, loss_fn, batches, opt, reference) if opt != "sgd" else {}
    for name, w in final.items():
        atol = max(1e-5 * float(np.abs(reference[name]).max()), 3 * spread.get(name, 0.0))
        np.testing.assert_allclose(w, reference[name], rtol=1e-5, atol=atol, err_msg=name)


def test_in_place_ops_are_functional_and_the_graph_reads_the_new_values():
    """relu_, add_ (a residual `out += identity`), hardswish_ and dropout_ at p 0 leave no
    in-place op in the program, and the program's forward is torch's."""
    torch.manual_seed(0)
    module = im.MobileNetStyle()
    x, y = _images(np.random.default_rng(1), 1)[0]
    spec = model_spec("m", module, (torch.from_numpy(x),), torch.from_numpy(y), F.cross_entropy)
    ops = {n[0] for layer in spec.layers for n in layer.unit["unit"]["forward"]}
    assert not any(op.endswith("_") for op in ops)
    assert {"clamp", "conv2d", "batch_norm"} <= ops
    live, _ = model_forward(spec, x, init_weights(spec, 0), ShardContext(0, 0, BATCH, slice(0, BATCH), True, labels=y))
    with torch.no_grad():
        want = float(F.cross_entropy(_call(module, x), torch.from_numpy(y)))
    assert model_loss(spec, live, y, BATCH).loss == pytest.approx(want, rel=1e-6)


@pytest.mark.cluster
def test_in_place_dropout_with_p_draws_the_runs_masks(monkeypatch):
    """Dropout(p=0.3, inplace=True) in training is the program's dropout (masks from the run's
    context, never a mask drawn once at capture): torch fed the same masks agrees."""
    torch.manual_seed(0)
    module = im.MobileNetStyle(dropout=0.3)
    batches = _images(np.random.default_rng(4), 3)
    x0, y0 = batches[0]
    spec = model_spec("m", module, (torch.from_numpy(x0),), torch.from_numpy(y0), F.cross_entropy)
    assert any(n[0] == "dropout_mask" for layer in spec.layers for n in layer.unit["unit"]["forward"])
    eager = copy.deepcopy(module)
    ours, _ = train_cpu_path(spec, batches, "sgd")
    theirs = train_torch(eager, F.cross_entropy, batches, "sgd", before_step=lambda step: monkeypatch.setattr(
        F, "dropout", _dropout_as_drawn(0, step, slice(0, BATCH))))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)


@pytest.mark.cluster
def test_batch_norm_in_eval_mode_normalizes_by_the_running_statistics():
    """Frozen batch norm (eval mode, as fine-tuning keeps it): the running statistics are
    constants of the program, the affine weights train, torch eager agrees."""
    torch.manual_seed(0)
    module = im.ResNetStyle(track_running_stats=True)
    for bn in (m for m in module.modules() if isinstance(m, torch.nn.BatchNorm2d)):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    module.eval()
    batches = _images(np.random.default_rng(5), 3)
    x0, y0 = batches[0]
    spec = model_spec("r", module, (torch.from_numpy(x0),), torch.from_numpy(y0), F.cross_entropy)
    eager = copy.deepcopy(module)
    ours, _ = train_cpu_path(spec, batches, "sgd")
    theirs = train_torch(eager, F.cross_entropy, batches, "sgd")
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(eager.buffers(), module.buffers()))   # torch left them too


def test_a_buffer_updated_in_place_other_than_batch_norms_is_refused_in_one_line():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)
            self.register_buffer("seen", torch.zeros(4))

        def forward(self, x):
            self.seen.add_(x.sum(0))
            return self.fc(x)
    with pytest.raises(CaptureError) as info:
        capture(Counter(), (torch.randn(4, 4),), torch.zeros(4, dtype=torch.long), F.cross_entropy)
    message = str(info.value)
    assert "\n" not in message and "buffer 'seen' in place" in message, message
    assert "test_torch_idioms.py:" in message, message


def test_a_random_op_other_than_the_draws_is_refused_not_drawn_once_at_capture():
    """rand, randn, randperm are drawn each step (tests/test_torch_draws.py); randint is not."""
    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x) + torch.randint(0, 3, (3,))
    with pytest.raises(CaptureError, match=r"module <root>: op aten\.randint.*capture would draw its values once"):
        capture(Noisy(), (torch.zeros(2, 4),), torch.zeros(2, dtype=torch.long), F.cross_entropy)


def test_the_documented_core_aten_coverage_is_torchs_count_and_names_each_op_left_out():
    """docs/torch.md says "N of M Core ATen ops" and lists each op left out with why: M is
    torch's own count (the ops it tags `core`), N the ones capture takes, and the list is
    exactly the rest."""
    import re
    from pathlib import Path
    from cs_torch.capture import core_aten_coverage
    taken, left_out = core_aten_coverage()
    doc = (Path(__file__).parent.parent / "docs" / "torch.md").read_text()
    counted = re.search(r"\*\*(\d+) of (\d+) Core ATen ops\*\*", doc)
    assert counted, "docs/torch.md gives no 'N of M Core ATen ops'"
    assert (int(counted.group(1)), int(counted.group(2))) == (len(taken), len(taken) + len(left_out))
    section = doc[counted.end():].split("\n## ")[0]
    listed = {name for row in re.findall(r"^\| (.+?) \| .+ \|$", section, re.M)
              for name in re.findall(r"`([\w.]+)`", row)}
    assert listed == left_out, f"documented but taken: {sorted(listed - left_out)}; " \
                               f"left out but not documented: {sorted(left_out - listed)}"


@pytest.mark.cluster
def test_the_size_ops_are_read_as_sizes_that_follow_the_batch():
    """The Core ATen ops of sizes count as taken: torch.export writes each as sym_size and
    numbers (or decides it at export), and views by them follow a shard's rows."""
    aten = torch.ops.aten

    class Sized(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(6, 3)

        def forward(self, x):
            x = x.view(aten.sym_size.int(x, 0), 6).view(aten.sym_numel(x) // 6, 6)
            x = x.view(x.shape[0] * aten.sym_stride.int(x, 1), 6).view(x.shape[0] + aten.sym_storage_offset(x), 6)
            return self.fc(x.view(x.shape[0] if aten.sym_is_contiguous(x) else 1, 6))
    captured = capture(Sized(), (torch.zeros(4, 6),), torch.zeros(4, dtype=torch.long), F.cross_entropy)
    reshapes = [n.attrs["shape"] for n in captured.program.nodes if n.op == "reshape"]
    assert reshapes and all(shape == [-1, 6] for shape in reshapes)


class _Bags(torch.nn.Module):
    """EmbeddingBag of a 2-d input (one bag of 5 ids per sample) in each of its modes."""
    def __init__(self):
        super().__init__()
        self.bags = torch.nn.ModuleList(torch.nn.EmbeddingBag(10, 4, mode=m) for m in ("sum", "mean", "max"))
        self.fc = torch.nn.Linear(12, 3)

    def forward(self, ids, offsets=None):
        return self.fc(torch.cat([bag(ids, offsets) for bag in self.bags], dim=1))


def _as_torch_on_shards_of_3_and_5(module, x, y):
    """The module captured at 8 rows, run as shards of 3 and 5: its logits and the shards' summed
    gradients against torch eager's on the whole batch, from the same weights (1e-5)."""
    from cs_runtime.numerics.model import ShardContext, init_weights, model_backward, model_forward, model_loss
    from cs_torch.capture import load_into, model_spec
    spec = model_spec(type(module).__name__, module, (x,), y, F.cross_entropy)
    weights = init_weights(spec, 0)
    load_into(module, {p: w for layer in weights.values() for p, w in layer.items()})
    logits = module(x)
    F.cross_entropy(logits, y).backward()
    scores, grads = [], {}
    for rows in (slice(0, 3), slice(3, 8)):
        live, caches = model_forward(spec, x.numpy()[rows], weights,
                                     ShardContext(0, 0, 8, rows, True, labels=y.numpy()[rows]))
        scores.append(live[spec.program["logits"]])
        for layer in model_backward(spec, model_loss(spec, live, y.numpy()[rows], 8).delta, caches, weights):
            for name, g in layer.items():
                grads[name] = grads.get(name, 0) + g
    np.testing.assert_allclose(np.concatenate(scores), logits.detach().numpy(), rtol=1e-5, atol=1e-6)
    for name, p in module.named_parameters():
        np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=1e-5, atol=1e-7, err_msg=name)
    return spec


@pytest.mark.cluster
def test_fixed_size_embedding_bags_are_torchs_on_any_shard_and_offsets_are_refused():
    """A 2-d input's bags (offsets arange(0, B*L, L)) are embedding(ids) summed, averaged or
    maxed over each sample's ids, as torch's on shards of 3 + 5 rows. Bags by offsets the data
    gives are a data-dependent grouping: refused in one line."""
    torch.manual_seed(0)
    _as_torch_on_shards_of_3_and_5(_Bags(), torch.randint(0, 10, (8, 5)), torch.arange(8) % 3)

    class ByOffsets(torch.nn.Module):   # bags of 3, 4, 2 and the rest of the flattened batch's ids
        def __init__(self):
            super().__init__()
            self.bag = torch.nn.EmbeddingBag(10, 4)
            self.register_buffer("offsets", torch.tensor([0, 3, 7, 9]))

        def forward(self, ids):
            return self.bag(ids.flatten(), self.offsets)
    with pytest.raises(CaptureError, match=r"aten\._embedding_bag.*bags given by offsets") as err:
        capture(ByOffsets(), (torch.randint(0, 10, (4, 6)),), torch.zeros(4), lambda out, t: out.sum())
    assert "\n" not in str(err.value) and "test_torch_idioms.py:" in str(err.value)


class _ScaledByItems(torch.nn.Module):
    """Numbers read off tensors by .item() that scale and shift the values (a float, an int count)."""
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(x) / self.fc.weight.abs().sum().item() + self.fc.bias.sum() * (self.fc.weight > 0).sum().item()


class _ItemAsSize(_ScaledByItems):
    def forward(self, x):
        return self.fc(x)[:, :(self.fc.weight > 0).sum().item() % 3 + 1].sum(1, keepdim=True).expand(-1, 3)


@pytest.mark.cluster
def test_item_as_a_factor_is_a_detached_value_and_as_a_size_is_refused():
    """.item() of a float and of an int count scale and shift the values as torch's numbers do
    (no gradient through them; the int was once read as the batch size); as a size, refused."""
    torch.manual_seed(0)
    spec = _as_torch_on_shards_of_3_and_5(_ScaledByItems(), torch.randn(8, 6), torch.arange(8) % 3)
    assert sum(n[0] == "detach" for layer in spec.layers for n in layer.unit["unit"]["forward"]) == 2
    with pytest.raises(CaptureError, match=r"aten\._local_scalar_dense.*\.item\(\) read by .*mod.*only a tensor's add"):
        capture(_ItemAsSize(), (torch.randn(8, 6),), torch.arange(8) % 3, F.cross_entropy)


@pytest.mark.parametrize("mixing,words", [
    (lambda x: torch.diagonal(x, dim1=0, dim2=1), "computes along the batch dim"),
    (lambda x: F.pdist(x), "pdist of the batch's rows|a shard of other rows would fail"),
])
def test_distances_and_diagonals_across_the_batchs_rows_are_refused(mixing, words):
    """A shard would see its own rows only: refused at capture (by torch.export's guard on the
    batch, where pdist's size of batch * (batch - 1) / 2 meets one)."""
    class Mixing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) + mixing(x).sum()
    with pytest.raises(CaptureError, match=words):
        capture(Mixing(), (torch.zeros(4, 4),), torch.zeros(4, dtype=torch.long), F.cross_entropy)


def test_one_d_pools_are_the_two_d_ones_of_height_one():
    class Pools(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 5)

        def forward(self, x):
            y = F.avg_pool1d(x, 2) + F.adaptive_avg_pool1d(x, 4)
            return self.fc(F.avg_pool1d(y, 2, 1, padding=1).mean(-1))
    torch.manual_seed(0)
    module, x, y = Pools(), torch.randn(2, 3, 8), torch.tensor([1, 4])
    spec = model_spec("p", module, (x,), y, F.cross_entropy)
    context = ShardContext(0, 0, 2, slice(0, 2), True, labels=y.numpy())
    live, _ = model_forward(spec, x.numpy(), init_weights(spec, 0), context)
    assert model_loss(spec, live, y.numpy(), 2).loss == pytest.approx(float(F.cross_entropy(module(x), y)), rel=1e-6)


@pytest.mark.parametrize("kind", ["bert_padding_mask", "unet_pieces", "resampling"])
def test_the_new_ops_cross_the_wire_as_plain_data(kind):
    """A program of the new ops (cat, pow, rsqrt, index, bitwise_and, scatter, slice_scatter,
    group_norm, ...) goes to a WSE as msgpack and computes the same loss there."""
    import msgpack
    from cs_runtime.numerics.model import ModelSpec
    make, loss_fn, batches_of = MODELS[kind]
    torch.manual_seed(0)
    x, y = batches_of(np.random.default_rng(1), 1)[0]
    spec = model_spec(kind, make(), _example(x), torch.from_numpy(y), loss_fn)
    back = ModelSpec.from_dict(msgpack.unpackb(msgpack.packb(spec.to_dict(), use_bin_type=True), raw=False))
    weights = init_weights(spec, 0)
    losses = []
    for s in (spec, back):
        live, _ = model_forward(s, x, weights, ShardContext(0, 0, BATCH, slice(0, BATCH), True, labels=y))
        losses.append(model_loss(s, live, y, BATCH).loss)
    assert np.isfinite(losses[0]) and losses[0] == losses[1]


class _Pooled(torch.nn.Module):
    def __init__(self, **pool):
        super().__init__()
        self.conv, self.pool, self.fc = torch.nn.Conv2d(3, 4, 3), pool, torch.nn.Linear(4 * 2 * 2, 5)

    def forward(self, x):
        return self.fc(F.avg_pool2d(self.conv(x), 3, 2, **self.pool).flatten(1))


@pytest.mark.parametrize("pool,why", [
    # refused by the op's shape rule, which capture runs: a ProgramError made a CaptureError
    ({"ceil_mode": True}, "pooling with ceil_mode=True"),
    # refused only as the op runs: capture runs the program once on the example batch
    ({"padding": 1, "count_include_pad": False}, "avg_pool2d with count_include_pad=False and padding")])
def test_what_an_op_refuses_fails_at_capture_naming_the_module_op_and_line(pool, why):
    with pytest.raises(CaptureError) as info:
        capture(_Pooled(**pool), (torch.randn(2, 3, 6, 6),), torch.zeros(2, dtype=torch.long), F.cross_entropy)
    message = str(info.value)
    assert "\n" not in message and message.startswith("module <root>, op avg_pool2d, at test_torch_idioms.py:"), message
    assert why in message, message
