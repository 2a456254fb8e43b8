"""run.py of tests/test_torch_batch_norm.conv_bn (a conv + BatchNorm classifier in training,
running statistics kept) on seeded random images, for the cluster tests that train it
on the CPU path, one and two WSEs and pipelined (tests/test_torch_batch_norm.py).
BN_SYNC=1 in the environment: its batch norms as SyncBatchNorm."""
import os
import sys
from pathlib import Path

import torch

if not __package__:  # run as a script: the tests package is found from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cs_runtime.runner import run  # noqa: E402
from cs_torch.capture import model_spec  # noqa: E402
from tests.test_torch_batch_norm import conv_bn, data_set  # noqa: E402


def model_fn(params):
    x, y = data_set(params.train_input.batch_size)
    return model_spec("conv_bn", conv_bn(sync=os.environ.get("BN_SYNC") == "1"), (torch.from_numpy(x),), torch.from_numpy(y),
                      torch.nn.functional.cross_entropy)


def input_fn(params):
    return data_set()


if __name__ == "__main__":
    run(model_fn, input_fn, input_fn)
