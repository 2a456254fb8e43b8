"""The compiler's one error: a model it cannot compile, said in one line that names the layer and the op."""


class CompileError(ValueError):
    """The model cannot be compiled; the message names the layer and the op."""
