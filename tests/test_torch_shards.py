"""A program captured at batch B holds for any shard: 1 row, B/2, uneven splits.
Captured at 8, each shard's scores equal torch's on those rows, and the shards'
loss shares and gradients add up to torch's on the whole batch (as the WSEs of a
data-parallel run add theirs). What cannot hold for a shard (a model that fixes its
batch, rows that meet a reduction over the batch, an op along it) is refused at
capture in one line naming the module, the op and the line. One cluster test: the
view(B, T, -1, hs) model on two WSEs of uneven shards."""
import subprocess
import sys

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch", reason="capturing a torch model needs torch (an optional extra)")
F = torch.nn.functional

from cs_runtime.numerics.model import (  # noqa: E402
    ShardContext, init_weights, model_backward, model_forward, model_loss)
from cs_torch.capture import CaptureError, capture, model_spec  # noqa: E402
from tests import torch_models  # noqa: E402
from tests.cluster_utils import REPO, final_weights, relative_error, tool, train_losses  # noqa: E402

BATCH, T, VOCAB = 8, 12, 30
SPLITS = {"whole": [8], "halves": [4, 4], "uneven": [3, 5], "rows": [1] * 8}


def _batch(seed=3):
    rng = np.random.default_rng(seed)
    return rng.integers(1, VOCAB, (BATCH, T)), rng.integers(0, VOCAB, (BATCH, T))


def _run_shards(spec, ids, labels, sizes):
    """(each shard's scores, the summed loss shares, the summed gradients by parameter)."""
    weights = init_weights(spec, 0)
    scores, loss, grads, start = [], 0.0, {}, 0
    for size in sizes:
        rows = slice(start, start + size)
        ctx = ShardContext(0, 0, BATCH, rows, True, labels=labels[rows])
        live, caches = model_forward(spec, ids[rows], weights, ctx)
        scores.append(live[spec.program["logits"]])
        result = model_loss(spec, live, labels[rows], BATCH, labels.size)
        loss += result.loss
        for layer in model_backward(spec, result.delta, caches, weights):
            for name, g in layer.items():
                grads[name] = grads.get(name, 0) + g
        start += size
    return scores, loss, grads


@pytest.mark.parametrize("kind", ["ViewAttention", "TypeBuffer", "HFStyleAttention", "RowIndexedMask"])
def test_a_program_captured_at_8_rows_runs_any_shard_as_torch_does(kind):
    torch.manual_seed(0)
    module = getattr(torch_models, kind)()
    ids, labels = _batch()
    spec = model_spec(kind, module, (torch.from_numpy(ids),), torch.from_numpy(labels), torch_models.token_loss)
    logits = module(torch.from_numpy(ids))
    loss = torch_models.token_loss(logits, torch.from_numpy(labels))
    loss.backward()
    for split, sizes in SPLITS.items():
        scores, ours, grads = _run_shards(spec, ids, labels, sizes)
        start = 0
        for size, shard in zip(sizes, scores):   # torch at the shard's own size
            theirs = module(torch.from_numpy(ids[start:start + size])).detach().numpy().reshape(shard.shape)
            np.testing.assert_allclose(shard, theirs, rtol=1e-4, atol=1e-5, err_msg=f"{split}, rows {start}+{size}")
            start += size
        assert ours == pytest.approx(loss.item(), rel=1e-5), split
        for name, p in module.named_parameters():
            np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=f"{split}: {name}")


def test_an_arange_of_the_batch_used_as_a_value_is_refused():
    module = torch_models.RowNumberAsValue()
    ids, labels = _batch()
    with pytest.raises(CaptureError, match="arange of the batch size used other than to index"):
        capture(module, (torch.from_numpy(ids),), torch.from_numpy(labels), torch_models.token_loss)


def test_the_shapes_that_follow_the_batch_carry_no_capture_batch_size():
    """The reshapes put -1 where the batch is; the buffer's expand reads the batch from an input."""
    torch.manual_seed(0)
    ids, labels = _batch()
    for module in (torch_models.ViewAttention(), torch_models.TypeBuffer()):
        program = capture(module, (torch.from_numpy(ids),), torch.from_numpy(labels), torch_models.token_loss).program
        shaped = [n for n in program.nodes if n.op in ("reshape", "expand")]
        assert shaped
        for node in shaped:
            assert node.attrs["shape"][0] != BATCH or node.attrs.get("batch_dims") == [0], (node.op, node.attrs)
        assert all(BATCH not in a.shape for a in program.consts.values())


def test_a_capture_at_one_row_runs_a_shard_of_eight():
    torch.manual_seed(0)
    module = torch_models.ViewAttention()
    ids, labels = _batch()
    spec = model_spec("one", module, (torch.from_numpy(ids[:1]),), torch.from_numpy(labels[:1]),
                      torch_models.token_loss)
    scores, _, _ = _run_shards(spec, ids, labels, [8])
    theirs = module(torch.from_numpy(ids)).detach().numpy()
    np.testing.assert_allclose(scores[0], theirs.reshape(scores[0].shape), rtol=1e-4, atol=1e-5)


def test_a_model_that_fixes_its_batch_is_refused_at_capture_at_its_line():
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    with pytest.raises(CaptureError) as err:
        capture(torch_models.FixedBatch(), (x,), y, F.cross_entropy)
    line = str(err.value)
    assert line.startswith("module <root>: at torch_models.py:") and "fixes the batch size at 8" in line, line
    assert "\n" not in line


class _ConstantReadTwice(torch.nn.Module):
    """Positions read by an embedding (they become a program constant), then by cumsum:
    torch computes that at capture too, so no op outside the op set is asked for."""
    def __init__(self):
        super().__init__()
        self.pos = torch.nn.Embedding(T * T, 6)
        self.head = torch.nn.Linear(6, VOCAB)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1])
        first = self.pos(pos)
        return self.head(first + self.pos(torch.cumsum(pos, 0)) + ids[..., None])


def test_a_constant_an_op_has_read_is_still_a_constant():
    ids, labels = _batch()
    captured = capture(_ConstantReadTwice(), (torch.from_numpy(ids).float(),), torch.from_numpy(labels),
                       torch_models.token_loss)
    assert not any(n.op == "cumsum" for n in captured.program.nodes)


class _BatchMean(torch.nn.Module):
    """Centres each sample on the batch's mean: a shard's mean is another number."""
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 5)

    def forward(self, x):
        return self.fc(x - x.mean(0, keepdim=True))


def test_a_model_that_reduces_over_the_batch_and_meets_its_rows_again_is_refused():
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    with pytest.raises(CaptureError) as err:
        capture(_BatchMean(), (x,), y, F.cross_entropy)
    line = str(err.value)
    assert "reduces over the batch" in line and "aten.mean" in line and "test_torch_shards.py:" in line
    # The loss's own mean over the rows is the loss's (weighted by the shard's rows, as before).
    capture(torch.nn.Linear(12, 5), (x,), torch.randn(8, 5), lambda out, t: ((out - t) * (out - t)).mean())


SHARD_RUN = str(REPO / "tests" / "torch_shard_run.py")
RUN_PARAMS = {
    # 7 rows: two WSEs take 4 and 3
    "train_input": {"batch_size": 7, "max_sequence_length": 16, "shuffle": True, "drop_last_batch": True},
    "eval_input": {"batch_size": 7, "max_sequence_length": 16},
    "model": {"model_type": "gpt2", "vocab_size": 260, "hidden_size": 32, "num_hidden_layers": 1, "num_heads": 4,
              "max_position_embeddings": 16},   # the run builds ViewAttention from these
    "optimizer": {"optimizer_type": "sgd", "learning_rate": 0.1, "momentum": 0.9},
    "runconfig": {"max_steps": 6, "log_steps": 3, "checkpoint_steps": 0, "seed": 2},
}


def _train(launcher, params, model_dir):
    cmd = [*launcher, sys.executable, SHARD_RUN, "--mode", "train", "--params", str(params),
           "--model_dir", str(model_dir)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


@pytest.mark.cluster
def test_view_attention_on_two_wses_of_uneven_shards_equals_the_cpu_path(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(RUN_PARAMS))
    _train([tool("csrun_cpu")], params, tmp_path / "cpu")
    _train([tool("csrun_wse"), "--num_csx", "2", "--num_workers_per_csx", "1"], params, tmp_path / "wse")
    cpu, wse = train_losses(tmp_path / "cpu"), train_losses(tmp_path / "wse")
    assert len(cpu) == len(wse) == 6
    assert (np.abs(wse - cpu) / np.abs(cpu)).max() < 1e-5
    weights, got = final_weights(tmp_path / "cpu"), final_weights(tmp_path / "wse")
    assert got.keys() == weights.keys()
    for name in weights:   # float32 summed in another order: two shards' gradients added
        assert relative_error(got[name], weights[name]) < 1e-5, name


def test_a_shape_rule_that_would_fail_on_a_shard_fails_at_capture(monkeypatch):
    """The safety net under the symbolic shapes: a lowering that wrote the capture's
    batch into a view (as capture once did) is caught by the shape rules run for a
    shard of one row more, before any step."""
    from cs_torch import capture as capture_mod
    monkeypatch.setitem(capture_mod._LOWER, "view", lambda L, n, x, shape: L.emit("reshape", [x], {
        "shape": [L.batch if d is n.args[1][0] else d for d in L._at_capture(n.meta["val"].shape)]}))
    monkeypatch.setitem(capture_mod._BATCH_SIZED, "view", capture_mod._LOWER["view"])
    ids, labels = _batch()
    with pytest.raises(CaptureError) as err:
        capture(torch_models.ViewAttention(), (torch.from_numpy(ids),), torch.from_numpy(labels),
                torch_models.token_loss)
    line = str(err.value)
    assert "op reshape" in line and "torch_models.py:" in line and "on a shard of 9 rows" in line, line


def test_an_unsupported_op_in_a_library_beside_torch_is_named_at_its_line(tmp_path, monkeypatch):
    """torchvision's files sit in a folder whose name starts as torch's does: its line is
    the model's, not torch's, and the capture error names it."""
    from cs_torch import capture as capture_mod
    (tmp_path / "torch").mkdir()
    library = tmp_path / "torchvision_like"
    library.mkdir()
    (library / "blocks.py").write_text(
        "import torch\n\n\nclass Block(torch.nn.Module):\n    def forward(self, x):\n"
        "        return torch.special.i0(x)\n")
    monkeypatch.setattr(capture_mod, "_TORCH_DIR", str(tmp_path / "torch"))
    monkeypatch.syspath_prepend(str(library))
    import blocks
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), blocks.Block())
    with pytest.raises(CaptureError) as err:
        capture(model, (torch.randn(8, 4),), torch.randint(0, 4, (8,)), F.cross_entropy)
    assert str(err.value).startswith("module 1: op aten.i0.default at blocks.py:6: not in the op set"), err.value


class _Squeezed(torch.nn.Module):
    """squeeze() of a [B, 1, 12] input: on a shard of one row the batch stays."""
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 5)

    def forward(self, x):
        return self.fc(x.squeeze())


def test_a_squeeze_keeps_the_batch_of_a_one_row_shard():
    torch.manual_seed(0)
    module = _Squeezed()
    x, y = np.random.default_rng(4).standard_normal((8, 1, 12)).astype(np.float32), np.arange(8) % 5
    spec = model_spec("squeezed", module, (torch.from_numpy(x),), torch.from_numpy(y), F.cross_entropy)
    weights = init_weights(spec, 0)
    live, _ = model_forward(spec, x[2:3], weights, ShardContext(0, 0, 8, slice(2, 3), True, labels=y[2:3]))
    scores = live[spec.program["logits"]]
    # The shard's row of the whole batch's scores (torch on one row alone squeezes its batch too).
    np.testing.assert_allclose(scores, module(torch.from_numpy(x)).detach().numpy()[2:3], rtol=1e-5, atol=1e-6)


class _EveryOther(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x)[::2]


class _Shifted(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x)[1:]


def test_a_slice_of_the_batch_is_refused():
    """x[1:] or x[::2] of the batch hold only for some shard sizes: torch.export finds the
    range, and the capture says it in one line."""
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    for model, cut in ((_Shifted, slice(1, None)), (_EveryOther, slice(None, None, 2))):
        with pytest.raises(CaptureError, match=r"^the model holds for a batch only where 3 <= batch: a shard "
                                               r"of other rows would fail[^\n]*$"):
            capture(model(12, 5), (x,), y, lambda out, t: F.cross_entropy(out, t[cut]))


class _FilledLike(torch.nn.Module):
    """ones_like / full_like of the batch's values: one row, broadcast to a shard's rows."""
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 5)

    def forward(self, x):
        h = self.fc(x)
        return h * torch.full_like(h, 0.5) + torch.ones_like(h) + torch.zeros_like(self.fc.bias)


def test_filled_like_tensors_follow_the_shard():
    torch.manual_seed(0)
    module = _FilledLike()
    x, y = np.random.default_rng(5).standard_normal((8, 12)).astype(np.float32), np.arange(8) % 5
    spec = model_spec("filled", module, (torch.from_numpy(x),), torch.from_numpy(y), F.cross_entropy)
    weights = init_weights(spec, 0)
    whole = module(torch.from_numpy(x)).detach().numpy()
    for rows in (slice(0, 1), slice(1, 4), slice(0, 8)):
        live, _ = model_forward(spec, x[rows], weights, ShardContext(0, 0, 8, rows, True, labels=y[rows]))
        np.testing.assert_allclose(live[spec.program["logits"]], whole[rows], rtol=1e-5, atol=1e-6)


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        if x.sum() > 0:   # Python control flow on a value: no program has it
            return self.fc(x)
        return self.fc(-x)


def test_what_torch_export_cannot_trace_is_named_by_module_and_line():
    model = torch.nn.Sequential(torch.nn.Identity(), _Branchy())
    with pytest.raises(CaptureError) as err:
        capture(model, (torch.randn(8, 4),), torch.randint(0, 3, (8,)), F.cross_entropy)
    line = str(err.value)
    assert line.startswith("module 1: at test_torch_shards.py:") and "torch.export could not trace" in line, line
    assert "\n" not in line


class _SoftmaxOverBatch(torch.nn.Module):
    """Each sample weighted against the others of its batch: softmax along dim 0."""
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 5)

    def forward(self, x):
        return self.fc(x) * torch.softmax(x.sum(-1, keepdim=True), dim=0)


def test_an_op_along_the_batch_dim_is_refused():
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    with pytest.raises(CaptureError, match=r"^module <root>: op aten\.softmax\.int at test_torch_shards\.py:\d+: "
                                           "computes along the batch dim"):
        capture(_SoftmaxOverBatch(), (x,), y, F.cross_entropy)
