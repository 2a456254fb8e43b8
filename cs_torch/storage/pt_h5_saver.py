"""cstorch.saver.pt_h5_saver (2.0/2.1): the module the model zoo imports PyTorchH5Saver from."""
from . import PyTorchH5Saver

__all__ = ["PyTorchH5Saver"]
