"""cstorch.utils: data (DataLoader, DataExecutor), tensorboard (SummaryWriter), CSConfig."""
from . import data, tensorboard
from .data import CSConfig

__all__ = ["CSConfig", "data", "tensorboard"]
