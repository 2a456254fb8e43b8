"""A LeNet-style PyTorch CNN on MNIST, handed to the project as it is.

    csrun_cpu python examples/torch_cnn/run.py --mode train --params examples/torch_cnn/configs/params.yaml
    csrun_wse python examples/torch_cnn/run.py --mode train --params examples/torch_cnn/configs/params.yaml

The data pipeline gives flat 784-pixel rows; the module reshapes them to 1 x 28 x 28 images itself.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from cs_runtime.data.mnist import load_mnist
from cs_runtime.runner import run
from cs_torch.capture import model_spec


class LeNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)     # 28 x 28
        self.conv2 = nn.Conv2d(6, 16, 5)               # 14 -> 10
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, classes)

    def forward(self, x):
        x = x.view(-1, 1, 28, 28)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def model_fn(params):
    torch.manual_seed(params.runconfig.seed)
    batch = params.train_input.batch_size
    example = (torch.zeros(batch, 784), torch.zeros(batch, dtype=torch.long))
    return model_spec("torch_cnn", LeNet(params.model.num_classes), example[:1], example[1], F.cross_entropy)


def train_input_fn(params):
    return load_mnist(params.train_input.data_dir, "train")


def eval_input_fn(params):
    return load_mnist(params.eval_input.data_dir, "test")


if __name__ == "__main__":
    run(model_fn, train_input_fn, eval_input_fn)
