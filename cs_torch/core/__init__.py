"""cstorch.core: the run modes (`core.modes`) as the model zoo's flow imports them."""
