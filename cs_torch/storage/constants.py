"""cstorch.storage.constants: the names of a checkpoint file's attributes, and the format version written.

The real API's names: a tool that reads a checkpoint (the model zoo's checkpoint command) asks for
`__CSTORCH_VERSION__` to show the release that wrote it.
"""
__VERSION__ = "__version__"                  # the checkpoint format's version
__CSTORCH_VERSION__ = "__cstorch_version__"  # the cstorch release that wrote the file
__SPEC__ = "__spec__"     # the real API's pickled tree of containers: never written nor read here

CURRENT_CKPT_FORMAT_VERSION = 0.4   # the model zoo's checkpoint format of the release emulated
