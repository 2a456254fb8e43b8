"""cstorch.utils.

    data.py         DataLoader(input_fn, *args), DataExecutor, CSConfig
    synthetic.py    SyntheticDataset: samples made from a spec (torch)
    nest.py         walking nested batches and state dicts by scope (visit_torch_tensors, recurse_spec)
    tensorboard.py  SummaryWriter and SummaryReader
"""
from . import data, nest, tensorboard
from .data import CSConfig, DataLoader

__all__ = ["CSConfig", "DataLoader", "SyntheticDataset", "data", "nest", "tensorboard"]


def __getattr__(name: str):
    if name == "SyntheticDataset":   # it needs torch: loaded when asked for
        from .synthetic import SyntheticDataset
        return SyntheticDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
