"""initialize(), module() and Session: a training loop of your own on the emulated CS system.

    cs_torch.initialize(cs_ip=None, num_csx=1)
    with cs_torch.Session(model, optimizer, cs_torch.nn.CrossEntropyLoss(), mode="train") as session:
        for step, batch in enumerate(loader):
            loss = session.step(batch)

A Session is one job, set up exactly as csrun_wse sets one up
(cs_runtime.launch.job: job_keys, check_insecure_and_ssh_hosts, open_front_door,
start_job): entering the `with` block starts the job's directory and,
without cs_ip, its CS system (MemoryX, SwarmX, the WSEs) on this machine;
with cs_ip the job uses the running CS system there. The chief runs in your process: the first `step` compiles the
model (cs_runtime.compiler.stage, reusing the artifact in model_dir), starts the input
workers for the batch's loader, loads the weights (from the latest checkpoint
in model_dir, if any) and from then on each `step` is one training (or eval)
step driven by chief.cluster_executor.ClusterExecutor, the same code
csrun_wse's chief runs. csrun_wse's supervisor (cs_runtime.launch.launcher) watches
the job's processes from a thread of your process: if one fails, the next
`step` raises JobFailed naming it.

Leaving the block, normally, by an exception of your loop, Ctrl-C or
SIGTERM, stops every process of the job and removes its shared-memory
segments and key folder. In train mode the steps done are saved to a
checkpoint first, unless the cluster failed or the block was left in the
middle of a step.
"""
from __future__ import annotations

import json
import logging
import math
import signal
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from chief.cluster_executor import ClusterExecutor, ServiceError
from cs_runtime.compiler.planner import Target
from cs_runtime.compiler.stage import compile_model, runnable
from chief.trainer import TAG_GRAD_NORM, TAG_LR, Trainer
from cs_runtime.config import ParamsError, params_from_dict
from cs_runtime.launch.front_door import FrontDoorError, split_address
from cs_runtime.numerics.model import ModelSpec
from cs_runtime.wire.protocol import ENDED_PHASES
from cs_runtime.launch import job as launch
from cs_runtime.launch.job import JobOptions
from cs_runtime.launch.launcher import JobFailed, numerics_env
from cs_runtime.run_args import RunArgs, UserFunctions
from cs_runtime.process.service import ProcessEnv

from .data import INPUT_ENV, Batch, DataLoader
from .nn import CrossEntropyLoss, CsTorchError, Sequential
from .optim import Optimizer

log = logging.getLogger("cs_torch")

MODES = ("train", "eval")
STRATEGIES = ("weight_streaming", "pipelined", None)
# The workers' plan has no end: the loop decides how many steps run, and the
# workers (PREFETCH batches ahead) are stopped with the job.
PLAN_STOP = 2 ** 62
SUPERVISOR_JOIN_S = 30.0


# ------------------------------------------------------------------ set-up
@dataclass(frozen=True)
class Backend:
    """Where Sessions run: initialize()'s arguments, checked."""
    cs_ip: str | None = None
    num_csx: int = 1
    num_workers_per_csx: int = 1
    insecure: bool = False
    no_shm: bool = False
    job_labels: tuple = ()   # (key, value) pairs, shown by csctl get jobs

    def job_options(self) -> JobOptions:
        """A Session's job: on this machine, its input workers cs_torch's own."""
        return JobOptions(command=[sys.executable, "-m", "cs_torch.input_worker"], launcher="local",
                          num_csx=self.num_csx, num_workers_per_csx=self.num_workers_per_csx,
                          cs_ip=self.cs_ip, insecure=self.insecure, no_shm=self.no_shm,
                          job_labels=dict(self.job_labels))


_backend = Backend()
_seed = 1  # runconfig.seed's default: weight init, dropout masks, shuffling


def initialize(cs_ip: str | None = None, num_csx: int = 1, num_workers_per_csx: int = 1,
               insecure: bool = False, no_shm: bool = False) -> Backend:
    """Where the next Sessions run: cs_ip=None starts an emulated CS system of num_csx WSEs on
    this machine for each Session (as csrun_wse does); "HOST:PORT" uses the CS system there."""
    global _backend
    for name, value in (("num_csx", num_csx), ("num_workers_per_csx", num_workers_per_csx)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CsTorchError(f"initialize: {name} must be a positive integer, got {value!r}")
    if cs_ip is not None:
        try:
            split_address(str(cs_ip), "cs_ip")
        except FrontDoorError as exc:
            raise CsTorchError(f"initialize: {exc}") from None
    _backend = Backend(cs_ip, num_csx, num_workers_per_csx, bool(insecure), bool(no_shm))
    return _backend


def manual_seed(seed: int) -> None:
    """The seed of weight initialisation, dropout masks and shuffling (runconfig.seed)."""
    global _seed
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise CsTorchError(f"manual_seed: seed must be a non-negative integer, got {seed!r}")
    _seed = seed
    if "torch" in sys.modules:   # a torch model's initial weights (the 2.x API); torch stays optional
        sys.modules["torch"].manual_seed(seed)


class Module:
    """A model for the CS system: its ModelSpec (`.spec`)."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec

    def parameters(self) -> list[str]:
        """The names of the trained tensors (every one: the optimizer takes them all)."""
        return [f"{layer.name}/{p}" for layer in self.spec.layers for p in layer.param_shapes()]

    def num_params(self) -> int:
        return self.spec.num_params()

    def __repr__(self) -> str:
        return f"Module({self.spec.name}: {len(self.spec.layers)} layers, {self.num_params():,} parameters)"


def module(model) -> Module:
    """Wrap a model description: a cs_runtime.model.ModelSpec (mlp_spec, transformer_spec) or nn.Sequential."""
    if isinstance(model, Module):
        return model
    if isinstance(model, Sequential):
        return Module(model.spec)
    if isinstance(model, ModelSpec):
        return Module(model)
    raise CsTorchError(f"module: expected a cs_runtime.model.ModelSpec or cs_torch.nn.Sequential, "
                       f"got {type(model).__name__}")


def dataloader(input_fn, batch_size: int, *args, **kwargs) -> DataLoader:
    """See cs_torch.data.DataLoader: batches of input_fn's data set, made by the input workers."""
    return DataLoader(input_fn, batch_size, *args, **kwargs)


def model_section(spec: ModelSpec) -> dict:
    """The params.yaml `model` section of a plain MLP (recorded in checkpoints); {} otherwise."""
    layers = spec.layers
    hidden = layers[:-1]
    if len(layers) < 2 or any(l.op != "dense" for l in layers) or layers[-1].activation != "none" \
            or len({(l.activation, l.dropout) for l in hidden}) != 1 or layers[-1].dropout:
        return {}
    return {"input_size": layers[0].in_features, "hidden_sizes": [l.out_features for l in hidden],
            "num_classes": layers[-1].out_features, "activation_fn": hidden[0].activation,
            "dropout": hidden[0].dropout}


def precision_section(spec: ModelSpec) -> dict:
    """The params.yaml keys of the spec's mixed precision (input workers send 16-bit batches then)."""
    if spec.precision == "float32":
        return {}
    return {"mixed_precision": True, "fp16_type": spec.precision}


# ------------------------------------------------------------------ the session
class Session:
    def __init__(self, model, optimizer=None, criterion=None, mode: str = "train", *,
                 model_dir: str = "model_dir", checkpoint_path: str | None = None,
                 execution_strategy: str | None = "weight_streaming"):
        self.model = module(model)
        if mode not in MODES:
            raise CsTorchError(f"Session: mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not isinstance(criterion, CrossEntropyLoss):
            raise CsTorchError(f"Session: criterion {type(criterion).__name__} is not supported; the CS system "
                               "trains with cs_torch.nn.CrossEntropyLoss()")
        if optimizer is None and mode == "train":
            raise CsTorchError("Session: mode='train' needs an optimizer (cs_torch.optim.SGD, Adam or AdamW)")
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise CsTorchError(f"Session: optimizer {type(optimizer).__name__} is not supported; use "
                               "cs_torch.optim.SGD, Adam or AdamW")
        if execution_strategy not in STRATEGIES:
            raise CsTorchError(f"Session: execution_strategy must be weight_streaming, pipelined or None "
                               f"(the compiler chooses), got {execution_strategy!r}")
        self.optimizer, self.mode, self.model_dir = optimizer, mode, str(model_dir)
        self.checkpoint_path, self.strategy = checkpoint_path, execution_strategy
        self.backend, self.seed = _backend, _seed
        self.params_dict(None)  # bad optimizer settings fail here, before anything starts
        self.job = None
        self.executor: ClusterExecutor | None = None
        self.trainer: Trainer | None = None
        self.loader: DataLoader | None = None
        self._stack = ExitStack()
        self._submitted = None        # the job on a shared CS system (initialize(cs_ip=...))
        self.executor_failed = False
        self._exit_exc: BaseException | None = None
        self._in_step = False
        self._saved_step = 0
        self._eval = {"loss_sum": 0.0, "correct": 0, "count": 0}
        self._clock: tuple[float, int] | None = None  # (time, global step) when the first step began
        self.samples_per_sec = 0.0

    # -------------------------------------------------------------- params
    def params_dict(self, loader: DataLoader | None):
        section = loader.section() if loader else {}
        params = {"train_input": section, "eval_input": section,
                  "model": {**model_section(self.model.spec), **precision_section(self.model.spec)},
                  "optimizer": self.optimizer_section(),
                  "runconfig": {"seed": self.seed, "execution_strategy": self.strategy}}
        try:
            return params_from_dict(params, "cs_torch")
        except ParamsError as exc:
            raise CsTorchError(str(exc)) from None

    def optimizer_section(self) -> dict:
        return self.optimizer.section if self.optimizer else {}

    # -------------------------------------------------------------- start and stop
    def __enter__(self) -> "Session":
        if self.job is not None:
            raise CsTorchError("Session: already started (a Session is one `with` block)")
        try:
            self._start_job()
        except BaseException:
            self._shutdown()
            raise
        return self

    def _start_job(self) -> None:
        options = self.backend.job_options()
        self.layout = launch.plan_layout(options)
        self._stack.enter_context(launch.job_keys(options.insecure))
        try:
            launch.check_insecure_and_ssh_hosts(options, self.layout)
            door = launch.open_front_door(options)
        except SystemExit as exc:   # launch.LaunchError: one line
            raise CsTorchError(str(exc)) from None
        self._catch_sigterm()
        job = cs_ip = check = None
        if door is not None:   # a shared CS system: queue there, then run on the directory it makes
            self._stack.callback(door.close)
            job, cs_ip, check = self._wait_turn(options, door)
        self.job = launch.start_job(options, self.layout, attempt=0, tasks=False, handle_signals=False,
                                    job=job, cs_ip=cs_ip)
        self.options = options
        self.supervisor_thread = threading.Thread(target=self.job.supervisor.run, args=(check,),
                                                  name="cs_torch-supervisor", daemon=True)
        self.supervisor_thread.start()

    def _wait_turn(self, options: JobOptions, door) -> tuple:
        """Submit to the CS system at cs_ip and wait for this job's turn:
        (job id, the job's directory there, a supervisor check that follows its phase)."""
        try:
            submitted = launch.submit(options, door)
        except SystemExit as exc:
            raise CsTorchError(str(exc)) from None
        try:
            state = submitted.wait_turn(lambda position: print(
                f"cs_torch: {submitted.name} is queued (position {position})", file=sys.stderr, flush=True))
        except BaseException:
            submitted.done("CANCELLED", "the session ended while queued")
            raise
        if state["phase"] in ENDED_PHASES:
            raise CsTorchError(f"{submitted.name} {state['phase']}: {state['reason']}")
        self._submitted = submitted
        self._stack.callback(self._report_done)   # once every process has stopped, before the door closes
        return state["job"], state["cs_ip"], launch.follower(submitted)

    def _report_done(self) -> None:
        """How the job ended, for the shared CS system's list (and to free its systems)."""
        exc = self._exit_exc
        failed = exc is not None or self.executor_failed
        self._submitted.done("FAILED" if failed else "SUCCEEDED", repr(exc)[:200] if exc is not None else "")

    def _catch_sigterm(self) -> None:
        """SIGTERM ends the `with` block as Ctrl-C does (so the job is stopped), in the main thread."""
        if threading.current_thread() is not threading.main_thread() \
                or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return

        def terminate(signum, _frame):
            raise SystemExit(128 + signum)
        signal.signal(signal.SIGTERM, terminate)
        self._stack.callback(signal.signal, signal.SIGTERM, signal.SIG_DFL)

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self._finish(exc)
        finally:
            self._exit_exc = exc
            self._shutdown()

    def _finish(self, exc) -> None:
        if self.executor is None:
            return
        healthy = not self.executor.failure and not isinstance(exc, JobFailed) and not self._in_step
        if self.mode == "train" and healthy and self.trainer.global_step > self._saved_step:
            path = self.save_checkpoint()
            if exc is not None:
                print(f"cs_torch: saved the {self.trainer.global_step} step(s) done to {path} before stopping",
                      file=sys.stderr, flush=True)
        if self.mode == "eval" and self._eval["count"]:
            m = self.metrics
            print(f"| Eval Device={self.executor.device}, Step={self.trainer.global_step}, Loss={m['loss']:.5f}, "
                  f"Accuracy={m['accuracy']:.4f} ({self._eval['correct']}/{self._eval['count']})", flush=True)
            self.trainer.scalar("eval", "loss", m["loss"])
            self.trainer.scalar("eval", "accuracy", m["accuracy"])
        if self.mode == "train" and self.samples_per_sec:
            print(f"| Train Device={self.executor.device}, Step={self.trainer.global_step}, "
                  f"GlobalRate={self.samples_per_sec:.1f} samples/sec", flush=True)

    def _shutdown(self) -> None:
        """Stop every process of the job, however the block ended; safe to call twice."""
        try:
            if self.trainer is not None:
                self.trainer.summaries.close()
            if self.executor is not None:
                executor, self.executor = self.executor, None
                self.executor_failed = bool(executor.failure)
                executor.close()  # JOB_END to the services, then its sockets
        finally:
            job, self.job = self.job, None
            try:
                if job is not None:
                    job.supervisor.finish_requested = True  # every process is told to exit, then stopped
                    self.supervisor_thread.join(SUPERVISOR_JOIN_S)
                    job.close()   # stops whatever is left, then the segments and the context
            finally:
                self._stack.close()

    # -------------------------------------------------------------- the first step
    def _start_model(self, loader: DataLoader) -> None:
        params = self.params_dict(loader)
        args = RunArgs(self.mode, "<cs_torch>", params, self.model_dir, self.checkpoint_path, False, False)
        spec = runnable(self.model.spec)
        # Compiled for the system it runs on, so the report says the mode and systems that run.
        compiled = compile_model(spec, args, Target(num_csx=self.options.num_csx, compiled_on="wse"))
        env, job = self.job.env, self.job
        penv = ProcessEnv(job.id, "chief", 0, job.directory.address, env["CS_IP"], self.options.num_csx,
                          self.layout.num_workers)
        self.executor = ClusterExecutor(args, UserFunctions(None, None, None), spec, compiled,
                                        penv=penv, exit_on_failure=False)
        self.trainer = Trainer(args, spec, self.executor)
        start = self.starting_state(self.trainer.initial_state())
        self.trainer.global_step = self._saved_step = start.global_step
        self._start_workers(loader, params)
        stream = "train" if self.mode == "train" else "eval"
        first = start.global_step if self.mode == "train" else 0
        self.executor.load(start.weights, start.opt_state, [{"stream": stream, "start": first, "stop": PLAN_STOP}])
        self.eval_step_index = 0

    def starting_state(self, start):
        """The job's starting state (a checkpoint.Checkpoint): the trainer's (the model's weights, or the
        checkpoint it resumes); a 2.x loop's job takes its optimizer's state (cs_torch/cluster_step.py)."""
        return start

    def _start_workers(self, loader: DataLoader, params) -> None:
        spec = {"input": loader.worker_spec(), "params": params.to_dict(), "mode": self.mode,
                "model_dir": self.model_dir}
        env = {**numerics_env(self.job.env, 1), INPUT_ENV: json.dumps(spec)}
        # The supervisor's registration deadline counts from now: the loop may begin long after the block.
        self.job.supervisor.started = time.monotonic()
        for rank in range(self.layout.num_workers):
            self.job.group.start("worker", rank, self.options.command,
                                 {**env, "CS_ROLE": "worker", "CS_RANK": str(rank)})

    # -------------------------------------------------------------- steps
    def step(self, batch: Batch) -> float:
        """One step on the CS system: train mode returns the batch's loss (after which the weights are
        updated), eval mode the batch's mean loss (accumulated into `metrics`)."""
        if not isinstance(batch, Batch):
            raise CsTorchError(f"Session.step: expected a batch from a cs_torch.dataloader, got "
                               f"{type(batch).__name__} (the input workers make the data)")
        if self.job is None:
            raise CsTorchError("Session.step: the Session is not running; use it as `with Session(...) as s:`")
        if self.loader is not None and batch.loader is not self.loader:
            raise CsTorchError("Session.step: a batch of another dataloader; a Session streams from one")
        self._in_step = True
        try:
            if self.loader is None:
                self.loader = batch.loader
                self._start_model(batch.loader)
            loss = self._train_step() if self.mode == "train" else self._eval_step()
        except ServiceError as exc:
            raise JobFailed(f"cs_torch: the job failed: {exc}") from None
        self._in_step = False
        return loss

    __call__ = step

    def _train_step(self) -> float:
        t, step = self.trainer, self.trainer.global_step
        if self._clock is None:
            self._clock = (time.monotonic(), step)
        lr, loss_scale = t.params.optimizer.lr_at(step), t.scaler.scale
        loss, grad_norm, applied = self.executor.train_step(step, lr, loss_scale)
        if not math.isfinite(loss):
            raise CsTorchError(f"loss is {loss} at step {step + 1} (lower the learning rate?)")
        t.after_step(step, applied, loss_scale)
        t.global_step += 1
        t.scalar("train", "loss", loss)
        t.scalar("train", TAG_LR, lr)
        t.scalar("train", TAG_GRAD_NORM, grad_norm)
        since, first = self._clock
        steps = t.global_step - first
        self.samples_per_sec = steps * self.loader.batch_size / max(time.monotonic() - since, 1e-9)
        return loss

    def _eval_step(self) -> float:
        loss_sum, correct, count = self.executor.eval_step(self.eval_step_index)
        self.eval_step_index += 1
        for key, value in (("loss_sum", loss_sum), ("correct", correct), ("count", count)):
            self._eval[key] += value
        return loss_sum / max(count, 1)

    @property
    def global_step(self) -> int:
        return self.trainer.global_step if self.trainer else 0

    @property
    def metrics(self) -> dict:
        """Eval mode: mean loss and accuracy over the steps so far."""
        n = max(self._eval["count"], 1)
        return {"loss": self._eval["loss_sum"] / n, "accuracy": self._eval["correct"] / n,
                "count": self._eval["count"]}

    def save_checkpoint(self) -> Path:
        """model_dir/checkpoint_<step>.npz: weights, optimizer state, step (csrun_wse's format)."""
        if self.executor is None:
            raise CsTorchError("Session.save_checkpoint: no step has run yet")
        self.trainer.save_checkpoint()
        self._saved_step = self.trainer.global_step
        return Path(self.model_dir) / f"checkpoint_{self.trainer.global_step}.npz"
