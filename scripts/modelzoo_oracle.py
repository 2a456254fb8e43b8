"""The Cerebras model zoo's own run.py on the emulator, checked against torch eager.

    python scripts/modelzoo_oracle.py /path/to/modelzoo-checkout [--models fc_mnist gpt2 bert]
                                      [--targets CPU CSX1 CSX2] [--dropout zero shipped] [--work DIR]
    python scripts/modelzoo_oracle.py /path/to/modelzoo-checkout --count-names
    python scripts/modelzoo_oracle.py /path/to/2.3+-checkout --modes train fit_eval restart validate --float32

For each model and target this makes a small data set and a small params
file (2 layers, hidden 64, sequence 64), runs the checkout's run.py as a user
would (`python run.py CPU|CSX --mode train --params P --model_dir D
[--num_csx N]`, with this project on PYTHONPATH so `cerebras_pytorch` /
`cerebras.pytorch` are the emulator's), and then trains the same model zoo
model in torch eager here: from the run's own initial checkpoint
(`save_initial_checkpoint`) and with the params the run saved in it, on the
batches of the same data loader (the model zoo's, unshuffled), with the
optimizer, schedule and clipping the model zoo's flow applies on that target.
On every target it checks the loss of every step (the run's TensorBoard
`loss`, float32) within 1e-5 relative, and every tensor of the final
checkpoint within max(1e-5, 3x the largest difference of torch's own float32
and float64 runs of that tensor); 2 WSEs are compared with 1 to the same
bounds. The params ask for float32 (`mixed_precision: false`), and the
emulator trains a CSX run in float32 unless mixed precision is asked for
(docs/cstorch.md), which the 2.1 flow never does for CSX: the half dtype it
sets on every run only picks the 16-bit format. The 2.3+ trainer does ask:
it enables mixed precision for CSX whatever its params say ("Mixed precision
must be enabled for CSX"), bfloat16 by default, so its CSX runs are reported
and held to a bound (1e-2 relative in the loss, 1e-3 in the weights, and so
2 WSEs against 1). With `--float32` the runs get the emulator-only switch
`CS_EMULATOR_FLOAT32=1`, which keeps them in float32 though the trainer
enables mixed precision, and are held to the float32 bounds. The 2.3+ trainer
also logs the gradient norm (ComputeNorm's `model_wise_grad_norm`), checked
against torch eager's before clipping; `--modes` adds its other flows: fit
with validation (`fit_eval`: the eval losses against torch eager of the eager
weights), a run stopped at its checkpoint and resumed (`restart`), and eval /
eval_all of the trained checkpoints (`validate`). A torch DataLoader keeps no
place, so each train loop and a resumed run read its data anew: torch eager
takes the batches in that order.

The model zoo is not part of this project: bring a checkout of its public
repository at the release to check. Release_2.1.1's layout (`modelzoo/...`:
FC-MNIST, GPT-2 and BERT through their run.py) and the 2.3+ layout
(`src/cerebras/modelzoo/...`, checked at Release_2.10.0: the Trainer, with
FC-MNIST through the model zoo CLI, `python -m cerebras.modelzoo.cli.main fit
P --target_device CPU|CSX`, the `cszoo` console script, and GPT-2 through its
run.py; the params in the trainer's format, torch eager on the loader and
param groups the trainer's own config makes). Its own requirements
(jsonschema, h5py, datasets, pydantic as it pins it, ...) must import:
PYTHONPATH passes through to the runs. CI does not run this script. The runs
get stand-ins, written into the work folder: a sitecustomize (torchvision
imported past its compiled ops, a wheel built for another torch; the eval
harnesses the 2.3+ trainer imports at its start, when not installed; the
TreeSpec spelling of torch 2.4 that the 2.3+ model zoo rebuilds its params
with) and, where torchvision does not import even so, the MNIST reader and
the transforms the model zoo uses. `--count-names` only counts the
`cerebras.pytorch` names the checkout references that resolve here.

Exit status 0 when every check passes, 1 when one fails, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import ast
import copy
import importlib
import itertools
import json
import math
import os
import runpy
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-5
SPREAD_FACTOR = 3.0
# The 2.3+ trainer enables mixed precision on CSX (its precision callback), as the CS system
# trains: the matmuls' operands round to bfloat16 (docs/torch.md). Against float32 torch eager
# that is a bound, not an equality.
MIXED_LOSS_RTOL = 1e-2
MIXED_WEIGHT_ATOL = 1e-3
STEPS = 6
SEED = 1
# The 2.3+ trainer's other flows (--modes): fit with validation every EVAL_EVERY steps, EVAL_STEPS
# batches each; a run stopped at RESTART_AT (its checkpoint) and run again to STEPS, resuming;
# validate: after training (a checkpoint every EVAL_EVERY steps), eval of the last checkpoint and
# eval_all of each (run.py --mode eval / eval_all, `cszoo validate` / `validate_all`).
MODES = ("train", "fit_eval", "restart", "validate")
# run.py's --mode -> the model zoo CLI's command
CSZOO_COMMANDS = {"train": "fit", "train_and_eval": "fit", "eval": "validate", "eval_all": "validate_all"}
EVAL_EVERY, EVAL_STEPS, RESTART_AT = 3, 2, 3


# ---------------------------------------------------------------- the models
@dataclass(frozen=True)
class ZooModel:
    name: str
    folder: str          # run.py's folder, relative to the package root
    model: str           # "module:Class" of the model zoo's model (called with params)
    train_data: str = ""  # "module:function" of its train input function (2.1; the trainer reads its config)
    entry: str = "run.py"  # run.py, or "cszoo": the model zoo CLI's `fit` (2.3+)


LAYOUTS = {
    # Release_2.1.1 and the 2.0/2.1 releases: modelzoo/<area>/pytorch/...
    "2.1": {
        "fc_mnist": ZooModel("fc_mnist", "modelzoo/fc_mnist/pytorch",
                             "modelzoo.fc_mnist.pytorch.model:MNISTModel",
                             "modelzoo.fc_mnist.pytorch.data:get_train_dataloader"),
        "gpt2": ZooModel("gpt2", "modelzoo/transformers/pytorch/gpt2",
                         "modelzoo.transformers.pytorch.gpt2.model:Gpt2Model",
                         "modelzoo.transformers.pytorch.gpt2.data:train_input_dataloader"),
        "bert": ZooModel("bert", "modelzoo/transformers/pytorch/bert",
                         "modelzoo.transformers.pytorch.bert.model:BertForPreTrainingModel",
                         "modelzoo.transformers.pytorch.bert.data:train_input_dataloader"),
    },
    # 2.3 on (checked at Release_2.10.0): src/cerebras/modelzoo/..., the Trainer. FC-MNIST has no run.py
    # any more: it runs through the model zoo's CLI (`cszoo fit`); GPT-2 through its run.py.
    "2.3+": {
        "fc_mnist": ZooModel("fc_mnist", "cerebras/modelzoo/models/vision/fc_mnist",
                             "cerebras.modelzoo.models.vision.fc_mnist.model:MNISTModel", entry="cszoo"),
        "gpt2": ZooModel("gpt2", "cerebras/modelzoo/models/nlp/gpt2",
                         "cerebras.modelzoo.models.nlp.gpt2.model:Gpt2Model"),
    },
}


def layout_of(checkout: Path) -> tuple[str, Path] | None:
    """(layout, the folder that goes on PYTHONPATH) of a model zoo checkout; None if it is not one."""
    if (checkout / "modelzoo" / "common" / "pytorch" / "run_utils.py").is_file():
        return "2.1", checkout
    if (checkout / "src" / "cerebras" / "modelzoo").is_dir():
        return "2.3+", checkout / "src"
    return None


# ---------------------------------------------------------------- data and params
def make_mnist(folder: Path, rng) -> Path:
    """MNIST's four idx files (random images and labels) where torchvision's MNIST reads them."""
    raw = folder / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, count in (("train", 256), ("t10k", 64)):
        images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, (count,), dtype=np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, count, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, count) + labels.tobytes())
    return folder


def make_gpt_hdf5(folder: Path, rng, vocab: int, seq: int, count: int = 64) -> Path:
    """The model zoo's GPT HDF5 sample format: files of data [n, 3, seq] (input_ids, input_mask,
    labels, the labels the ids shifted by one), attribute n_examples."""
    import h5py
    folder.mkdir(parents=True, exist_ok=True)
    tokens = rng.integers(0, vocab, (count, seq + 1), dtype=np.int32)
    data = np.stack([tokens[:, :-1], np.ones((count, seq), np.int32), tokens[:, 1:]], axis=1)
    for index, part in enumerate(np.split(data, 2)):
        with h5py.File(folder / f"data-{index}.h5", "w") as f:
            f.attrs["n_examples"] = len(part)
            f.create_dataset("data", data=part)
    return folder


def make_bert_csv(folder: Path, rng, vocab: int, seq: int, predictions: int, count: int = 64) -> Path:
    """The model zoo's BERT CSV format (BertCSVDataProcessor): files of rows whose features are
    lists written as text, and meta.dat naming each file and its rows."""
    import csv
    folder.mkdir(parents=True, exist_ok=True)
    columns = ["input_ids", "attention_mask", "token_type_ids", "masked_lm_positions", "masked_lm_weights",
               "labels", "next_sentence_label"]
    with open(folder / "data-0.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for _ in range(count):
            length = int(rng.integers(seq // 2, seq + 1))
            ids = [int(t) for t in rng.integers(5, vocab, length)] + [0] * (seq - length)
            split = int(rng.integers(1, length))
            positions = sorted(int(p) for p in rng.choice(np.arange(1, length), predictions, replace=False))
            writer.writerow({"input_ids": ids, "attention_mask": [1] * length + [0] * (seq - length),
                             "token_type_ids": [0] * split + [1] * (length - split) + [0] * (seq - length),
                             "masked_lm_positions": positions, "masked_lm_weights": [1] * predictions,
                             "labels": [int(t) for t in rng.integers(5, vocab, predictions)],
                             "next_sentence_label": [int(rng.integers(0, 2))]})
    (folder / "meta.dat").write_text(f"data-0.csv {count}\n")
    return folder


def params_for(model: str, data: Path, dropout: str) -> dict:
    """A small params file of the model as the model zoo ships it (2 layers, hidden 64)."""
    runconfig = {"max_steps": STEPS, "log_steps": 1, "checkpoint_steps": STEPS, "save_initial_checkpoint": True,
                 "seed": SEED}
    if model == "fc_mnist":
        return {
            "train_input": {"data_dir": str(data), "batch_size": 16, "drop_last_batch": True,
                            "to_float16": False, "shuffle": False},
            "eval_input": {"data_dir": str(data), "batch_size": 16, "drop_last_batch": True, "shuffle": False},
            "model": {"name": "fc_mnist", "mixed_precision": False, "depth": 2, "hidden_size": 64,
                      # FC-MNIST ships dropout 0.0: "shipped" uses 0.2, so that its masks are checked too
                      "dropout": 0.0 if dropout == "zero" else 0.2, "activation_fn": "relu", "to_float16": False},
            "optimizer": {"optimizer_type": "SGD", "learning_rate": 0.01, "momentum": 0.9,
                          "loss_scaling_factor": 1.0},
            "runconfig": runconfig,
        }
    if model == "gpt2":
        rate = 0.0 if dropout == "zero" else 0.1
        return {
            "train_input": {"data_processor": "GptHDF5DataProcessor", "data_dir": str(data), "batch_size": 8,
                            "shuffle": False, "num_workers": 0},
            "model": {"hidden_size": 64, "vocab_size": 512, "position_embedding_type": "learned",
                      "share_embedding_weights": True, "max_position_embeddings": 64,
                      "num_hidden_layers": 2, "dropout_rate": rate, "layer_norm_epsilon": 1.0e-5,
                      "loss_scaling": "num_tokens", "loss_weight": 1.0, "num_heads": 4,
                      "attention_type": "scaled_dot_product", "attention_dropout_rate": rate,
                      "use_projection_bias_in_attention": True, "use_ffn_bias_in_attention": True,
                      "filter_size": 256, "nonlinearity": "gelu", "use_ffn_bias": True,
                      "use_bias_in_output": False, "mixed_precision": False},
            "optimizer": {"optimizer_type": "adamw", "betas": [0.9, 0.95], "eps": 1.0e-8,
                          "max_gradient_norm": 1.0, "weight_decay": 0.01, "loss_scaling_factor": 1.0,
                          "learning_rate": [
                              {"scheduler": "Linear", "initial_learning_rate": 0.0,
                               "end_learning_rate": 0.0006, "total_iters": 3},
                              {"scheduler": "Linear", "initial_learning_rate": 0.0006,
                               "end_learning_rate": 0.0, "total_iters": 100}]},
            "runconfig": runconfig,
        }
    if model == "bert":
        rate = 0.0 if dropout == "zero" else 0.1
        section = {"data_processor": "BertCSVDataProcessor", "data_dir": str(data), "batch_size": 8,
                   "max_sequence_length": 64, "max_predictions_per_seq": 8, "shuffle": False, "num_workers": 0}
        return {
            "train_input": section, "eval_input": dict(section),
            "model": {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4,
                      "filter_size": 256, "encoder_nonlinearity": "gelu", "pooler_nonlinearity": "tanh",
                      "dropout_rate": rate, "attention_dropout_rate": rate, "max_position_embeddings": 64,
                      "layer_norm_epsilon": 1.0e-5, "mlm_loss_weight": 0.058, "mixed_precision": False},
            "optimizer": {"optimizer_type": "AdamW", "weight_decay": 0.01, "max_gradient_norm": 1.0,
                          "loss_scaling_factor": 1.0,
                          "learning_rate": [
                              {"scheduler": "Linear", "initial_learning_rate": 0.0,
                               "end_learning_rate": 0.0002, "total_iters": 3},
                              {"scheduler": "Linear", "initial_learning_rate": 0.0002,
                               "end_learning_rate": 0.0, "total_iters": 100}]},
            "runconfig": runconfig,
        }
    raise SystemExit(f"modelzoo_oracle: no small params for {model}")


def make_data(model: str, work: Path) -> Path:
    rng = np.random.default_rng(0)
    if model == "fc_mnist":
        return make_mnist(work / "mnist", rng)
    if model == "gpt2":
        return make_gpt_hdf5(work / "gpt2_h5", rng, vocab=512, seq=64)
    if model == "bert":
        return make_bert_csv(work / "bert_csv", rng, vocab=512, seq=64, predictions=8)
    raise SystemExit(f"modelzoo_oracle: no data for {model}")


# ---------------------------------------------------------------- torchvision
_TORCHVISION_STANDIN = {
    "__init__.py": '"""A stand-in: torchvision\'s MNIST reader and the transforms the model zoo uses."""\n'
                   "from . import datasets, io, ops, transforms\n",
    "io/__init__.py": "from . import image\n",
    "io/image.py": "",
    "ops.py": '''
        class FrozenBatchNorm2d:     # named in the model zoo's table of norms; none of the checked models uses it
            def __init__(self, *args, **kwargs):
                raise NotImplementedError("the torchvision stand-in has no FrozenBatchNorm2d")
        ''',
    "datasets.py": '''
        import os
        import numpy as np
        import torch

        def _idx(path):
            data = open(path, "rb").read()
            shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(data[3]))
            return np.frombuffer(data, np.uint8, offset=4 + 4 * data[3]).reshape(shape)

        class MNIST(torch.utils.data.Dataset):
            def __init__(self, root, train=True, download=False, transform=None, target_transform=None):
                prefix = os.path.join(root, "MNIST", "raw", "train" if train else "t10k")
                self.data = torch.from_numpy(_idx(prefix + "-images-idx3-ubyte").copy())
                self.targets = torch.from_numpy(_idx(prefix + "-labels-idx1-ubyte").astype(np.int64))
                self.transform, self.target_transform = transform, target_transform

            def __len__(self):
                return len(self.data)

            def __getitem__(self, index):
                image, target = self.data[index], int(self.targets[index])
                if self.transform is not None:
                    image = self.transform(image)
                if self.target_transform is not None:
                    target = self.target_transform(target)
                return image, target
        ''',
    "transforms.py": '''
        import torch

        class Compose:
            def __init__(self, transforms):
                self.transforms = transforms

            def __call__(self, x):
                for t in self.transforms:
                    x = t(x)
                return x

        class ToTensor:      # uint8 [H, W] -> float32 [1, H, W] in [0, 1], as torchvision's
            def __call__(self, image):
                return image.to(torch.float32).div(255).unsqueeze(0)

        class Normalize:
            def __init__(self, mean, std):
                self.mean, self.std = mean, std

            def __call__(self, x):
                mean = torch.as_tensor(self.mean, dtype=x.dtype).view(-1, 1, 1)
                std = torch.as_tensor(self.std, dtype=x.dtype).view(-1, 1, 1)
                return (x - mean) / std

        class Lambda:
            def __init__(self, fn):
                self.fn = fn

            def __call__(self, x):
                return self.fn(x)
        ''',
}


_SITECUSTOMIZE = '''
    """Stand-ins for the model zoo oracle's runs (written by scripts/modelzoo_oracle.py)."""
    import dataclasses
    import importlib.abc
    import importlib.machinery
    import sys
    import types

    # torchvision's compiled ops (a wheel built for another torch) do not load; its data sets and
    # transforms never call them, so the module that registers their fake kernels is left out.
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))


    class _StandIn:
        """A name of an eval harness the 2.3+ trainer imports at its start; called, it says so."""

        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, *args, **kwargs):
            if len(args) == 1 and isinstance(args[0], type) and not kwargs:
                return args[0]     # a registering decorator
            raise RuntimeError("modelzoo_oracle: the eval harnesses (lm_eval, bigcode_eval) are stand-ins here")


    class _Module(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (_StandIn,), {})


    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        """lm_eval and bigcode_eval (installed from source archives, not a registry) when not installed."""
        ROOTS = ("lm_eval", "bigcode_eval")

        def find_spec(self, fullname, path=None, target=None):
            if fullname.split(".")[0] in self.ROOTS:
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            module = _Module(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module):
            pass


    sys.meta_path.append(_Finder())

    # The 2.3+ model zoo (written for torch 2.4) rebuilds pytree TreeSpecs with
    # dataclasses.replace(spec, type=, children_specs=); later torch's TreeSpec takes
    # (type, context, children_specs) and names its fields _context and _children.
    _replace = dataclasses.replace


    def _treespec_replace(obj, /, **changes):
        cls = type(obj)
        if cls.__name__ == "TreeSpec" and cls.__module__ == "torch.utils._pytree" and hasattr(obj, "_children"):
            return cls(changes.get("type", obj.type), changes.get("context", obj._context),
                       changes.get("children_specs", list(obj._children)))
        return _replace(obj, **changes)


    dataclasses.replace = _treespec_replace
    '''


def standins_path(work: Path) -> list[str]:
    """The folders of the runs' stand-ins: a sitecustomize (torchvision past its compiled ops, the eval
    harnesses, the TreeSpec spelling), and where torchvision does not import even so, the MNIST reader."""
    site = work / "standins_site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(textwrap.dedent(_SITECUSTOMIZE))
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *inherited]))
    probe = subprocess.run([sys.executable, "-c", "import torchvision.datasets"], capture_output=True, env=env)
    if probe.returncode == 0:
        return [str(site)]
    folder = work / "standins"
    for name, text in _TORCHVISION_STANDIN.items():
        path = folder / "torchvision" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    print("modelzoo_oracle: torchvision does not import here; FC-MNIST reads MNIST through a stand-in "
          f"({folder / 'torchvision'})", file=sys.stderr)
    return [str(site), str(folder)]


# ---------------------------------------------------------------- the run
def run_zoo(checkout: Path, zoo: ZooModel, params: dict, target: str, out: Path, extra_path: list[str],
            mode: str = "train", fresh: bool = True):
    """Run the model zoo's run.py (or `cszoo fit`) in `mode` (train, train_and_eval); (returncode, output).
    `fresh`: in an empty folder (else it resumes from the checkpoint the last run left there)."""
    import yaml
    if fresh:
        shutil.rmtree(out, ignore_errors=True)     # the model zoo resumes from a checkpoint it finds there
    out.mkdir(parents=True, exist_ok=True)
    params_file = out / "params.yaml"
    params_file.write_text(yaml.safe_dump(params))
    _, root = layout_of(checkout)
    _, _, count = target.partition("CSX")
    device = "CSX" if count else "CPU"
    if zoo.entry == "cszoo":    # the model zoo CLI (the `cszoo` console script is this module's main)
        command = [sys.executable, "-m", "cerebras.modelzoo.cli.main", CSZOO_COMMANDS[mode], str(params_file),
                   "--target_device", device, "--model_dir", str(out / "model_dir")]
    else:
        command = [sys.executable, "run.py", device, "--mode", mode, "--params", str(params_file),
                   "--model_dir", str(out / "model_dir")]
    if count:
        command += ["--num_csx", count]
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]   # the zoo's requirements
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*extra_path, str(REPO), str(root), *inherited]))
    result = subprocess.run(command, cwd=root / zoo.folder, env=env, capture_output=True, text=True,
                            timeout=1800)
    with open(out / "run.log", "a") as log:
        log.write(result.stdout + result.stderr)
    return result.returncode, result.stdout + result.stderr


def run_losses(model_dir: Path, tag: str = "loss") -> dict[int, float] | dict[int, list[float]]:
    """The run's `loss` scalars by step: model_dir/train (2.1) or model_dir/events (the 2.3+ trainer,
    every invocation's files). Another tag (the trainer's eval losses): each step's values, in order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    folder = model_dir / "train" if (model_dir / "train").is_dir() else model_dir / "events"
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    if tag == "loss":
        return {e.step: e.value for e in acc.Scalars("loss")}
    found = [t for t in acc.Tags()["scalars"] if t == tag or t.endswith("/" + tag)]
    values: dict[int, list[float]] = {}
    for e in acc.Scalars(found[0]) if found else ():
        values.setdefault(e.step, []).append(e.value)
    return values


def load_checkpoint(path: Path) -> dict:
    import torch
    return torch.load(path, map_location="cpu", weights_only=True)


# ---------------------------------------------------------------- torch eager
def lr_at(learning_rate, step: int) -> float:
    """The model zoo's schedule at `step` (0-based): a number, or pieces run one after another
    (Linear and Constant, as the small params use)."""
    if isinstance(learning_rate, (int, float)):
        return float(learning_rate)
    pieces = learning_rate if isinstance(learning_rate, list) else [learning_rate]
    for index, piece in enumerate(pieces):
        total = piece.get("total_iters", piece.get("steps"))
        last = index == len(pieces) - 1
        if not last and step >= total:
            step -= total
            continue
        kind = piece["scheduler"].lower()
        if kind == "constant":
            return float(piece["learning_rate"])
        if kind == "linear":
            start, end = piece["initial_learning_rate"], piece["end_learning_rate"]
            return start + (end - start) * min(step, total) / total
        raise ValueError(f"lr_at: scheduler {piece['scheduler']} not modelled here")
    raise AssertionError("unreachable")


def decays(name: str, module) -> bool:
    """The model zoo's rule for weight decay: not biases, not normalisation layers' weights."""
    return not (name.endswith("bias") or "norm" in type(module).__name__.lower())


def eager_optimizer(model, optimizer: dict):
    import torch
    owners = {f"{m_name}.{p_name}" if m_name else p_name: module
              for m_name, module in model.named_modules() for p_name, _ in module.named_parameters(recurse=False)}
    weight_decay = optimizer.get("weight_decay", 0.0)
    decayed = [p for n, p in model.named_parameters() if decays(n, owners[n])]
    kept = [p for n, p in model.named_parameters() if not decays(n, owners[n])]
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": kept, "weight_decay": 0.0}]
    kind = optimizer["optimizer_type"].lower()
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.0, momentum=optimizer.get("momentum", 0.0),
                               nesterov=optimizer.get("use_nesterov", False))
    if kind in ("adam", "adamw"):
        cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        return cls(groups, lr=0.0, betas=tuple(optimizer.get("betas", (0.9, 0.999))),
                   eps=optimizer.get("eps", 1e-6))
    raise ValueError(f"eager_optimizer: {kind} not modelled here")


def batches_of(loader, steps: int, dtype):
    """The loader's first `steps` batches (epoch after epoch), float tensors in `dtype`."""
    out = []
    while len(out) < steps:
        for batch in loader:
            out.append(_cast(batch, dtype))
            if len(out) == steps:
                break
    return out


def _cast(batch, dtype):
    import torch
    if isinstance(batch, dict):
        return {k: _cast(v, dtype) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_cast(v, dtype) for v in batch)
    if isinstance(batch, torch.Tensor) and batch.is_floating_point():
        return batch.to(dtype)
    return batch


def eager(zoo: ZooModel, params: dict, initial: dict, target: str, dtype_name: str):
    """(losses, final state dict) of torch eager: the model zoo's model from the run's initial
    weights, its data loader's batches, the step the model zoo's flow takes on that target."""
    from cs_torch.oracle import torch_dropout_with_run_masks
    import torch
    dtype = getattr(torch, dtype_name)
    params = copy.deepcopy(params)
    torch.manual_seed(params["runconfig"].get("seed", 0))
    model_cls = _load(zoo.model)
    data_fn = _load(zoo.train_data)
    model = model_cls(params)
    model.load_state_dict(initial)
    model.to(dtype)
    model.train()
    optimizer_params = params["optimizer"]
    optimizer = eager_optimizer(model, optimizer_params)
    batches = batches_of(data_fn(params), STEPS, dtype)
    # The flow clips gradients only where it makes a GradScaler: on CSX, with a loss scaling factor.
    clip = optimizer_params.get("max_gradient_norm") if target.startswith("CSX") and \
        optimizer_params.get("loss_scaling_factor", 1.0) is not None else None
    losses = []
    for step, batch in enumerate(batches):
        with torch_dropout_with_run_masks(step, _rows(batch)):
            loss = model(batch)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(optimizer_params["learning_rate"], step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rows(batch) -> int:
    """The batch's samples: dim 0 of its first tensor."""
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return _rows(batch[0])
    return int(batch.shape[0])


def _load(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------- the 2.3+ trainer
def trainer_params(model: str, data: Path, dropout: str, model_dir: Path, mode: str = "train",
                   max_steps: int = STEPS) -> dict:
    """The small params of params_for in the 2.3+ trainer's format (trainer: init, fit); for the
    fit_eval mode with a validation loader, run every EVAL_EVERY steps for EVAL_STEPS batches; for
    the restart mode a checkpoint every RESTART_AT steps (the first invocation stops there)."""
    legacy = params_for(model, data, dropout)
    optimizer = dict(legacy["optimizer"])
    kind = {"sgd": "SGD", "adamw": "AdamW", "adam": "Adam"}[optimizer.pop("optimizer_type").lower()]
    schedule = optimizer.pop("learning_rate")
    clip = optimizer.pop("max_gradient_norm", None)
    optimizer.pop("loss_scaling_factor", None)
    model_section = {k: v for k, v in legacy["model"].items() if k not in ("name", "mixed_precision")}
    init = {"model_dir": str(model_dir), "seed": SEED, "model": {"name": model, **model_section},
            "precision": {"enabled": False, "loss_scaling_factor": 1.0,
                          **({"max_gradient_norm": clip} if clip else {})},
            "loop": {"max_steps": max_steps},
            "checkpoint": {"steps": {"restart": RESTART_AT, "validate": EVAL_EVERY}.get(mode, STEPS),
                           "save_initial_checkpoint": True},
            "logging": {"log_steps": 1}}
    if isinstance(schedule, list):
        init["optimizer"] = {kind: optimizer}
        init["schedulers"] = [{"SequentialLR": {"schedulers": [
            {"LinearLR": {k: piece[k] for k in ("initial_learning_rate", "end_learning_rate", "total_iters")}}
            for piece in schedule]}}]
    else:
        init["optimizer"] = {kind: {**optimizer, "learning_rate": schedule}}
    train = dict(legacy["train_input"])
    if model == "fc_mnist":
        train.update(data_processor="MNISTDataProcessor", split="train")
    fit = {"train_dataloader": train}
    if mode in ("fit_eval", "validate"):
        fit["val_dataloader"] = {**train, "split": "val"} if model == "fc_mnist" else dict(train)
    if mode == "fit_eval":
        init["loop"].update(eval_frequency=EVAL_EVERY, eval_steps=EVAL_STEPS)
    if mode in ("fit_eval", "validate") and model == "gpt2":
        # its eval metrics update inside its forward, which the emulator refuses in one line (docs/cstorch.md)
        init["model"]["compute_eval_metrics"] = False
    return {"trainer": {"init": init, "fit": fit}}


def validate_params(params: dict, model_dir: Path, checkpoints: list[Path]) -> dict:
    """The trainer params of an eval of the last checkpoint (one given) or an eval_all of each."""
    init = {k: v for k, v in params["trainer"]["init"].items() if k != "checkpoint"}
    init.update(model_dir=str(model_dir), loop={"eval_steps": EVAL_STEPS})
    val = params["trainer"]["fit"]["val_dataloader"]
    if len(checkpoints) == 1:
        return {"trainer": {"init": init, "validate": {"val_dataloader": val, "ckpt_path": str(checkpoints[0])}}}
    return {"trainer": {"init": init, "validate_all": {"val_dataloaders": [val],
                                                       "ckpt_paths": [str(c) for c in checkpoints]}}}


def trainer_schedule(params: dict):
    """The trainer params' learning rate in the 2.1 spelling lr_at reads."""
    init = params["trainer"]["init"]
    if "schedulers" in init:
        return [{"scheduler": "Linear", **piece["LinearLR"]}
                for piece in init["schedulers"][0]["SequentialLR"]["schedulers"]]
    return next(iter(init["optimizer"].values()))["learning_rate"]


def eager_trainer(zoo: ZooModel, params: dict, initial: dict, dtype_name: str, order: list[int] | None = None,
                  snapshots: dict | None = None, grad_norms: list | None = None):
    """(losses, final state dict) of torch eager: the model zoo's model from the run's initial weights,
    the batches of the loader its trainer config makes (in `order`: their indices, one a step), the
    param groups its configure_param_groups makes, the optimizer, schedule and clipping of its params,
    in `dtype`. `snapshots`: {step: None} is filled with the state dict after each such step;
    `grad_norms` with each step's gradient norm before clipping (what the trainer logs)."""
    from cs_torch.oracle import torch_dropout_with_run_masks
    import torch
    from cerebras.modelzoo.common.optim_utils import configure_param_groups
    from cerebras.modelzoo.trainer.utils import create_dataloader_from_config
    from cerebras.modelzoo.trainer.validate import validate_trainer_params
    dtype = getattr(torch, dtype_name)
    init = params["trainer"]["init"]
    torch.manual_seed(init["seed"])
    model = _load(zoo.model)(copy.deepcopy(init["model"]))
    model.load_state_dict(initial)
    model.to(dtype)
    model.train()
    (kind, settings), = init["optimizer"].items()
    groups = configure_param_groups(model, dict(settings))
    options = {k: v for k, v in settings.items() if k not in ("learning_rate", "weight_decay")}
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    optimizer = getattr(torch.optim, kind)(groups, lr=0.0, **options)
    config = validate_trainer_params(copy.deepcopy(params))[0]
    loader = create_dataloader_from_config(config.fit.train_dataloader).dataloader
    batches = batches_of(loader, STEPS, dtype)
    batches = [batches[i] for i in order] if order is not None else batches
    clip = init["precision"].get("max_gradient_norm")
    schedule = trainer_schedule(params)
    losses = []
    for step, batch in enumerate(batches):
        with torch_dropout_with_run_masks(step, _rows(batch)):
            output = model(batch)
        loss = output["loss"] if isinstance(output, dict) else output
        loss.backward()
        if grad_norms is not None:
            grad_norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()
                                                                   if p.grad is not None])))
        if clip:
            torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], clip)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(schedule, step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        if snapshots is not None and step + 1 in snapshots:
            snapshots[step + 1] = copy.deepcopy(model.state_dict())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def eager_eval(zoo: ZooModel, params: dict, state: dict) -> list[float]:
    """torch eager's loss of the model zoo's model with `state` on each of the validation loader's
    first EVAL_STEPS batches (float32)."""
    import torch
    from cerebras.modelzoo.trainer.utils import create_dataloader_from_config
    from cerebras.modelzoo.trainer.validate import validate_trainer_params
    model = _load(zoo.model)(copy.deepcopy(params["trainer"]["init"]["model"]))
    model.load_state_dict(state)
    model.eval()
    config = validate_trainer_params(copy.deepcopy(params))[0]
    val = config.fit.val_dataloader
    loader = create_dataloader_from_config(val[0] if isinstance(val, list) else val).dataloader
    losses = []
    with torch.no_grad():
        for batch in batches_of(loader, EVAL_STEPS, torch.float32):
            output = model(batch)
            losses.append(float(output["loss"] if isinstance(output, dict) else output))
    return losses


def restarts_its_data(params: dict) -> bool:
    """Whether the trainer's train loader starts its data anew when a run resumes: a torch DataLoader
    keeps no place; the model zoo's RestartableDataLoader saves it in the checkpoint."""
    from cerebras.modelzoo.data.common.restartable_dataloader import RestartableDataLoader
    from cerebras.modelzoo.trainer.utils import create_dataloader_from_config
    from cerebras.modelzoo.trainer.validate import validate_trainer_params
    config = validate_trainer_params(copy.deepcopy(params))[0]
    return not isinstance(create_dataloader_from_config(config.fit.train_dataloader).dataloader,
                          RestartableDataLoader)


# ---------------------------------------------------------------- one check
def run_mode(checkout: Path, zoo: ZooModel, params: dict, target: str, out: Path, extra_path: list[str],
             mode: str):
    """The model zoo's runs of a mode: one, or for restart one stopped at RESTART_AT and one resumed
    from its checkpoint to STEPS (the same model_dir); (returncode, output) of the last that ran."""
    if mode != "restart":
        return run_zoo(checkout, zoo, params, target, out, extra_path,
                       mode="train_and_eval" if mode == "fit_eval" else "train")
    stopped = copy.deepcopy(params)
    stopped["trainer"]["init"]["loop"]["max_steps"] = RESTART_AT
    code, output = run_zoo(checkout, zoo, stopped, target, out, extra_path)
    if code != 0:
        return code, output
    return run_zoo(checkout, zoo, params, target, out, extra_path, fresh=False)


def check(checkout: Path, zoo: ZooModel, target: str, dropout: str, work: Path, extra_path: list[str],
          layout: str = "2.1", mode: str = "train") -> dict:
    data = make_data(zoo.name, work / "data")
    out = work / (f"{zoo.name}_{target}_{dropout}" + ("" if mode == "train" else f"_{mode}"))
    model_dir = out / "model_dir"
    trainer = layout == "2.3+"
    params = trainer_params(zoo.name, data, dropout, model_dir, mode) if trainer else \
        params_for(zoo.name, data, dropout)
    code, output = run_mode(checkout, zoo, params, target, out, extra_path, mode)
    row = {"model": zoo.name, "target": target, "dropout": dropout, "entry": zoo.entry, "mode": mode}
    if code != 0:
        lines = [ln for ln in output.strip().splitlines() if ln.strip()]
        return {**row, "ok": False, "error": f"{zoo.entry} exited {code}: {lines[-1] if lines else ''}",
                "log": str(out / "run.log")}
    first, last = load_checkpoint(model_dir / "checkpoint_0.mdl"), load_checkpoint(model_dir / f"checkpoint_{STEPS}.mdl")
    snapshots = {step: None for step in range(EVAL_EVERY, STEPS + 1, EVAL_EVERY)} \
        if mode in ("fit_eval", "validate") else None
    # Each train loop of a run (fit_eval: between validations) and a resumed run read the data from
    # the start again where the loader keeps no place.
    stop = {"fit_eval": EVAL_EVERY, "restart": RESTART_AT}.get(mode)
    order = [step % stop for step in range(STEPS)] if stop and trainer and restarts_its_data(params) else None
    norms32: list[float] = []
    if trainer:
        def eager_run(dtype):
            return eager_trainer(zoo, params, first["model"], dtype, order,
                                 snapshots if dtype == "float32" else None, norms32 if dtype == "float32" else None)
    else:
        saved = first["__metadata__"][0]["params"]     # the params the run saved, as it read them

        def eager_run(dtype):
            return eager(zoo, saved, first["model"], target, dtype)
    got = run_losses(model_dir)
    want32, weights32 = eager_run("float32")
    try:
        _, weights64 = eager_run("float64")
    except Exception as exc:  # a model zoo model that builds float32 tensors of its own
        print(f"modelzoo_oracle: {zoo.name} in float64: {exc}; the weight tolerance is {WEIGHT_ATOL}",
              file=sys.stderr)
        weights64 = None
    steps = sorted(got)
    loss_err = max(abs(got[s] - want32[s - 1]) / max(abs(want32[s - 1]), 1e-30) for s in steps) if steps else math.inf
    worst = (0.0, 1.0, "")
    for name, value in last["model"].items():
        if not hasattr(value, "dtype") or not value.is_floating_point():
            continue
        error = float((value.double() - weights32[name].double()).abs().max())
        spread = float((weights32[name].double() - weights64[name]).abs().max()) if weights64 else 0.0
        tolerance = max(WEIGHT_ATOL, SPREAD_FACTOR * spread)
        if error / tolerance >= worst[0] / worst[1]:
            worst = (error, tolerance, name)
    mixed = trainer and target.startswith("CSX") and not float32_switch()
    loss_tol = MIXED_LOSS_RTOL if mixed else LOSS_RTOL
    weight_tol = max(worst[1], MIXED_WEIGHT_ATOL) if mixed else worst[1]
    ok = steps == list(range(1, STEPS + 1)) and loss_err <= loss_tol and worst[0] <= weight_tol
    if norms32:   # the gradient norm the trainer logs (ComputeNorm), against torch eager's
        logged = [values[0] for _, values in sorted(run_losses(model_dir, "model_wise_grad_norm").items())]
        norm_err = max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(logged, norms32)), default=math.inf)
        row["grad_norm_rel_err"] = norm_err
        ok = ok and len(logged) == STEPS and norm_err <= loss_tol
    if snapshots:   # the eval losses, against torch eager's of the eager weights at those steps
        want = {step: eager_eval(zoo, params, state) for step, state in snapshots.items()}
        runs = [("fit", run_losses(model_dir, "val_loss"), list(snapshots))] if mode == "fit_eval" else \
            validate_runs(checkout, zoo, params, target, out, extra_path, snapshots)
        for name, evals, steps_evaluated in runs:
            eval_err = max((abs(a - b) / max(abs(b), 1e-30) for step, values in want.items()
                            for a, b in zip(evals.get(step, []), values)), default=math.inf)
            counts = {step: len(v) for step, v in evals.items()}
            row[f"eval_{name}"] = {"steps": counts, "rel_err": eval_err}
            ok = ok and eval_err <= loss_tol and counts == {s: EVAL_STEPS for s in steps_evaluated}
    if order is not None:
        row["data"] = f"anew every {stop} steps"
    return {**row, "ok": ok, "precision": "mixed bfloat16" if mixed else "float32", "steps": len(steps),
            "loss_rel_err": loss_err, "loss_tol": loss_tol, "weight_err": worst[0], "weight_tol": weight_tol,
            "worst_tensor": worst[2], "losses": [got[s] for s in steps], "final": str(model_dir / f"checkpoint_{STEPS}.mdl")}


def float32_switch() -> bool:
    """Whether the runs keep CSX in float32 though the trainer enables mixed precision (--float32)."""
    from cs_runtime import env
    return env.EMULATOR_FLOAT32.get()


def validate_runs(checkout: Path, zoo: ZooModel, params: dict, target: str, out: Path, extra_path: list[str],
                  snapshots: dict) -> list:
    """The model zoo's eval of the last checkpoint and eval_all of each: [(mode, its val_loss by step,
    the steps it evaluated)] (an empty val_loss where a run failed: its log says why)."""
    model_dir = out / "model_dir"
    checkpoints = [model_dir / f"checkpoint_{step}.mdl" for step in snapshots]
    runs = []
    for mode, chosen in (("eval", checkpoints[-1:]), ("eval_all", checkpoints)):
        folder = out / mode
        settings = validate_params(params, folder / "model_dir", chosen)
        code, _ = run_zoo(checkout, zoo, settings, target, folder, extra_path, mode=mode)
        evals = run_losses(folder / "model_dir", "val_loss") if code == 0 else {}
        runs.append((mode, evals, [int(c.stem.split("_")[1]) for c in chosen]))
    return runs


def same_run(one: dict, two: dict) -> dict:
    """2 WSEs against 1: the float32 bounds (SwarmX sums the WSEs' gradients in another order than
    one WSE's batch sum, so they may differ in the last bits); the mixed-precision bound where the
    runs were mixed (each WSE's gradients leave it in 16 bits before SwarmX sums them)."""
    row = {"model": one["model"], "target": "CSX2 vs CSX1", "dropout": one["dropout"], "mode": one.get("mode")}
    if not (one.get("losses") and two.get("losses")):
        return {**row, "ok": False, "error": "a run did not finish"}
    loss_err = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(two["losses"], one["losses"]))
    first, second = load_checkpoint(Path(one["final"]))["model"], load_checkpoint(Path(two["final"]))["model"]
    weight_err = max(float((second[k].double() - v.double()).abs().max()) for k, v in first.items()
                     if hasattr(v, "is_floating_point") and v.is_floating_point())
    mixed = one.get("precision", "float32") != "float32"
    ok = (loss_err <= MIXED_LOSS_RTOL and weight_err <= MIXED_WEIGHT_ATOL if mixed
          else loss_err <= LOSS_RTOL and weight_err <= WEIGHT_ATOL)
    return {**row, "ok": ok, "loss_rel_err": loss_err, "weight_err": weight_err}


# ---------------------------------------------------------------- the API names a checkout references
def referenced_names(package: Path, prefix: str) -> set[str]:
    """Every `cstorch.X.Y` chain (cstorch: a name `prefix` is imported as) and every
    `from prefix.X import Y` in the package's sources, each at its longest (a name another extends
    is left out)."""
    names: set[str] = set()
    for path in package.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == prefix or alias.name.startswith(prefix + "."):
                        aliases[alias.asname or prefix] = alias.name if alias.asname else prefix
            elif isinstance(node, ast.ImportFrom) and node.module and \
                    (node.module == prefix or node.module.startswith(prefix + ".")):
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        for node in ast.walk(tree):
            chain = _dotted(node) if isinstance(node, ast.Attribute) else None
            for alias, module in aliases.items() if chain else ():
                head = alias.split(".")
                if chain[:len(head)] == head and len(chain) > len(head):
                    names.add(".".join([module, *chain[len(head):]]))
    return {n for n in names if not any(other.startswith(n + ".") for other in names)}


def _dotted(node) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def resolves(name: str) -> bool:
    """Whether the dotted name imports here: the longest module prefix, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except Exception:  # noqa: BLE001 (any failure to import means: not this prefix)
            continue
        try:
            for part in parts[cut:]:
                value = getattr(value, part)
            return True
        except Exception:  # noqa: BLE001 (a name that fails to resolve, however it fails)
            return False
    return False


def count_names(root: Path, layout: str) -> int:
    prefix = "cerebras.pytorch" if layout == "2.3+" else "cerebras_pytorch"
    package = root / ("cerebras/modelzoo" if layout == "2.3+" else "modelzoo")
    names = sorted(referenced_names(package, prefix))
    missing = [n for n in names if not resolves(n)]
    print(f"modelzoo_oracle: {len(names) - len(missing)} of {len(names)} {prefix} names the model zoo references "
          "resolve here")
    for name in missing:
        print(f"  missing: {name}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkout", type=Path, help="a model zoo checkout (its repository root)")
    parser.add_argument("--models", nargs="+", default=["fc_mnist", "gpt2", "bert"])
    parser.add_argument("--targets", nargs="+", default=["CPU", "CSX1", "CSX2"], choices=["CPU", "CSX1", "CSX2"])
    parser.add_argument("--dropout", nargs="+", default=["zero"], choices=["zero", "shipped"])
    parser.add_argument("--work", type=Path, default=None, help="where runs and data go (default: a temporary folder)")
    parser.add_argument("--modes", nargs="+", default=["train"], choices=MODES,
                        help="the 2.3+ trainer's flows: train; fit_eval (fit with validation every "
                             f"{EVAL_EVERY} steps); restart (stopped at step {RESTART_AT}, resumed to {STEPS}); "
                             "validate (eval and eval_all of the trained checkpoints)")
    parser.add_argument("--float32", action="store_true",
                        help="the 2.3+ trainer's CSX runs in float32 (CS_EMULATOR_FLOAT32=1, an emulator-only "
                             "switch), held to the float32 bounds")
    parser.add_argument("--count-names", action="store_true",
                        help="only count the cerebras.pytorch names the checkout references that resolve here")
    args = parser.parse_args(argv)
    found = layout_of(args.checkout) if args.checkout.is_dir() else None
    if found is None:
        parser.error(f"{args.checkout} is not a model zoo checkout (no modelzoo/common/pytorch/run_utils.py, "
                     "no src/cerebras/modelzoo)")
    layout, root = found
    if args.count_names:
        sys.path[:0] = [str(REPO), str(root)]
        return count_names(root, layout)
    known = LAYOUTS.get(layout, {})
    for name in args.models:
        if name not in known:
            parser.error(f"model {name!r}: not known for the {layout} layout (known: {', '.join(known) or 'none'})")
    if args.float32:
        os.environ["CS_EMULATOR_FLOAT32"] = "1"    # the runs inherit it
    work = args.work or Path(tempfile.mkdtemp(prefix="modelzoo_oracle_"))
    work.mkdir(parents=True, exist_ok=True)
    extra_path = standins_path(work)
    sys.path[:0] = [*extra_path, str(REPO), str(root)]
    runpy.run_path(str(Path(extra_path[0]) / "sitecustomize.py"))    # the runs' stand-ins, here too
    rows = []
    if layout != "2.3+" and args.modes != ["train"]:
        parser.error("--modes other than train are the 2.3+ trainer's (a src/cerebras/modelzoo checkout)")
    for name, mode, dropout in itertools.product(args.models, args.modes, args.dropout):
        for target in args.targets:
            row = check(args.checkout, known[name], target, dropout, work, extra_path, layout, mode)
            print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "final")}), flush=True)
            rows.append(row)
        runs = {r["target"]: r for r in rows if (r["model"], r["dropout"], r.get("mode")) == (name, dropout, mode)}
        if "CSX1" in runs and "CSX2" in runs:
            rows.append(same_run(runs["CSX1"], runs["CSX2"]))
            print(json.dumps(rows[-1]), flush=True)
    failed = [r for r in rows if not r["ok"]]
    print(f"modelzoo_oracle: {len(rows) - len(failed)} of {len(rows)} checks pass (work folder {work})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
