"""Models written by others, as their packages ship them (transformers, torchvision,
timm; the `models` extra), at tiny sizes, each with its loss and its batches: what
tests/test_torch_others.py trains against torch eager and tests/others_run.py (a
run.py of them) runs on every path.

The registry's torchvision wheel is built against the CUDA torch: its compiled ops
(`_C.so`: nms, roi_align, the detection ops) do not load beside the CPU torch, and
`torchvision/_meta_registrations.py`, run at import, then fails registering their
fake kernels ("operator torchvision::nms does not exist"). The model definitions
never call those ops, so `importable_torchvision()` imports it with that one module
stubbed (docs/testing.md)."""
import copy
import functools
import importlib
import sys
import types

import torch
import torch.nn.functional as F

from tests.other_batches import BATCHES, T, VOCAB, first_batch


class MissingPackage(Exception):
    """A package of the `models` extra is not installed; the message names it."""


def importable_torchvision():
    """torchvision, imported past its detection ops' registration where the wheel's
    compiled ops do not load; None when not installed. transformers and timm import
    torchvision themselves when it is there, so they come after."""
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


def _package(name):
    importable_torchvision()
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        raise MissingPackage(f"{name} is not installed (pip install -e '.[torch,models]')") from None


def torchvision():
    module = importable_torchvision()
    if module is None:
        raise MissingPackage("torchvision is not installed (pip install -e '.[torch,models]')")
    return module


class LabelsLoss(torch.nn.Module):
    """model(input_ids, labels=labels).loss: the loss as a transformers model computes it."""
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def the_loss(loss, target):
    return loss


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def mlm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def gpt2():
    """GPT2LMHeadModel of the default config (its dropouts of 0.1 included) at a tiny size."""
    tf = _package("transformers")
    config = tf.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    return LabelsLoss(tf.GPT2LMHeadModel(config)), the_loss


def llama():
    tf = _package("transformers")
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    return LabelsLoss(tf.LlamaForCausalLM(config)), the_loss


def bert():
    tf = _package("transformers")
    config = tf.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)
    return Logits(tf.BertForMaskedLM(config)), mlm_loss


def resnet18():
    """torchvision's resnet18: batch norm in training, its running statistics carried as
    buffers; each residual block's last batch norm starts at zero (its constructor's
    zero_init_residual), so the blocks start as identities and 20 steps train smoothly in
    torch itself (tests/test_torch_others.py, TRAINING)."""
    return torchvision().models.resnet18(num_classes=5, zero_init_residual=True), F.cross_entropy


def mobilenet():
    """mobilenet_v3_small: in-place hardswish and hardsigmoid, depthwise convolutions,
    squeeze-excite, batch norm in training, Dropout(0.2, inplace=True)."""
    return torchvision().models.mobilenet_v3_small(num_classes=5), F.cross_entropy


def vit():
    torchvision()
    timm = _package("timm")
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, depth=2,
                              num_classes=5)
    return model, F.cross_entropy


def nanogpt():
    from examples.torch_gpt.model import GPT, GPTConfig, gpt_loss
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=2, n_embd=16)), gpt_loss


# kind -> () -> (module, loss_fn); its batches: tests/other_batches.py's BATCHES[kind].
MODELS = {"nanogpt": nanogpt, "gpt2": gpt2, "bert_masked_lm": bert, "llama": llama, "resnet18": resnet18,
          "mobilenet_v3_small": mobilenet, "vit": vit}
# Their dropouts in training (p > 0): torch is given the run's masks.
WITH_DROPOUT = {"gpt2", "mobilenet_v3_small"}


def build(kind):
    """(module, loss_fn, batches_of(rng, steps)) of a model, its weights from seed 0."""
    if kind not in MODELS:
        raise ValueError(f"unknown model {kind!r}; expected one of {sorted(MODELS)}")
    torch.manual_seed(0)
    return (*MODELS[kind](), BATCHES[kind])


def example_of(x):
    """A batch's features as the model's example inputs: by name, or the one positional input."""
    return {k: torch.from_numpy(a) for k, a in x.items()} if isinstance(x, dict) else (torch.from_numpy(x),)


@functools.lru_cache(maxsize=None)
def captured(kind):
    """(the module as built, its loss, batches_of, the spec captured on a copy of it at its
    first batch); once per model and process: the tests train from it and run
    tests/others_run.py's command line in-process on it."""
    from cs_torch.capture import model_spec
    module, loss_fn, batches_of = build(kind)
    x, y = first_batch(batches_of)
    return module, loss_fn, batches_of, model_spec(kind, copy.deepcopy(module), example_of(x), torch.from_numpy(y),
                                                   loss_fn)

