"""A model script's command line and what run() hands each role.

    python run.py [CPU|CSX] --mode train --params configs/params.yaml [--model_dir D] [--checkpoint_path C]
        [--override KEY.PATH=VALUE ...] [--version]
    python run.py CSX --mode train --params P --model_dir D --num_csx 2 --num_workers_per_csx 1 \
        --job_labels name=bert --mount_dirs /home --python_paths ~/modelzoo --compile_dir me

The model zoo's command line is taken as it is: the target first (CPU: in this
process; CSX: a job on the emulated cluster, cs_runtime/launch/target.py; GPU
runs as CPU), its modes (eval_all: every checkpoint of model_dir) and its
flags. A flag that means nothing here is accepted and named once
(`unused_flags`). Without a target the script runs as its launcher says
(csrun_cpu, csrun_wse, or in this process).

`RunArgs` (the parsed command line, params loaded and checked) and
`UserFunctions` (model_fn and the input functions of run.py) are all the
chief, the input workers and the probes get from `cs_runtime.runner.run()`.
They sit low in the layers so that every role can import them.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Callable

from cs_runtime.errors import UserInputError
from cs_runtime.config import Params, ParamsError, load_params
from cs_runtime.numerics.model import ModelSpec
from cs_runtime.version import version_line


class RunError(UserInputError):
    """A user-facing failure of a run: the chief prints it as one line, exit code 2 (no restart)."""


MODES = ("train", "eval", "train_and_eval", "eval_all", "validate_only", "compile_only")
TARGETS = ("CPU", "GPU", "CSX")

# The model zoo's flags that change nothing here, each with why (said once, in one line).
NO_EFFECT = {
    "compile_dir": "compiles are in model_dir",
    "mount_dirs": "the job's processes share this file system",
    "credentials_path": "the job's CURVE keys are made for it",
    "debug_args_path": "no cluster debug args",
    "job_time_sec": "no time limit",
    "disable_version_check": "one version",
    "num_wgt_servers": "one MemoryX",
    "num_act_servers": "one SwarmX",
    "mgmt_namespace": "one namespace",
    "wsc_log_level": "--logging sets every process's level",
    "load_checkpoint_states": "a checkpoint is loaded whole",
    "disable_strict_checkpoint_loading": "a checkpoint must match the model",
    "dist_addr": "GPU runs on the CPU path", "dist_backend": "GPU runs on the CPU path",
    "init_method": "GPU runs on the CPU path",
}


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
    # The model zoo's target (CPU, GPU, CSX; None: as the launcher says) and how a CSX job runs.
    target: str | None = None
    cluster: dict = field(default_factory=dict)   # num_csx, num_workers_per_csx, mgmt_address, job_labels, python_paths
    logging: str | None = None
    unused_flags: list[str] = field(default_factory=list)   # "--flag (why)" for each given that changes nothing
    command_line: list[str] = field(default_factory=list)   # run.py's arguments after the target


@dataclass
class UserFunctions:
    model_fn: Callable[[Params], ModelSpec]
    train_input_fn: Callable[[Params], object]
    eval_input_fn: Callable[[Params], object] | None


def parse_args(argv: list[str] | None = None, model: str | None = None) -> RunArgs:
    """run.py's command line; `model` (fc_mnist, gpt2, bert) is what the script
    builds, which says what the params' model section may hold."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    target = argv.pop(0) if argv and argv[0] in TARGETS else None
    ns = _parser().parse_args(argv)
    try:
        params = load_params(ns.params, model, ns.override + _length_overrides(ns))
    except ParamsError as exc:
        _parser().exit(2, "".join(f"error: {line}\n" for line in exc.lines))
    rc = params.runconfig
    validate_only = bool(ns.validate_only or ns.mode == "validate_only" or rc.validate_only)
    compile_only = bool(ns.compile_only or ns.mode == "compile_only" or rc.compile_only)
    mode = "train" if ns.mode in ("validate_only", "compile_only") else ns.mode
    # As in the model zoo, the command line wins over runconfig.model_dir and runconfig.mode.
    model_dir = ns.model_dir or rc.model_dir or "model_dir"
    return RunArgs(mode, ns.params, params, model_dir, ns.checkpoint_path, validate_only, compile_only,
                   ns.multireplica, target, _cluster(ns, rc), ns.logging, _unused(ns, target), argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Train or evaluate a model on the emulated CS system.",
                                     usage="%(prog)s [CPU|CSX] --mode MODE --params FILE [options]")
    parser.add_argument("--version", action="version", version=version_line(parser.prog))
    parser.add_argument("-m", "--mode", choices=MODES, required=True)
    parser.add_argument("-p", "--params", required=True, help="params.yaml")
    parser.add_argument("-o", "--model_dir", default=None,
                        help="checkpoints, logs, compile output (default: runconfig.model_dir, else model_dir)")
    parser.add_argument("--checkpoint_path", default=None, help="resume from this checkpoint")
    parser.add_argument("--validate_only", action="store_true", help="check the model compiles; run nothing")
    parser.add_argument("--compile_only", action="store_true", help="compile and write the report; run nothing")
    parser.add_argument("--multireplica", action="store_true",
                        help="layer pipelined: several copies of a small model on one WSE")
    parser.add_argument("--override", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="set a params key, e.g. runconfig.max_steps=10 or train_input.data_dir=/data "
                             "(trainer.init.loop.max_steps=10 in a 2.x file); repeatable")
    parser.add_argument("--max_steps", type=int, default=None, help="runconfig.max_steps")
    parser.add_argument("--eval_steps", type=int, default=None, help="runconfig.eval_steps")
    parser.add_argument("--logging", default=None, help="logging level of every process (INFO, DEBUG, ...)")
    csx = parser.add_argument_group("CSX (the emulated cluster)")
    csx.add_argument("--num_csx", type=int, default=None, help="WSEs (default: runconfig.num_csx, else 1)")
    csx.add_argument("--num_workers_per_csx", type=int, default=None, help="input workers per WSE (default 1)")
    csx.add_argument("--mgmt_address", default=None,
                     help="HOST:PORT of a running `cs_system serve`: run as a job of it (default: a cluster "
                          "started for this job)")
    csx.add_argument("--job_labels", nargs="+", default=None, metavar="KEY=VALUE",
                     help="labels of the job, shown by csctl get jobs (with --mgmt_address)")
    csx.add_argument("--python_paths", nargs="+", default=None, help="added to the job processes' PYTHONPATH")
    for name in NO_EFFECT:
        many = name in ("mount_dirs", "wsc_log_level")
        flag = name in ("disable_version_check", "disable_strict_checkpoint_loading")
        csx.add_argument(f"--{name}", default=None, help=f"accepted; no effect here: {NO_EFFECT[name]}",
                         **({"nargs": "+"} if many else {"action": "store_true"} if flag else {}))
    return parser


def _length_overrides(ns: argparse.Namespace) -> list[str]:
    """--max_steps / --eval_steps as params overrides, spelled for the file's layout."""
    out = []
    for name in ("max_steps", "eval_steps"):
        value = getattr(ns, name)
        if value is not None:
            out.append(f"{name}={value}")
    if not out:
        return []
    from cs_runtime.config import read_params_file
    from cs_runtime.params_compat import is_trainer_layout
    prefix = "trainer.init.loop." if is_trainer_layout(read_params_file(ns.params)) else "runconfig."
    return [prefix + item for item in out]


def _cluster(ns: argparse.Namespace, rc) -> dict:
    """How a CSX job runs: the command line, else the runconfig keys of the same names."""
    labels = ns.job_labels if ns.job_labels is not None else rc.job_labels
    return {"num_csx": ns.num_csx or rc.num_csx or 1,
            "num_workers_per_csx": ns.num_workers_per_csx or rc.num_workers_per_csx or None,
            "mgmt_address": ns.mgmt_address or rc.cs_ip,
            "job_labels": list(labels or []),
            "python_paths": list(ns.python_paths or rc.python_paths or [])}


def _unused(ns: argparse.Namespace, target: str | None) -> list[str]:
    """Each flag given that changes nothing here, with why."""
    out = [f"--{name} ({why})" for name, why in NO_EFFECT.items() if getattr(ns, name) not in (None, False)]
    if target != "CSX":
        for name in ("num_csx", "num_workers_per_csx", "mgmt_address", "job_labels", "python_paths"):
            if getattr(ns, name) is not None:
                out.append(f"--{name} (for CSX; this run is {target or 'on the CPU path'})")
    return out
