"""cstorch.sparse.configure: both the module (default_sparse_param_filter) and, called, the
function that makes a sparsity algorithm from a config (refused: sparsity is not emulated)."""
from __future__ import annotations

import sys
import types

NOT_EMULATED = ("the 2.3+ sparsity algorithms are not emulated (only the 2.0/2.1 static sparsity of "
                "configure_sparsity_optimizer, on the CPU backend)")

# Parameters that are never made sparse by default: the real filter's documented exclusions.
_DENSE_BY_DEFAULT = ("embedding", "norm", "lm_head", "pe_helper")


def default_sparse_param_filter(name: str, param) -> bool:
    """Whether sparsity applies to this parameter by default: a weight of 2 or more dims that is not
    an embedding, a normalisation layer's, the LM head's or a position-embedding helper's."""
    return len(param.shape) > 1 and not any(part in name.lower() for part in _DENSE_BY_DEFAULT)


def configure(config):
    raise NotImplementedError(f"cstorch.sparse.configure: {NOT_EMULATED}")


class _CallableModule(types.ModuleType):
    def __call__(self, config):
        return configure(config)


# `import cerebras.pytorch.sparse.configure` sets the package's `configure` to this module: calling
# it must still be the function, as `cstorch.sparse.configure(config)` in the model zoo does.
sys.modules[__name__].__class__ = _CallableModule
