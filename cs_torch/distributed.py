"""cstorch.distributed.ClusterConfig (the cluster settings of cstorch.backend)."""
from .backend import ClusterConfig

__all__ = ["ClusterConfig"]
