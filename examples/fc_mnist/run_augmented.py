"""FC-MNIST with an expensive augmentation: an input-bound run for scaling input workers.

    csrun_wse --num_workers_per_csx 4 python examples/fc_mnist/run_augmented.py --mode train \
        --params examples/fc_mnist/configs/params.yaml

Every training sample is shifted by up to 2 pixels and blurred AUGMENT_ROUNDS
times (environment, default 60) with a 3x3 box filter, one sample at a time as
a typical Python augmentation would. The shift is drawn from the sample's
index, so a batch is the same whichever worker makes it (the numbers do not
depend on the worker count, as the oracle requires).
"""
import os

import numpy as np

from cs_runtime.data.mnist import load_mnist
from cs_runtime.runner import run

from run import eval_input_fn, model_fn  # noqa: E402  (same folder; runs as a script)

SIDE = 28


class AugmentedDigits:
    def __init__(self, images: np.ndarray, labels: np.ndarray, rounds: int):
        self.images, self.labels, self.rounds = images, labels, rounds

    def __len__(self) -> int:
        return len(self.labels)

    def get(self, indices: np.ndarray):
        return np.stack([self.augment(int(i)) for i in indices]), self.labels[indices]

    def augment(self, index: int) -> np.ndarray:
        shift = np.random.default_rng(index).integers(-2, 3, size=2)
        image = np.roll(self.images[index].reshape(SIDE, SIDE), tuple(shift), axis=(0, 1))
        for _ in range(self.rounds):
            padded = np.pad(image, 1, mode="edge")
            image = sum(padded[dy:dy + SIDE, dx:dx + SIDE] for dy in range(3) for dx in range(3)) / 9.0
        return image.reshape(-1).astype(np.float32)


def train_input_fn(params):
    images, labels = load_mnist(params.train_input.data_dir, "train")
    return AugmentedDigits(images, labels, int(os.environ.get("AUGMENT_ROUNDS", "60")))


if __name__ == "__main__":
    run(model_fn, train_input_fn, eval_input_fn, model="fc_mnist")
