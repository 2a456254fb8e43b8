"""cstorch.sparse: weight sparsity, as far as it is emulated.

    static.py       the 2.0/2.1 API the model zoo's flow calls: static sparsity on the CPU backend
                    (configure_sparsity_optimizer, StaticSparsityOptimizer, SparsityWrapperOptimizer,
                    configure_sparsity_wrapper); dynamic types and CSX are refused in one line
    configure.py    the 2.3+ API: configure(config) (refused in one line) and default_sparse_param_filter

The 2.3+ trainer annotates its sparsity option with SparsityAlgorithm, builds its params schema
from the algorithms' signatures and checks isinstance against Group, so those classes exist;
making one (a params file with `sparsity:`) fails in one line naming what is not emulated,
so no run trains dense weights as if they were sparse.
"""
from __future__ import annotations

import abc

from . import configure as _configure_module   # noqa: F401 (the submodule, before the function below)
from .configure import NOT_EMULATED, configure, default_sparse_param_filter
from .static import (BaseSparsityOptimizer, SparsityWrapperOptimizer, StaticSparsityOptimizer,
                     configure_sparsity_optimizer, configure_sparsity_wrapper)

__all__ = ["BaseSparsityOptimizer", "Group", "SparsityAlgorithm", "SparsityWrapperOptimizer", "Static",
           "StaticSparsityOptimizer", "configure", "configure_sparsity_optimizer", "configure_sparsity_wrapper",
           "default_sparse_param_filter"]


class SparsityAlgorithm(abc.ABC):
    """The base of the real package's sparsity algorithms (abstract)."""

    @abc.abstractmethod
    def __init__(self, sparsity=None, init_method: str = "random"):
        """Each algorithm's own options."""


class Static(SparsityAlgorithm):
    """Static sparsity: fixed masks. Refused when made (see the module's docstring)."""

    def __init__(self, sparsity: float | None = None, init_method: str = "random"):
        raise NotImplementedError(f"cstorch.sparse.Static: {NOT_EMULATED}")


class Group(SparsityAlgorithm):
    """Several algorithms, each on the parameters a filter picks. Refused when made."""

    def __init__(self, groups: dict | None = None):
        raise NotImplementedError(f"cstorch.sparse.Group: {NOT_EMULATED}")
