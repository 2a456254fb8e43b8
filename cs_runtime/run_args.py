"""A model script's command line and what run() hands each role.

    python run.py --mode train --params configs/params.yaml [--model_dir D] [--checkpoint_path C]

`RunArgs` (the parsed command line, params loaded and checked) and
`UserFunctions` (model_fn and the input functions of run.py) are all the
chief, the input workers and the probes get from `cs_runtime.runner.run()`.
They sit low in the layers so that every role can import them.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from cs_runtime.config import Params, ParamsError, load_params
from cs_runtime.numerics.model import ModelSpec

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


def parse_args(argv: list[str] | None = None) -> RunArgs:
    parser = argparse.ArgumentParser(description="Train or evaluate a model on the emulated CS system.")
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--params", required=True, help="params.yaml")
    parser.add_argument("--model_dir", default="model_dir", help="checkpoints, logs, compile output")
    parser.add_argument("--checkpoint_path", default=None, help="resume from this checkpoint")
    parser.add_argument("--validate_only", action="store_true", help="check the model compiles; run nothing")
    parser.add_argument("--compile_only", action="store_true", help="compile and write the report; run nothing")
    parser.add_argument("--multireplica", action="store_true",
                        help="layer pipelined: several copies of a small model on one WSE")
    ns = parser.parse_args(argv)
    try:
        params = load_params(ns.params)
    except ParamsError as exc:
        parser.exit(2, f"error: {exc}\n")
    validate_only = ns.validate_only or ns.mode == "validate_only"
    compile_only = ns.compile_only or ns.mode == "compile_only"
    mode = "train" if ns.mode in ("validate_only", "compile_only") else ns.mode
    return RunArgs(mode, ns.params, params, ns.model_dir, ns.checkpoint_path, validate_only, compile_only,
                   ns.multireplica)
