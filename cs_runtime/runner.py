"""`run()`: the entry point a model's run.py calls, model-zoo style.

    def main():
        run(model_fn, train_input_fn, eval_input_fn)

The same script is every task of a job. What this process does depends on
the role the launcher gave it (environment CS_ROLE):
- no role (plain `python run.py` or `csrun_cpu`): the CPU path, in-process;
- chief (`csrun_wse` task 0): compile, then drive the CS system;
- worker (`csrun_wse` other tasks): stream its shard of the input;
- input_probe / wse_probe (`cs_input_analyzer`): measure input and WSE rates;
- precheck (`csrun_wse`, before it starts anything): validate the params and
  the model, as --validate_only does, and exit (2 on a bad params file).

The roles live above cs_runtime (chief/, worker/, wse/): each is imported by
name from cs_runtime.roles, so no import of this package points up.
"""
from __future__ import annotations

import importlib
import sys

from cs_runtime import env
from cs_runtime.launch.target import hand_over
from cs_runtime.run_args import RunArgs, UserFunctions, parse_args
from cs_runtime.roles import entry_point
from cs_runtime.process.service import setup_logging

__all__ = ["RunArgs", "UserFunctions", "run"]

def run(model_fn, train_input_fn, eval_input_fn=None, argv: list[str] | None = None,
        model: str | None = None) -> None:
    """`model`: the model the script builds (fc_mnist, gpt2, bert), as a model-zoo
    run.py knows it; None lets `model.model_type` say (older params files)."""
    args = parse_args(argv, model)
    code = hand_over(args)   # the model zoo's targets: CSX becomes csrun_wse, eval_all one eval a checkpoint
    if code is not None:
        sys.exit(code)
    fns = UserFunctions(model_fn, train_input_fn, eval_input_fn)
    role = env.ROLE.get()
    setup_logging(role or "cpu")
    module, function = entry_point(role)
    code = getattr(importlib.import_module(module), function)(args, fns)
    if code is not None:
        sys.exit(code)
