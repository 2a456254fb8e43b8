"""The `models` preset of scripts/bench.py: models written by others (torchvision's
resnet18 and mobilenet_v3_small, transformers' LlamaForCausalLM, GPT2LMHeadModel and
BertForMaskedLM, timm's ViT) at sizes where a torch eager step takes 50-500 ms on
one thread, captured as they ship.

    OPENBLAS_NUM_THREADS=1 python scripts/bench_models.py resnet18 [--steps 4]   # in this process
    csrun_wse python scripts/bench_models.py --mode train --params p.yaml   # p.yaml's model.name, 1 WSE

In process, each step is timed by CPU time (time.process_time: every thread of this
process, BLAS's included) and by wall clock; torch runs on one thread
(torch.set_num_threads(1)) and bench.py runs this with OPENBLAS_NUM_THREADS=1, so that
each side's CPU time is its work, not a BLAS thread spinning for a core, and with the
allocator csrun_cpu gives the CPU path (cs_runtime/env.py's ALLOCATOR). Batch norm is
in eval mode (running statistics as constants), dropout off: the step is the same
work on both sides. Under csrun_wse the same module trains on synthetic batches of the
same shapes; model.name picks the model (names that are not the model zoo's).
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

LR = 1e-3
SEQ, VOCAB = 128, 1024
# name -> (batch, what the batch holds): chosen so that torch eager, one thread, takes 50-500 ms a step
MODELS = {
    "resnet18": {"batch": 8, "image": 64},
    "mobilenet_v3_small": {"batch": 16, "image": 96},
    "llama_causal_lm": {"batch": 8, "seq": SEQ},
    "gpt2_lm_head": {"batch": 8, "seq": SEQ},
    "bert_masked_lm": {"batch": 8, "seq": SEQ},
    "vit_tiny": {"batch": 16, "image": 64},
}
CLASSES = 10


def _torchvision():
    """torchvision past its detection ops' registration (tests/other_models.py says why)."""
    from tests.other_models import importable_torchvision   # imports torch: only when a model is built
    return importable_torchvision()


def _frozen_batch_norm(model):
    import torch
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.eval()
    return model


def _transformers():
    _torchvision()     # transformers imports torchvision itself when it is there
    return importlib.import_module("transformers")


def _labels_loss(model):
    import torch

    class LabelsLoss(torch.nn.Module):
        """model(input_ids, labels=labels).loss, as the transformers model computes it."""
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, labels):
            return self.model(input_ids=input_ids, labels=labels).loss
    return LabelsLoss()


def _logits(model):
    import torch

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits
    return Logits()


def _the_loss(loss, target):
    return loss


def _mlm_loss(logits, labels):
    import torch.nn.functional as F
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def build(name: str):
    """(module, loss_fn, kind of batch) of a bench model, seeded."""
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    if name == "resnet18":
        return _frozen_batch_norm(_torchvision().models.resnet18(num_classes=CLASSES)), F.cross_entropy, "image"
    if name == "mobilenet_v3_small":
        module = _torchvision().models.mobilenet_v3_small(num_classes=CLASSES, dropout=0.0)
        return _frozen_batch_norm(module), F.cross_entropy, "image"
    if name == "vit_tiny":
        _torchvision()
        timm = importlib.import_module("timm")
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=MODELS[name]["image"],
                                 patch_size=8, num_classes=CLASSES), F.cross_entropy, "image"
    tf = _transformers()
    if name == "llama_causal_lm":
        config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ)
        return _labels_loss(tf.LlamaForCausalLM(config)), _the_loss, "lm"
    if name == "gpt2_lm_head":
        config = tf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=256, n_layer=4, n_head=4,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return _labels_loss(tf.GPT2LMHeadModel(config)), _the_loss, "lm"
    if name == "bert_masked_lm":
        config = tf.BertConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                               intermediate_size=1024, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)
        return _logits(tf.BertForMaskedLM(config)), _mlm_loss, "mlm"
    raise SystemExit(f"bench_models: unknown model {name!r} (one of {', '.join(MODELS)})")


def batch_of(name: str, kind: str, rng, batch: int | None = None):
    """One synthetic batch (features, labels) of the model's shapes."""
    size = MODELS[name]
    n = batch or size["batch"]
    if kind == "image":
        return rng.standard_normal((n, 3, size["image"], size["image"])).astype(np.float32), \
            rng.integers(0, CLASSES, n)
    ids = rng.integers(1, VOCAB, (n, size["seq"]))
    if kind == "lm":
        return {"input_ids": ids, "labels": ids.copy()}, ids.copy()
    mask = np.ones_like(ids)
    labels = np.where(rng.random(ids.shape) < 0.15, rng.integers(0, VOCAB, ids.shape), -100)
    return {"input_ids": ids, "attention_mask": mask}, labels


def _tensors(x):
    import torch
    return {k: torch.from_numpy(a) for k, a in x.items()} if isinstance(x, dict) else (torch.from_numpy(x),)


def _call(module, x):
    import torch
    return module(**{k: torch.from_numpy(a) for k, a in x.items()}) if isinstance(x, dict) \
        else module(torch.from_numpy(x))


def in_process(name: str, steps: int) -> dict:
    """torch eager (one thread) and the CPU path's calls on the same module and batches,
    AdamW, alternated step by step: CPU seconds and wall seconds a step, median over the steps."""
    import torch

    from cs_runtime.numerics.model import ShardContext, init_weights, model_backward, model_forward, model_loss
    from cs_runtime.numerics.optim import Optimizer, OptimizerSpec
    from cs_torch.capture import model_spec
    torch.set_num_threads(1)
    module, loss_fn, kind = build(name)
    rng = np.random.default_rng(0)
    batches = [batch_of(name, kind, rng) for _ in range(steps + 1)]
    x0, y0 = batches[0]
    spec = model_spec(f"bench_{name}", copy.deepcopy(module), _tensors(x0), torch.from_numpy(y0), loss_fn)
    weights, optimizer = init_weights(spec, 0), Optimizer(OptimizerSpec("adamw", weight_decay=0.01))
    state = {layer: optimizer.init_state(w) for layer, w in weights.items()}
    names = [layer.name for layer in spec.layers]
    n = len(y0)

    def ours(step, x, y):
        ctx = ShardContext(0, step, n, slice(0, n), True, labels=y)
        live, caches = model_forward(spec, x, weights, ctx)
        result = model_loss(spec, live, y, n)
        optimizer.update_model(names, weights, model_backward(spec, result.delta, caches, weights, step), state,
                               LR, step, None, need_norms=False)

    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01)

    def theirs(step, x, y):
        opt.zero_grad()
        loss_fn(_call(module, x), torch.from_numpy(y)).backward()
        opt.step()

    timed = {"torch": ([], []), "ours": ([], [])}
    for step, (x, y) in enumerate(batches):
        for side, fn in (("torch", theirs), ("ours", ours)):
            cpu, wall = time.process_time(), time.perf_counter()
            fn(step, x, y)
            if step:                                  # step 0 warms up, left out
                timed[side][0].append(time.process_time() - cpu)
                timed[side][1].append(time.perf_counter() - wall)
    med = {side: (float(np.median(c)), float(np.median(w))) for side, (c, w) in timed.items()}
    return {"model": name, "batch": n, "torch_cpu_s": med["torch"][0], "torch_wall_s": med["torch"][1],
            "ours_cpu_s": med["ours"][0], "ours_wall_s": med["ours"][1],
            "cpu_ratio": med["torch"][0] / med["ours"][0]}


# ------------------------------------------------------------------ run under csrun_wse

class SyntheticBatches:
    """The run's input: seeded synthetic samples of the model's shapes."""

    def __init__(self, name: str, samples: int, seed: int):
        _, _, kind = build(name)
        self.features, self.labels = batch_of(name, kind, np.random.default_rng(seed), samples)

    def __len__(self) -> int:
        return len(self.labels)

    def get(self, indices):
        x = {k: a[indices] for k, a in self.features.items()} if isinstance(self.features, dict) \
            else self.features[indices]
        return x, self.labels[indices]


def model_fn(params):
    import torch

    from cs_torch.capture import model_spec
    name = params.model.name
    module, loss_fn, kind = build(name)
    x, y = batch_of(name, kind, np.random.default_rng(0), params.train_input.batch_size)
    return model_spec(f"bench_{name}", module, _tensors(x), torch.from_numpy(y), loss_fn)


def train_input_fn(params):
    return SyntheticBatches(params.model.name, 8 * params.train_input.batch_size, params.runconfig.seed)


def main() -> None:
    if "--mode" in sys.argv:
        from cs_runtime.runner import run
        run(model_fn, train_input_fn, train_input_fn)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print(json.dumps(in_process(args.model, args.steps)))


if __name__ == "__main__":
    main()
