"""The older (1.x) Cerebras PyTorch API, on the same capture and executor as the 2.x API.

    import cs_torch.cbtorch as cbtorch

    cbtorch.initialize(cs_ip=None, compile_dir="compile")
    device = cbtorch.device()
    model = cbtorch.module(Model(), device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train_loader = cbtorch.dataloader(torch_loader)
    with cbtorch.Session(train_loader, mode="train") as session:
        for epoch in range(num_epochs):
            for step, (inputs, targets) in enumerate(train_loader):
                optimizer.zero_grad()
                outputs = model(inputs)
                loss = loss_fn(outputs, targets)
                loss.backward()
                optimizer.step()
                session.add_step_closure(print_loss, [loss, step])

With a CSX backend (`initialize(cs_ip=...)`, or a "CSX" backend made
before) the Session's loop is one job of the CS system: its first iteration
is recorded and captured with the model as one program, and every iteration
is a step on the WSEs (cs_torch/cbtorch_cluster.py).

With a CPU backend `module` captures the model alone, on its first call, as
a program whose loss is sum(output * g) with g an input. Its forward runs the
program's forward nodes and gives the output; torch's backward hands g =
d loss / d output to the program's backward (unit by unit), whose parameter
gradients land in `.grad`. The loss function and the optimizer (torch's or
cstorch's) run as the script wrote them.
"""
from __future__ import annotations

import numpy as np
import torch

from cs_runtime.numerics.executor import forward_backward, rounded, run_nodes

from . import amp
from . import capture as capture_mod
from .backends import backend, current_backend, note
from .nn import CsTorchError
from .recording import _active, legacy_loop
from .tracing import _host_values

MODES = ("train", "eval")


def initialize(cs_ip: str | None = None, service_workdir: str = "./", compile_dir: str | None = None,
               compile_only: bool = False, validate_only: bool = False, num_csx: int = 1,
               num_workers_per_csx: int = 0, use_cbfloat16: bool = False, cpu: bool = False, **kwargs):
    """Where the run executes: cs_ip names the CS system; without it the job starts an emulated
    CS system of num_csx WSEs on this machine (as csrun_wse does); cpu=True (the emulator's
    switch) runs the model in this process instead."""
    for key in sorted(kwargs):
        note(f"cbtorch.initialize: argument {key}={kwargs[key]!r} is not honoured by the emulator")
    if use_cbfloat16:   # asks for mixed precision in cbfloat16
        amp.set_half_dtype("cbfloat16")
    return backend("CPU" if cpu else "CSX", artifact_dir=service_workdir, compile_dir=compile_dir,
                   compile_only=compile_only, validate_only=validate_only, mixed_precision=bool(use_cbfloat16),
                   cluster_config={"mgmt_address": cs_ip, "num_csx": num_csx,
                                   "num_workers_per_csx": num_workers_per_csx})


def device():
    return torch.device("cpu")


def _sum_with(output, g):
    return (output * g).sum()


class _Program:
    """The model's program at one input shape, and where its output is."""

    def __init__(self, model, args):
        with torch.no_grad():
            out = model(*args)
        if not isinstance(out, torch.Tensor):
            raise CsTorchError(f"cbtorch.module: the model returns {type(out).__name__}; one tensor is supported")
        try:
            self.captured = capture_mod.capture(model, args, torch.zeros_like(out), _sum_with, dropout=False)
        except capture_mod.CaptureError as exc:
            raise CsTorchError(f"cbtorch.module: {exc}") from None
        program = self.captured.program
        mul = next(n for n in program.nodes if n.op == "mul" and "target" in n.inputs)
        self.output = next(i for i in mul.inputs if i != "target")
        self.shape, self.dtype = tuple(out.shape), out.dtype
        self.params = {name: model.get_parameter(name) for name in program.params}

    def inputs(self, args, g=None, fmt: str = "float32") -> dict:
        """The model's inputs (in `fmt`, as they stream) and g, the output's gradient (as torch gives it)."""
        names = self.captured.input_names
        arrays = [a.detach().cpu().numpy() for a in args]
        feed = rounded(dict(zip(names, arrays)), fmt)
        feed[names[len(arrays)]] = g if g is not None else np.zeros(self.shape, np.float32)
        return feed

    def weights(self) -> dict:
        return {name: p.detach().numpy() for name, p in self.params.items()}

    def forward(self, args) -> np.ndarray:
        fmt = amp.precision()
        env = {**rounded(self.weights(), fmt), **self.inputs(args, fmt=fmt), **self.captured.program.consts}
        return run_nodes(self.captured.program.nodes, env, fmt=fmt)[self.output]

    def backward(self, args, g: np.ndarray) -> dict:
        fmt = amp.precision()
        _, grads = forward_backward(self.captured.units, self.weights(), self.inputs(args, g, fmt),
                                    self.captured.program.consts, self.captured.program.outputs["loss"],
                                    fmt=fmt, round_inputs=False)
        return {self.params[name]: grad for name, grad in grads.items()}


class _Run(torch.autograd.Function):
    @staticmethod
    def forward(ctx, program, anchor, *args):
        ctx.program, ctx.args = program, args
        return torch.from_numpy(np.array(program.forward(args)))

    @staticmethod
    def backward(ctx, g):
        grads = ctx.program.backward(ctx.args, g.detach().numpy().astype(np.float32))
        for p, grad in grads.items():
            grad = torch.from_numpy(np.array(grad, dtype=np.float32))
            p.grad = grad if p.grad is None else p.grad + grad
        return (None, None, *(None for _ in ctx.args))


class CompiledModule(torch.nn.Module):
    """cbtorch.module's result: calls run the model's compiled program; parameters are the model's."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self._programs: dict = {}
        # autograd needs one tensor that requires grad to call the backward at all
        self._anchor = torch.zeros((), requires_grad=True)

    def forward(self, *args):
        if not args or not all(isinstance(a, torch.Tensor) for a in args):
            raise CsTorchError("cbtorch.module: call the model with positional tensors")
        loop = legacy_loop()
        if loop is not None:   # a Session on the CS system: the step runs there
            return loop.model_call(self, args)
        key = tuple((tuple(a.shape), a.dtype) for a in args)
        program = self._programs.get(key)
        if program is None:
            if self._programs:
                note(f"cbtorch.module: a new input shape {key[0][0]}: compiling the model again")
            program = self._programs[key] = _Program(self.model, args)
        if not torch.is_grad_enabled():
            return torch.from_numpy(np.array(program.forward(args)))
        return _Run.apply(program, self._anchor, *args)

    def parameters(self, recurse: bool = True):
        return self.model.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.model.named_parameters(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.model.load_state_dict(*args, **kwargs)


def module(model: torch.nn.Module, device=None) -> CompiledModule:
    if not isinstance(model, torch.nn.Module):
        raise CsTorchError(f"cbtorch.module: expected a torch.nn.Module, got {type(model).__name__}")
    return CompiledModule(model)


class _Loader:
    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        loop = legacy_loop()
        if loop is not None and loop.dataloader is self:   # the batches the input workers stream
            return loop.batches(self)
        return iter(self.loader)

    def __len__(self):
        return len(self.loader)


def dataloader(torch_dataloader) -> _Loader:
    if not hasattr(torch_dataloader, "__iter__"):
        raise CsTorchError(f"cbtorch.dataloader: expected a torch DataLoader, got {type(torch_dataloader).__name__}")
    return _Loader(torch_dataloader)


class Session:
    """with Session(dataloader, mode="train") as session: the loop of one run; with a CSX
    backend the loop is one job of the CS system (cs_torch/cbtorch_cluster.py)."""

    def __init__(self, dataloader=None, mode: str = "train"):
        if mode not in MODES:
            raise CsTorchError(f"cbtorch.Session: mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.dataloader, self.mode = dataloader, mode
        self.closures_run = 0
        self._loop = None

    def __enter__(self) -> "Session":
        backend = current_backend()
        if backend.is_csx and not (backend.compile_only or backend.validate_only):
            from .cbtorch_cluster import ClusterLoop
            if legacy_loop() is not None:
                raise CsTorchError("cbtorch.Session: a Session is running already (one at a time)")
            self._loop = ClusterLoop(self, backend)
            self._patch = _LoopHooks(self._loop)
            self._patch.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            try:
                loop.finish(exc)
            finally:
                self._patch.__exit__()
        return None

    def add_step_closure(self, closure, args=(), run_async: bool = False) -> None:
        """Run closure with the step's tensors as host tensors (the step's values exist once it returns)."""
        self.closures_run += 1
        if self._loop is not None:
            self._loop.closure(closure, args)
            return
        closure(*_host_values(tuple(args)))

    def is_master_ordinal(self) -> bool:
        return True


class _LoopHooks:
    """While a Session runs on the CS system: backward() and every torch optimizer's step() go to its loop
    (a torch optimizer's own step then finds no gradient and changes nothing)."""

    def __init__(self, loop):
        self.loop = loop

    def __enter__(self):
        loop = self.loop

        def backward(tensor, *args, **kwargs):
            loop.backward(tensor)

        def before_step(optimizer, args, kwargs):
            loop.optimizer_step(optimizer)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        self.hook = register_optimizer_step_pre_hook(before_step)
        self.saved = torch.Tensor.backward
        torch.Tensor.backward = backward
        _active["loop"] = loop

    def __exit__(self, *exc):
        _active["loop"] = None
        self.hook.remove()
        torch.Tensor.backward = self.saved
