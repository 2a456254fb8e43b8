"""A model script's command line and what run() hands each role.

    python run.py --mode train --params configs/params.yaml [--model_dir D] [--checkpoint_path C]
        [--override KEY.PATH=VALUE ...] [--version]

`RunArgs` (the parsed command line, params loaded and checked) and
`UserFunctions` (model_fn and the input functions of run.py) are all the
chief, the input workers and the probes get from `cs_runtime.runner.run()`.
They sit low in the layers so that every role can import them.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from cs_runtime.errors import UserInputError
from cs_runtime.config import Params, ParamsError, load_params
from cs_runtime.numerics.model import ModelSpec
from cs_runtime.version import version_line


class RunError(UserInputError):
    """A user-facing failure of a run: the chief prints it as one line, exit code 2 (no restart)."""


MODES = ("train", "eval", "train_and_eval", "validate_only", "compile_only")


@dataclass
class RunArgs:
    mode: str
    params_path: str
    params: Params
    model_dir: str
    checkpoint_path: str | None
    validate_only: bool
    compile_only: bool
    multireplica: bool = False


@dataclass
class UserFunctions:
    model_fn: Callable[[Params], ModelSpec]
    train_input_fn: Callable[[Params], object]
    eval_input_fn: Callable[[Params], object] | None


def parse_args(argv: list[str] | None = None, model: str | None = None) -> RunArgs:
    """run.py's command line; `model` (fc_mnist, gpt2, bert) is what the script
    builds, which says what the params' model section may hold."""
    parser = argparse.ArgumentParser(description="Train or evaluate a model on the emulated CS system.")
    parser.add_argument("--version", action="version", version=version_line(parser.prog))
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--params", required=True, help="params.yaml")
    parser.add_argument("--model_dir", default=None,
                        help="checkpoints, logs, compile output (default: runconfig.model_dir, else model_dir)")
    parser.add_argument("--checkpoint_path", default=None, help="resume from this checkpoint")
    parser.add_argument("--validate_only", action="store_true", help="check the model compiles; run nothing")
    parser.add_argument("--compile_only", action="store_true", help="compile and write the report; run nothing")
    parser.add_argument("--multireplica", action="store_true",
                        help="layer pipelined: several copies of a small model on one WSE")
    parser.add_argument("--override", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="set a params key, e.g. runconfig.max_steps=10 or train_input.data_dir=/data "
                             "(trainer.init.loop.max_steps=10 in a 2.x file); repeatable")
    ns = parser.parse_args(argv)
    try:
        params = load_params(ns.params, model, ns.override)
    except ParamsError as exc:
        parser.exit(2, "".join(f"error: {line}\n" for line in exc.lines))
    validate_only = ns.validate_only or ns.mode == "validate_only"
    compile_only = ns.compile_only or ns.mode == "compile_only"
    mode = "train" if ns.mode in ("validate_only", "compile_only") else ns.mode
    # As in the model zoo, the command line wins over runconfig.model_dir and runconfig.mode.
    model_dir = ns.model_dir or params.runconfig.model_dir or "model_dir"
    return RunArgs(mode, ns.params, params, model_dir, ns.checkpoint_path, validate_only, compile_only,
                   ns.multireplica)
