"""The chief's training loop, shared by the CPU path and the CS system.

The loop talks to an executor (`CpuExecutor` in this process, or
`ClusterExecutor` driving MemoryX, SwarmX and the WSEs over ZeroMQ) through
four calls: load, train_step, eval_step, state. Everything a user sees
(progress lines, TensorBoard, checkpoints, resume) is written here once, so
both paths report alike and the CPU path is a true oracle of the other.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import yaml

from chief.cluster_executor import ClusterExecutor
from chief import story as run_story
from chief.summaries import Summaries
from cs_runtime.compiler import pictures
from cs_runtime.compiler.stage import build_spec, compile_model
from chief.cpu_executor import CpuExecutor
from cs_runtime import checkpoint as ckpt
from cs_runtime import env
from cs_runtime import errors
from cs_runtime import run_lock
from cs_runtime import trace
from cs_runtime.config import Params
from cs_runtime.wire.transport import host_name
from cs_runtime.numerics.model import ModelSpec, init_weights
from cs_runtime.numerics.optim import Optimizer
from cs_runtime.numerics.precision import LossScaler
from cs_runtime.run_args import RunArgs, RunError, UserFunctions

log = logging.getLogger("chief")
# How a role is named where an error of the user's code is shown.
ROLE_NAMES = {"": "cpu", "precheck": "csrun_wse's check before the job starts"}
PROCESS_STARTED = time.monotonic() - run_story.process_age()   # the first step's line counts from it

# TensorBoard tags as the model zoo's 2.x runner names them (cerebras.modelzoo's
# run_utils): rates at each log step, the learning rate of param group 0, the global
# gradient norm (its compute_grad_norm); per_layer_grad_norm/<layer> below.
TAG_RATE = "local_samples_per_sec"      # since the previous log step
TAG_GLOBAL_RATE = "avg_samples_per_sec"  # since training started in this run
TAG_STEPS_RATE = "avg_steps_per_sec"
TAG_LR = "lr/0"
TAG_GRAD_NORM = "model_wise_grad_norm"


def run_on_cpu(args: RunArgs, fns: UserFunctions) -> int:
    """The chief of `python run.py` / csrun_cpu: the whole model in this process."""
    stop_on_sigterm()
    return run_chief(args, fns, on_cluster=False)


def run_on_cluster(args: RunArgs, fns: UserFunctions) -> int:
    """Task 0 of csrun_wse: drive the CS system's services."""
    stop_on_sigterm()
    return run_chief(args, fns, on_cluster=True)


def stop_on_sigterm() -> None:
    """SIGTERM (a scheduler, `timeout`, the launcher stopping the job) ends the run as Ctrl-C
    does: with the step reached and the last checkpoint said, not silently."""
    def interrupt(_signum, _frame):
        raise KeyboardInterrupt
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, interrupt)


def run_precheck(args: RunArgs, fns: UserFunctions) -> int:
    """csrun_wse's check before it starts anything: the params (already read by
    parse_args), what would fail only once the cluster runs (check_before_start),
    and the model, as --validate_only (or --compile_only) does."""
    writes = not args.validate_only
    if not args.compile_only:
        args.validate_only = True
    return run_chief(args, fns, on_cluster=False, before=lambda: check_before_start(args, writes),
                     eval_needs_weights=writes and env.PRECHECK_HERE.get())


def check_before_start(args: RunArgs, writes: bool) -> None:
    """Every WSE gets rows of each batch; where the chief will run here (a local job), model_dir
    takes files and each data_dir exists (an eval's checkpoint: once the model is built). RunError
    otherwise."""
    num_csx = env.NUM_CSX.get()
    for name in input_sections(args.mode):
        batch = getattr(args.params, name).batch_size
        if batch < num_csx:
            raise RunError(f"{name}.batch_size {batch} leaves {num_csx - batch} of the {num_csx} WSEs (--num_csx) "
                           f"without rows; use a batch of {num_csx} or more, or fewer WSEs")
    if not env.PRECHECK_HERE.get() or not writes:   # validate_only reads no data and writes nothing
        return
    ensure_writable(args.model_dir)
    run_lock.check_free(args.model_dir)
    for name in input_sections(args.mode):
        data_dir = getattr(args.params, name).data_dir
        if data_dir is not None and not os.path.exists(data_dir):
            raise RunError(f"{name}.data_dir {data_dir}: no such file or folder")


def input_sections(mode: str) -> tuple[str, ...]:
    """The params sections whose input a mode reads."""
    return {"train": ("train_input",), "eval": ("eval_input",)}.get(mode, ("train_input", "eval_input"))


def compile_and_run(args: RunArgs, fns: UserFunctions, on_cluster: bool, eval_needs_weights: bool) -> int:
    spec = build_spec(args, fns)
    if eval_needs_weights:
        check_eval_has_checkpoint(args, spec)
    compiled = compile_model(spec, args)
    if args.validate_only or args.compile_only:
        return 0
    executor = make_executor(args, fns, spec, compiled, on_cluster)
    try:
        Trainer(args, spec, executor, fns).run()
    finally:
        executor.close()
    return 0


def hold_model_dir(model_dir: str) -> run_lock.RunLock:
    """This run's hold on model_dir (ModelDirInUse while another run has it); a dead run's lock
    taken over is said."""
    lock, taken_over = run_lock.hold(model_dir, env.JOB_ID.get() or f"a {env.ROLE.get() or 'CPU'} run")
    if taken_over:   # after --max_restarts' restart, the failed attempt's lock: expected, said quietly
        log.log(logging.INFO if env.RESTART.get() else logging.WARNING, "%s", taken_over)
    return lock


def check_eval_has_checkpoint(args: RunArgs, spec: ModelSpec) -> None:
    """--mode eval without a checkpoint would score random weights as if trained: RunError
    (a captured module's own weights, which may be trained, are not random)."""
    if spec.initial_weights is not None:
        return
    if args.mode == "eval" and args.checkpoint_path is None and ckpt.latest(args.model_dir) is None:
        raise RunError(no_checkpoint_to_evaluate(args.model_dir))


def no_checkpoint_to_evaluate(model_dir: str) -> str:
    return (f"--mode eval needs trained weights: no checkpoint in {model_dir} and no --checkpoint_path "
            "(train first, or give --checkpoint_path)")


def run_chief(args: RunArgs, fns: UserFunctions, on_cluster: bool, before=None,
              eval_needs_weights: bool | None = None) -> int:
    """`before`: checks before anything is written; `eval_needs_weights`: whether --mode eval is
    refused without a checkpoint (default: when the run trains or evaluates)."""
    if eval_needs_weights is None:
        eval_needs_weights = not (args.validate_only or args.compile_only)
    trace.RECORDER.reset(trace.enabled_from_env())   # csrun_wse --trace / csrun_cpu --trace
    try:
        if before is not None:
            before()
        lock = None
        if not args.validate_only:   # validate_only writes nothing
            ensure_writable(args.model_dir)
            lock = hold_model_dir(args.model_dir)
        try:
            return compile_and_run(args, fns, on_cluster, eval_needs_weights)
        finally:
            if lock is not None:
                lock.release()
    except KeyboardInterrupt:   # Ctrl-C of csrun_cpu: the trainer said where it got to; no traceback
        return 130
    except Exception as exc:
        # Bad input (params, data, checkpoint) or a diverged loss: one line, exit 2, no restart.
        # The user's own code: its frames. Ours: the whole traceback (re-raised).
        code = errors.report(exc, f"{ROLE_NAMES.get(env.ROLE.get(), env.ROLE.get())} on {host_name()}")
        if code is None:
            raise
        return code


def ensure_writable(model_dir: str) -> None:
    """model_dir exists (made if need be) and takes files, or one line says why not."""
    try:
        os.makedirs(model_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=model_dir, prefix=".writable-"):
            pass
    except OSError as exc:
        raise RunError(f"--model_dir {model_dir}: cannot create or write there ({exc.strerror or exc})") from None


def make_executor(args, fns, spec, compiled, on_cluster: bool):
    if on_cluster:
        return ClusterExecutor(args, fns, spec, compiled)
    return CpuExecutor(args, fns, spec)


def make_loss_scaler(params: Params) -> LossScaler:
    o = params.optimizer
    mode = o.loss_scaling_mode()
    return LossScaler(mode, initial_scale=o.initial_loss_scale, steps_per_increase=o.steps_per_increase,
                      min_scale=o.min_loss_scale, max_scale=o.max_loss_scale,
                      static_scale=o.loss_scaling_factor if mode == "static" else 1.0)


class Trainer:
    def __init__(self, args: RunArgs, spec: ModelSpec, executor, fns: UserFunctions | None = None):
        self.args, self.spec, self.executor, self.fns = args, spec, executor, fns
        self.params = args.params
        self.rc = self.params.runconfig
        self.model_dir = Path(args.model_dir)
        self.summaries = Summaries(self.model_dir)
        self.scaler = make_loss_scaler(self.params)
        self.skipped_steps = 0
        self.story = run_story.RunStory(self.model_dir, PROCESS_STARTED)

    # ------------------------------------------------------------ start state
    def initial_state(self) -> ckpt.Checkpoint:
        optimizer = Optimizer(self.params.optimizer.optimizer_spec())
        found = self.checkpoint_to_resume()
        if found is None:
            weights = init_weights(self.spec, self.rc.seed)
            opt_state = {name: optimizer.init_state(w) for name, w in weights.items()}
            return ckpt.Checkpoint(0, 0, weights, opt_state, {})
        state, path = found
        ckpt.with_tied_copies(self.spec, state.weights, state.opt_state)
        expected = {l.name: l.param_shapes() for l in self.spec.layers}
        ckpt.check_compatible(state, expected, path, builds=self.spec.name)
        for layer, params in state.weights.items():
            optimizer.fill_missing(state.opt_state.setdefault(layer, {}), params, state.global_step)
        if "loss_scaler" in state.meta:
            self.scaler.load_state_dict(state.meta["loss_scaler"])
        log.info("Restored checkpoint %s at global step %d", path, state.global_step)
        self.story.checkpoint_saved(Path(path))
        return state

    def checkpoint_to_resume(self) -> tuple[ckpt.Checkpoint, Path] | None:
        """--checkpoint_path, else (and always on a restart) the newest checkpoint
        in model_dir that loads; each newer one skipped is said, with why."""
        path = self.args.checkpoint_path
        restarted = env.RESTART.get() > 0
        if path is not None and not (restarted and ckpt.latest(self.model_dir) is not None):
            return ckpt.load(path), Path(path)
        # A restarted job goes on from where it got to, not from where it began.
        found = ckpt.load_newest(self.model_dir, set_aside=True)
        if found is None:
            return None
        state, path, skipped = found
        for reason in skipped:
            log.warning("skipping %s; %s", reason,
                        "resuming from an older one" if state is not None else "no checkpoint to resume from")
        if state is None:
            return None
        log.info("Found checkpoint %s in model_dir: resuming from it", path)
        return state, path

    # ------------------------------------------------------------ the run
    def run(self) -> None:
        self.summaries.exit_on_disk_errors()
        self.story.open_log(self.args.mode, sys.argv)
        run_story.write_effective_params(self.model_dir, self.args.mode, self.params.to_dict())
        run_story.CURRENT = self.story
        try:
            self._run()
        except KeyboardInterrupt:
            self.story.stopped("interrupted")
            raise
        finally:
            run_story.CURRENT = None
            self.summaries.abandon()   # after a failure: no flush left for atexit to fail at
            self.story.close_log()

    def _run(self) -> None:
        start = self.initial_state()
        self.global_step = start.global_step
        mode = self.args.mode
        self.max_steps = self.stop_step()
        phases = []
        if mode in ("train", "train_and_eval") and self.global_step < self.max_steps:
            phases.append({"stream": "train", "start": self.global_step, "stop": self.max_steps})
        if mode in ("eval", "train_and_eval"):
            phases.append({"stream": "eval", "start": 0, "stop": self.executor.num_eval_steps()})
        with trace.span("load"):
            self.executor.load(start.weights, start.opt_state, phases)
        self.write_text_summaries()
        if mode in ("train", "train_and_eval"):
            if self.rc.save_initial_checkpoint and self.global_step == 0:
                self.save_checkpoint()
            self.train()
        if mode in ("eval", "train_and_eval"):
            self.evaluate()
        self.summaries.close()
        self.story.summary(self.write_trace() if trace.RECORDER.enabled else None)

    def stop_step(self) -> int:
        """The global step training stops at (runconfig: max_steps, num_steps or num_epochs)."""
        per_epoch = None
        if self.rc.num_epochs is not None and self.rc.steps_per_epoch is None and self.fns is not None:
            from cs_runtime.data.inputs import dataset_len
            section = self.params.train_input
            per_epoch = dataset_len(self.fns.train_input_fn(self.params)) // section.batch_size
        stop = self.rc.stop_step(self.global_step, per_epoch)
        every = self.rc.eval_frequency
        if self.args.mode == "train_and_eval" and every is not None and every < stop - self.global_step:
            raise RunError(f"runconfig.eval_frequency {every}: evaluating during training is not emulated (eval "
                           f"runs once, after step {stop}); set eval_frequency to {stop - self.global_step} or more")
        return stop

    def train(self) -> None:
        if self.global_step >= self.max_steps:
            log.info("Already at step %d of max_steps %d: nothing to train", self.global_step, self.max_steps)
            return
        batch = self.params.train_input.batch_size
        self.writer("train")  # opened (and tensorboardX imported) before the clock starts
        t_start = t_last = time.monotonic()
        first_step, steps_since = self.global_step, 0
        self.story.begin_training(self.global_step, self.max_steps)
        while self.global_step < self.max_steps:
            step = self.global_step
            args = self.step_args(step)
            lr, loss_scale = args[1], args[2]
            with trace.span("train_step", step=step):
                loss, grad_norm, applied = self.executor.train_step(*args, ahead=self.next_step_args)
            if not math.isfinite(loss):
                raise RunError(f"loss is {loss} at step {step + 1}; stopping (lower the learning rate?)")
            self.after_step(step, applied, loss_scale)
            self.global_step += 1
            steps_since += 1
            self.story.step_done(self.global_step, loss)
            self.scalar("train", "loss", loss)
            if self.scaler.skips_nonfinite:
                self.scalar("train", "loss_scale", loss_scale)
            if self.logs_at(self.global_step):
                now = time.monotonic()
                rate = steps_since * batch / max(now - t_last, 1e-9)
                global_rate = (self.global_step - first_step) * batch / max(now - t_start, 1e-9)
                t_last, steps_since = now, 0
                scale_note = f", LossScale={loss_scale:g}" if self.scaler.skips_nonfinite else ""
                eta = run_story.clock((self.max_steps - self.global_step) * (now - t_start) / (self.global_step - first_step))
                self.story.say(f"| Train Device={self.executor.device}, Step={self.global_step}, Loss={loss:.5f}"
                               f"{scale_note}, Rate={rate:.1f} samples/sec, GlobalRate={global_rate:.1f} "
                               f"samples/sec, Progress={self.global_step}/{self.max_steps}, ETA={eta}")
                self.scalar("train", TAG_RATE, rate)
                self.scalar("train", TAG_GLOBAL_RATE, global_rate)
                self.scalar("train", TAG_STEPS_RATE, global_rate / batch)
                self.scalar("train", TAG_LR, lr)
                self.scalar("train", TAG_GRAD_NORM, grad_norm)
                for layer, norm in zip(self.spec.layers, getattr(self.executor, "layer_grad_norms", ())):
                    self.scalar("train", f"per_layer_grad_norm/{layer.name}", norm)
            elif self.story.progress_due():   # a slow run between log_steps lines: still alive, and where
                self.story.say(f"| Train Device={self.executor.device}, Step={self.global_step}, Loss={loss:.5f}, "
                               f"Progress={self.global_step}/{self.max_steps}, ETA={self.story.eta()}")
            if self.checkpoint_due():
                self.save_checkpoint()
        if not self.checkpoint_due():  # the final step always has a checkpoint
            self.save_checkpoint()
        if self.skipped_steps:
            self.story.say(f"| Train: {self.skipped_steps} step(s) skipped for overflowed gradients; "
                           f"final loss scale {self.scaler.scale:g}")
        summary = self.executor.traffic_summary()
        if summary:
            self.story.say(summary)

    def step_args(self, step: int) -> tuple[int, float, float, bool]:
        """What TRAIN_STEP `step` carries: (step, lr, loss scale, whether it computes the norms)."""
        return step, self.params.optimizer.lr_at(step), self.scaler.scale, self.logs_at(step + 1)

    def next_step_args(self, step: int) -> tuple | None:
        """step_args of the step after `step` when they are known before `step` ends, else None.
        A cluster sends such steps ahead, so that MemoryX (or a pipelined WSE) finds them queued
        instead of idling through the hops of the chief's round trip (chief/cluster_executor.py). It asks
        for steps beyond the next too, before `step` ends: what decides the answer (the lr
        schedule, a static scale, the log and checkpoint steps) does not depend on results.
        Not known: a dynamic loss scale (it follows the step's result); not sent: after the
        last step, or when a checkpoint comes between (it must hold this step's weights)."""
        nxt = step + 1
        if nxt >= self.max_steps or self.scaler.mode == "dynamic" or self.due_at(nxt):
            return None
        return self.step_args(nxt)

    def logs_at(self, global_step: int) -> bool:
        """Whether the progress line and the step's summaries are written after `global_step`
        steps; the gradient norms are computed for those steps only."""
        return global_step % self.rc.log_steps == 0 or global_step == self.max_steps

    def after_step(self, step: int, applied: bool, loss_scale: float) -> None:
        """Advance the loss scale; a skipped step is said once, with what happens next."""
        self.scaler.update(applied)
        if not applied:
            self.skipped_steps += 1
            log.warning("step %d: gradients overflowed (inf/nan) at loss scale %g; step skipped, "
                        "loss scale now %g", step + 1, loss_scale, self.scaler.scale)

    def checkpoint_due(self) -> bool:
        return self.due_at(self.global_step)

    def due_at(self, global_step: int) -> bool:
        """Whether a checkpoint is written once `global_step` steps are done."""
        return bool(self.rc.checkpoint_steps) and global_step % self.rc.checkpoint_steps == 0

    def evaluate(self) -> None:
        total_loss, correct, count = 0.0, 0, 0
        for step in range(self.executor.num_eval_steps()):
            with trace.span("eval_step", step=step):
                loss_sum, c, n = self.executor.eval_step(step)
            total_loss, correct, count = total_loss + loss_sum, correct + c, count + n
        loss, accuracy = total_loss / max(count, 1), correct / max(count, 1)
        self.story.say(f"| Eval Device={self.executor.device}, Step={self.global_step}, Loss={loss:.5f}, "
                       f"Accuracy={accuracy:.4f} ({correct}/{count})")
        self.story.evaluated(f"eval loss {loss:.5f}, accuracy {accuracy:.4f}")
        self.scalar("eval", "loss", loss)
        self.scalar("eval", "accuracy", accuracy)

    # ------------------------------------------------------------ outputs
    def save_checkpoint(self) -> None:
        with trace.span("checkpoint", step=self.global_step):
            self._save_checkpoint()

    def _save_checkpoint(self) -> None:
        weights, opt_state = ckpt.stored_once(self.spec, *self.executor.state())
        meta = {"model": self.spec.describe(), "params": self.params.to_dict(),
                "device": self.executor.device, "loss_scaler": self.scaler.state_dict()}
        state = ckpt.Checkpoint(self.global_step, self.global_step, weights, opt_state, meta)
        path = ckpt.save(self.model_dir, state, self.rc.max_checkpoints)
        self.story.checkpoint_saved(path)
        # Summaries up to the checkpoint are on disk too: a restart resumes here
        # and never writes the earlier steps again.
        self.summaries.flush()
        log.info("Saved checkpoint %s", path)

    def write_text_summaries(self) -> None:
        """The params and the compile report as TensorBoard text (TEXT tab), once per run."""
        writer = self.writer("train")
        writer.add_text("params", as_code(yaml.safe_dump(self.params.to_dict(), sort_keys=False)), self.global_step)
        report = self.model_dir / "compile_report.txt"
        if report.is_file():
            writer.add_text("compile_report", as_code(report.read_text()), self.global_step)

    def write_trace(self) -> Path:
        """Merge every process's spans into model_dir/trace.json and say where it is."""
        own = trace.ProcessTrace("chief", trace.RECORDER.take(), 0, trace.RECORDER.dropped)
        processes = [own, *self.executor.collect_traces()]
        path = self.model_dir / "trace.json"
        spans = trace.write_chrome_trace(path, processes)
        timeline = pictures.write_timeline(path)   # one step, viewable without browser tools
        seen = f"; one step drawn in {timeline}" if timeline else ""
        self.story.say(f"| Trace: {path} ({spans} spans from {len(processes)} process(es)); "
                       f"open it in https://ui.perfetto.dev or chrome://tracing{seen}")
        return path

    def writer(self, split: str):
        return self.summaries.writer(split)

    def scalar(self, split: str, tag: str, value: float) -> None:
        self.summaries.scalar(split, tag, value, self.global_step)


def as_code(text: str) -> str:
    """Markdown code block (TensorBoard renders text summaries as markdown)."""
    return "\n".join("    " + line for line in text.splitlines())
