"""cstorch.utils.tensorboard.SummaryWriter."""
from ..summary import SummaryWriter

__all__ = ["SummaryWriter"]
