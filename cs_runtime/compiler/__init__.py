"""The compiler: model -> program -> units -> plan -> report and artifact.

    families.py        the built-in families (FC-MNIST, GPT-2, BERT) lowered to the program the executor runs
    autodiff.py        the backward program, from one vector-Jacobian rule per op
    units.py           a program cut into weight-streaming units, each with its backward
    lower.py           ModelSpec -> Graph of primitive ops (ir.py), validated, for the plan and report
    ir.py              the kernel graph
    rewrites.py        constant folding, no-op and dead-node removal, dense fusion (on the graph)
    interp.py          a numpy interpreter of the graph (the rewrites' oracle)
    planner.py         execution mode, PEs per kernel, estimate (hardware.py)
    hardware.py        the hardware model: WSE-2 figures with their sources, the cost model
    report.py          compile_report.txt, plan.json, wafer.svg
    program_report.py  compile_report.txt for a captured torch model's program
    artifact.py        the compiled artifact on disk, its key, reuse and rejection
    stage.py           the compile stage every run has: runs these in order (compile_model)
"""
from .ir import CompileError, Graph, Node
from .lower import lower
from .planner import Plan, Target, make_plan, target_from_env
from .rewrites import optimize

__all__ = ["CompileError", "Graph", "Node", "Plan", "Target", "lower", "make_plan", "optimize",
           "target_from_env"]
