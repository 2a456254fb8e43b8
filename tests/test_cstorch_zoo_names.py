"""The rest of the names the model zoo's own code references (Release_2.1.1 and the newest release),
each against torch eager or the real API's documented behaviour. Cheap: no process, tiny tensors.

    python -m pytest tests/test_cstorch_zoo_names.py -q
"""
from __future__ import annotations

import pytest

try:   # imported here, at collection: h5py's import runs `uname -p`, which a test may not start
    import h5py
except ImportError:
    h5py = None

torch = pytest.importorskip("torch", reason="cs_torch's 2.x API takes torch modules (pip install -e '.[torch]')")

import cerebras.pytorch as cstorch  # noqa: E402  (after the skip: it needs torch)
from cs_torch.backends import reset_backend  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_backend")   # tests/conftest.py


# ---------------------------------------------------------------- nn, distributed, storage
@pytest.mark.parametrize("beta", [1.0, 0.3, 0.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_smooth_l1_loss_is_torchs(beta, reduction) -> None:
    x = torch.tensor([[0.1, -2.0, 0.5], [3.0, 0.2, -0.05]], requires_grad=True)
    target = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.1]])
    ours = cstorch.nn.SmoothL1Loss(reduction=reduction, beta=beta)(x, target)
    theirs = torch.nn.SmoothL1Loss(reduction=reduction, beta=beta)(x, target)
    torch.testing.assert_close(ours, theirs)
    (g_ours,) = torch.autograd.grad(ours.sum(), x)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), x)
    torch.testing.assert_close(g_ours, g_theirs)
    with pytest.raises(ValueError, match="beta must be non-negative"):
        cstorch.nn.SmoothL1Loss(beta=-1.0)


def test_ranks_are_torch_distributeds_or_one_process() -> None:
    assert torch.distributed.is_initialized() is False
    assert (cstorch.distributed.get_rank(), cstorch.distributed.get_world_size()) == (0, 1)


def test_checkpoint_constants_and_serializer_switches(tmp_path) -> None:
    if h5py is None:
        pytest.skip("the model zoo's HDF5 checkpoints need h5py (pip install 'cs-emulator[hdf5]')")
    path = tmp_path / "c.mdl"
    switches = cstorch.storage.serializers
    assert not switches.use_external_link and switches.cache_deferred_tensors     # the real defaults
    with switches.use_external_link(True), switches.cache_deferred_tensors(False):
        assert switches.use_external_link and not switches.cache_deferred_tensors
        cstorch.storage.save({"model": {"w": torch.arange(4.0)}}, str(path))
    assert not switches.use_external_link and switches.cache_deferred_tensors     # restored after the block
    with h5py.File(path, "r") as f:   # no tensor is deferred here: the values are in the file
        assert f.attrs[cstorch.storage.constants.__CSTORCH_VERSION__] == cstorch.__version__
        assert list(f["model.w"][()]) == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(TypeError, match="use_external_link"):
        with switches.use_external_link("yes"):
            pass
    import cerebras_pytorch
    assert cerebras_pytorch.saver.pt_h5_saver.PyTorchH5Saver is cstorch.storage.PyTorchH5Saver


# ---------------------------------------------------------------- utils.data.DistributedSampler, benchmark
class _Numbers(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)])


def test_distributed_sampler_order_is_the_documented_one() -> None:
    data = _Numbers(10)
    sampler = cstorch.utils.data.DistributedSampler(data, shuffle=True, seed=7, batch_size=4)
    first, second = list(sampler), list(sampler)
    g = torch.Generator()
    epoch0 = torch.randperm(10, generator=g.manual_seed(7)).tolist()
    epoch1 = torch.randperm(10, generator=g.manual_seed(8)).tolist()
    assert first == [epoch0[0:4], epoch0[4:8]]
    assert second == [epoch0[8:10] + epoch1[0:2], epoch1[2:6], epoch1[6:10]]   # the leftovers open epoch 1
    restarted = cstorch.utils.data.DistributedSampler(data, shuffle=True, seed=7, start_index=13)
    assert list(restarted) == epoch1[3:]                         # 13 samples streamed: epoch 1, index 3
    padded = cstorch.utils.data.DistributedSampler(data, shuffle=False, batch_size=4, drop_last=False, pad_last=True)
    assert list(padded)[-1] == [8, 9, -1, -1]
    longer = cstorch.utils.data.DistributedSampler(data, shuffle=False, num_samples=12)
    assert list(longer) == list(range(10)) + [0, 1]
    loader = torch.utils.data.DataLoader(data, batch_sampler=cstorch.utils.data.DistributedSampler(
        data, shuffle=False, batch_size=5))
    assert [b.flatten().tolist() for b in loader] == [[0.0, 1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0, 9.0]]
    cstorch.backend("CSX")
    with pytest.raises(ValueError, match="drop_last=True or pad_last=True"):
        cstorch.utils.data.DistributedSampler(data, batch_size=4, drop_last=False, seed=1)


def test_benchmark_dataloader_counts_steps_and_batch_structures(capsys) -> None:
    def input_fn():
        return torch.utils.data.DataLoader(_Numbers(10), batch_size=4)   # batches of 4, 4 and 2
    metrics = cstorch.utils.benchmark.benchmark_dataloader(input_fn, num_epochs=2, sampling_frequency=2)
    assert metrics.total_steps == 6 and not metrics.is_partial
    assert [e.total_steps for e in metrics.epoch_metrics] == [3, 3]
    assert [b.epoch_step for b in metrics.epoch_metrics[0].batch_metrics] == [1, 2]
    assert sorted(o.count for o in metrics.batch_specs.values()) == [2, 4]
    assert metrics.global_sample_rate is None and metrics.global_rate > 0      # two structures: no sample rate
    assert "Total steps: 6" in capsys.readouterr().out
    capped = cstorch.utils.benchmark.benchmark_dataloader(input_fn, steps_per_epoch=2, print_metrics=False)
    assert capped.total_steps == 2 and capped.global_sample_rate == pytest.approx(4 * capped.global_rate)
    with pytest.raises(ValueError, match="not emulated"):
        cstorch.utils.benchmark.benchmark_dataloader(input_fn, profile_activities=["memory_uss"])


# ---------------------------------------------------------------- nn.SelectiveGrad
def eager_selective_steps(model, make_optimizer, masks: dict, batches,
                          loss_fn=torch.nn.functional.mse_loss) -> list[float]:
    """The real API's arithmetic in torch eager: gradient masked; before the step the parameter and its
    state masked, after it the entries outside the mask added back. Each step's loss."""
    optimizer = make_optimizer(model.parameters())
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        held = {}
        with torch.no_grad():
            for p, mask in masks.items():
                p.grad.mul_(mask)
                held[p] = torch.where(mask, torch.zeros_like(p), p)
                p.mul_(mask)
                for s in optimizer.state[p].values():
                    if isinstance(s, torch.Tensor) and s.shape == p.shape:
                        s.mul_(mask)
        optimizer.step()
        with torch.no_grad():
            for p in masks:
                p.add_(held[p])
    return losses


@pytest.mark.parametrize("rule", ["sgd", "adamw"])
def test_selective_grad_trains_only_the_masked_entries_as_the_real_api(rule) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    eager = __import__("copy").deepcopy(model)
    batches = [(torch.randn(4, 6), torch.randn(4, 2)) for _ in range(3)]
    with pytest.raises(TypeError):                     # torch's apply wants a callable, as before compile
        model.apply(cstorch.nn.SelectiveGrad("0.weight", lambda p: p.abs() > 0.2))
    cstorch.compile(model, cstorch.backend("CPU"))     # compiled: apply hands the object the whole model
    model.apply(cstorch.nn.SelectiveGrad("0.weight", lambda p: p.abs() > 0.2))
    mask = model[0].weight_requires_grad
    assert "0.weight_requires_grad" in model.state_dict() and 0 < int(mask.sum()) < mask.numel()
    start = model[0].weight.detach().clone()
    ours = {"sgd": lambda ps: cstorch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
            "adamw": lambda ps: cstorch.optim.AdamW(ps, lr=0.05, weight_decay=0.1)}[rule](model.parameters())
    for x, y in batches:
        ours.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        ours.step()
    theirs = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
              "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, eps=1e-6)}[rule]
    eager_selective_steps(eager, theirs, {eager[0].weight: mask}, batches)
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(model[0].weight[~mask], start[~mask])          # outside the mask: untouched
    assert not torch.equal(model[0].weight[mask], start[mask])
    state = ours.state[model[0].weight]
    moments = state["momentum_buffer" if rule == "sgd" else "exp_avg"]
    assert torch.all(moments[~mask] == 0)


def test_selective_grad_outlier_mask_and_refusal() -> None:
    layer = torch.nn.Linear(50, 4)
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(-1, 1, 200).reshape(4, 50))
    cstorch.nn.SelectiveGrad("weight").apply(layer)
    magnitude = layer.weight.detach().abs()
    assert torch.equal(layer.weight_requires_grad, magnitude >= 2.25 * magnitude.std(dim=0, keepdim=True))
    with pytest.raises(ValueError, match="unknown init_method 'top'"):
        cstorch.nn.SelectiveGrad("weight", "top")


# ---------------------------------------------------------------- profiler
def _profiled_loop(tmp_path, start_step: int, end_step: int, backend: str = "CPU"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    compiled = cstorch.compile(model, cstorch.backend(backend))
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.1)

    @cstorch.trace
    def step(x, y):
        loss = torch.nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def input_fn():
        data = torch.utils.data.TensorDataset(torch.randn(12, 4), torch.randint(0, 2, (12,)))
        return torch.utils.data.DataLoader(data, batch_size=4, drop_last=True)

    with cstorch.profiler.profile(schedule=cstorch.profiler.schedule(start_step=start_step, end_step=end_step),
                                  on_trace_ready=cstorch.profiler.tensorboard_trace_handler(str(tmp_path))) as prof:
        for x, y in cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(input_fn), num_steps=3):
            step(x, y)
    return prof


def test_profile_times_the_modules_of_the_steps_asked_for(tmp_path) -> None:
    import json
    prof = _profiled_loop(tmp_path, 2, 3)
    names = [e["name"] for e in prof.events]
    units = sorted(set(names))
    assert names.count(units[0]) == 2 and len(names) == 2 * len(units)     # once a step, steps 2 and 3
    assert any(n.endswith("(backward)") for n in units) and any(not n.endswith("(backward)") for n in units)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in prof.events)
    written = list(tmp_path.glob("*.pt.trace.json"))                      # on_trace_ready's handler wrote it
    assert len(written) == 1 and len(json.loads(written[0].read_text())["traceEvents"]) == len(names)
    prof.export_chrome_trace(tmp_path / "chrome_trace.json")
    assert json.loads((tmp_path / "chrome_trace.json").read_text())["traceEvents"][0]["ph"] == "X"
    summary = prof.get_summary().splitlines()
    assert summary[0].startswith("PYTORCH MODULE NAME") and len(summary) == 1 + min(10, len(units))
    assert cstorch.profiler.ProfilerRegistry.get_profiler() is None          # unregistered on leaving


def test_profile_checks_its_steps_and_is_one_at_a_time(tmp_path) -> None:
    assert _profiled_loop(tmp_path, -1, -1).events == []                    # -1: not asked
    with pytest.raises(ValueError, match="between 1 and 3, got 2:5"):
        _profiled_loop(tmp_path, 2, 5)
    with pytest.raises(ValueError, match="must not be after end_step"):
        cstorch.profiler.schedule(start_step=3, end_step=2)
    with cstorch.profiler.profile(schedule=cstorch.profiler.schedule(start_step=1, end_step=1)):
        with pytest.raises(RuntimeError, match="already active"):
            cstorch.profiler.profile(schedule=cstorch.profiler.schedule(start_step=1, end_step=1)).__enter__()


@pytest.mark.cluster
def test_profile_times_the_modules_of_a_csx_run_on_its_wse(tmp_path, monkeypatch) -> None:
    """On CSX the job records its timeline; the first WSE's forward and backward spans of each layer (a
    module of the captured program) in the steps asked for are the profile: the CPU run's events."""
    import json
    monkeypatch.chdir(tmp_path)
    cpu = _profiled_loop(tmp_path / "cpu", 2, 3)
    reset_backend()
    csx = _profiled_loop(tmp_path / "csx", 2, 3, backend="CSX")
    assert sorted(e["name"] for e in csx.events) == sorted(e["name"] for e in cpu.events) and csx.events
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in csx.events)
    written = list((tmp_path / "csx").glob("*.pt.trace.json"))
    assert len(written) == 1 and len(json.loads(written[0].read_text())["traceEvents"]) == len(csx.events)
    assert csx.get_summary().splitlines()[0].startswith("PYTORCH MODULE NAME")
    assert csx.events[-1]["ts"] > csx.events[0]["ts"]      # two steps, in order


# ---------------------------------------------------------------- nn.functional's sparse matmuls
def test_sparse_matmul_is_each_chosen_experts_matmul() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 2, 5, requires_grad=True)                  # (B, M, C chosen experts, N)
    indices = torch.tensor([[[0, 3], [2, 1], [3, 0]], [[1, 2], [0, 1], [2, 3]]])
    weight = torch.randn(4, 4, 5, requires_grad=True)                # (K, E experts, N)
    out = cstorch.nn.functional.sparse_matmul(x, indices, weight)
    expected = torch.stack([torch.stack([torch.stack([weight[:, indices[b, m, c]] @ x[b, m, c] for c in range(2)])
                                         for m in range(3)]) for b in range(2)])
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.square().sum(), (x, weight))
    torch.testing.assert_close(grads, torch.autograd.grad(expected.square().sum(), (x, weight)))


def test_sparse_act_matmul_is_the_masked_linear() -> None:
    torch.manual_seed(0)
    x, weight = torch.randn(2, 4, 3), torch.randn(5, 3)
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 1, 0]], dtype=torch.int16)
    out = cstorch.nn.functional.sparse_act_matmul(x, mask, weight, dense_capacity=3)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight) * mask[..., None])
    with pytest.raises(ValueError, match="must agree"):
        cstorch.nn.functional.sparse_act_matmul(x, mask[:, :3], weight)


# ---------------------------------------------------------------- cirh's sampling kernels
def _nucleus_sample(probs: torch.Tensor, k: int, p: float, u: float) -> int:
    """Top-k then top-p sampling of one row, written plainly: the documented rule."""
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))[:k]
    kept, ahead = [], 0.0
    for i in order:
        if kept and ahead >= p:
            break
        kept.append(i)
        ahead += float(probs[i])
    target, running = u * sum(float(probs[i]) for i in kept), 0.0
    for i in kept:
        running += float(probs[i])
        if running > target:
            return i
    return kept[-1]


def test_fused_top_k_and_top_p_sample_the_nucleus() -> None:
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(6, 20), dim=-1)
    p = torch.tensor([[0.9], [0.5], [1.0], [0.01], [0.7], [0.95]])
    u = torch.tensor([[0.3], [0.99], [0.0], [0.5], [0.8], [1.0]])
    k = torch.tensor([[5], [8], [1], [8], [8], [3]], dtype=torch.int32)
    with torch.no_grad():
        fused = cstorch.cirh.FusedTopK(probs, k=8, dimension=1)
        tokens = cstorch.cirh.FusedTopP(fused, p=p, u=u, k=k)
    top = torch.topk(probs, 8, dim=1)
    torch.testing.assert_close(fused[..., 0], top.values)
    assert torch.equal(fused[..., 1].long(), top.indices) and tokens.shape == (6, 1)
    expected = [_nucleus_sample(probs[b], int(k[b]), float(p[b]), float(u[b])) for b in range(6)]
    assert tokens.flatten().tolist() == expected
    assert tokens[2, 0] == probs[2].argmax() and tokens[3, 0] == probs[3].argmax()   # k = 1; p below the top
    with pytest.raises(RuntimeError, match="no gradient"):
        cstorch.cirh.FusedTopK(probs.requires_grad_(), k=2, dimension=1)


# ---------------------------------------------------------------- experimental
def test_loop_iteration_slice_gathers_the_loops_position() -> None:
    hidden = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)        # (B, S, H)
    index = torch.tensor([[1], [4]], dtype=torch.int32)                             # (B, 1): one position a row
    sliced = cstorch.experimental.get_loop_iteration_slice(hidden, index)
    assert torch.equal(sliced, torch.stack([hidden[0, 1:2], hidden[1, 4:5]]))
    tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
    assert cstorch.experimental.get_loop_iteration_slice(tokens, torch.tensor([[2], [0]])).tolist() == [[7], [8]]


def test_implicit_loops_refused_as_the_real_cpu_backend_refuses_them() -> None:
    ids = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="expected -1 <= loop_dim < 2, got 2"):
        cstorch.experimental.start_implicit_loop(ids, loop_dim=2)
    with pytest.raises(NotImplementedError, match="^cstorch.experimental.start_implicit_loop: .* on the CPU backend"):
        cstorch.experimental.start_implicit_loop(ids, loop_dim=1)
    cstorch.backend("CSX")
    with pytest.raises(NotImplementedError, match="update_implicit_loop: .* on the CSX backend .*no inner loop"):
        cstorch.experimental.update_implicit_loop(ids, ids[:, :1], ids[:, :1], torch.tensor([[2]]), 1)
    import cerebras_pytorch
    with pytest.raises(NotImplementedError, match="run_implicit_autoregressive_loop"):
        cerebras_pytorch.experimental.run_implicit_autoregressive_loop(ids, ids, loop_dim=1, start_token=1)


def test_compression_marks_the_matching_weights_and_leaves_cpu_values_alone() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    x = torch.randn(2, 3)
    before = model(x)
    cstorch.experimental.Compression("mx8-e4m3", ["0.weight", "1.*"]).apply(model)
    assert torch.equal(model(x), before)                                 # the CPU backend drops the mark
    from cs_torch.experimental.compression import compressed
    assert compressed(model.named_parameters()) == {"0.weight": "mx8-e4m3", "1.weight": "mx8-e4m3",
                                                    "1.bias": "mx8-e4m3"}
    with pytest.raises(ValueError, match="format must be one of"):
        cstorch.experimental.Compression("fp8", "*")


def test_create_listener_checks_a_params_entry() -> None:
    import cerebras_pytorch
    listener = cerebras_pytorch.experimental.listener.create_listener(
        listener_type="norm", listener_name="grads", tensor_names=["*.fc*"])
    assert (listener.listener_type, listener.listener_name, listener.tensor_names) == ("norm", "grads", ["*.fc*"])
    with pytest.raises(ValueError, match="listener_type must be one of"):
        cerebras_pytorch.experimental.listener.create_listener(listener_type="dump", listener_name="x",
                                                               tensor_names="*")
