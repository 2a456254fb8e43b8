"""FC-MNIST whose input worker 1 is slow, and once stalls: for the input-bottleneck test.

Same data, model and batches as examples/fc_mnist/run.py, so the CPU oracle
applies; only the time worker 1 takes differs (the sleeps stand for a slow
decoder and a stuck file system, not for synchronisation).
"""
import os
import time

from cs_runtime.data.mnist import load_mnist
from cs_runtime.numerics.model import mlp_spec
from cs_runtime.runner import run

SLOW_S = float(os.environ.get("SLOW_INPUT_S", "0.5"))   # for each of the first SLOW_CALLS batches
STALL_S = float(os.environ.get("STALL_INPUT_S", "0"))   # once, at batch STALL_AT_CALL
SLOW_CALLS = 12
# Right after the slow batches: the WSE is already waiting for this worker, so
# the whole stall is time without a step (later, its prefetched batches would hide part of it).
STALL_AT_CALL = SLOW_CALLS + 1


class SlowOnWorker1:
    def __init__(self, data):
        self.x, self.y = data
        self.slow = os.environ.get("CS_ROLE") == "worker" and os.environ.get("CS_RANK") == "1"
        self.calls = 0

    def __len__(self):
        return len(self.y)

    def get(self, indices):
        if self.slow:
            self.calls += 1
            if self.calls <= SLOW_CALLS:
                time.sleep(SLOW_S)
            elif self.calls == STALL_AT_CALL:
                time.sleep(STALL_S)
        return self.x[indices], self.y[indices]


def model_fn(params):
    m = params.model
    return mlp_spec("fc_mnist", m.layer_sizes(), m.activation, m.dropout)


def train_input_fn(params):
    return SlowOnWorker1(load_mnist(params.train_input.data_dir, "train"))


if __name__ == "__main__":
    run(model_fn, train_input_fn)
