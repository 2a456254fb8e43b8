"""FC-MNIST: a fully connected digit classifier, model-zoo style.

    csrun_cpu python examples/fc_mnist/run.py --mode train --params examples/fc_mnist/configs/params.yaml
    csrun_wse python examples/fc_mnist/run.py --mode train --params examples/fc_mnist/configs/params.yaml

With `train_input.data_dir: null` it trains on the real handwritten digits
embedded in the package; point data_dir at a folder of MNIST IDX files
(train-images-idx3-ubyte[.gz], ...) for the full data set.
"""
from cs_runtime.data.mnist import load_mnist
from cs_runtime.numerics.model import mlp_spec
from cs_runtime.runner import run


def model_fn(params):
    m = params.model
    return mlp_spec("fc_mnist", m.layer_sizes(), m.activation_fn, m.dropout)


def mnist_split(section, default: str) -> str:
    """The section's `split` (the model zoo's, 2.5 on: train, or val for the test digits)."""
    return {"train": "train", "val": "test", "test": "test"}[section.split or default]


def train_input_fn(params):
    return load_mnist(params.train_input.data_dir, mnist_split(params.train_input, "train"))


def eval_input_fn(params):
    return load_mnist(params.eval_input.data_dir, mnist_split(params.eval_input, "test"))


if __name__ == "__main__":
    run(model_fn, train_input_fn, eval_input_fn, model="fc_mnist")
