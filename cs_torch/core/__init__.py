"""cstorch.core: the run modes (`core.modes`) as the model zoo's flow imports them.

    annotation.py  AnnotationMode, create_annotation: compiler attributes of a region (validated, no effect)
    modes.py       the run modes a model zoo run.py takes, by the real API's names
    name_scope.py  name scopes and debug names
    pol.py         pol / current_pol: kernels' precision optimisation levels (checked and kept)
    tensors.py     tensors on the host: make_constant, to_numpy, from_numpy
"""
from . import modes, name_scope, pol, tensors  # noqa: F401 (cstorch.core.modes as scripts reach it; no torch)
