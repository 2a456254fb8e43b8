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

    session.py          initialize(), module(), Session: a training loop of your own
    data.py             dataloader(input_fn, batch_size): batches made by the job's input workers
    input_worker.py     python -m cs_torch.input_worker (started by a Session)
    nn.py               layers and the loss, PyTorch-style names for the project's model description
    optim.py            optimizers by PyTorch's names (params.yaml's section; torch modules': optimizers.py)
    lib.py              cstorch.lib.cerebras_pytorch_lib.set_attribute (compiler attributes: checked, dropped)
    optim_params.py     cstorch.optim.optimizer: ParamsT (an optimizer's parameters, as a type)
    optimizers.py       cstorch.optim for torch modules (2.x): SGD, Adam, AdamW; on CPU eight more (Adagrad, ...)
    lr_scheduler.py     cstorch.optim.lr_scheduler
    scheduler.py        cstorch.optim.scheduler: any param-group value by the step (lr, weight decay)
    weight_decay_scheduler.py  cstorch.optim.weight_decay_scheduler
    amp.py              GradScaler and the half dtype
    backends.py         cstorch.backend(): where a 2.x run executes
    csx_settings.py     cstorch.backends.csx: the CS system's settings (POL, debug, performance), kept
    distributed/        cstorch.distributed: the cluster settings of a backend, the job's tasks
    backend/            cstorch.backend: the function and the module of the real API's names
    core/               cstorch.core: run modes, name scopes and debug names, host tensors
    nn_functional.py    cstorch.nn.functional (one_hot)
    nn_losses.py        cstorch.nn's losses for torch modules (SmoothL1Loss)
    selective_grad.py   cstorch.nn.SelectiveGrad: only the masked entries of chosen parameters are trained
    optim_configure.py  cstorch.optim.configure_param_groups / configure_optimizer / configure_lr_scheduler
    capture.py          a torch.nn.Module captured as a program (torch.export)
    tracing.py          compile, @trace, @step_closure, @checkpoint_closure
    recording.py        what the step in progress is doing, read by what records into it
    cirh.py             cstorch.cirh: the CS system's sampling kernels by name (FusedTopK, FusedTopP)
    profiler.py         cstorch.profiler: profile / schedule, the units of a range of steps timed (CPU backend)
    csx_grads.py        a parameter's gradient in a CSX step: its norm (MemoryX keeps the values)
    engine.py           the 2.x step engine: one captured program, on the CPU path
    cluster_step.py     a traced step as a job of the emulated CS system
    loader_replay.py    a torch DataLoader's order replayed epoch by epoch for a CSX run (user and input workers)
    cbtorch.py          the 1.x API (cbtorch); cbtorch_cluster.py: its loop on the CS system
    batch_files.py      a 1.x loop's IterableDataset read as the loop goes, one file a step for the workers
    saving.py           cstorch.save / cstorch.load
    storage/            cstorch.storage (2.0/2.1: saver): the model zoo's HDF5 checkpoints
    summary.py          summarize_scalar, summarize_tensor
    oracle.py           torch eager given a run's dropout masks, for oracle comparisons
    hooks.py            user hooks and the handles that remove them (backend and listener hooks)
    metrics.py          cstorch.metrics
    utils/              cstorch.utils: data (DataLoader, DataExecutor), tensorboard, CSConfig
    experimental/       cstorch.experimental: its module names; listener hooks; the rest refused in one line
    sparse/             cstorch.sparse: 2.0/2.1 static sparsity on the CPU backend; the 2.3+ algorithms' names
"""
import importlib
from . import nn, optim
from .data import Batch, DataLoader
from .nn import CsTorchError
from .session import JobFailed, Module, Session, dataloader, initialize, manual_seed, module
from cs_runtime.errors import exit_on_user_input_error

# A script written for the real API (the model zoo's run.py) catches nothing: our one-line errors
# out of it end the run as they do out of the project's own entry points (one line, exit 2).
exit_on_user_input_error()

# The 2.x names, each from the module that holds it; loaded on first use (they need torch).
_LAZY = {"current_backend": "backends", "compile": "tracing", "trace": "tracing",
         "step_closure": "tracing", "checkpoint_closure": "tracing", "save": "saving", "load": "saving",
         "summarize_scalar": "summary", "summarize_tensor": "summary", "use_cs": "backends",
         "current_executor": "recording", "name_scope": "core.name_scope", "add_debug_name": "core.name_scope",
         "get_debug_name": "core.name_scope", "make_constant": "core.tensors", "to_numpy": "core.tensors",
         "from_numpy": "core.tensors", "full": "core.tensors", "full_like": "core.tensors",
         "ones": "core.tensors", "ones_like": "core.tensors", "zeros": "core.tensors", "zeros_like": "core.tensors",
         "current_torch_device": "backends", "pol": "core.pol", "current_pol": "core.pol"}
# `backend` is a callable module: cstorch.backend("CSX") and cstorch.backend.use_cs() (cs_torch/backend).
_LAZY_MODULES = ("utils", "amp", "distributed", "cbtorch", "metrics", "core", "backend", "storage", "sparse", "lib",
                 "experimental", "profiler", "cirh")

# The real package sets this while its API docs are built; code run then skips work (never here).
_generating_docs = False

# The release of the real API this emulates (the model zoo writes it into checkpoints).
__version__ = "2.1.1"


# Parts of the real API the emulator does not have: one line saying so, not a bare AttributeError.
_NOT_SUPPORTED = {"mesh": "one device mesh: the CS system of the job"}


def _as_vendor_package() -> None:
    """What importing a vendor's name (cerebras_pytorch, cerebras.pytorch) adds: the vendor's package is
    a torch package, so with torch installed the signatures the real API documents name torch's types
    (cs_torch may have been imported before torch). Without torch the ModelSpec API, and the names,
    still import."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    from . import lr_scheduler, weight_decay_scheduler
    optim.document_signatures()
    lr_scheduler.annotate()
    weight_decay_scheduler.annotate()


def __getattr__(name):
    if name in _NOT_SUPPORTED:
        raise AttributeError(f"cstorch.{name} is not supported by the emulator: {_NOT_SUPPORTED[name]}")
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name == "saver":   # the 2.0/2.1 name of storage (saver.PyTorchH5Saver)
        return importlib.import_module(".storage", __name__)
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'cs_torch' has no attribute {name!r}")


__all__ = ["Batch", "CsTorchError", "DataLoader", "JobFailed", "Module", "Session", "dataloader", "initialize",
           "manual_seed", "module", "nn", "optim"]
