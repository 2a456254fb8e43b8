"""Torch is the oracle on models written by others, as their packages ship them
(transformers, torchvision, timm; pinned in the torch extra), at tiny sizes: each
is captured and trained a few steps on the CPU path with SGD (momentum) and AdamW
against torch eager on the same module, batches and optimizer (every loss within
1e-5 relative; with SGD every weight within max(1e-5, 3x torch's own
float32-vs-float64 spread), the issue's bound; with AdamW the first step's
gradients as close to torch's float64 ones as torch's float32 ones are:
_same_gradients says why). A package that is missing skips
its tests with a line naming it.

The registry's torchvision wheel is built against the CUDA torch: its compiled ops
(`_C.so`: nms, roi_align, the detection ops) do not load beside the CPU torch, and
`torchvision/_meta_registrations.py`, run at import, then fails registering their
fake kernels ("operator torchvision::nms does not exist"). The model definitions
never call those ops, so `_torchvision()` imports it with that one module stubbed
(docs/testing.md)."""
import copy
import importlib
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="capturing a torch model needs torch (an optional extra)")
F = torch.nn.functional

from cs_torch.capture import CaptureError, capture, model_spec  # noqa: E402
from cs_runtime.numerics.model import (ShardContext, init_weights, model_backward, model_forward,  # noqa: E402
                                       model_loss)
from tests.test_torch_programs import _call, _dropout_as_drawn, _example, train_both, train_cpu_path, train_torch  # noqa: E402,E501

# Capturing and training real models takes seconds each: the full pass runs them.
pytestmark = pytest.mark.cluster

STEPS, BATCH, T, VOCAB = 3, 4, 8, 32


def _importable_torchvision():
    """torchvision, imported past its detection ops' registration where the wheel's
    compiled ops do not load (the module docstring says why); None when not installed.
    transformers and timm import torchvision themselves when it is there, so they come after."""
    try:
        return importlib.import_module("torchvision")
    except ModuleNotFoundError:
        return None
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
    return importlib.import_module("torchvision")


def _torchvision():
    module = _importable_torchvision()
    if module is None:
        pytest.skip("torchvision is not installed (pip install -e '.[torch]')")
    return module


def _transformers():
    _importable_torchvision()
    return pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[torch]')")


class _LabelsLoss(torch.nn.Module):
    """model(input_ids, labels=labels).loss: the loss as a transformers model computes it."""
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def _the_loss(loss, target):
    return loss


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def _mlm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def _lm_batches(rng, steps):
    out = []
    for _ in range(steps):
        ids = rng.integers(0, VOCAB, (BATCH, T))
        out.append(({"input_ids": ids, "labels": ids.copy()}, ids.copy()))
    return out


def _mlm_batches(rng, steps):
    out = []
    for _ in range(steps):
        ids = rng.integers(1, VOCAB, (BATCH, T))
        lengths = rng.integers(3, T + 1, BATCH)
        mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
        labels = np.where(mask == 0, -100, rng.integers(0, VOCAB, (BATCH, T)))
        out.append(({"input_ids": ids * mask, "attention_mask": mask}, labels))
    return out


def _image_batches(rng, steps, size=16):
    return [(rng.standard_normal((BATCH, 3, size, size)).astype(np.float32), rng.integers(0, 5, BATCH))
            for _ in range(steps)]


def _gpt2():
    tf = _transformers()
    config = tf.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0)
    return _LabelsLoss(tf.GPT2LMHeadModel(config)), _the_loss, _lm_batches


def _llama():
    tf = _transformers()
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    return _LabelsLoss(tf.LlamaForCausalLM(config)), _the_loss, _lm_batches


def _bert():
    tf = _transformers()
    config = tf.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)
    return _Logits(tf.BertForMaskedLM(config)), _mlm_loss, _mlm_batches


def _frozen_batch_norm(model):
    """Batch norm in eval mode (running statistics as constants), the rest in train mode."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.eval()
    return model


def _resnet18():
    # 32x32, not 16: at 16 its last stages see 2x2 and 1x1 maps, where AdamW turns float32 noise in
    # near-zero gradients into steps 5x torch's own float32-vs-float64 spread (measured); SGD agrees either way.
    return _frozen_batch_norm(_torchvision().models.resnet18(num_classes=5)), F.cross_entropy, \
        lambda rng, steps: _image_batches(rng, steps, size=32)


def _vit():
    _torchvision()
    timm = pytest.importorskip("timm", reason="timm is not installed (pip install -e '.[torch]')")
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, depth=2,
                              num_classes=5)
    return model, F.cross_entropy, _image_batches


def _nanogpt():
    from examples.torch_gpt.model import GPT, GPTConfig, gpt_loss

    def batches(rng, steps):
        out = []
        for _ in range(steps):
            ids = rng.integers(0, VOCAB, (BATCH, T))
            labels = np.roll(ids, -1, axis=1)
            labels[:, -1] = -1
            out.append((ids, labels))
        return out
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=2, n_embd=16)), gpt_loss, batches


MODELS = {"nanogpt": _nanogpt, "gpt2": _gpt2, "bert_masked_lm": _bert, "llama": _llama, "resnet18": _resnet18,
          "vit": _vit}


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_a_packaged_model_trains_with_torchs_numbers(kind, opt):
    torch.manual_seed(0)
    module, loss_fn, batches_of = MODELS[kind]()
    batches = batches_of(np.random.default_rng(3), STEPS)
    spec, ours, theirs, weights, eager = train_both(kind, module, loss_fn, batches, opt)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    if opt == "sgd":
        _same_weights(module, loss_fn, batches, opt, weights, eager)
    else:
        _same_gradients(spec, module, loss_fn, batches[0])


def _same_weights(module, loss_fn, batches, opt, weights, eager):
    """Every weight within max(1e-5, 3x torch's own float32-vs-float64 spread) of torch's float32 one."""
    reference = {n: t.detach().numpy() for n, t in eager.state_dict().items()}
    final = {p: w for layer in weights.values() for p, w in layer.items()}
    assert set(final) <= set(reference)
    exact = _trained64(module, loss_fn, batches, opt)
    for name, w in final.items():
        tol = max(1e-5, 3 * float(np.abs(reference[name] - exact[name]).max()))
        np.testing.assert_allclose(w, reference[name], rtol=1e-5, atol=tol, err_msg=name)


def _trained64(module, loss_fn, batches, opt, steps=None):
    exact = copy.deepcopy(module).double()
    train_torch(exact, loss_fn, batches if steps is None else batches[:steps], opt, dtype=np.float64)
    return {n: t.detach().numpy() for n, t in exact.state_dict().items()}


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


def _sdpa_reference(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's documented reference math for scaled_dot_product_attention, its dropout
    through F.dropout (so a test can give it the run's masks)."""
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if is_causal:
        scores = scores.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return F.dropout(scores.softmax(-1), dropout_p, True) @ v


def test_gpt2_of_the_default_config_trains_with_its_dropout_given_the_runs_masks(monkeypatch):
    """GPT2LMHeadModel with the default config's dropouts (0.1 on the embeddings, the
    attention probabilities -- inside scaled_dot_product_attention -- and the residuals),
    loss through labels=: torch fed the run's masks agrees, loss and weights."""
    tf = _transformers()
    torch.manual_seed(0)
    module = _LabelsLoss(tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2,
                                                          n_head=2)))
    batches = _lm_batches(np.random.default_rng(6), STEPS)
    x0, y0 = batches[0]
    spec = model_spec("gpt2", module, _example(x0), torch.from_numpy(y0), _the_loss)
    assert sum(n[0] == "dropout_mask" for layer in spec.layers for n in layer.unit["unit"]["forward"]) == 7
    eager = copy.deepcopy(module)
    ours, weights = train_cpu_path(spec, batches, "sgd")
    monkeypatch.setattr(F, "scaled_dot_product_attention", _sdpa_reference)
    theirs = train_torch(eager, _the_loss, batches, "sgd", before_step=lambda step: monkeypatch.setattr(
        F, "dropout", _dropout_as_drawn(0, step, slice(0, BATCH))))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    monkeypatch.undo()
    reference = eager.state_dict()
    for layer in weights.values():
        for name, w in layer.items():
            np.testing.assert_allclose(w, reference[name].numpy(), rtol=1e-5,
                                       atol=1e-5 * max(1.0, float(reference[name].abs().max())), err_msg=name)


def test_mobilenet_v3_small_trains_with_its_dropout_given_the_runs_masks(monkeypatch):
    """torchvision's mobilenet_v3_small: hardswish and hardsigmoid in place, depthwise
    convolutions, Dropout(0.2, inplace=True) in training (torch fed the run's masks),
    batch norm frozen."""
    torch.manual_seed(0)
    module = _frozen_batch_norm(_torchvision().models.mobilenet_v3_small(num_classes=5))
    batches = _image_batches(np.random.default_rng(4), STEPS)
    x0, y0 = batches[0]
    spec = model_spec("mobilenet", module, (torch.from_numpy(x0),), torch.from_numpy(y0), F.cross_entropy)
    assert sum(n[0] == "dropout_mask" for layer in spec.layers for n in layer.unit["unit"]["forward"]) == 1
    eager = copy.deepcopy(module)
    ours, weights = train_cpu_path(spec, batches, "sgd")
    theirs = train_torch(eager, F.cross_entropy, batches, "sgd", before_step=lambda step: monkeypatch.setattr(
        F, "dropout", _dropout_as_drawn(0, step, slice(0, BATCH))))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    monkeypatch.undo()
    _same_weights(module, F.cross_entropy, batches, "sgd", weights, eager)


def test_torchvisions_batch_norm_in_training_carries_its_running_statistics():
    module = _torchvision().models.resnet18(num_classes=5).train()
    x, y = _image_batches(np.random.default_rng(1), 1)[0]
    spec = model_spec("resnet18", module, (torch.from_numpy(x),), torch.from_numpy(y), F.cross_entropy)
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
