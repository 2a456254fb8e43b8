"""cstorch.core: the run modes (`core.modes`) as the model zoo's flow imports them.

    modes.py       the run modes a model zoo run.py takes, by the real API's names
    name_scope.py  name scopes and debug names
    tensors.py     tensors on the host: make_constant, to_numpy, from_numpy
"""
