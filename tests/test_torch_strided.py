"""as_strided and unfold in a captured model: the elements the view's strides reach in its
input's storage, as a gather of fixed indices from the input's values (capture.py
_strided_view). Where the input's dim 0 is the batch the view keeps it and reaches into each
row only, so the program holds for any shard; against torch eager's values and gradients on
shards of 1 row, 4 + 4 and 3 + 5. Marked cluster: each capture costs a torch.export."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="capturing a torch model needs torch (an optional extra)")
F = torch.nn.functional

from cs_runtime.numerics.model import ShardContext, init_weights, model_backward, model_forward, model_loss  # noqa: E402
from cs_torch.capture import CaptureError, capture, load_into, model_spec  # noqa: E402

pytestmark = pytest.mark.cluster
BATCH = 8
SPLITS = {"whole": [8], "halves": [4, 4], "uneven": [3, 5], "rows": [1] * 8}


class Windows(torch.nn.Module):
    """Sliding windows of a [B, C, L] signal by unfold (overlapping: step 1 < size 3)."""
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2 * 3 * 3, 3)

    def forward(self, x):
        return self.fc(x.unfold(2, 3, 1).reshape(x.shape[0], -1))


class StridedOfTransposed(torch.nn.Module):
    """as_strided ignores its input's strides and reads storage: here that of a transposed view, from offset 1."""
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.fc(x.transpose(1, 2).as_strided((x.shape[0], 4, 3), (10, 1, 2), 1).flatten(1))


class UnfoldedWeight(torch.nn.Module):
    """A view without the batch: windows of a parameter, whose gradient sums the windows'."""
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(10, 4))

    def forward(self, x):
        return x.flatten(1) @ self.w.unfold(1, 2, 1).sum(-1)


@pytest.mark.parametrize("kind", [Windows, StridedOfTransposed, UnfoldedWeight])
def test_a_strided_view_is_torchs_on_any_shard(kind):
    torch.manual_seed(0)
    module = kind()
    x, y = torch.randn(BATCH, 2, 5), torch.arange(BATCH) % 3
    spec = model_spec(kind.__name__, module, (x,), y, F.cross_entropy)
    assert any(n[0] == "index_select" for layer in spec.layers for n in layer.unit["unit"]["forward"])
    weights = init_weights(spec, 0)
    load_into(module, {p: w for layer in weights.values() for p, w in layer.items()})
    logits = module(x)
    F.cross_entropy(logits, y).backward()
    for split, sizes in SPLITS.items():
        scores, loss, grads, start = [], 0.0, {}, 0
        for size in sizes:
            rows = slice(start, start + size)
            live, caches = model_forward(spec, x.numpy()[rows], weights,
                                         ShardContext(0, 0, BATCH, rows, True, labels=y.numpy()[rows]))
            scores.append(live[spec.program["logits"]])
            result = model_loss(spec, live, y.numpy()[rows], BATCH)
            loss += result.loss
            for layer in model_backward(spec, result.delta, caches, weights):
                for name, g in layer.items():
                    grads[name] = grads.get(name, 0) + g
            start += size
        np.testing.assert_allclose(np.concatenate(scores), logits.detach().numpy(), rtol=1e-5, atol=1e-6)
        assert loss == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-5), split
        for name, p in module.named_parameters():
            np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{split} {name}")


class _AcrossRows(torch.nn.Module):
    def forward(self, x):
        return x.as_strided((x.shape[0], 10), (5, 1))     # each row reads the next row's start


class _OutsideItsInput(torch.nn.Module):
    def forward(self, x):
        return x[:, 1:3].as_strided((x.shape[0], 3), (5, 1), 1)   # reaches x[:, 3], not the slice's


@pytest.mark.parametrize("module,words", [(_AcrossRows(), "a strided view across the batch's rows"),
                                          (_OutsideItsInput(), "reaches storage outside its input's elements")])
def test_a_strided_view_a_shard_cannot_compute_is_refused_at_its_line(module, words):
    with pytest.raises(CaptureError, match=r"aten\.as_strided.*" + words) as err:
        capture(module, (torch.zeros(4, 5),), torch.zeros(4), lambda out, t: out.sum())
    assert "\n" not in str(err.value) and "test_torch_strided.py:" in str(err.value)
