"""The names of the real cerebras.pytorch / cerebras.appliance API that the 2.10 model zoo's trainer
(cerebras.modelzoo.trainer) calls, each against torch eager or the real API's documented meaning.
scripts/modelzoo_oracle.py runs the model zoo's own trainer; these hold the contracts it relies on.

    python -m pytest tests/test_cstorch_trainer_api.py -q
"""
from __future__ import annotations

import copy
import inspect
import json
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="cs_torch's 2.x API takes torch modules (pip install -e '.[torch]')")

import cerebras.pytorch as cstorch  # noqa: E402  (after the skip: it needs torch)


pytestmark = pytest.mark.usefixtures("fresh_backend")   # tests/conftest.py


# ---------------------------------------------------------------- a traced method, against torch eager
class _Trainer:
    """The trainer's shape: @cstorch.trace on a method that clips the gradients (its precision callback)
    and logs through a step closure."""

    def __init__(self, model, max_norm):
        self.compiled = cstorch.compile(model, cstorch.backend("CPU"))
        self.optimizer = cstorch.optim.SGD(model.parameters(), lr=0.5)
        self.max_norm, self.logged = max_norm, []

    @cstorch.step_closure
    def log(self, loss, grad_norm):
        self.logged.append((float(loss), float(grad_norm)))

    @cstorch.trace
    def training_step(self, batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.compiled(x), y)
        loss.backward()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grad_norm = torch.tensor(0.0)      # as the trainer's ComputeNorm computes it
        for p in params:
            if p.grad is not None:
                grad_norm = grad_norm + torch.sum(p.grad ** 2)
        grad_norm = torch.sqrt(grad_norm)
        torch.nn.utils.clip_grad_norm_(params, self.max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.log(loss, grad_norm)
        return loss


def test_a_traced_method_clips_as_torch_and_hands_its_tensors_to_the_hooks():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    twin = copy.deepcopy(model)
    batches = [(torch.randn(8, 4) * 5, torch.randn(8, 3)) for _ in range(3)]
    seen, traced_names = [], []
    host_hook = cstorch.backend.ltc_backend.register_after_tensor_to_cpu(lambda t, name: seen.append(name))
    from cerebras.pytorch.experimental.listener import register_traced_tensor_hook
    listener = register_traced_tensor_hook(lambda t, name: traced_names.append((name, tuple(t.shape))))
    try:
        trainer = _Trainer(model, max_norm=0.1)
        for batch in batches:
            trainer.training_step(batch)
    finally:
        host_hook.remove()
        listener.remove()
    eager = torch.optim.SGD(twin.parameters(), lr=0.5)
    want = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(twin(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(twin.parameters()), 0.1)
        assert norm > 0.1          # the clipping is exercised
        eager.step()
        eager.zero_grad()
        want.append((loss.item(), norm.item()))
    np.testing.assert_allclose(trainer.logged, want, rtol=1e-6)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, twin.state_dict()[name], rtol=1e-6, atol=1e-7)
    assert seen == ["1", "2"] * 3     # the closure's tensors each step, named by their place (self is 0)
    assert traced_names == [("Linear", (8, 3))]   # the capture names the root module's output (by its type) once
    assert isinstance(_Trainer.__dict__["training_step"], type(trainer.training_step))   # one capture per instance


def test_clip_grad_value_inside_a_traced_step_is_refused_in_one_line():
    model = torch.nn.Linear(2, 1)
    compiled = cstorch.compile(model, cstorch.backend("CPU"))

    @cstorch.trace
    def step(x):
        compiled(x).sum().backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)

    with pytest.raises(cstorch.CsTorchError, match="^trace: clip_grad_value_ inside a traced step is not emulated"):
        step(torch.ones(2, 2))


# ---------------------------------------------------------------- utils
def test_schedule_ranges_as_the_trainer_reads_them():
    Schedule = cstorch.utils.data.utils.Schedule
    every = Schedule.Range(start=4, step=5, end=17, include_last=True)
    assert list(every) == [4, 9, 14, 16] and len(every) == 4 and list(every.range()) == [4, 9, 14]
    assert every.next_immediate_step(0) == 4 and every.next_immediate_step(5) == 9 and every.next_immediate_step(9) == 9
    schedule = Schedule([every, 2])
    assert [i for i in range(20) if i in schedule] == [2, 4, 9, 14, 16]
    from dataclasses import asdict
    assert asdict(schedule)["ranges"][0] == {"start": 4, "end": 17, "step": 5, "include_last": True}
    with pytest.raises(ValueError, match="step must be a positive integer"):
        Schedule.Range(start=0, step=0)


def test_infer_batch_size_and_the_glob_filters():
    infer = cstorch.utils.data.utils.infer_batch_size
    assert infer({"x": torch.ones(3, 2), "y": [torch.ones(3)]}) == 3 and infer({"n": 1}) is None
    with pytest.raises(ValueError, match="disagree on dim 0"):
        infer((torch.ones(3), torch.ones(4)))
    from cerebras.pytorch.utils.utils import convert_glob_to_regex, make_param_filter
    picks = make_param_filter(["*decoder*ffn.ffn.[!1]*weight", "*embedding*weight"])
    assert picks("decoder.layers.0.ffn.ffn.0.linear.weight", None)
    assert not picks("decoder.layers.0.ffn.ffn.1.linear.weight", None) and picks("embedding.weight", None)
    assert convert_glob_to_regex("*.bias").search("layer.bias") and not convert_glob_to_regex("*.bias").search("bias2")


def test_each_dataloader_has_an_id_of_its_own():
    """The trainer names a validation loader's stage and name scope by its id."""
    first, second = (cstorch.utils.data.DataLoader(lambda: [1]) for _ in range(2))
    assert isinstance(first.id, int) and first.id != second.id


def test_call_once_and_the_rate_tracker():
    calls = []

    @cstorch.utils.call_once.call_once()
    def setup():
        calls.append(1)
        return len(calls)

    assert setup() == 1 and setup() == 1 and calls == [1]
    tracker = cstorch.utils.tracker.RateTracker()
    tracker.add(8)
    tracker.add(8)
    assert tracker.total_count == 16 and tracker.rate() >= 0.0 and tracker.global_rate() >= 0.0
    tracker.reset()
    assert tracker.total_count == 0


def test_a_nested_input_function_travels_to_the_workers_by_name_and_json():
    from cs_torch.data import arrived, function_location, travelling
    from cs_torch.input_worker import load_function
    from pydantic import BaseModel

    made = _nested_input_fn(json.JSONDecoder)
    location = function_location(made)
    assert location["closure"]["cls"] == {"name": "json.decoder:JSONDecoder"}
    assert location["closure"]["scale"] == {"value": 3}
    rebuilt = load_function(json.loads(json.dumps(location)))
    assert rebuilt(2) == made(2) == (json.decoder.JSONDecoder, 6)

    class Section(BaseModel):
        data_dir: str
        batch_size: int

    Section.__qualname__ = "Section"          # importable by name in this module
    globals()["Section"] = Section
    sent = travelling({"config": Section(data_dir="/d", batch_size=4)})
    assert json.loads(json.dumps(sent)) == sent
    assert arrived(sent)["config"] == Section(data_dir="/d", batch_size=4)
    with pytest.raises(cstorch.CsTorchError, match="captures box .object.: the input workers get only JSON"):
        function_location(_nested_input_fn(object(), box=True))


def _nested_input_fn(cls, box=False):
    scale = 3
    if box:
        box = cls

        def boxed(n):
            return box, n
        return boxed

    def input_fn(n):
        return cls, n * scale
    return input_fn


# ---------------------------------------------------------------- backends, amp, settings
def test_backend_names_the_trainer_reads():
    assert cstorch.backend.BackendType.from_str("csx") is cstorch.backend.BackendType.CSX
    with pytest.raises(ValueError, match="TPU backend not yet supported"):
        cstorch.backend.BackendType.from_str("TPU")
    assert cstorch.backend.current_backend_impl(raise_exception=False) is None
    backend = cstorch.backend("CPU")
    assert backend.is_e2e_execution and not backend.is_tracing and backend._impl is backend
    with pytest.raises(AttributeError, match="a CPU backend has no cluster"):
        backend.cluster
    config = cstorch.distributed.ClusterConfig(num_csx=2, job_labels=["a=b"])
    assert hash(config) == hash(cstorch.distributed.ClusterConfig(num_csx=2, job_labels=["a=b"]))


def test_csx_settings_and_mixed_precision_switches():
    csx = cstorch.backends.csx
    assert csx.precision.optimization_level == 1 and cstorch.current_pol() == 1
    with pytest.raises(ValueError, match="optimization_level must be 0, 1 or 2"):
        csx.precision.optimization_level = 3
    csx.debug.debug_args.MergeFrom({"debug_usr": {"x": 1}})
    assert csx.debug.debug_args.debug_usr.x == 1
    csx.debug.ini.ws_flag = True
    del csx.debug.ini.ws_flag
    from cs_torch import amp
    state = dict(amp._half)
    try:
        cstorch.amp.enable_mixed_precision(False)
        assert not cstorch.amp.mixed_precision() and cstorch.amp.get_floating_point_dtype() is torch.float32
        cstorch.amp.set_half_dtype("bfloat16")   # picks the format, does not switch it on
        assert cstorch.amp.get_floating_point_dtype() is torch.float32 and cstorch.amp.precision() == "float32"
        cstorch.amp.enable_mixed_precision()
        assert cstorch.amp.get_floating_point_dtype() is torch.bfloat16 and cstorch.amp.precision() == "bfloat16"
        assert cstorch.amp.get_floating_point_dtype_str() == "bfloat16"
        assert not cstorch.amp.is_cbfloat16_tensor(torch.ones(1, dtype=torch.bfloat16))
    finally:
        amp._half.update(state)


def test_signatures_the_trainer_builds_its_params_schema_from():
    sgd = inspect.signature(cstorch.optim.SGD)
    assert list(sgd.parameters)[:2] == ["params", "lr"] and sgd.parameters["lr"].annotation is float
    assert sgd.parameters["params"].annotation is cstorch.optim.optimizer.ParamsT
    sequential = inspect.signature(cstorch.optim.lr_scheduler.SequentialLR)
    assert sequential.parameters["optimizer"].annotation is torch.optim.Optimizer
    assert sequential.parameters["schedulers"].annotation == list[cstorch.optim.lr_scheduler.LRScheduler] or \
        str(sequential.parameters["schedulers"].annotation).endswith("List[cs_torch.lr_scheduler.LRScheduler]")
    wd = inspect.signature(cstorch.optim.weight_decay_scheduler.SequentialWD)
    assert "WeightDecayScheduler" in str(wd.parameters["schedulers"].annotation)


def test_appliance_storage_telemetry_and_annotations(tmp_path):
    from cerebras.appliance.cluster.client import TelemetryClient
    from cerebras.appliance.storage import S3Writer, StorageDeleter, StorageWriter
    assert StorageWriter.is_valid_path(str(tmp_path)) and not StorageWriter.is_valid_path("s3://bucket/x")
    assert not S3Writer.is_valid_path("s3://bucket/x")
    (tmp_path / "ckpt").write_text("x")
    StorageDeleter.get(str(tmp_path / "ckpt")).delete()
    assert not StorageWriter.path_exists(str(tmp_path / "ckpt"))
    client = types.SimpleNamespace(telemetry=[])
    with TelemetryClient(client, max_buffer_size=2) as telemetry:
        telemetry.push({"loss": 1.0}, labels={"step": "1"})
        assert client.telemetry == []
    assert client.telemetry == [({"loss": 1.0}, {"step": "1"})]
    from dataclasses import dataclass

    from cerebras.pytorch.core.annotation import AnnotationMode, create_annotation

    @dataclass
    class Named(AnnotationMode.Config):
        name: str

    named = create_annotation(Named, lambda c, bwd: AnnotationMode.Attribute("named", c.name), name="x")
    assert named(lambda a: a + 1)(1) == 2
    assert cstorch.utils.kernel.kernel_annotater("FLASH")(torch.matmul) is torch.matmul


def _ten_rows():
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(10.0)), batch_size=2)


def test_an_executor_checkpoints_on_its_schedule_and_has_a_folder(tmp_path):
    cstorch.backend("CPU", artifact_dir=str(tmp_path))
    Schedule = cstorch.utils.data.Schedule
    loader = cstorch.utils.data.DataLoader(_ten_rows)
    executor = cstorch.utils.data.DataExecutor(
        loader, num_steps=5, checkpoint_steps=Schedule([Schedule.Range(start=1, step=2, end=5, include_last=True)]))
    checkpointed = [executor.iteration for _ in executor if executor.on_checkpoint_step]
    assert checkpointed == [1, 3, 4] and executor.user_iteration == 5
    assert executor.artifact_dir.is_dir() and executor.artifact_dir.parent == tmp_path / "executors"
    assert loader.dataloader is loader.loader
    with pytest.raises(cstorch.CsTorchError, match="checkpoint_steps must be a positive integer"):
        cstorch.utils.data.DataExecutor(loader, num_steps=5, checkpoint_steps=0)


def test_a_csx_backend_has_its_cluster():
    backend = cstorch.backend("CSX", cluster_config=cstorch.distributed.ClusterConfig(num_csx=2))
    cluster = backend.cluster
    assert cluster.config.num_csx == 2 and cluster.workflow_id is None
    assert cluster.start_workflow(lock_resources=True) and cluster.workflow_id
    cluster.config = {"num_csx": 1}
    assert backend.cluster_config.num_csx == 1
    cluster.stop_workflow()
    assert cluster.workflow_id is None


def test_a_metric_the_models_own_forward_calls_is_refused_in_one_line():
    """The model zoo's GPT-2 updates its eval metrics inside its forward (compute_eval_metrics): the
    capture names the metric and what to do instead, never evaluates without it."""
    class WithMetric(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)
            self.perplexity_metric = cstorch.metrics.PerplexityMetric(name="eval/lm_perplexity")

        def forward(self, batch):
            loss = torch.nn.functional.cross_entropy(self.fc(batch[0]), batch[1])
            self.perplexity_metric(labels=batch[1], loss=loss, weights=batch[1] >= 0)
            return loss

    model = WithMetric().eval()
    compiled = cstorch.compile(model, cstorch.backend("CPU"))

    @cstorch.trace
    def eval_step(batch):
        return compiled(batch)

    with pytest.raises(Exception, match="calls the metric 'perplexity_metric' .*compute_eval_metrics: false"):
        eval_step([torch.ones(2, 4), torch.tensor([0, 1])])
