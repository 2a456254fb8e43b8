"""The plan: execution mode, PEs per kernel, and the performance estimate.

    plan = make_plan(spec, params, mode="train", target=target_from_env())   # spec: the program run
    plan.execution_strategy     # "pipelined" or "weight_streaming"

Mode: layer pipelined when the weights, gradients and optimizer state of the
whole model fit in wafer memory (`csconfig.wafer_memory_bytes`, default the
WSE-2's 40 GB), else weight streaming; `runconfig.execution_strategy` forces
either.

Pipelined: every kernel gets its own rectangle of the PE grid, strips laid
left to right in program order (activations flow east), each sized so that all
stages take the same time per sample: a pipeline runs at the pace of its
slowest stage, so PEs beyond that pace are wasted.

Weight streaming: each kernel in turn has the whole wafer, its weights
streamed in over the system I/O while the activations stay resident.

Systems and replicas: several CS systems (--num_csx > 1) train together only
in weight streaming, each on its share of the batch; --multireplica runs two
copies of a pipelined model side by side on one wafer, each on half the
batch. `run_mode` is that rule, written once: the compile applies it, and the
chief applies it again to whatever plan it is handed, so the mode reported
is the mode run.

All times come from cs_runtime/compiler/hardware.py.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping

from cs_runtime import env as cs_env
from cs_runtime.config import Params
from cs_runtime.compiler.hardware import WAFERS, WSE2, WSE3, Wafer
from cs_runtime.numerics.model import ModelSpec
from cs_runtime.numerics.precision import wire_dtype

from .costs import Cost, Kernel, describe, program_kernels
from .errors import CompileError

STRATEGIES = ("weight_streaming", "pipelined")


# ---------------------------------------------------------------- the target

@dataclass(frozen=True)
class Target:
    """What the plan is for. `compiled_on` is informational: a compile made
    with csrun_cpu is valid for the wafer, so it is not part of the key."""

    device: str = "wse2"
    num_csx: int = 1
    compiled_on: str = "cpu"
    multireplica: bool = False     # run.py's --multireplica

    def key_fields(self) -> dict[str, Any]:
        return {"device": self.device, "num_csx": self.num_csx, "multireplica": self.multireplica}


def target_from_env(env: Mapping[str, str] | None = None, multireplica: bool = False) -> Target:
    """CS_TARGET (cpu | wse, set by csrun_cpu / csrun_wse) and, for wse, CS_NUM_CSX (default: os.environ)."""
    try:
        on = cs_env.TARGET.get(env)
        return Target(num_csx=cs_env.NUM_CSX.get(env) if on == "wse" else 1, compiled_on=on,
                      multireplica=bool(multireplica))
    except cs_env.EnvError as exc:
        raise CompileError(str(exc)) from None


# ---------------------------------------------------------------- the mode a system runs

PIPELINED_REPLICAS = 2   # --multireplica: copies of a pipelined model on one wafer


def run_mode(strategy: str, num_csx: int, multireplica: bool) -> tuple[str, int, str]:
    """(strategy, replicas, note) a CS system of `num_csx` WSEs runs a `strategy` plan in;
    the note says what changed and why ("" when nothing did)."""
    note = ""
    if strategy == "pipelined" and num_csx > 1:
        strategy = "weight_streaming"
        note = f"{num_csx} CS systems train together only in weight streaming"
    replicas = PIPELINED_REPLICAS if multireplica and strategy == "pipelined" else 1
    if multireplica and replicas == 1:
        note = "; ".join(filter(None, [note, "--multireplica applies to layer pipelined runs only"]))
    return strategy, replicas, note


def mode_name(strategy: str, replicas: int) -> str:
    """As the run's Device line says it: pipelined, pipelined x2, weight_streaming."""
    return strategy + (f" x{replicas}" if replicas > 1 else "")


# ---------------------------------------------------------------- kernel costs

def state_copies(params: Params, train: bool) -> int:
    """Copies of each weight kept while running: the weight, its gradient, optimizer slots."""
    if not train:
        return 1
    opt = params.optimizer
    slots = 2 if opt.optimizer_type in ("adam", "adamw") else int(opt.momentum > 0)
    return 2 + slots


# ---------------------------------------------------------------- the plan

@dataclass
class KernelPlan:
    name: str
    op: str
    layer: str
    flops_per_sample: float
    weight_bytes: int
    resident_bytes: int
    pes: int                 # cores given to it
    active_pes: int          # of those, cores with work to do
    rect: dict[str, int]     # x, y, w, h on the grid (the whole grid in weight streaming)
    compute_samples_per_s: float | None       # None: no bound
    transmission_samples_per_s: float | None
    ops: list[str] = field(default_factory=list)   # the program's ops it holds


@dataclass
class Estimate:
    """Rates of a named system, from its published figures (hardware.py), not measured."""

    samples_per_s: float            # a whole step: the slower bound, with a pipeline's fill and drain
    compute_samples_per_s: float    # steady state, compute alone
    transmission_samples_per_s: float | None
    active_pes_pct: float
    compute_utilization_pct: float
    step_s: float = 0.0             # one step of the batch the plan is for


@dataclass
class Plan:
    model: str
    execution_strategy: str
    strategy_reason: str
    mode: str
    target: dict[str, Any]
    batch_size: int
    per_system_batch: int
    grid: dict[str, int]
    wafer_memory_bytes: int
    resident_bytes: int
    kernels: list[KernelPlan]
    estimate: Estimate
    kernel_notes: list[str] = field(default_factory=list)   # how the program's ops became kernels
    precision: str = "float32"     # of matmul inputs and streamed tensors (model.mixed_precision)
    num_replicas: int = 1          # copies of a pipelined model on each wafer (--multireplica)
    second_target: dict[str, Any] = field(default_factory=dict)   # the same model on the other system

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rate(samples: float, seconds: float) -> float | None:
    return samples / seconds if seconds > 0 else None


def _min_rate(rates: list[float | None]) -> float | None:
    bounded = [r for r in rates if r is not None]
    return min(bounded) if bounded else None


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n} B"


def check_forced(forced: str | None, num_csx: int) -> None:
    """A forced mode the job's systems cannot run is an error, said before anything starts."""
    if forced == "pipelined" and num_csx > 1:
        raise CompileError(f"runconfig.execution_strategy is pipelined but the job has {num_csx} CS systems "
                           f"(--num_csx {num_csx}); layer pipelined runs on one: use weight_streaming "
                           f"or --num_csx 1")


FORCED_WHY = "forced by runconfig.execution_strategy"
CAPTURED_DEFAULT = ("weight_streaming", "a captured program runs as weight-streaming units unless "
                    "runconfig.execution_strategy says otherwise")


def setting(spec: ModelSpec, params: Params) -> tuple[str | None, str]:
    """The mode asked for (None: the compiler chooses) and why: runconfig.execution_strategy,
    else weight streaming for a captured program (as it has always run)."""
    forced = params.runconfig.execution_strategy
    if forced:
        return forced, FORCED_WHY
    return CAPTURED_DEFAULT if spec.captured else (None, "")


def choose_strategy(resident: int, wafer: Wafer, forced: str | None, num_csx: int = 1,
                    forced_why: str = FORCED_WHY) -> tuple[str, str]:
    """(strategy, why) — the why is shown to the user."""
    need, have = fmt_bytes(resident), fmt_bytes(wafer.memory_bytes)
    fits = resident <= wafer.memory_bytes
    check_forced(forced, num_csx)
    if forced == "pipelined" and not fits:
        raise CompileError(f"runconfig.execution_strategy is pipelined but the model needs {need} "
                           f"on the wafer and {have} are available; use weight_streaming")
    if forced:
        return forced, forced_why
    if not fits:
        return "weight_streaming", f"the model ({need} with optimizer state) does not fit in {have} of wafer memory"
    if num_csx > 1:
        strategy, _, why = run_mode("pipelined", num_csx, False)
        return strategy, why
    return "pipelined", f"the whole model ({need} with optimizer state) fits in {have} of wafer memory"


def balance(costs: list[Cost], wafer: Wafer) -> list[int]:
    """PEs per pipeline stage, so that every stage takes the same time per sample."""
    f = wafer.core_flops_s
    # Keep a column per stage spare: strips are rounded up to whole columns.
    usable = max(wafer.cores - wafer.rows * len(costs), 1)
    # The pace: the slowest stage at its most parallel, or all the work spread
    # over the wafer. A stage without weights is not capped: it can take
    # several samples at once on separate cores.
    capped = [c.flops / (c.max_pes * f) for c in costs if c.weight_bytes]
    pace = max([*capped, sum(c.flops for c in costs) / (usable * f)])
    return [max(math.ceil(c.flops / (pace * f)), wafer.pes_for_memory(c.resident_bytes)) for c in costs]


def place(pes: list[int], wafer: Wafer) -> list[dict[str, int]]:
    """Strips left to right: full height when a stage needs a column or more."""
    rects, x = [], 0
    for n in pes:
        w, h = math.ceil(n / wafer.rows), min(n, wafer.rows)
        rects.append({"x": x, "y": 0, "w": w, "h": h})
        x += w
    if x > wafer.cols:
        raise CompileError(f"a pipelined plan needs {x} columns of PEs; the wafer has {wafer.cols}")
    return rects


def plan_pipelined(nodes: list[Kernel], costs: list[Cost], wafer: Wafer, batch: int,
                   train: bool) -> tuple[list[KernelPlan], Estimate]:
    rects = place(balance(costs, wafer), wafer)
    kernels = []
    for node, c, r in zip(nodes, costs, rects):
        area = r["w"] * r["h"]
        active = min(area, c.max_pes) if c.weight_bytes else area
        compute_s = wafer.compute_time(c.flops, active)
        # Activations enter a strip through its west edge, r["h"] cores tall.
        trans_s = wafer.fabric_time(c.act_bytes, r["h"]) + wafer.io_time(c.host_bytes)
        kernels.append(KernelPlan(node.name, node.op, node.layer, c.flops, c.weight_bytes, c.resident_bytes,
                                  area, active, r, _rate(1, compute_s), _rate(1, trans_s), list(node.nodes)))
    # A pipeline runs at the pace of its slowest stage.
    compute = _min_rate([k.compute_samples_per_s for k in kernels]) or math.inf
    trans = _min_rate([k.transmission_samples_per_s for k in kernels])
    used = sum(k.pes for k in kernels)
    est = _estimate(compute, trans, used / wafer.cores, costs, wafer)
    return kernels, filled(est, batch, len(kernels) * (2 if train else 1))


def filled(est: Estimate, batch: int, depth: int) -> Estimate:
    """A step of `batch` samples through a pipeline `depth` stages deep (forward, then
    backward when training): the first sample takes `depth` paces to come out, the
    rest one pace each, so small batches pay for the fill and drain."""
    pace = 1 / est.samples_per_s
    step = (batch + depth - 1) * pace
    rate = batch / step
    return replace(est, samples_per_s=rate, compute_utilization_pct=est.compute_utilization_pct * rate * pace,
                   step_s=step)


def plan_weight_streaming(nodes: list[Kernel], costs: list[Cost], wafer: Wafer, train: bool,
                          batch: int, precision: str = "float32") -> tuple[list[KernelPlan], Estimate]:
    whole = {"x": 0, "y": 0, "w": wafer.cols, "h": wafer.rows}
    kernels, compute_s, trans_s = [], [], []
    for node, c in zip(nodes, costs):
        active = min(wafer.cores, batch * c.max_pes)
        compute_s.append(wafer.compute_time(batch * c.flops, active))
        # Weights come in for the forward and backward pass, gradients go out,
        # in 16 bits each with mixed precision (the costs count float32).
        streamed = (c.weight_bytes * (3 if train else 1) + batch * c.host_bytes) * wire_fraction(precision)
        trans_s.append(wafer.io_time(streamed))
        kernels.append(KernelPlan(node.name, node.op, node.layer, c.flops, c.weight_bytes, c.resident_bytes,
                                  wafer.cores, active, whole, _rate(batch, compute_s[-1]),
                                  _rate(batch, trans_s[-1]), list(node.nodes)))
    # Layers run one after another; streaming overlaps with compute.
    busy = sum(k.active_pes * s for k, s in zip(kernels, compute_s)) / max(sum(compute_s), 1e-30)
    compute = _rate(batch, sum(compute_s)) or math.inf
    return kernels, streaming_step(_estimate(compute, _rate(batch, sum(trans_s)), busy / wafer.cores, costs, wafer), batch)


def _estimate(compute: float, trans: float | None, active: float, costs: list[Cost], wafer: Wafer) -> Estimate:
    """Per-system rates; scaled to the whole target by make_plan."""
    samples = min(compute, trans) if trans is not None else compute
    flops = sum(c.flops for c in costs)
    return Estimate(samples, compute, trans, 100 * active, 100 * samples * flops / wafer.peak_flops_s)


def streaming_step(est: Estimate, batch: int) -> Estimate:
    """Weight streaming: a step is the batch at the slower of compute and the weights' stream."""
    return replace(est, step_s=batch / est.samples_per_s)


def _scale(e: Estimate, n: int) -> Estimate:
    """N systems each take 1/N of the batch: rates add up, percentages stay."""
    trans = e.transmission_samples_per_s
    return Estimate(e.samples_per_s * n, e.compute_samples_per_s * n, trans * n if trans else trans,
                    e.active_pes_pct, e.compute_utilization_pct, e.step_s)


def kernels_of(spec: ModelSpec, params: Params, mode: str) -> list[Kernel]:
    train = mode != "eval"
    return program_kernels(spec, train, state_copies(params, train))


def strategy_for(spec: ModelSpec, kernels: list[Kernel], params: Params, target: Target) -> tuple[str, str]:
    """The execution mode and why, without planning (what validate_only reports)."""
    resident = sum(k.cost.resident_bytes for k in kernels)
    wafer = WAFERS[target.device].with_memory(params.csconfig.wafer_memory_bytes)
    forced, forced_why = setting(spec, params)
    return choose_strategy(resident, wafer, forced, target.num_csx, forced_why)


def make_plan(spec: ModelSpec, params: Params, mode: str, target: Target,
              kernels: list[Kernel] | None = None) -> Plan:
    """The plan for the target's system, with the same model's estimate on the second target."""
    kernels = kernels if kernels is not None else kernels_of(spec, params, mode)
    plan = plan_on(WAFERS[target.device], spec, kernels, params, mode, target)
    other = WSE3 if target.device != WSE3.name else WSE2
    try:
        second = plan_on(other, spec, kernels, params, mode, target)
        plan.second_target = {"system": other.system, "execution_strategy": second.execution_strategy,
                              "num_replicas": second.num_replicas, **asdict(second.estimate)}
    except CompileError as exc:   # a forced mode the other system cannot run
        plan.second_target = {"system": other.system, "error": str(exc)}
    return plan


def plan_on(wafer: Wafer, spec: ModelSpec, nodes: list[Kernel], params: Params, mode: str, target: Target) -> Plan:
    train = mode != "eval"
    wafer = wafer.with_memory(params.csconfig.wafer_memory_bytes)
    costs = [k.cost for k in nodes]
    resident = sum(c.resident_bytes for c in costs)
    forced, forced_why = setting(spec, params)
    strategy, why = choose_strategy(resident, wafer, forced, target.num_csx, forced_why)
    batch = params.train_input.batch_size if train else params.eval_input.batch_size
    per_system = math.ceil(batch / target.num_csx)
    replicas = 1
    if strategy == "pipelined":
        try:
            replicas = run_mode(strategy, target.num_csx, target.multireplica)[1]
            kernels, est = plan_pipelined(nodes, costs, wafer.part(replicas), math.ceil(batch / replicas), train)
            est = _scale(est, replicas)
        except CompileError as exc:
            if forced:
                raise
            strategy, why, replicas = "weight_streaming", f"{exc}", 1
    if strategy == "weight_streaming":
        kernels, est = plan_weight_streaming(nodes, costs, wafer, train, per_system, params.precision)
    note = run_mode(strategy, target.num_csx, target.multireplica)[2]
    return Plan(spec.name, strategy, "; ".join(filter(None, [why, note])), mode,
                {**target.key_fields(), "compiled_on": target.compiled_on, "system": wafer.system},
                batch, per_system, {"rows": wafer.rows, "cols": wafer.cols, "cores": wafer.cores},
                wafer.memory_bytes, resident, kernels, _scale(est, target.num_csx), grouping_notes(nodes),
                params.precision, replicas)


def grouping_notes(kernels: list[Kernel]) -> list[str]:
    d = describe(kernels)
    return [f"{d['ops']} ops of the program in {d['kernels']} kernels: a kernel starts at a node that reads a "
            f"weight matrix or is matmul-like; the {d['fused']} others (biases, activations, dropout, norms, "
            "residual adds, reshapes, the loss) joined the kernel before them"]


def wire_fraction(precision: str) -> float:
    """Bytes a streamed value takes in `precision`, relative to float32."""
    return wire_dtype(precision).itemsize / 4
