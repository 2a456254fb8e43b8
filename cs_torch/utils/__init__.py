"""cstorch.utils.

    data.py         DataLoader(input_fn, *args), DataExecutor, CSConfig
    tensorboard.py  SummaryWriter and SummaryReader
    nest.py         walking a nested batch to its tensors (visit_torch_tensors)
"""
from . import data, nest, tensorboard
from .data import CSConfig

__all__ = ["CSConfig", "data", "nest", "tensorboard"]
