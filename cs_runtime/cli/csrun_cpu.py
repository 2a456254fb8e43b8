"""csrun_cpu: run a model script on the CPU (the oracle path), compile-only or validate-only.

    csrun_cpu python examples/fc_mnist/run.py --mode train --params examples/fc_mnist/configs/params.yaml
    csrun_cpu python examples/fc_mnist/run.py --mode train --params ... --compile_only
    csrun_cpu --trace python examples/fc_mnist/run.py ...   # timeline in model_dir/trace.json

It runs the command as it is, in the foreground, with no CS system role set,
so `run()` takes the in-process CPU path.
"""
from __future__ import annotations

import os
import sys

from cs_runtime.env import with_numerics_defaults
from cs_runtime.version import version_line

USAGE = "usage: csrun_cpu [-h] [--version] [--trace] python run.py --mode MODE --params FILE [run.py options]"
OPTIONS = """
options:
  -h, --help   show this help and exit
  --version    show the version and exit
  --trace      record a timeline of the run into model_dir/trace.json

run.py options (python run.py --help): --mode {train,eval,train_and_eval,eval_all,validate_only,compile_only}
  --params FILE  --model_dir DIR  --checkpoint_path CKPT  --validate_only  --compile_only
  --override KEY.PATH=VALUE (repeatable)  --multireplica  --version; the model zoo's command line too:
  python run.py CPU|CSX --mode MODE --params FILE ... (docs/running.md)"""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__.strip()}\n{OPTIONS}" if argv else USAGE, file=sys.stdout if argv else sys.stderr)
        sys.exit(0 if argv else 2)
    if argv[0] == "--version":
        print(version_line("csrun_cpu"))
        sys.exit(0)
    traced = argv[0] == "--trace"
    if traced:
        argv = argv[1:]
    if not argv or argv[0].startswith("-"):
        print(f"{USAGE}\ncsrun_cpu: error: {'unrecognized argument: ' + argv[0] if argv else 'no command given'}",
              file=sys.stderr)
        sys.exit(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CS_")}
    env["CS_TARGET"] = "cpu"
    with_numerics_defaults(env, threaded=True)   # unless set: cs_runtime/env.py says why
    env["CS_TRACE"] = "1" if traced else "0"
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        sys.exit(f"csrun_cpu: cannot run {argv[0]}: {exc.strerror}")


if __name__ == "__main__":
    main()
