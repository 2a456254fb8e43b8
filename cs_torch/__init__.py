"""cs_torch: write your own training loop for the emulated CS system, in the spirit of
Cerebras' PyTorch integration (cerebras.pytorch). No torch needed.

    import cs_torch as cstorch
    from cs_runtime.data.mnist import load_mnist
    from cs_runtime.numerics.model import mlp_spec

    def train_input_fn():
        return load_mnist(None, "train")

    if __name__ == "__main__":
        cstorch.initialize(cs_ip=None, num_csx=1)
        model = cstorch.module(mlp_spec("fc_mnist", [784, 256, 128, 10], "relu", 0.1))
        loader = cstorch.dataloader(train_input_fn, batch_size=100, num_steps=100)
        optimizer = cstorch.optim.SGD(lr=0.01, momentum=0.9)
        with cstorch.Session(model, optimizer, cstorch.nn.CrossEntropyLoss(), mode="train") as session:
            for step, batch in enumerate(loader):
                loss = session.step(batch)

See examples/fc_mnist/train_cstorch.py and docs/cs_torch.md.

The Cerebras PyTorch 2.x API for torch.nn.Modules (backend, compile, trace,
step_closure, checkpoint_closure, save, load, utils.data, optim with
lr_scheduler, amp, summarize_scalar, summarize_tensor, metrics) is here too, imported on first use so
that this package needs torch only when a torch model is brought; see
docs/cstorch.md. The 1.x API is cs_torch.cbtorch.
"""
import importlib
from . import nn, optim
from .data import Batch, DataLoader
from .nn import CsTorchError
from .session import JobFailed, Module, Session, dataloader, initialize, manual_seed, module

# The 2.x names, each from the module that holds it; loaded on first use (they need torch).
_LAZY = {"current_backend": "backends", "compile": "tracing", "trace": "tracing",
         "step_closure": "tracing", "checkpoint_closure": "tracing", "save": "saving", "load": "saving",
         "summarize_scalar": "summary", "summarize_tensor": "summary", "use_cs": "backends",
         "current_executor": "recording", "name_scope": "core.name_scope", "add_debug_name": "core.name_scope",
         "get_debug_name": "core.name_scope", "make_constant": "core.tensors", "to_numpy": "core.tensors",
         "from_numpy": "core.tensors"}
# `backend` is a callable module: cstorch.backend("CSX") and cstorch.backend.use_cs() (cs_torch/backend).
_LAZY_MODULES = ("utils", "amp", "distributed", "cbtorch", "metrics", "core", "backend")

# The release of the real API this emulates (the model zoo writes it into checkpoints).
__version__ = "2.1.1"


# Parts of the real API the emulator does not have: one line saying so, not a bare AttributeError.
_NOT_SUPPORTED = {"sparse": "weights are dense (no sparsity masks in the program or MemoryX)",
                  "saver": "checkpoints are cstorch.save / cstorch.load's files (docs/cstorch.md)",
                  "experimental": "listeners and implicit autoregressive loops are not emulated",
                  "storage": "checkpoints are cstorch.save / cstorch.load's files (docs/cstorch.md)",
                  "profiler": "use csrun_wse --trace timelines (docs/running.md) for where a step's time goes"}


def __getattr__(name):
    if name in _NOT_SUPPORTED:
        raise AttributeError(f"cstorch.{name} is not supported by the emulator: {_NOT_SUPPORTED[name]}")
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'cs_torch' has no attribute {name!r}")


__all__ = ["Batch", "CsTorchError", "DataLoader", "JobFailed", "Module", "Session", "dataloader", "initialize",
           "manual_seed", "module", "nn", "optim"]
