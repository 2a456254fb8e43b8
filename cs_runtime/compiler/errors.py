"""The compiler's one error: a model it cannot compile, said in one line that names the layer and the op."""
from cs_runtime.errors import UserInputError


class CompileError(UserInputError):
    """The model cannot be compiled; the message names the layer and the op (bad input: exit 2, no restart)."""
