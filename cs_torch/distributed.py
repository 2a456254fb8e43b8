"""cstorch.distributed.ClusterConfig (the cluster settings of cstorch.backend)."""
from .backends import ClusterConfig

__all__ = ["ClusterConfig"]
