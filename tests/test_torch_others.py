"""Torch is the oracle on models written by others, as their packages ship them
(tests/other_models.py: transformers, torchvision, timm; the `models` extra), at tiny
sizes. Each is captured, passes --validate_only and --compile_only, and trains 20
steps on the CPU path with SGD (momentum) and with AdamW against torch eager on the
same module, batches and optimizer (models with dropout: torch given the run's
masks; the batch-norm models as TRAINING says): every loss within 1e-5 relative,
every weight within max(1e-5, 3x torch's own float32-vs-float64 spread). All but
nanoGPT (examples/torch_gpt's GPT, which tests/test_torch_cluster.py runs) also run
on the CPU path through run.py's command line, and on 1 WSE, 2 WSEs and pipelined
against that run; three of them (CLUSTER, docs/testing.md says why those) hold that
run to torch eager. A package that is missing skips its tests with a line naming it."""
import copy
import subprocess
import sys

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch", reason="capturing a torch model needs torch (an optional extra)")
F = torch.nn.functional

from cs_runtime.numerics.model import (ShardContext, init_weights, model_backward, model_forward,  # noqa: E402
                                       model_loss)
from cs_torch.capture import CaptureError, capture, model_spec  # noqa: E402
from tests import other_batches, other_models  # noqa: E402
from tests.cluster_utils import REPO, cpu_path_in_process, final_weights, tool, train_losses  # noqa: E402
from tests.test_torch_programs import LR, _call, _dropout_as_drawn, train_cpu_path, train_torch  # noqa: E402

# Capturing and training real models takes seconds each: the full pass runs them.
pytestmark = pytest.mark.cluster

STEPS = 20
# The batch-norm models' training, where torch's own float32 and float64 runs stay together:
# (batch, learning rate of each optimizer). On the shipped defaults at 32x32 their training is
# chaotic in torch itself (resnet18: batch norm over 4 values a channel on the 1x1 last maps; its
# float32 and float64 losses part by 1e-1 relative after one SGD step at lr 1e-3, and by 1e-4
# within 20 steps even at lr 1e-5). Batch 8 of class_images (a class pattern to learn), SGD lr
# 1e-3, AdamW lr 3e-5, resnet18's residual blocks starting as identities (zero_init_residual):
# over 20 steps torch's float32 losses stay within 5e-7 of its float64 ones and its weights within
# 4e-6 (measured, torch 2.13). AdamW at lr 1e-4 is not enough: one ReLU or max-pool decision of
# resnet18's layer2.1 at step 4 falls otherwise in our float32 than in torch's, and AdamW makes a
# whole step of that gradient's sign (weights 1.3e-4 from torch's, 13x the bound).
TRAINING = {"resnet18": (8, {"sgd": 1e-3, "adamw": 3e-5}), "mobilenet_v3_small": (8, {"sgd": 1e-3, "adamw": 3e-5})}
BATCH = other_batches.BATCH
RUN = str(REPO / "tests" / "others_run.py")


def _captured(kind):
    """(the module as built, its loss, its batches, the spec captured at the first); captured once per model."""
    try:
        module, loss_fn, batches_of, spec = other_models.captured(kind)
    except other_models.MissingPackage as exc:
        pytest.skip(str(exc))
    rows = {"batch": TRAINING[kind][0]} if kind in TRAINING else {}
    return module, loss_fn, batches_of(np.random.default_rng(3), STEPS, **rows), spec


def _lr(kind, opt):
    """The learning rate `kind` trains at with `opt` (TRAINING's; LR's for the others)."""
    return TRAINING[kind][1][opt] if kind in TRAINING else LR[opt]


def _sdpa_reference(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's documented reference math for scaled_dot_product_attention, its dropout
    through F.dropout (so torch can be given the run's masks)."""
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if is_causal:
        scores = scores.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return F.dropout(scores.softmax(-1), dropout_p, True) @ v


# AdamW's eps: the Cerebras API's default, given to torch too. With torch's 1e-8, AdamW's step
# m / (sqrt(v) + eps) turns float32 noise in a near-zero gradient into a step of up to the
# learning rate, in torch too: timm's ViT's loss at step 7 differed 1.4e-5 relative and its
# class token ended 3.1x torch's own float32-vs-float64 spread from torch's (measured).
EPS = 1e-6


def torch_trained(kind, module, loss_fn, batches, opt, dtype=np.float32, seed=0, lr=None):
    """torch eager's losses training `module` in place; a model with dropout is given the
    masks the run draws (F.dropout, and attention's through the reference math)."""
    with pytest.MonkeyPatch.context() as patch:
        before_step = None
        if kind in other_models.WITH_DROPOUT:
            patch.setattr(F, "scaled_dot_product_attention", _sdpa_reference)
            rows = slice(0, len(batches[0][1]))

            def before_step(step):
                patch.setattr(F, "dropout", _dropout_as_drawn(seed, step, rows))
        return train_torch(module, loss_fn, batches, opt, dtype=dtype, before_step=before_step, eps=EPS, lr=lr)


OPTIMIZERS = [(kind, opt) for kind in other_models.MODELS for opt in ("sgd", "adamw")]


@pytest.mark.parametrize("kind,opt", OPTIMIZERS)
def test_a_packaged_model_trains_20_steps_with_torchs_numbers(kind, opt):
    """Every step's loss within 1e-5 relative of torch's; every weight and buffer within
    max(1e-5, 3x torch's own float32-vs-float64 spread of that tensor) of torch's (20 steps;
    the batch-norm models as TRAINING says)."""
    module, loss_fn, batches, spec = _captured(kind)
    lr = _lr(kind, opt)
    ours, weights = train_cpu_path(spec, batches, opt, eps=EPS, lr=lr)
    eager = copy.deepcopy(module)
    theirs = torch_trained(kind, eager, loss_fn, batches, opt, lr=lr)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert len(set(np.round(theirs, 5))) > 1     # the steps moved the loss
    reference = {n: t.detach().numpy() for n, t in eager.state_dict().items()}
    final = {p: w for layer in weights.values() for p, w in layer.items()}
    assert set(final) <= set(reference) and len(final) >= len(list(module.parameters()))
    far = [n for n, w in final.items() if not np.allclose(w, reference[n], rtol=1e-5, atol=1e-5)]
    if far:   # torch's own spread, from the same training in float64, where 1e-5 is not met
        exact = copy.deepcopy(module).double()
        torch_trained(kind, exact, loss_fn, batches, opt, dtype=np.float64, lr=lr)
        exact = exact.state_dict()
        for name in far:
            spread = float(np.abs(reference[name] - exact[name].numpy()).max())
            np.testing.assert_allclose(final[name], reference[name], rtol=1e-5, atol=max(1e-5, 3 * spread),
                                       err_msg=name)


def _in_process(argv):
    """tests/others_run.py's command line in this process, as csrun_cpu runs it (its model
    captured once, by _captured): its exit code."""
    return cpu_path_in_process(RUN, argv)


def _command_line(argv, capsys):
    """_in_process's (exit code, stdout, stderr)."""
    code = _in_process(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


# What --compile_only writes (cs_runtime/compiler/report.py; docs/running.md); --validate_only writes nothing.
COMPILE_OUTPUTS = ("compile_report.txt", "compile/plan.json", "compile/program.txt", "compile/streaming.svg",
                   "compile/artifact.json")


@pytest.mark.parametrize("kind", list(other_models.MODELS))
def test_a_packaged_model_passes_validate_only_and_compile_only_on_the_command_line(kind, tmp_path, capsys):
    """`python tests/others_run.py KIND --mode train --params ... --validate_only`, then
    `--compile_only`: exit 0, the lines and files each says it makes, and no step run."""
    spec = _captured(kind)[3]
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"train_input": {"batch_size": BATCH},
                                      "runconfig": {"max_steps": STEPS, "seed": 0}}))
    model_dir = tmp_path / "m"
    common = [kind, "--mode", "train", "--params", str(params), "--model_dir", str(model_dir)]
    code, out, err = _command_line([*common, "--validate_only"], capsys)
    assert code == 0, err[-2000:]
    assert f"validate_only: {kind} is valid: {len(spec.layers)} layers" in out, out
    assert "would run weight_streaming on 1 CS system(s)" in out and "nothing was compiled or run" in out, out
    assert not model_dir.exists() or not any(model_dir.iterdir())
    code, out, err = _command_line([*common, "--compile_only"], capsys)
    assert code == 0, err[-2000:]
    assert f"compile: compiling {kind} (" in out and "compile_only: done; nothing was run" in out, out
    assert all((model_dir / name).is_file() for name in COMPILE_OUTPUTS), sorted(model_dir.rglob("*"))
    report = (model_dir / "compile_report.txt").read_text()
    assert all(layer.name in report for layer in spec.layers)
    assert not list(model_dir.glob("checkpoint_*")) and not (model_dir / "train").exists()


def test_an_unsupported_torchvision_op_fails_validate_only_in_one_line(tmp_path, capsys, monkeypatch):
    """squeezenet1_0's max_pool2d(ceil_mode=True), through the same command line: exit 2, one
    line naming the module, the op and torchvision's own source line."""
    models = _torchvision().models
    monkeypatch.setitem(other_models.MODELS, "squeezenet1_0", lambda: (models.squeezenet1_0(num_classes=5),
                                                                       F.cross_entropy))
    monkeypatch.setitem(other_batches.BATCHES, "squeezenet1_0", other_batches.images_32)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"train_input": {"batch_size": BATCH}}))
    code, out, err = _command_line(["squeezenet1_0", "--mode", "train", "--params", str(params),
                                    "--model_dir", str(tmp_path / "m"), "--validate_only"], capsys)
    assert code == 2, err[-2000:]
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, err[-2000:]
    line = errors[0]
    assert line.startswith("error: module features.") and "op max_pool2d" in line, line
    assert "squeezenet.py:" in line and "ceil_mode=True" in line, line
    assert "validate_only" not in out


# ---------------------------------------------------------------- through the system

# The models whose csrun_cpu run is held to torch eager over 20 steps (docs/testing.md says
# why these): GPT2LMHeadModel (dropout on every path, the loss through labels=), BertForMaskedLM
# (two inputs, a padding mask, the token_type_ids buffer expanded over the batch), timm's ViT (a
# class token parameter expanded over the batch, convolution). Every model runs on one WSE, two
# WSEs and pipelined against its CPU-path run; the others 3 steps (a run's cost is its processes'
# start, not its steps). nanoGPT's GPT is examples/torch_gpt's, which tests/test_torch_cluster.py
# runs on the same three.
CLUSTER = ["gpt2", "bert_masked_lm", "vit"]
WSE_MODES = [(1, "weight_streaming"), (2, "weight_streaming"), (1, "pipelined")]
ON_WSES = [(kind, *mode) for kind in [*CLUSTER, "llama", "resnet18", "mobilenet_v3_small"] for mode in WSE_MODES]
CLUSTER_STEPS = {kind: STEPS if kind in CLUSTER else 3 for kind, _, _ in ON_WSES}
# A batch-norm model on two WSEs normalizes each shard by its own rows' statistics (torch DDP's
# numbers, tests/test_torch_batch_norm.py): its oracle is the CPU path's calls on those shards.
BATCH_NORM = {"resnet18", "mobilenet_v3_small"}


def cluster_params(kind):
    steps = CLUSTER_STEPS[kind]
    return {"train_input": {"batch_size": BATCH, "shuffle": False, "drop_last_batch": True},
            "optimizer": {"optimizer_type": "sgd", "learning_rate": LR["sgd"], "momentum": 0.9},
            "runconfig": {"max_steps": steps, "log_steps": min(5, steps), "checkpoint_steps": 0, "seed": 0}}


def _run(kind, launcher, params, model_dir, *extra):
    cmd = [*launcher, sys.executable, RUN, kind, "--mode", "train", "--params", str(params),
           "--model_dir", str(model_dir), *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory):
    """kind -> (params file, losses, final weights) of its CPU-path run: run.py's command line in
    this process, as csrun_cpu runs it (the model captured once, by _captured); one run per model."""
    runs = {}

    def of(kind):
        if kind not in runs:
            _captured(kind)
            tmp = tmp_path_factory.mktemp(kind)
            params = tmp / "params.yaml"
            params.write_text(yaml.safe_dump(cluster_params(kind)))
            argv = [kind, "--mode", "train", "--params", str(params), "--model_dir", str(tmp / "cpu")]
            assert _in_process(argv) == 0
            runs[kind] = params, train_losses(tmp / "cpu"), final_weights(tmp / "cpu")
        return runs[kind]
    return of


def _as_taken(x):
    """A batch's features as the model takes them: ids sent as int32 are int64 again."""
    def taken(a):
        return a.astype(np.int64) if a.dtype.kind in "iu" else a
    return {k: taken(a) for k, a in x.items()} if isinstance(x, dict) else taken(x)


def _stream(kind, params_path):
    """The run's InputStream: the batches its input pipeline gives, in order."""
    from cs_runtime.config import load_params
    from cs_runtime.data.inputs import InputStream
    from tests.others_run import the_batches
    params = load_params(str(params_path))
    return InputStream.build("train", other_batches.as_dataset(the_batches(kind, params)), params.train_input, 0)


@pytest.mark.parametrize("kind", CLUSTER)
def test_csrun_cpu_of_a_packaged_model_equals_torch_eager(kind, cpu_runs):
    """The CPU path's run (its input pipeline's batches, its checkpoint) against torch eager
    on the batches the run's InputStream gives: every loss within 1e-5 relative, every
    weight within 1e-5 of its tensor's scale (_close; SGD, where torch's own
    float32-vs-float64 spread is far below that)."""
    params_path, losses, weights = cpu_runs(kind)
    stream = _stream(kind, params_path)
    batches = [(_as_taken(stream.shard(s).x), stream.shard(s).y) for s in range(STEPS)]
    module, loss_fn, _, _ = _captured(kind)
    eager = copy.deepcopy(module)
    theirs = torch_trained(kind, eager, loss_fn, batches, "sgd")
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, theirs, rtol=1e-5)
    reference = eager.state_dict()
    for key, w in weights.items():
        _close(w, reference[key.split("/", 2)[2]].numpy(), key)


def _on_two_shards(kind, params_path):
    """A batch-norm model's CPU-path calls on the two WSEs' shards of every step (each shard's
    batch statistics, their gradients summed in rank order, rank 0's running statistics kept):
    (losses, final weights keyed as a checkpoint keys them)."""
    from tests.test_torch_batch_norm import train_ours
    stream, spec = _stream(kind, params_path), _captured(kind)[3]
    steps = CLUSTER_STEPS[kind]
    batches = [(stream.shard(s).x, stream.shard(s).y) for s in range(steps)]
    shards = [shard.rows for shard in stream.shards(0, 2)]
    assert all([shard.rows for shard in stream.shards(s, 2)] == shards for s in range(steps))
    losses, weights, _ = train_ours(spec, batches, shards, lr=LR["sgd"])
    return losses, {p: w for layer in weights.values() for p, w in layer.items()}


@pytest.mark.parametrize("kind,num_csx,strategy", ON_WSES)
def test_a_packaged_model_on_wses_equals_the_cpu_path(kind, num_csx, strategy, tmp_path, cpu_runs):
    """One WSE, weight streaming or pipelined, is the CPU run bit for bit: every loss and
    weight (tied parameters, BERT's and GPT-2's word embedding and output head, included;
    mobilenet_v3_small's hundreds of arrays, whose table outgrows a message header).
    Two WSEs (2 rows each) sum the shards' gradients in another order: every loss within
    1e-5 relative and every weight within 1e-5 of its scale of the CPU run (a batch-norm
    model: of the CPU path's calls on the same two shards)."""
    params, losses, weights = cpu_runs(kind)
    result = _run(kind, [tool("csrun_wse"), "--num_csx", str(num_csx), "--num_workers_per_csx", "1"], params,
                  tmp_path / "m", "--override", f"runconfig.execution_strategy={strategy}")
    steps = CLUSTER_STEPS[kind]
    assert f"Mode={strategy}, Step={steps}," in result.stdout, result.stdout[-2000:]
    got, got_w = train_losses(tmp_path / "m"), final_weights(tmp_path / "m")
    assert len(got) == steps and got_w.keys() == weights.keys()
    if num_csx == 1:
        np.testing.assert_array_equal(got, losses)
        for name in weights:
            np.testing.assert_array_equal(got_w[name], weights[name], err_msg=name)
        return
    if kind in BATCH_NORM:
        losses, by_param = _on_two_shards(kind, params)
        weights = {key: by_param[key.split("/", 2)[2]] for key in weights}
    np.testing.assert_allclose(got, losses, rtol=1e-5)
    for name in weights:
        _close(got_w[name], weights[name], name)


def _close(ours, theirs, name):
    """Within 1e-5 of the tensor's largest value, or 1e-6 where that is smaller: a weight
    whose gradient is zero in exact arithmetic (an attention key bias) moves by float32
    noise alone, 1e-13 here."""
    assert float(np.abs(ours - theirs).max()) <= max(1e-5 * float(np.abs(theirs).max()), 1e-6), name


# Torchvision models beyond the seven: built here, their first step against torch's.
_image_batches = other_batches.image_batches


def _torchvision():
    try:
        return other_models.torchvision()
    except other_models.MissingPackage as exc:
        pytest.skip(str(exc))


def _same_gradients(spec, module, loss_fn, batch):
    """The first step's gradients: ours as close to torch's float64 ones as torch's float32
    ones are (within 3x that spread, or 1e-6 of the tensor's scale: a few float32 ulps).
    AdamW's step m / sqrt(v) turns float32 noise in a near-zero gradient into a step of up to
    the learning rate, in torch too, so among millions of weights (resnet18, timm's ViT) a few
    end 5-6x torch's spread from torch's float32 ones after a few steps: with AdamW the weights
    are held by the gradients that made them, and by the loss at every step."""
    x, y = batch
    live, caches = model_forward(spec, x, init_weights(spec, 0), ShardContext(0, 0, len(y), slice(0, len(y)), True,
                                                                               labels=y))
    grads = model_backward(spec, model_loss(spec, live, y, len(y)).delta, caches, init_weights(spec, 0), 0)
    ours = {p: g for layer in grads for p, g in layer.items()}
    eager, exact = copy.deepcopy(module), copy.deepcopy(module).double()
    for m, dtype in ((eager, np.float32), (exact, np.float64)):
        m.zero_grad()
        loss_fn(_call(m, x, dtype), torch.from_numpy(y)).backward()
    exact_grads = dict(exact.named_parameters())
    for name, p in eager.named_parameters():
        if name not in ours:
            continue
        g32, g64 = p.grad.numpy(), exact_grads[name].grad.numpy()
        tol = max(3 * float(np.abs(g32 - g64).max()), 1e-6 * float(np.abs(g64).max()))
        assert float(np.abs(ours[name] - g64).max()) <= tol, name


def test_torchvisions_batch_norm_in_training_carries_its_running_statistics():
    module, _, _, spec = _captured("resnet18")
    norms = [name for name, m in module.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(norms) == 20
    assert set(spec.program["buffers"]) == {f"{n}.{b}" for n in norms
                                            for b in ("running_mean", "running_var", "num_batches_tracked")}


# Other torchvision classifiers in training (batch norm's running statistics kept, dropout at
# p 0): each takes torch's loss and gradients, or is refused at capture in one line naming its
# module, the op and torchvision's own line -- never during a step.
OTHER_VISION = {"shufflenet_v2_x0_5": None,
                "squeezenet1_0": "pooling with ceil_mode=True",
                "efficientnet_b0": "a random op",                       # stochastic depth's bernoulli
                "vgg11": "adaptive_avg_pool2d from 2x2 to 7x7"}


@pytest.mark.parametrize("name", list(OTHER_VISION))
def test_another_torchvision_model_computes_torchs_step_or_is_refused_at_capture_in_one_line(name):
    torch.manual_seed(0)
    module = getattr(_torchvision().models, name)(num_classes=5).train()
    for dropout in (m for m in module.modules() if isinstance(m, torch.nn.Dropout)):
        dropout.p = 0.0
    batches = _image_batches(np.random.default_rng(2), 1, size=64)
    why = OTHER_VISION[name]
    x, y = batches[0]
    if why is None:   # the first step (batch norm on 4 images makes later steps chaotic, in torch too)
        spec = model_spec(name, module, (torch.from_numpy(x),), torch.from_numpy(y), F.cross_entropy)
        live, _ = model_forward(spec, x, init_weights(spec, 0), ShardContext(0, 0, BATCH, slice(0, BATCH), True,
                                                                             labels=y))
        want = F.cross_entropy(copy.deepcopy(module)(torch.from_numpy(x)), torch.from_numpy(y)).item()
        assert model_loss(spec, live, y, BATCH).loss == pytest.approx(want, rel=1e-5)
        _same_gradients(spec, module, F.cross_entropy, (x, y))
        return
    with pytest.raises(CaptureError) as info:
        capture(module, (torch.from_numpy(x),), torch.from_numpy(y), F.cross_entropy)
    message = str(info.value)
    assert "\n" not in message and message.startswith("module ") and why in message, message
    line = message.split(" at ", 1)[1].split(":")[0] if " at " in message else ""
    assert line.endswith(".py") and line not in ("capture.py", "test_torch_others.py"), message


# mnasnet0_5 and regnet_x_400mf in training, their last blocks on 2x2 feature maps (batch norm's
# statistics from 16 values). On 64x64 images (mnasnet) and 48x48 (regnet) with these weights one
# batch-normalized value sits closer to a ReLU's kink in float64 than float32's forward error there
# (6.6e-7 from it in mnasnet's layers.12.2.layers.4, where torch's float32 values and ours are 1e-5
# to 1e-4 off): our float32 lands on the other side than torch's, the ReLU passes that value's
# gradient, and the first step's gradients below leave float64's by up to 10-19% of a tensor's
# scale. Float64 with that one value moved to our side agrees with ours within the float32 bound.
# So the rules are held in float64, where no kink is that close: every gradient within 1e-9 of its
# tensor's scale of torch's (measured 2.5e-11 and 8e-13). In float32 the bound holds where every
# kink stays clear of float32's error: mnasnet at 48x48 (regnet has one that close at every size
# tried, 32 to 64, and which side it lands on depends on the kernels' summation order).
KINKED_VISION = {"mnasnet0_5": 64, "regnet_x_400mf": 48}


def _torchvision_in_training(name):
    torch.manual_seed(0)
    module = getattr(_torchvision().models, name)(num_classes=5).train()
    for dropout in (m for m in module.modules() if isinstance(m, torch.nn.Dropout)):
        dropout.p = 0.0
    return module


def _widened(weights: dict) -> dict:
    return {layer: {p: w.astype(np.float64) if w.dtype == np.float32 else w for p, w in params.items()}
            for layer, params in weights.items()}


@pytest.mark.parametrize("name", list(KINKED_VISION))
def test_small_feature_maps_with_batch_norm_in_training_take_torchs_float64_step(name):
    module = _torchvision_in_training(name)
    x, y = _image_batches(np.random.default_rng(2), 1, size=KINKED_VISION[name])[0]
    spec = model_spec(name, module, (torch.from_numpy(x),), torch.from_numpy(y), F.cross_entropy)
    weights = _widened(init_weights(spec, 0))
    live, caches = model_forward(spec, x.astype(np.float64), weights,
                                 ShardContext(0, 0, BATCH, slice(0, BATCH), True, labels=y))
    result = model_loss(spec, live, y, BATCH)
    ours = {p: g for layer in model_backward(spec, result.delta, caches, weights, 0) for p, g in layer.items()}
    exact = copy.deepcopy(module).double()
    loss = F.cross_entropy(_call(exact, x, np.float64), torch.from_numpy(y))
    loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-12)
    for p, param in exact.named_parameters():   # a bias that batch norm follows: 0 up to 1e-13 of noise
        want = param.grad.numpy()
        assert ours[p].dtype == np.float64 and np.abs(ours[p] - want).max() <= 1e-9 * max(np.abs(want).max(), 1e-3), p


def test_mnasnet_on_small_feature_maps_takes_torchs_float32_step_where_no_kink_is_within_its_error():
    module = _torchvision_in_training("mnasnet0_5")
    x, y = _image_batches(np.random.default_rng(2), 1, size=48)[0]
    spec = model_spec("mnasnet0_5", module, (torch.from_numpy(x),), torch.from_numpy(y), F.cross_entropy)
    live, _ = model_forward(spec, x, init_weights(spec, 0), ShardContext(0, 0, BATCH, slice(0, BATCH), True,
                                                                         labels=y))
    want = F.cross_entropy(copy.deepcopy(module)(torch.from_numpy(x)), torch.from_numpy(y)).item()
    assert model_loss(spec, live, y, BATCH).loss == pytest.approx(want, rel=1e-5)
    _same_gradients(spec, module, F.cross_entropy, (x, y))
