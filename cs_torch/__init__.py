"""cs_torch: write your own training loop for the emulated CS system, in the spirit of
Cerebras' PyTorch integration (cerebras.pytorch). No torch needed.

    import cs_torch as cstorch
    from cs_runtime.data.mnist import load_mnist
    from cs_runtime.numerics.model import mlp_spec

    def train_input_fn():
        return load_mnist(None, "train")

    if __name__ == "__main__":
        cstorch.initialize(cs_ip=None, num_csx=1)
        model = cstorch.module(mlp_spec("fc_mnist", [784, 256, 128, 10], "relu", 0.1))
        loader = cstorch.dataloader(train_input_fn, batch_size=100, num_steps=100)
        optimizer = cstorch.optim.SGD(lr=0.01, momentum=0.9)
        with cstorch.Session(model, optimizer, cstorch.nn.CrossEntropyLoss(), mode="train") as session:
            for step, batch in enumerate(loader):
                loss = session.step(batch)

See examples/fc_mnist/train_cstorch.py and docs/cs_torch.md.
"""
from . import nn, optim
from .data import Batch, DataLoader
from .nn import CsTorchError
from .session import JobFailed, Module, Session, dataloader, initialize, manual_seed, module

__all__ = ["Batch", "CsTorchError", "DataLoader", "JobFailed", "Module", "Session", "dataloader", "initialize",
           "manual_seed", "module", "nn", "optim"]
