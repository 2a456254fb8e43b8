"""An input worker of a cs_torch Session: `python -m cs_torch.input_worker` (started by the Session).

It imports the loader's input function by name (a module, or the user's
script run under another name than __main__, so that its guarded training
loop does not run), then serves batches exactly as csrun_wse's input
workers do (worker.input_worker.serve_inputs). What to import and the
params come in the environment (INPUT_ENV, JSON), never pickled.
"""
from __future__ import annotations

import importlib
import json
import runpy
import sys
import types
from pathlib import Path

from cs_runtime import env
from cs_runtime.config import params_from_dict
from cs_runtime.process.service import setup_logging
from cs_runtime.run_args import RunArgs, UserFunctions

SCRIPT_RUN_NAME = "__cs_torch_input__"


def load_function(spec: dict):
    """The input function named by a DataLoader's worker_spec (cs_torch.data.function_location)."""
    module, file, name = spec["module"], spec["file"], spec["function"]
    outer, _, inner = name.partition(".<locals>.")
    if module == "__main__":
        namespace = runpy.run_path(file, run_name=SCRIPT_RUN_NAME)
    else:
        if file:  # the folder the module was imported from, in case it is not on the worker's path
            root = Path(file).parent
            for _ in range(module.count(".") + (Path(file).name == "__init__.py")):
                root = root.parent
            sys.path.insert(0, str(root))
        namespace = vars(importlib.import_module(module))
    if not inner:
        return namespace[name]
    return _rebuilt(namespace, outer, inner, spec.get("closure") or {})


def _rebuilt(namespace: dict, outer: str, inner: str, closure: dict):
    """A function defined inside `outer`: its code (a constant of outer's), with the values it captured."""
    code = next((c for c in namespace[outer].__code__.co_consts
                 if isinstance(c, types.CodeType) and c.co_name == inner), None)
    if code is None or set(code.co_freevars) != set(closure):
        raise RuntimeError(f"input worker: cannot rebuild {outer}.<locals>.{inner} from its captured values")
    cells = tuple(types.CellType(_captured_value(closure[v])) for v in code.co_freevars)
    return types.FunctionType(code, namespace, inner, None, cells)


def _captured_value(spec: dict):
    if "value" in spec:
        return spec["value"]
    module, _, qualname = spec["name"].partition(":")
    value = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def main() -> None:
    setup_logging(env.ROLE.get() or "worker")
    spec = json.loads(env.TORCH_INPUT.get())
    fn = load_function(spec["input"])
    args, kwargs = spec["input"]["args"], spec["input"]["kwargs"]
    params = params_from_dict(spec["params"], "cs_torch session")
    run_args = RunArgs(spec["mode"], "<cs_torch>", params, spec["model_dir"], None, False, False)

    def dataset(_params):
        return fn(*args, **kwargs)

    from worker.input_worker import serve_inputs
    serve_inputs(run_args, UserFunctions(None, dataset, dataset))


if __name__ == "__main__":
    main()
