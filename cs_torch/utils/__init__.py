"""cstorch.utils.

    data.py         DataLoader(input_fn, *args), DataExecutor, CSConfig
    tensorboard.py  SummaryWriter and SummaryReader
"""
from . import data, tensorboard
from .data import CSConfig

__all__ = ["CSConfig", "data", "tensorboard"]
