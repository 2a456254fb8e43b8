"""The compile stage: runs before anything else, on csrun_cpu and csrun_wse alike.

    csrun_cpu python examples/fc_mnist/run.py --mode train --params ... --model_dir /tmp/fc --validate_only
    csrun_cpu python examples/fc_mnist/run.py --mode train --params ... --model_dir /tmp/fc --compile_only
    csrun_wse python examples/fc_mnist/run.py --mode train --params ... --model_dir /tmp/fc   # reuses it

1. validate: the model becomes a kernel graph; every op, shape and dtype is
   checked. With --validate_only that is all: nothing is compiled or written.
2. reuse: if model_dir/compile/artifact.json has this run's key (model,
   compile-relevant params, mode, target), its plan is used as it is.
3. compile otherwise, saying why (no artifact, which input changed, or why
   the old one was rejected): rewrite the graph, plan it, save the artifact.
4. report: compile_report.txt, compile/plan.json, compile/graph.txt and the picture of the
   mode run (compile/wafer.svg pipelined, compile/streaming.svg weight streaming).

Errors (CompileError, a ValueError) name the layer and the op; the trainer
prints them and exits 1.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from cs_runtime.compiler import artifact
from cs_runtime.compiler.families import lower_spec
from cs_runtime.compiler.ir import CompileError, Graph
from cs_runtime.compiler.lower import lower
from cs_runtime.compiler.planner import Target, check_forced, make_plan, mode_name, run_mode, strategy_for, target_from_env
from cs_runtime.compiler.report import write_outputs
from cs_runtime.compiler.rewrites import optimize
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


def compile_model(spec: ModelSpec, args: RunArgs) -> dict[str, Any]:
    """Validate, then compile or reuse; returns the plan (with "execution_strategy")."""
    if spec.captured:
        return compile_program(spec, args)
    start = time.perf_counter()
    graph = lower(spec)
    target = target_from_env(multireplica=args.multireplica)
    if args.validate_only:
        return validate_only(spec, graph, args, target, time.perf_counter() - start)
    inputs = artifact.compile_inputs(spec, args.params, args.mode, target)
    key = artifact.key_of(inputs)
    compile_dir = Path(args.model_dir) / "compile"
    found, why = reusable(compile_dir, inputs, key)
    if found is not None:
        plan, final = found.plan, found.graph
        say(f"reused compiled artifact {key[:12]} from {compile_dir}: skipped compilation")
    else:
        say(f"compiling {spec.name} ({why})")
        final, notes = optimize(graph)
        plan = make_plan(final, args.params, args.mode, target, notes).to_dict()
        saved = artifact.save(compile_dir, inputs, final, plan)
        say(f"compiled in {time.perf_counter() - start:.2f} s; artifact {key[:12]} saved to {saved}")
    written = write_outputs(args.model_dir, plan, f"# as extracted\n{graph}\n\n# as compiled\n{final}\n")
    summarize(plan, written[0])
    if args.compile_only:
        say("compile_only: done; nothing was run")
    return {**plan, "artifact_key": key, "reused": found is not None}


def validate_only(spec: ModelSpec, graph: Graph, args: RunArgs, target: Target, seconds: float) -> dict[str, Any]:
    strategy, why = strategy_for(graph, args.params, args.mode, target)
    ops = sorted({n.op for n in graph.kernels()})
    say(f"validate_only: {spec.name} is valid: {len(spec.layers)} layers, {spec.num_params():,} parameters, "
        f"{len(graph.kernels())} kernels ({', '.join(ops)}), checked in {seconds * 1000:.1f} ms")
    replicas = run_mode(strategy, target.num_csx, target.multireplica)[1]
    say(f"validate_only: would run {mode_name(strategy, replicas)} on {target.num_csx} CS system(s) ({why}); "
        "nothing was compiled or run")
    log.debug("kernel graph:\n%s", graph)
    return {"execution_strategy": strategy, "strategy_reason": why, "num_replicas": replicas,
            "validated_only": True}


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


def compile_program(spec: ModelSpec, args: RunArgs) -> dict[str, Any]:
    """A captured program was validated and compiled (autodiff, units) when it was
    captured; here it is reported. Every path runs it as weight-streaming units."""
    from cs_runtime.compiler import program_report
    values = spec.program["values"]
    shapes = {k: tuple(v[0]) for k, v in values.items()}
    dtypes = {k: v[1] for k, v in values.items()}
    batch = shapes[spec.program["inputs"][0]][0] if shapes[spec.program["inputs"][0]] else 1
    ops = sorted({n[0] for layer in spec.layers for n in layer.unit["unit"]["forward"]})
    say(f"{spec.name}: a compiled program of {len(spec.layers)} weight-streaming units, "
        f"{spec.num_params():,} parameters, ops: {', '.join(ops)}")
    strategy, replicas, why = program_mode(args)
    if args.validate_only:
        say(f"validate_only: {spec.name} is valid; would run {mode_name(strategy, replicas)} ({why}); "
            "nothing was compiled or run")
        return {"execution_strategy": strategy, "strategy_reason": why, "num_replicas": replicas,
                "validated_only": True}
    listing = "\n".join(f"# unit {layer.name}\n" + "\n".join(
        f"{', '.join(n[2])} = {n[0]}({', '.join(n[1])}) {n[3] or ''}  # {n[4]} {n[5]}"
        for n in layer.unit["unit"]["forward"]) for layer in spec.layers)
    mode = f"Execution strategy: {mode_name(strategy, replicas)} on {target_from_env().num_csx} CS system(s) ({why})"
    report = program_report.write(args.model_dir, spec, shapes, dtypes, batch, listing + "\n", mode)
    say(f"report: {report}")
    if args.compile_only:
        say("compile_only: done; nothing was run")
    return {"execution_strategy": strategy, "strategy_reason": why, "num_replicas": replicas, "model": spec.name}


def program_mode(args: RunArgs) -> tuple[str, int, str]:
    """(strategy, replicas, why) of a compiled program: weight-streaming units unless
    runconfig.execution_strategy says otherwise, as the CS system of this run can run it."""
    target = target_from_env(multireplica=args.multireplica)
    forced = args.params.runconfig.execution_strategy
    check_forced(forced, target.num_csx)
    strategy, replicas, note = run_mode(forced or "weight_streaming", target.num_csx, target.multireplica)
    why = "forced by runconfig.execution_strategy" if forced else "a compiled program runs as weight-streaming units"
    return strategy, replicas, "; ".join(filter(None, [why, note]))
