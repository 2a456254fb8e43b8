"""The compile stage: runs before anything else, on csrun_cpu and csrun_wse alike.

    csrun_cpu python examples/fc_mnist/run.py --mode train --params ... --model_dir /tmp/fc --validate_only
    csrun_cpu python examples/fc_mnist/run.py --mode train --params ... --model_dir /tmp/fc --compile_only
    csrun_wse python examples/fc_mnist/run.py --mode train --params ... --model_dir /tmp/fc   # reuses it

1. validate: the model is the program every path runs (a captured model's, or a
   built-in model lowered by families.py); every op's shape rule is checked and
   its kernels costed (costs.py). With --validate_only that is all: nothing is
   compiled or written.
2. reuse: if model_dir/compile/artifact.json has this run's key (model,
   compile-relevant params, mode, target), its plan is used as it is.
3. compile otherwise, saying why (no artifact, which input changed, or why
   the old one was rejected): plan the program's kernels, save the artifact.
4. report: compile_report.txt, compile/plan.json, compile/program.txt and the picture of the
   mode run (compile/wafer.svg pipelined, compile/streaming.svg weight streaming).

Errors (CompileError, a ValueError) name the layer and the op; the trainer
prints them and exits 2.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from cs_runtime.compiler import artifact
from cs_runtime.compiler.families import lower_spec
from cs_runtime.compiler.costs import listing, program_shapes
from cs_runtime.compiler.errors import CompileError
from cs_runtime.compiler.planner import (Target, kernels_of, make_plan, mode_name, run_mode,
                                         strategy_for, target_from_env)
from cs_runtime.compiler.report import write_outputs
from cs_runtime.compiler.units import unit_table
from cs_runtime.numerics import program_layer
from cs_runtime.numerics.model import ModelSpec
from cs_runtime.run_args import RunArgs, RunError, UserFunctions

__all__ = ["CompileError", "build_spec", "compile_model", "runnable"]

log = logging.getLogger("chief")
MAX_CHANGES_SHOWN = 5


def say(message: str) -> None:
    """A line for the user: the compile stage is visible in every run's output."""
    print(f"compile: {message}", flush=True)


def build_spec(args: RunArgs, fns: UserFunctions) -> ModelSpec:
    """The user's model_fn's ModelSpec, at the precision the params say, lowered to
    the program every path runs (a built-in model: families.lower_spec)."""
    spec = fns.model_fn(args.params)
    if not isinstance(spec, ModelSpec):
        raise RunError(f"model_fn returned {type(spec).__name__}, expected a cs_runtime.model.ModelSpec")
    # The params say the precision (model.mixed_precision), whatever model_fn built.
    return runnable(dataclasses.replace(spec.plain(), precision=args.params.precision))


def runnable(spec: ModelSpec) -> ModelSpec:
    """The spec as every path runs it: a built-in model lowered to its program, in every precision."""
    return lower_spec(spec)


def compile_model(spec: ModelSpec, args: RunArgs, target: Target | None = None) -> dict[str, Any]:
    """Validate, then compile or reuse; returns the plan (with "execution_strategy").
    Built-in and captured models alike: the plan is made from the program that runs.
    `target`: the CS system it runs on (default: csrun_cpu / csrun_wse's, from the environment)."""
    start = time.perf_counter()
    spec = runnable(spec)
    target = target or target_from_env(multireplica=args.multireplica)
    kernels = kernels_of(spec, args.params, args.mode)
    if args.validate_only:
        return validate_only(spec, kernels, args, target, time.perf_counter() - start)
    inputs = artifact.compile_inputs(spec, args.params, args.mode, target)
    key = artifact.key_of(inputs)
    compile_dir = Path(args.model_dir) / "compile"
    found, why = reusable(compile_dir, inputs, key)
    if found is not None:
        plan = found.plan
        refuse_synced_replicas(spec, plan.get("num_replicas", 1))
        say(f"reused compiled artifact {key[:12]} from {compile_dir}: skipped compilation")
    else:
        say(f"compiling {spec.name} ({why})")
        plan = {**make_plan(spec, args.params, args.mode, target, kernels).to_dict(),
                "units": unit_rows(spec)}
        refuse_synced_replicas(spec, plan.get("num_replicas", 1))
        saved = artifact.save(compile_dir, inputs, plan)
        say(f"compiled in {time.perf_counter() - start:.2f} s; artifact {key[:12]} saved to {saved}")
    written = write_outputs(args.model_dir, plan, listing(spec))
    summarize(plan, written[0])
    if args.compile_only:
        say("compile_only: done; nothing was run")
    return {**plan, "artifact_key": key, "reused": found is not None}


def unit_rows(spec: ModelSpec) -> list[dict[str, Any]]:
    """Per weight-streaming unit: its parameters, the activations its backward keeps, its FLOPs."""
    shapes, dtypes, batch = program_shapes(spec)
    return [{**row, "fwd_flops": row["fwd_flops"] / batch, "bwd_flops": row["bwd_flops"] / batch}
            for row in unit_table(spec, shapes, dtypes)]


def validate_only(spec: ModelSpec, kernels: list, args: RunArgs, target: Target, seconds: float) -> dict[str, Any]:
    strategy, why = strategy_for(spec, kernels, args.params, target)
    replicas = run_mode(strategy, target.num_csx, target.multireplica)[1]
    refuse_synced_replicas(spec, replicas)
    ops = sorted({op for k in kernels for op in k.nodes})
    say(f"validate_only: {spec.name} is valid: {len(spec.layers)} layers, {spec.num_params():,} parameters, "
        f"{len(kernels)} kernels ({', '.join(ops)}), checked in {seconds * 1000:.1f} ms")
    say(f"validate_only: would run {mode_name(strategy, replicas)} on {target.num_csx} CS system(s) ({why}); "
        "nothing was compiled or run")
    return {"execution_strategy": strategy, "strategy_reason": why, "num_replicas": replicas,
            "validated_only": True}


def refuse_synced_replicas(spec: ModelSpec, replicas: int) -> None:
    """The replicas of a pipelined WSE (--multireplica) run one after another in its process,
    so a SyncBatchNorm's statistics cannot be summed over them: refused before anything runs
    (weight streaming sums them over the WSEs through SwarmX)."""
    synced = program_layer.synced_modules(spec) if replicas > 1 else []
    if synced:
        raise CompileError(f"module {synced[0]}: SyncBatchNorm in training with --multireplica is not supported "
                           f"(the {replicas} pipelined replicas run one after another, so their batch statistics "
                           "cannot be synchronized); run without --multireplica, or use BatchNorm")


def reusable(compile_dir: Path, inputs: dict[str, Any], key: str) -> tuple[artifact.Artifact | None, str]:
    """(the artifact to reuse, or None and why it cannot be)."""
    try:
        found = artifact.load(compile_dir)
    except artifact.ArtifactError as exc:
        say(f"warning: rejected {exc}; recompiling")
        return None, "the previous artifact was rejected"
    if found is None:
        return None, "no compiled artifact yet"
    if found.key == key:
        return found, ""
    changes = artifact.changed_inputs(found.inputs, inputs)
    shown = "; ".join(changes[:MAX_CHANGES_SHOWN])
    more = f" (+{len(changes) - MAX_CHANGES_SHOWN} more)" if len(changes) > MAX_CHANGES_SHOWN else ""
    return None, f"inputs changed since the last compile: {shown}{more}"


def summarize(plan: dict[str, Any], report: Path) -> None:
    est = plan["estimate"]
    say(f"{plan['model']}: {len(plan['kernels'])} kernels, "
        f"{mode_name(plan['execution_strategy'], plan.get('num_replicas', 1))} on "
        f"{plan['target']['num_csx']} CS system(s) ({plan['strategy_reason']})")
    second = plan.get("second_target", {}).get("samples_per_s")
    on_cs3 = f"; on {plan['second_target']['system']}: {second:,.0f}" if second else ""
    say(f"estimate for {plan['target']['system']} x {plan['target']['num_csx']} (not measured): "
        f"{est['samples_per_s']:,.0f} samples/s, {est['active_pes_pct']:.1f}% of PEs active, "
        f"{est['compute_utilization_pct']:.2f}% compute utilization{on_cs3}; report: {report}")
