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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if argv else 2)
    traced = argv[0] == "--trace"
    if traced:
        argv = argv[1:]
    if not argv or argv[0].startswith("-"):
        sys.exit(f"csrun_cpu: {'unrecognized argument: ' + argv[0] if argv else 'no command given'} "
                 "(usage: csrun_cpu [--trace] python run.py ...)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CS_")}
    env["CS_TARGET"] = "cpu"
    env["CS_TRACE"] = "1" if traced else "0"
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        sys.exit(f"csrun_cpu: cannot run {argv[0]}: {exc.strerror}")


if __name__ == "__main__":
    main()
