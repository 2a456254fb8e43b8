"""A traced step (2.x API) run as a job of the emulated CS system.

With a CSX backend, a DataExecutor's loop is one job: the traced step's
captured program becomes a ModelSpec of program layers (one per
weight-streaming unit, cs_runtime/compiler/units.py: program_spec), and
cs_torch.Session, the machinery of the ModelSpec API, runs it: it starts
MemoryX, SwarmX and num_csx WSEs (or queues on the CS system at
mgmt_address), compiles (the compiler picks weight streaming or pipelined),
starts the input workers, which call the loader's input_fn themselves, and
drives each step with chief.cluster_executor. The job's weights start from
the torch module's own; MemoryX keeps them and applies the optimizer's rule
with the learning rate and loss scale of each step as this process's
optimizer and schedulers give them. When the loop ends (or a checkpoint
closure runs) the trained weights come back into the module, so
`model.state_dict()` and cstorch.save see them.

A failure of any process of the job, an exception or Ctrl-C in the loop
stop every process (cs_torch.Session's lifecycle); a failure arrives as one
JobFailed line.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time

import numpy as np
import torch

from cs_runtime import spans
from cs_runtime.compiler.units import program_spec
from cs_runtime.numerics.optim import MASK_SLOT, Optimizer as Rule, OptimizerSpec

from . import amp
from . import session as session_mod
from .capture import load_into
from .experimental.compression import compressed
from .data import DataLoader as WorkerLoader
from .loader_replay import LABELS, RunSamples, batch_size_of, is_iterable, start_states
from .nn import CrossEntropyLoss, CsTorchError
from . import optim as old_optim

_runs = itertools.count()
_SLOT_NAMES = {"momentum": "momentum_buffer"}   # MemoryX's slot names -> torch's state keys


def _one_rule(optimizer, params: dict) -> tuple[dict, bool]:
    """The settings of the one rule MemoryX applies, and whether it leaves biases and normalisation
    weights undecayed. Several groups are one rule when they differ only in weight decay, as the model
    zoo's configure_param_groups splits them: the decayed weights, and the biases and norm weights at 0
    (MemoryX tells those apart by name, cs_runtime/numerics/optim.py)."""
    groups = optimizer.param_groups
    if len(groups) == 1:
        return groups[0], False
    shared = sorted(set(groups[0]) - {"params", "weight_decay"})
    for g in groups[1:]:
        differ = [k for k in shared if g.get(k) != groups[0].get(k)]
        if differ:
            raise CsTorchError(f"CSX backend: param groups differing in {', '.join(differ)} (MemoryX applies one "
                               "rule; groups may differ only in weight decay, biases and norm weights at 0)")
    decay = max(g["weight_decay"] for g in groups)
    if all(g["weight_decay"] == decay for g in groups):
        return groups[0], False   # one rule for every parameter, as one group would be
    group_decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    rule = Rule(OptimizerSpec("sgd", weight_decay=decay, exclude_bias_and_norm=True))
    for name, param in params.items():
        given = group_decay.get(id(param), decay)
        if given != rule.decay_of(name):
            raise CsTorchError(f"CSX backend: parameter {name} has weight decay {given} in its param group; "
                               f"MemoryX decays every weight by {decay} but biases and normalisation weights")
    return {**groups[0], "weight_decay": decay}, True


def memoryx_optimizer(optimizer, params: dict | None = None):
    """The MemoryX learning rule of an optimizer of cstorch.optim or torch.optim (its rule must be
    one MemoryX has); `params` (program names -> parameters) checks several param groups."""
    group, exclude_bias_and_norm = _one_rule(optimizer, params or {})
    rule = _rule_of(optimizer, group)
    rule.section["exclude_bias_and_norm"] = exclude_bias_and_norm
    return rule


def _rule_of(optimizer, g: dict):
    from . import optimizers
    if getattr(optimizer, "cluster_refusal", None):
        raise CsTorchError(f"CSX backend: {optimizer.cluster_refusal}")
    if g.get("maximize"):
        raise CsTorchError(f"CSX backend: {type(optimizer).__name__} with maximize=True is not a MemoryX rule; "
                           "use backend('CPU') for it")
    if isinstance(optimizer, (optimizers.SGD, torch.optim.SGD)):
        return old_optim.SGD(lr=g["lr"] or 1.0, momentum=g["momentum"], weight_decay=g["weight_decay"],
                             nesterov=bool(g["nesterov"]), dampening=float(g["dampening"]))
    if g.get("amsgrad"):
        raise CsTorchError(f"CSX backend: {type(optimizer).__name__} with amsgrad=True is not a MemoryX rule")
    if isinstance(optimizer, (optimizers.AdamW, torch.optim.AdamW)):
        cls = old_optim.AdamW
    elif isinstance(optimizer, (optimizers.Adam, torch.optim.Adam)):
        cls = old_optim.Adam
    else:
        raise CsTorchError(f"CSX backend: optimizer {type(optimizer).__name__} has no MemoryX rule "
                           "(SGD, Adam and AdamW have)")
    return cls(lr=g["lr"] or 1.0, betas=tuple(g["betas"]), eps=g["eps"], weight_decay=g["weight_decay"])


def _step_rate(optimizer):
    """Each step's learning rate for MemoryX: the one rate of every param group. A scheduler that leaves
    the groups at different rates, or changes a weight decay MemoryX took at the start, is refused."""
    decays = [g.get("weight_decay") for g in optimizer.param_groups]

    def rate() -> float:
        groups = optimizer.param_groups
        rates = {g["lr"] for g in groups}
        if len(rates) > 1:
            raise CsTorchError(f"CSX backend: the param groups' learning rates differ at this step "
                               f"({sorted(rates)}); MemoryX applies one rate a step (use backend('CPU'))")
        if [g.get("weight_decay") for g in groups] != decays:
            raise CsTorchError("CSX backend: a param group's weight_decay changed during the run (a weight decay "
                               "scheduler); MemoryX applies the weight decay the job started with "
                               "(use backend('CPU'))")
        return groups[0]["lr"]
    return rate


class _Session(session_mod.Session):
    """A Session whose learning rate and loss scale come from the 2.x objects, step by step."""
    lr_of = None
    scale_of = None
    applied = True
    loss_scaled = False     # a GradScaler scales the loss: MemoryX unscales, and skips overflowed steps
    opt_state_of = None     # () -> the optimizer's state in MemoryX's slots, by program name
    report_eval = True   # False: the program's loss is a stand-in (a 1.x eval loop computes its own)

    def optimizer_section(self) -> dict:
        section = super().optimizer_section()
        return {**section, "loss_scaling_factor": "dynamic"} if section and self.loss_scaled else section

    def _finish(self, exc) -> None:
        if not self.report_eval:
            self._eval["count"] = 0
        super()._finish(exc)

    def starting_state(self, start):
        """A 2.x loop's job starts from its optimizer's state as it is now (the moments and step counts
        an earlier loop of the run, or a checkpoint the script loaded, left), not from zeros."""
        if self.opt_state_of is not None and self.mode == "train":
            given = self.opt_state_of()
            for layer in start.opt_state.values():
                for name, slots in layer.items():
                    for slot, value in given.get(name, {}).items():
                        if slot == MASK_SLOT:   # a SelectiveGrad mask goes with the state
                            slots[slot] = np.array(value, dtype=np.float32)
                        elif slot in slots:
                            slots[slot] = np.array(value, dtype=np.float32).reshape(np.shape(slots[slot]))
        return start

    def save_checkpoint(self):
        """None: a 2.x loop's checkpoints are the script's (checkpoint closures, cstorch.save), taken
        from the module after the weights come back; the job writes no csrun_wse checkpoint."""
        self._saved_step = self.trainer.global_step
        return None

    def _train_step(self) -> float:
        t, step = self.trainer, self.trainer.global_step
        if self._clock is None:
            self._clock = (time.monotonic(), step)
        loss, _norm, self.applied = self.executor.train_step(step, float(self.lr_of()), float(self.scale_of()))
        t.global_step += 1
        t.scalar("train", "loss", loss)
        since, first = self._clock
        self.samples_per_sec = (t.global_step - first) * self.loader.batch_size / max(time.monotonic() - since, 1e-9)
        return loss


def _clipping(effects, params: dict) -> float | None:
    """The max norm of a traced step's clip_grad_norm_ (MemoryX clips the global norm of every trained
    weight): None without one; clipping some weights only, or twice, is refused."""
    clips = [e for e in effects if e[0] == "clip_norm"]
    if not clips:
        return None
    trained = {id(p) for p in params.values() if p.requires_grad}
    if len(clips) > 1 or not trained <= {id(p) for p in clips[0][1]}:
        raise CsTorchError("CSX backend: the step clips the gradients of some weights only (or twice); MemoryX "
                           "clips the global norm of every weight once (use backend('CPU'))")
    return clips[0][2]


def memoryx_slots(optimizer, params: dict) -> dict:
    """The optimizer's state of each parameter (program name -> parameter) in MemoryX's slot names
    (ClusterRun.sync's converse): {name: {slot: value}}; a parameter without state is left out."""
    torch_names = {torch_name: slot for slot, torch_name in _SLOT_NAMES.items()}
    slots = {}
    for name, param in params.items():
        state = optimizer.state.get(param) or {}
        given = {torch_names.get(key, key): value for key, value in state.items() if value is not None}
        slots[name] = {slot: np.asarray(value.detach().numpy() if isinstance(value, torch.Tensor) else value,
                                        dtype=np.float32) for slot, value in given.items()}
        entries = getattr(param, "_selective_grad", None)   # nn.SelectiveGrad: MemoryX's update masks as the CPU's
        if entries is not None:
            slots[name][MASK_SLOT] = entries.mask.numpy().astype(np.float32)
    return {name: value for name, value in slots.items() if value}


class ClusterRun:
    """One job: a captured program, for the steps of one loop. `params` maps the program's
    parameter names to the module's parameters; `batch_of(i)` is the i-th step's batch handle
    (the input workers'); with `return_output` each step hands back the model's output too."""

    def __init__(self, captured, model, params: dict, backend, optimizer, scaler, training: bool, batch_of,
                 return_output: bool = False, report_eval: bool = True, max_gradient_norm: float | None = None,
                 first_step: int = 0, profile_window=None):
        marked = compressed([*model.named_parameters(), *model.named_buffers()])
        if marked:
            raise CsTorchError(f"CSX backend: experimental.Compression is not emulated on CSX (the emulated CS "
                               f"system keeps float32 weights), marked: {', '.join(sorted(marked))}")
        weights = {name: p.detach().numpy().copy() for name, p in params.items()}
        spec = program_spec(type(model).__name__.lower(), captured.program, captured.units, captured.shapes,
                            captured.dtypes, weights, return_output=return_output,
                            features=captured.feature_names)   # a dict batch's inputs travel by these names
        # cstorch.amp's format; the steps the run took before this job (dropout masks go on from them)
        spec = dataclasses.replace(spec, precision=amp.precision(), program={**spec.program, "first_step": first_step})
        self.optimizer, self.scaler, self.params, self.batch_of = optimizer, scaler, params, batch_of
        mode = "train" if training else "eval"
        cc = backend.cluster_config
        session_mod._backend = session_mod.Backend(cc.mgmt_address, cc.num_csx, max(cc.num_workers_per_csx, 1),
                                                   job_labels=tuple(cc.labels().items()))
        model_dir = os.path.join(backend.artifact_dir, f"job_{os.getpid()}_{next(_runs)}_{mode}")
        rule = memoryx_optimizer(self.optimizer, params) if self.optimizer else None
        if rule is not None and max_gradient_norm is not None:   # the step's clip_grad_norm_, done by MemoryX
            rule.section["max_gradient_norm"] = max_gradient_norm
        self.session = _Session(spec, rule, CrossEntropyLoss(), mode, model_dir=model_dir, execution_strategy=None)
        self.session.lr_of = _step_rate(self.optimizer) if self.optimizer else None
        self.session.scale_of = lambda: self.scaler.scale_value() if self.scaler else 1.0
        self.session.loss_scaled = self.scaler is not None
        self.session.opt_state_of = (lambda: memoryx_slots(self.optimizer, params)) if self.optimizer else None
        self.session.report_eval = report_eval
        # cstorch.profiler's steps (a profiler.StepWindow): the job records every process's timeline
        self.profile_window, self.layer_names = profile_window, [layer.name for layer in spec.layers]
        if profile_window is not None:
            spans.RECORDER.reset(True)
        self.session.__enter__()
        self.aliases = captured.aliases
        self.scalar_output = captured.shapes.get(captured.program.outputs.get("output")) == ()
        self.model = model
        self.steps = 0
        self.on_failure = None   # called (with nothing) before a failed job is stopped

    @classmethod
    def of_traced(cls, traced, executor, return_output: bool = False) -> "ClusterRun":
        """The job of a traced step (2.x API) in a DataExecutor's loop."""
        effects = traced.effects
        optimizer = next((e[1] for e in effects if e[0] == "opt_step"), None) or \
            next((e[2] for e in effects if e[0] == "scaler_step"), None)
        scaler = next((e[1] for e in effects if e[0] == "scaler_step"), None)
        run = cls(traced.captured, traced.compiled.model, traced.engine.params, traced.compiled.backend, optimizer,
                  scaler, traced.training, executor.worker_batch, return_output,
                  max_gradient_norm=_clipping(effects, traced.engine.params), first_step=traced.engine.steps,
                  profile_window=executor.profile_window)
        run.on_failure = lambda: executor._runs.pop(traced, None)
        return run

    def step(self) -> tuple[float, bool, np.ndarray | None]:
        """One step on the CS system: (loss, whether the update was applied, the model's output or None)."""
        try:
            loss = self.session.step(self.batch_of(self.steps))
        except BaseException as exc:   # a failed process, Ctrl-C in the step: stop the job, say it once
            if self.on_failure is not None:
                self.on_failure()
            self.finish(exc)
            raise
        self.steps += 1
        if not math.isfinite(loss) and self.scaler is None and self.session.mode == "train":
            raise CsTorchError(f"loss is {loss} at step {self.steps} (lower the learning rate?)")
        output = self.session.executor.outputs.get("output")
        if output is not None and self.scalar_output:
            # A model that returns its own loss: each WSE hands back its shard's; the step's is the
            # loss the cluster reports for the whole batch (SwarmX combines the shards' by their rows).
            output = np.array(loss, dtype=np.float32)
        return loss, bool(self.session.applied), output

    def param_grad_norms(self) -> dict[str, float]:
        """The last step's gradient norm of each parameter, by program name (MemoryX's answer)."""
        return self.session.executor.param_grad_norms

    def param_norms(self) -> dict[str, float]:
        """Each parameter's norm as the last step began, by program name (MemoryX's answer)."""
        return self.session.executor.param_norms

    def sync(self) -> None:
        """The job's current weights into the torch module, its optimizer state into the optimizer."""
        if self.session.executor is None or self.session.mode != "train":
            return
        weights, opt_state = self.session.executor.state()
        flat = {p: w for layer in weights.values() for p, w in layer.items()}
        with torch.no_grad():
            load_into(self.model, flat, self.aliases)
        slots = {p: s for layer in opt_state.values() for p, s in layer.items()}
        params = self.params
        for name, state in slots.items():
            mine = self.optimizer.state.setdefault(params[name], {})
            for slot, value in state.items():
                if slot == MASK_SLOT:   # the parameter's SelectiveGrad buffer holds it
                    continue
                if slot == "step" and "exp_avg" not in state:
                    continue   # SGD with dampening counts its updates; torch's SGD keeps no count
                mine[_SLOT_NAMES.get(slot, slot)] = torch.from_numpy(np.array(value, dtype=np.float32))
            if "exp_avg" in mine:   # torch keeps Adam's count as a tensor, cstorch's optimizers as a float
                count = float(self.session.trainer.global_step)
                mine["step"] = torch.tensor(count) if isinstance(self.optimizer, torch.optim.Optimizer) else count

    def finish(self, exc: BaseException | None = None) -> None:
        try:
            if exc is None:
                self.sync()
                self.hand_profile()
        finally:
            if self.profile_window is not None:
                spans.RECORDER.reset(False)
            self.session.__exit__(type(exc) if exc else None, exc, None)

    def hand_profile(self) -> None:
        """The first WSE's spans of the steps the profiler asked for, to it (a job that ran them)."""
        if self.profile_window is None or self.session.executor is None:
            return
        # the input workers' spans are not asked: a worker that has streamed every batch may be gone
        traces = {t.name: t for t in self.session.executor.collect_traces(workers=False)}
        if "wse0" not in traces:
            raise CsTorchError("cstorch.profiler: the CS system's first WSE sent no timeline of the steps profiled")
        self.profile_window.record_job(traces["wse0"].spans, self.layer_names)


# ---------------------------------------------------------------- the data, for the workers
def worker_dataset(module, file, function, args, kwargs, states_file, steps, closure=None):
    """What the input workers call (by name): the samples of the run's `steps` batches of the user's
    input_fn's torch DataLoader, in its order (replayed from the generators' states the user's process
    saved in states_file; None for an IterableDataset)."""
    from .input_worker import load_function
    from .data import arrived
    fn = load_function({"module": module, "file": file, "function": function, "closure": closure})
    loader = fn(*arrived(args), **arrived(kwargs))
    states = None
    if states_file is not None:
        with np.load(states_file, allow_pickle=False) as saved:
            states = {role: saved[role] for role in saved.files}
    return RunSamples(loader, steps, states)


def loader_settings(loader) -> dict:
    """The batching of a torch DataLoader, as the workers' batch plan takes it."""
    batch_size = batch_size_of(loader) if hasattr(loader, "dataset") else None
    if not isinstance(batch_size, int):
        raise CsTorchError("CSX backend: the torch DataLoader needs a batch_size")
    sampler = type(getattr(loader, "sampler", None)).__name__
    return {"batch_size": batch_size, "shuffle": sampler == "RandomSampler",
            "drop_last": bool(getattr(loader, "drop_last", True))}


def worker_loader(dataloader, seed: int, steps: int, directory: str) -> tuple[WorkerLoader, RunSamples]:
    """The ModelSpec API's loader that has the input workers build the 2.x loader's batches of `steps`
    steps, in the torch loader's order (its generators' states saved in `directory` for them to replay),
    and those samples here."""
    from .data import function_location, travelling
    loader = dataloader.loader
    settings = loader_settings(loader)
    states, states_file = None, None
    if not is_iterable(loader):
        states = start_states(loader)
        os.makedirs(directory, exist_ok=True)
        states_file = os.path.join(os.path.abspath(directory), f"loader_states_{os.getpid()}_{next(_runs)}.npz")
        np.savez(states_file, **states)
    samples = RunSamples(loader, steps, states)
    location = function_location(dataloader.input_fn)
    settings.update(shuffle=False, drop_last=True)   # the order is the torch loader's, shuffle included
    return WorkerLoader(worker_dataset, settings.pop("batch_size"), location["module"], location["file"],
                        location["function"], travelling(list(dataloader.args)), travelling(dict(dataloader.kwargs)),
                        states_file, steps,
                        location.get("closure"), shuffle_seed=seed, **settings), samples


def saved_dataset(path: str):
    """What the input workers call (by name) for a 1.x loop: the data set its loader held,
    saved for them (numpy arrays, never pickled)."""
    with np.load(path, allow_pickle=False) as saved:
        return saved["x"], saved["y"]


def saved_loader(loader, arrays, directory: str, seed: int) -> WorkerLoader:
    """A loader whose data set the workers cannot import (a 1.x loop's torch DataLoader
    object): its arrays saved in `directory` for them."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(os.path.abspath(directory), f"dataset_{os.getpid()}_{next(_runs)}.npz")
    np.savez(path, x=arrays[0], y=arrays[1])
    settings = loader_settings(loader)
    return WorkerLoader(saved_dataset, settings.pop("batch_size"), path, shuffle_seed=seed, **settings)


def plan_batches(loader: WorkerLoader, arrays):
    """The global batches the input workers stream for `loader`, as torch tensors, step after step."""
    from cs_runtime.data.inputs import InputStream, fetch
    seed = loader.shuffle_seed
    section = type("Section", (), {"batch_size": loader.batch_size, "shuffle": loader.shuffle,
                                   "drop_last_batch": loader.drop_last, "seed": lambda _self, run_seed: seed})()
    stream = InputStream.build("train", arrays, section, seed)
    # the loader's dtypes: a 1.x loop's (inputs, labels) arrays, or the first batch a run's samples give
    own = arrays if isinstance(arrays, tuple) else arrays.get(np.arange(loader.batch_size))
    for step in itertools.count():
        x, y = fetch(stream.dataset, stream.plan.global_indices(step))
        if isinstance(x, dict):   # a dict batch as the loader gave it (its dtypes too): named inputs and labels
            yield {**{name: _as_loader_gave(a, own[0][name]) for name, a in x.items()},
                   LABELS: _as_loader_gave(y, own[1])}
        else:
            yield torch.from_numpy(x), torch.from_numpy(y)


def _as_loader_gave(array: np.ndarray, own: np.ndarray):
    """A batch's array as a torch tensor of the dtype the loader gave (the wire carries ids as int32 and
    labels as int64; the model zoo's models assert their dtypes)."""
    return torch.from_numpy(np.asarray(array, dtype=own.dtype))
