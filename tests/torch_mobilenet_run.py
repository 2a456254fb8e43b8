"""run.py of torchvision's mobilenet_v3_small with batch norm in training (its running
statistics kept) on seeded random images: a model of hundreds of arrays, whose LOAD_MODEL
table outgrows a message header (tests/test_cluster.py)."""
import sys
from pathlib import Path

import numpy as np
import torch

if not __package__:  # run as a script: the tests package is found from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cs_runtime.runner import run  # noqa: E402
from cs_torch.capture import model_spec  # noqa: E402
from tests.other_models import importable_torchvision  # noqa: E402

CLASSES, SIDE = 5, 32


def data_set(count=32):
    rng = np.random.default_rng(5)
    return rng.standard_normal((count, 3, SIDE, SIDE)).astype(np.float32), rng.integers(0, CLASSES, count)


def model_fn(params):
    torch.manual_seed(0)
    module = importable_torchvision().models.mobilenet_v3_small(num_classes=CLASSES, dropout=0.0)
    x, y = data_set(params.train_input.batch_size)
    return model_spec("mobilenet_v3_small", module, (torch.from_numpy(x),), torch.from_numpy(y),
                      torch.nn.functional.cross_entropy)


def input_fn(params):
    return data_set()


if __name__ == "__main__":
    run(model_fn, input_fn, input_fn)
