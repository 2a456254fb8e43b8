"""The compiler: the program every path runs -> its kernels -> plan -> report, pictures and artifact.

    families.py  a built-in model (params.yaml's FC-MNIST, GPT-2, BERT) lowered to its program
    autodiff.py  a program's backward, from the op set's vector-Jacobian rules
    units.py     the program cut into weight-streaming units
    costs.py     the program's kernels, costed by the op set's shape and FLOP rules
    planner.py   execution mode (run_mode), PEs per kernel, estimate (cs_runtime/compiler/hardware.py)
    report.py    compile_report.txt, plan.json, program.txt, and the mode's picture
    pictures.py  wafer.svg, streaming.svg, timeline.svg (from a trace)
    artifact.py  the compiled artifact on disk, its key, reuse and rejection
    hardware.py  the hardware model: WSE-2 and WSE-3 figures with their sources, the cost model
    errors.py    CompileError
    stage.py     the compile stage every run has: runs these in order (compile_model)
"""
from .costs import Kernel, program_kernels
from .errors import CompileError
from .planner import Plan, Target, make_plan, target_from_env

__all__ = ["CompileError", "Kernel", "Plan", "Target", "make_plan", "program_kernels", "target_from_env"]
