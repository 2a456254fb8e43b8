"""A plain PyTorch MLP on MNIST, handed to the project as it is.

    csrun_cpu python examples/torch_mlp/run.py --mode train --params examples/torch_mlp/configs/params.yaml
    csrun_wse python examples/torch_mlp/run.py --mode train --params examples/torch_mlp/configs/params.yaml

model_fn builds an ordinary torch.nn.Module and captures it with an example
batch and a loss (cs_torch/capture.py); every path then runs the compiled
program, starting from the module's own (torch-initialised) weights.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from cs_runtime.data.mnist import load_mnist
from cs_runtime.runner import run
from cs_torch.capture import model_spec


class MLP(nn.Module):
    def __init__(self, sizes: list[int]):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


def model_fn(params):
    m = params.model
    torch.manual_seed(params.runconfig.seed)
    module = MLP([m.input_size, *m.hidden_sizes, m.num_classes])
    batch = params.train_input.batch_size
    example = (torch.zeros(batch, m.input_size), torch.zeros(batch, dtype=torch.long))
    return model_spec("torch_mlp", module, example[:1], example[1], F.cross_entropy)


def train_input_fn(params):
    return load_mnist(params.train_input.data_dir, "train")


def eval_input_fn(params):
    return load_mnist(params.eval_input.data_dir, "test")


if __name__ == "__main__":
    run(model_fn, train_input_fn, eval_input_fn)
