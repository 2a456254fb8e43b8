"""The Cerebras model zoo's 2.x training flow (its run_cstorch_flow and model shapes), written
here, on the cstorch API: each call it makes, against torch eager.

The model zoo's own run.py is checked from outside by scripts/modelzoo_oracle.py (the model
zoo is not part of this project); these tests keep each API that flow uses honest.

    python -m pytest tests/test_modelzoo_flow.py -q
"""
from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the model zoo's flow trains torch modules; torch is an optional extra")

import cerebras_pytorch as cstorch  # noqa: E402  (after the skip: it needs torch)
from cs_torch import amp  # noqa: E402
from cs_torch.backends import reset_backend  # noqa: E402
from cs_torch.nn import CsTorchError  # noqa: E402
from cs_torch.oracle import torch_dropout_with_run_masks  # noqa: E402
from examples.cstorch import mlp  # noqa: E402

REL = 1e-5
STEPS = 5


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """A new backend per test, and cstorch.amp's process-wide half dtype left as it was."""
    monkeypatch.setattr(amp, "_half", {"dtype": "float16", "enabled": False})
    reset_backend()
    yield
    reset_backend()


class SelfLossMLP(torch.nn.Module):
    """The model zoo's model shape: forward(batch) with batch [inputs, labels] (FC-MNIST) or a
    dict (GPT-2, BERT), returning its own loss (log_softmax + NLLLoss, as FC-MNIST's)."""

    def __init__(self, keyed: bool = False, over_rows: bool = False, dropout: float = 0.0):
        super().__init__()
        self.model = mlp.MLP(hidden=16)
        self.model.fc2 = torch.nn.Sequential(self.model.fc2, torch.nn.Dropout(dropout))
        self.loss_fn = torch.nn.NLLLoss(reduction="sum" if over_rows else "mean")
        self.keyed, self.over_rows = keyed, over_rows

    def forward(self, data):
        inputs, labels = (data["inputs"], data["labels"]) if self.keyed else data
        loss = self.loss_fn(torch.nn.functional.log_softmax(self.model(inputs), dim=1), labels)
        # BERT's masked-LM loss: summed, then divided by the batch size (labels.shape[0])
        return loss / labels.shape[0] if self.over_rows else loss


def zoo_flow(model, batches, backend_kind: str = "CPU", **backend_args):
    """The 2.1 model zoo's run_cstorch_train, cut to what it calls: (losses, logged steps, saved steps)."""
    cstorch.amp.set_half_dtype("float16")              # set_half_dtype_from_params: on every run
    backend = cstorch.backend(backend_kind, artifact_dir="unused", max_checkpoints=None, **backend_args)
    assert backend.is_cpu and not backend.is_gpu and backend.backend_type.name == "CPU"
    with backend.device:
        compiled = cstorch.compile(model, backend)
    compiled.train()
    optimizer_params = {"optimizer_type": "SGD", "learning_rate": 0.05, "momentum": 0.9, "weight_decay": 0.01}
    groups = cstorch.optim.configure_param_groups(model, optimizer_params)
    optimizer = cstorch.optim.configure_optimizer(optimizer_type=optimizer_params.pop("optimizer_type"),
                                                  params=groups, **optimizer_params)
    dataloader = cstorch.utils.data.DataLoader(lambda: batches)
    assert dataloader.is_restartable is False and dataloader.batch_size is None   # a plain list of batches
    saved, logged = [], []

    @cstorch.checkpoint_closure
    def save_checkpoint(step):
        saved.append(step)

    training_step = zoo_training_step(compiled, optimizer)

    @cstorch.step_closure
    def post_training_step(loss, loss_scale):
        logged.append(loss.item())

    cs_config = cstorch.utils.CSConfig(num_csx=None, max_wgt_servers=None, mgmt_namespace=None, job_labels=None,
                                       num_workers_per_csx=None, disable_version_check=False)
    executor = cstorch.utils.data.DataExecutor(dataloader, num_steps=len(batches), checkpoint_steps=len(batches),
                                               cs_config=cs_config, writer=None, listeners=[])
    losses = []
    for step, batch in enumerate(executor, start=1):
        loss, _ = training_step(batch, step)
        post_training_step(loss, None)
        save_checkpoint(step)                          # called every step; saves on checkpoint steps only
        losses.append(loss.item())
    assert executor.profiler.rate_tracker.total_samples == sum(len(b["labels"] if isinstance(b, dict) else b[1])
                                                               for b in batches)
    return losses, logged, saved


def eager_flow(model, batches):
    """torch eager of zoo_flow: SGD with the model zoo's two groups (biases undecayed)."""
    decayed = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    kept = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.SGD([{"params": decayed, "weight_decay": 0.01}, {"params": kept, "weight_decay": 0.0}],
                                lr=0.05, momentum=0.9)
    losses = []
    for batch in batches:
        loss = model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def batches_of(keyed: bool):
    loader = mlp.input_fn(16)
    out = []
    for x, y in loader:
        out.append({"inputs": x, "labels": y} if keyed else [x, y])
        if len(out) == STEPS:
            return out


@pytest.mark.parametrize("keyed", [False, True], ids=["list batch", "dict batch"])
def test_a_model_that_computes_its_own_loss_from_the_batch_trains_as_torch_eager(keyed: bool) -> None:
    torch.manual_seed(0)
    model = SelfLossMLP(keyed)
    reference = copy.deepcopy(model)
    batches = batches_of(keyed)
    losses, logged, saved = zoo_flow(model, batches, mixed_precision=False)
    want = eager_flow(reference, batches)
    assert logged == losses and saved == [STEPS]
    for got, expected in zip(losses, want):
        assert abs(got - expected) <= REL * abs(expected), (losses, want)
    for name, value in reference.state_dict().items():
        assert torch.allclose(model.state_dict()[name], value, rtol=0, atol=1e-6), name


def test_the_cpu_backends_mixed_precision_argument_decides_over_the_half_dtype() -> None:
    """The 2.1 model zoo sets the half dtype on every run and passes `mixed_precision` to its CPU
    backend: False trains in float32 (torch eager's numbers), True in the half dtype."""
    cstorch.amp.set_half_dtype("float16")
    assert amp.precision() == "float32"               # the half dtype alone switches nothing on
    cstorch.backend("CPU", mixed_precision=False)
    assert amp.precision() == "float32"
    reset_backend()
    cstorch.backend("CPU", mixed_precision=True)
    assert amp.precision() == "float16"
    torch.manual_seed(0)
    model = SelfLossMLP()
    reference = copy.deepcopy(model)
    batches = batches_of(False)
    reset_backend()
    half, _, _ = zoo_flow(model, batches, mixed_precision=True)
    want = eager_flow(reference, batches)
    assert max(abs(a - b) / b for a, b in zip(half, want)) > REL     # float16 operands are not float32's


def test_the_emulators_float32_switch_keeps_enabled_mixed_precision_float32(monkeypatch, capsys) -> None:
    """The 2.3+ trainer enables mixed precision for every CSX run; the API's meaning stays the
    default, and CS_EMULATOR_FLOAT32=1 (emulator only) keeps programs in float32, saying so once."""
    monkeypatch.setattr(amp, "_overridden", [])
    cstorch.amp.set_half_dtype("bfloat16")
    cstorch.amp.enable_mixed_precision()
    assert amp.precision() == "bfloat16" and cstorch.amp.get_floating_point_dtype() == torch.bfloat16
    monkeypatch.setenv("CS_EMULATOR_FLOAT32", "1")
    for _ in range(2):
        assert amp.precision() == "float32" and cstorch.amp.get_floating_point_dtype() == torch.float32
    cstorch.backend("CPU", mixed_precision=True)
    assert amp.precision() == "float32"
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "CS_EMULATOR_FLOAT32" in ln]
    assert len(lines) == 1 and "not part of the real API" in lines[0]
    monkeypatch.setenv("CS_EMULATOR_FLOAT32", "0")
    assert amp.precision() == "bfloat16"


def test_visit_torch_tensors_walks_a_batch_in_order() -> None:
    from cerebras_pytorch.utils.nest import recurse_spec, visit_torch_tensors
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    batch = {"x": [a, 3, b], "y": c}
    found = list(visit_torch_tensors(batch, scope=["input"]))
    assert [scope for scope, _ in found] == [["input", "x", "0"], ["input", "x", "2"], ["input", "y"]]
    assert [t for _, t in found] == [a, b, c]
    assert list(recurse_spec(torch.utils._pytree.tree_flatten({"p": [1, 2]})[1])) == [["p", "0"], ["p", "1"]]
    with pytest.raises(ValueError, match="Unknown data structure: 3"):
        list(visit_torch_tensors(batch, strict=True))


def test_the_backend_and_config_as_the_model_zoo_reads_them() -> None:
    config = cstorch.utils.CSConfig(num_csx=None, mgmt_namespace=None, job_labels=None, max_act_per_csx=None,
                                    num_workers_per_csx=None, transfer_processes=None, debug_args=object())
    cluster = config.cluster_config()
    assert (cluster.num_csx, cluster.max_wgt_servers, cluster.num_workers_per_csx) == (1, 24, 0)
    assert cstorch.utils.CSConfig(num_csx=2).cluster_config().num_csx == 2
    backend = cstorch.backend("CSX")
    assert backend.is_csx and backend.backend_type == "CSX" and backend.backend_type.name == "CSX"
    assert str(backend.device) == "CSX"
    backend.device.config.lazy_initialization = False     # the model zoo sets these; nothing changes here
    backend.device.config.drop_data = True
    with backend.device:
        layer = torch.nn.Linear(2, 2)
    assert layer.weight.device.type == "cpu"


def test_summary_writer_base_step_offsets_the_executors_steps(tmp_path) -> None:
    """The model zoo makes its writer with base_step = global_step + 1: a summary of the first step
    after a restart at step 10 is written at step 11."""
    writer = cstorch.utils.tensorboard.SummaryWriter(log_dir=str(tmp_path), base_step=11)
    model = torch.nn.Linear(4, 1)
    compiled = cstorch.compile(model, cstorch.backend("CPU"))

    @cstorch.trace
    def step(x):
        out = compiled(x).sum()
        cstorch.summarize_tensor("out", out)
        return out

    data = [torch.ones(2, 4), torch.zeros(2, 4)]
    for x in cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: data), num_steps=2, writer=writer):
        step(x)
    steps = [d.step for d in cstorch.utils.tensorboard.SummaryReader(str(tmp_path)).read_tensor("out")]
    assert steps == [11, 12]


def zoo_training_step(compiled, optimizer, read_norms: bool = False):
    """The model zoo's training step, traced: `training_step(batch, step)` -> (loss, None), the
    model computing its own loss from the batch (`compiled(batch)`), then backward and the update.
    With `read_norms` the second value is the gradients' norm as the 2.10 trainer's ComputeNorm
    reads it (each parameter's torch.norm, squared and summed), clip_grad_norm_'s return value,
    and the parameters' norm as its ComputeNormGNS reads it before backward (model_wise_params_norm)."""
    def params_norm():
        squares = torch.tensor(0.0)
        for param in compiled.parameters():
            if param.requires_grad:
                squares += torch.pow(torch.norm(param), 2.0)
        return torch.sqrt(squares)

    @cstorch.trace
    def training_step(batch, step):
        loss = compiled(batch)
        weights_norm = params_norm() if read_norms else None
        loss.backward()
        norms = None
        if read_norms:
            squares = torch.tensor(0.0)
            for param in compiled.parameters():
                if param.grad is not None:
                    squares += torch.pow(torch.norm(param.grad), 2.0)
            norms = (torch.sqrt(squares), torch.nn.utils.clip_grad_norm_(list(compiled.parameters()), 1e6),
                     weights_norm)
        optimizer.step()
        optimizer.zero_grad()
        return loss, norms

    return training_step


def eager_grad_norm(model) -> float:
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))


def eager_norms(model) -> list[float]:
    """zoo_training_step's norms of a torch module after backward, before its update."""
    grad_norm = eager_grad_norm(model)
    return [grad_norm, grad_norm, float(torch.nn.utils.get_total_norm(list(model.parameters())))]


def traced_sgd_step(model, lr: float):
    """zoo_training_step with SGD on the CPU backend, as `step(batch)` -> the loss."""
    training_step = zoo_training_step(cstorch.compile(model, cstorch.backend("CPU")),
                                      cstorch.optim.SGD(model.parameters(), lr=lr))
    return lambda batch: training_step(batch, None)[0]


def test_a_loss_divided_by_the_batch_size_trains_as_torch_eager() -> None:
    """...and the gradient norm the step reads (ComputeNorm's way, and clip_grad_norm_'s return
    value) is torch eager's."""
    torch.manual_seed(0)
    model = SelfLossMLP(over_rows=True)
    reference = copy.deepcopy(model)
    batches = batches_of(False)
    step = zoo_training_step(cstorch.compile(model, cstorch.backend("CPU")),
                             cstorch.optim.SGD(model.parameters(), lr=0.05), read_norms=True)

    eager_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for batch in batches:
        loss, norms = step(batch, None)
        got = loss.item()
        want = reference(batch)
        want.backward()
        assert [float(n) for n in norms] == pytest.approx(eager_norms(reference), rel=1e-6)
        eager_optimizer.step()
        eager_optimizer.zero_grad()
        assert abs(got - want.item()) <= REL * want.item()


def test_dropout_in_a_traced_step_draws_the_runs_masks_as_torch_eager_given_them() -> None:
    """The model zoo's models train with dropout as shipped: a traced step draws each site's masks
    from (seed, step, site, sample), the same on the CPU path and every WSE; torch eager given the
    same masks computes the same losses and weights."""
    torch.manual_seed(0)
    model = SelfLossMLP(dropout=0.3)
    reference = copy.deepcopy(model)
    batches = batches_of(False)
    step = traced_sgd_step(model, lr=0.05)

    eager_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    plain = copy.deepcopy(reference)
    for index, batch in enumerate(batches):
        got = step(batch).item()
        with torch_dropout_with_run_masks(index, len(batch[1]), seed=1):
            want = reference(batch)
        want.backward()
        eager_optimizer.step()
        eager_optimizer.zero_grad()
        assert abs(got - want.item()) <= REL * want.item()
    assert plain(batches[0]).item() != reference(batches[0]).item()      # the masks changed the training
    for name, value in reference.state_dict().items():
        assert torch.allclose(model.state_dict()[name], value, rtol=0, atol=1e-6), name


@pytest.mark.cluster
@pytest.mark.parametrize("over_rows, dropout", [(False, 0.0), (True, 0.25)],
                         ids=["mean loss", "sum over the batch size, dropout"])
def test_a_self_loss_model_on_csx_trains_as_torch_eager_and_the_cpu_path(tmp_path, over_rows: bool,
                                                                         dropout: float) -> None:
    """On CSX the step streams [inputs, labels] and the model computes its loss from both (the
    labels are the program's target, read by the model): 1 and 2 WSEs against torch eager; a
    loss summed and divided by the batch size is each shard's over its own rows, weighted. The
    gradient norm the step reads (MemoryX keeps the gradients; its answer has their norms) is
    torch eager's, and so is the parameters' norm it reads (MemoryX's, as each step began; the
    module holds the weights the job began on). A second loop's job starts from the optimizer
    state the first left."""
    torch.manual_seed(0)
    initial = SelfLossMLP(over_rows=over_rows, dropout=dropout).state_dict()
    results = {}
    for num_csx in (1, 2):
        reset_backend()
        model = SelfLossMLP(over_rows=over_rows, dropout=dropout)
        model.load_state_dict(initial)
        backend = cstorch.backend("CSX", artifact_dir=str(tmp_path / f"csx{num_csx}"),
                                  cluster_config=cstorch.distributed.ClusterConfig(num_csx=num_csx))
        compiled = cstorch.compile(model, backend)
        optimizer = cstorch.optim.SGD(model.parameters(), 0.05, momentum=0.9)

        training_step = zoo_training_step(compiled, optimizer, read_norms=True)

        losses, seen, norms = [], [], []
        # On 2 WSEs the steps are two loops, two jobs: the second starts from the momentum the first left.
        for steps in ((STEPS,) if num_csx == 1 else (3, STEPS - 3)):
            executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(mlp.input_fn, 16),
                                                       num_steps=steps)
            for step, batch in enumerate(executor, start=len(losses) + 1):
                seen.append([t.clone() for t in batch])
                loss, read = training_step(batch, step)
                losses.append(loss.item())
                norms.append([float(n) for n in read])
        results[num_csx] = (losses, seen, copy.deepcopy(model.state_dict()), norms)
    for losses, seen, weights, norms in results.values():
        reference = SelfLossMLP(over_rows=over_rows, dropout=dropout)
        reference.load_state_dict(initial)
        optimizer = torch.optim.SGD(reference.parameters(), 0.05, momentum=0.9)
        want = []
        for step, batch in enumerate(seen):
            with torch_dropout_with_run_masks(step, len(batch[1]), seed=1):
                loss = reference(batch)
            loss.backward()
            assert norms[step] == pytest.approx(eager_norms(reference), rel=1e-5)
            optimizer.step()
            optimizer.zero_grad()
            want.append(loss.item())
        for got, expected in zip(losses, want):
            assert abs(got - expected) <= REL * abs(expected), (losses, want)
        for name, value in reference.state_dict().items():
            assert torch.allclose(weights[name], value, rtol=0, atol=1e-5), name


class MaskedTokenLoss(torch.nn.Module):
    """The model zoo's GPT-2 loss (GPTLMHeadModelLoss, num_tokens): per-token cross entropy
    (reduction "none"), masked, summed and divided by the tokens counted."""

    def __init__(self, vocab: int = 50, width: int = 16):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)
        self.vocab = vocab

    def forward(self, data):
        logits = self.head(self.embedding(data["input_ids"]))
        per_token = torch.nn.CrossEntropyLoss(reduction="none")(logits.view(-1, self.vocab),
                                                                 data["labels"].view(-1).long())
        mask = data["attention_mask"].to(dtype=logits.dtype)
        return torch.sum(per_token * mask.view(-1)) / torch.sum(mask)


def test_per_token_cross_entropy_with_a_mask_trains_as_torch_eager() -> None:
    torch.manual_seed(0)
    model = MaskedTokenLoss()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(3):
        mask = (torch.rand(4, 8, generator=gen) > 0.3).to(torch.int32)
        batches.append({"input_ids": torch.randint(0, 50, (4, 8), generator=gen, dtype=torch.int32),
                        "attention_mask": mask,
                        "labels": torch.randint(0, 50, (4, 8), generator=gen, dtype=torch.int32)})
    step = traced_sgd_step(model, lr=0.5)

    got = [step(b).item() for b in batches]
    eager_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for batch, loss in zip(batches, got):
        want = reference(batch)
        want.backward()
        eager_optimizer.step()
        eager_optimizer.zero_grad()
        assert abs(loss - want.item()) <= REL * want.item()
    for name, value in reference.state_dict().items():
        assert torch.allclose(model.state_dict()[name], value, rtol=0, atol=1e-6), name


class CountingLoader(torch.utils.data.DataLoader):
    """The model zoo's RestartableDataLoader protocol: each worker's state from get_worker_state,
    aggregated over the workers, deaggregated and loaded on restart."""

    def state_dict(self):
        return {"samples_streamed": cstorch.distributed.get_worker_state().samples_streamed}

    def aggregate_state_dict(self, worker_states):
        return {"samples_streamed": sum(s["samples_streamed"] for s in worker_states), "seed": 7}

    def deaggregate_state_dict(self, aggregated):
        return {"samples_streamed": aggregated["samples_streamed"]}

    def load_state_dict(self, state):
        self.loaded = state


def test_a_restartable_loaders_state_is_the_samples_streamed() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(40.0).view(20, 2), torch.arange(20))
    loader = cstorch.utils.data.DataLoader(lambda: CountingLoader(data, batch_size=4))
    assert loader.is_restartable and loader.batch_size == 4
    for _ in cstorch.utils.data.DataExecutor(loader, num_steps=3):
        pass
    assert loader.state_dict() == {"samples_streamed": 12, "seed": 7}
    loader.load_state_dict({"samples_streamed": 12, "seed": 7})
    assert loader.loader.loaded == {"samples_streamed": 12}
    with pytest.raises(Exception, match="get_worker_state"):      # outside a loader's state_dict
        cstorch.distributed.get_worker_state()
    plain = cstorch.utils.data.DataLoader(lambda: torch.utils.data.DataLoader(data, batch_size=4))
    with pytest.raises(Exception, match="not restartable"):
        plain.state_dict()
    spec = cstorch.distributed.cluster_resolver.ClusterSpec(
        tasks=[cstorch.distributed.cluster_resolver.TaskSpec(0, 0, 0)])
    assert spec.num_tasks() == 1


SPARSE = [r".*fc1\.weight", r".*out\.weight"]


def test_static_sparsity_trains_as_torch_eager_with_its_masks() -> None:
    """The 2.1 flow's three calls (configure_sparsity_optimizer on the params file's section, hook_module,
    SparsityWrapperOptimizer) against torch eager with the same masks on the weights and their gradients:
    SGD with momentum and weight decay, so the masked weights and momentum must stay 0."""
    torch.manual_seed(0)
    model = SelfLossMLP()
    reference = copy.deepcopy(model)
    compiled = cstorch.compile(model, cstorch.backend("CPU"))
    optimizer = cstorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    sparsity = cstorch.sparse.configure_sparsity_optimizer("static", model.named_parameters(), sparsity=0.75,
                                                           init_method="random", param_name_patterns=SPARSE)
    sparsity.hook_module(model)
    optimizer = cstorch.sparse.SparsityWrapperOptimizer(optimizer, sparsity)
    sparsity.initialize_sparsity()                     # the flow's call, after loading a checkpoint if any
    masks = {name: sparsity.masks[p] for name, p in sparsity.params}
    assert sorted(masks) == ["model.fc1.weight", "model.out.weight"]
    assert all(int(m.sum()) == round(0.25 * m.numel()) for m in masks.values())

    @cstorch.trace
    def training_step(batch):
        loss = compiled(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    batches = batches_of(False)
    executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: batches), num_steps=STEPS)
    losses = [training_step(batch).item() for batch in executor]

    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name in masks:
                p.mul_(masks[name])
                p.register_hook(lambda grad, mask=masks[name]: grad * mask)
    eager = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    want = []
    for batch in batches:
        loss = reference(batch)
        loss.backward()
        eager.step()
        eager.zero_grad()
        want.append(loss.item())
    np.testing.assert_allclose(losses, want, rtol=REL)
    state = model.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.allclose(state[name], value, rtol=0, atol=1e-6), name
        if name in masks:
            assert not state[name][~masks[name]].any()
            assert not optimizer.state[model.get_parameter(name)]["momentum_buffer"][~masks[name]].any()


def test_what_sparsity_cannot_do_here_is_one_line() -> None:
    from cs_torch.cluster_step import memoryx_optimizer
    model = torch.nn.Linear(4, 4)
    with pytest.raises(cstorch.CsTorchError, match=r"^sparse: dynamic sparsity \(rigl\) is not emulated"):
        cstorch.sparse.configure_sparsity_optimizer("rigl", model.named_parameters(), sparsity=0.5,
                                                    param_name_patterns="weight")
    with pytest.raises(cstorch.CsTorchError, match="give param_name_patterns"):
        cstorch.sparse.configure_sparsity_optimizer("static", model.named_parameters(), sparsity=0.5)
    wrapped = cstorch.sparse.configure_sparsity_wrapper(model, cstorch.optim.SGD(model.parameters(), lr=0.1),
                                                        "static", sparsity=0.5, param_name_patterns="weight")
    assert not (model.weight == 0).any()             # the masks are drawn at the module's first call
    model(torch.ones(1, 4))
    assert int((model.weight == 0).sum()) == 8
    with pytest.raises(cstorch.CsTorchError, match="^CSX backend: weight sparsity is not emulated on CSX"):
        memoryx_optimizer(wrapped)


def test_a_gradient_on_csx_gives_its_norm_as_torch_reads_it_and_nothing_else() -> None:
    """On CSX a step's gradients stay in MemoryX and the step's answer carries each one's norm:
    inside the step p.grad reads as that norm the ways torch computes one, and fails in one line
    where the values are needed."""
    from cs_torch.csx_grads import GradientNorm, norm_grads
    param = torch.nn.Parameter(torch.ones(3, 4))
    param.grad = GradientNorm(param.detach(), 5.0)
    grad = param.grad
    assert tuple(grad.shape) == (3, 4) and grad.dtype == torch.float32
    for read in (torch.norm(grad), grad.norm(), torch.linalg.vector_norm(grad), torch.norm(grad, p=2)):
        assert float(read) == 5.0
    assert float(torch.pow(grad, 2.0).sum()) == 25.0 and float(torch.sum(grad ** 2)) == 25.0
    for values_needed in (lambda g: g * 2, lambda g: g.norm(p=1), lambda g: g.sum(), lambda g: g.abs(),
                          lambda g: g.data, lambda g: g.item()):
        with pytest.raises(CsTorchError, match="stay in MemoryX"):
            values_needed(grad)
    torch.optim.SGD([param], lr=0.1).zero_grad(set_to_none=False)     # the rerun's gradients end
    assert float(torch.norm(param.grad)) == 0.0
    tied = torch.nn.Parameter(torch.ones(2))       # one parameter under two program names
    grads = norm_grads({"embedding.weight": tied, "head.weight": tied, "w": param}, {"head.weight": 1.0, "w": 2.0})
    assert {float(g.grad_norm) for g in grads.values()} == {1.0, 2.0} and len(grads) == 2
    with pytest.raises(CsTorchError, match="no gradient norm of w"):
        norm_grads({"w": param}, {})


def test_a_parameter_on_csx_gives_its_norm_as_the_step_began_and_nothing_else() -> None:
    """On CSX the weights stay in MemoryX: inside a step's rerun a parameter's 2-norm is the one
    the answer carries; another reading of its values, or a norm after optimizer.step(), fails in one line."""
    from cs_torch.csx_grads import WeightNorms
    from cs_torch.recording import _active
    from cs_torch.tracing import _Replay
    param, other = torch.nn.Parameter(torch.ones(3, 4)), torch.nn.Parameter(torch.ones(2))
    replay = _Replay(None, effects=[])
    _active["replay"] = replay
    try:
        with WeightNorms({"w": param, "v": other}, {"w": 5.0}):
            for read in (torch.norm(param), param.norm(), torch.linalg.vector_norm(param)):
                assert float(read) == 5.0
            assert float(torch.pow(param, 2.0).sum()) == 25.0 and float(torch.norm(other)) == pytest.approx(2.0 ** 0.5)
            with pytest.raises(CsTorchError, match="other than its 2-norm"):
                param.norm(p=1)
            cstorch.optim.SGD([param], lr=0.1).step()
            with pytest.raises(CsTorchError, match="after optimizer.step"):
                torch.norm(param)
    finally:
        _active["replay"] = None
    assert float(torch.norm(param)) == pytest.approx(12 ** 0.5)

