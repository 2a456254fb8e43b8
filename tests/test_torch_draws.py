"""torch.rand, randn, randperm and their _like forms in a captured model: drawn anew each
step from the run's context (ops.py `draw`), a sample's draws the same whichever shard
holds it; torch eager fed the run's draws (cs_torch/oracle.py) is the oracle. Two WSEs
against the CPU path: tests/test_torch_shards.py's cluster run, whose model adds
randn_like noise. The op's own numbers (moments, independence, shard splits):
tests/test_draws.py. Marked cluster: each capture costs a torch.export."""
import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="capturing a torch model needs torch (an optional extra)")
F = torch.nn.functional

from cs_runtime.numerics.model import ShardContext, init_weights, model_forward  # noqa: E402
from cs_torch.capture import CaptureError, capture, model_spec  # noqa: E402
from cs_torch.oracle import torch_random_with_run_draws  # noqa: E402
from tests import torch_models  # noqa: E402
from tests.test_torch_programs import assert_weights_match_module, train_cpu_path, train_torch  # noqa: E402

pytestmark = pytest.mark.cluster
BATCH = 8
SPLITS = {"whole": [8], "halves": [4, 4], "uneven": [3, 5], "rows": [1] * 8}


def test_each_draw_follows_the_shard_is_fresh_each_step_and_is_what_torch_is_fed():
    torch.manual_seed(0)
    module = torch_models.Draws()
    x, y = np.random.default_rng(1).standard_normal((BATCH, 6)).astype(np.float32), np.arange(BATCH) % 3
    spec = model_spec("draws", module, (torch.from_numpy(x),), torch.from_numpy(y), F.cross_entropy)
    draws = [n for layer in spec.layers for n in layer.unit["unit"]["forward"] if n[0] == "draw"]
    assert len(draws) == 5
    weights = init_weights(spec, 0)

    def logits(rows, step=2):
        live, _ = model_forward(spec, x[rows], weights, ShardContext(0, step, BATCH, rows, True, labels=y[rows]))
        return live[spec.program["logits"]]
    whole = logits(slice(0, BATCH))
    for split, sizes in SPLITS.items():
        starts = np.cumsum([0, *sizes])
        shards = np.concatenate([logits(slice(a, b)) for a, b in zip(starts[:-1], starts[1:])])
        np.testing.assert_allclose(shards, whole, rtol=1e-6, atol=1e-6, err_msg=split)
    assert np.abs(logits(slice(0, BATCH), step=3) - whole).max() > 0.1   # a new step, new draws
    with torch.no_grad(), torch_random_with_run_draws(2, seed=0):
        want = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(whole, want, rtol=1e-5, atol=1e-6)


def test_a_vae_trains_on_the_cpu_path_with_torchs_numbers_given_the_runs_draws():
    """The reparameterisation z = mu + sigma * randn_like(mu), 20 SGD steps: the CPU path against
    torch eager fed each step's draws, loss at every step and every weight within 1e-5."""
    torch.manual_seed(0)
    module = torch_models.VAE()
    rng = np.random.default_rng(3)
    batches = [(x, x) for x in (rng.standard_normal((BATCH, 12)).astype(np.float32) for _ in range(20))]
    spec = model_spec("vae", module, (torch.from_numpy(batches[0][0]),), torch.from_numpy(batches[0][1]),
                      torch_models.vae_loss)
    eager, fixed = (torch_models.VAE() for _ in range(2))
    eager.load_state_dict(module.state_dict())
    fixed.load_state_dict(module.state_dict())
    ours, weights = train_cpu_path(spec, batches, "sgd")
    with contextlib.ExitStack() as draws:
        def at(step):   # step's draws, as the run drew them
            draws.close()
            draws.enter_context(torch_random_with_run_draws(step, seed=0))
        theirs = train_torch(eager, torch_models.vae_loss, batches, "sgd", before_step=at)
        stale = train_torch(fixed, torch_models.vae_loss, batches, "sgd", before_step=lambda step: at(0))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert_weights_match_module(weights, eager)
    assert np.abs(np.array(stale) - np.array(theirs)).max() > 1e-3   # step 0's draws every step end elsewhere


class _Permuted(torch.nn.Module):
    def forward(self, x):
        return x[torch.randperm(x.shape[0])]


class _Noisy(torch.nn.Module):
    def __init__(self, noise):
        super().__init__()
        self.fc, self.noise = torch.nn.Linear(4, 3), noise

    def forward(self, x):
        return self.fc(x) + self.noise(x)


@pytest.mark.parametrize("module,dropout,words", [
    (_Permuted(), True, r"aten\.randperm.*a permutation of the batch's rows"),
    (_Noisy(lambda x: torch.randn(x.shape[0], 3)), False, r"aten\.randn.*a 1\.x loop feeds no run context"),
])
def test_what_a_shard_or_a_loop_cannot_draw_is_refused_in_one_line(module, dropout, words):
    with pytest.raises(CaptureError, match=words) as err:
        capture(module, (torch.zeros(4, 4),), torch.zeros(4, dtype=torch.long),
                lambda out, t: out.float().sum(), dropout=dropout)
    assert "\n" not in str(err.value) and "test_torch_draws.py:" in str(err.value)
