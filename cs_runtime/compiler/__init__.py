"""The compiler: model -> kernel graph -> rewrites -> plan -> report, pictures and artifact.

    lower.py     ModelSpec -> Graph of primitive ops (ir.py), validated
    rewrites.py  constant folding, no-op and dead-node removal, dense fusion
    interp.py    a numpy interpreter of the graph (the rewrites' oracle)
    planner.py   execution mode (run_mode), PEs per kernel, estimate (cs_runtime/compiler/hardware.py)
    report.py    compile_report.txt, plan.json, and the mode's picture
    pictures.py  wafer.svg, streaming.svg, timeline.svg (from a trace)
    artifact.py  the compiled artifact on disk, its key, reuse and rejection

stage.py       the compile stage every run has: runs these in order (compile_model)
"""
from .ir import CompileError, Graph, Node
from .lower import lower
from .planner import Plan, Target, make_plan, target_from_env
from .rewrites import optimize

__all__ = ["CompileError", "Graph", "Node", "Plan", "Target", "lower", "make_plan", "optimize",
           "target_from_env"]
