"""The input-worker process: `python -m worker run.py ARGS...` (started by csrun_wse).

Runs the user's script as an input worker: it builds the user's input
function and streams its share of the batches to its WSE.
"""
from __future__ import annotations

import os
import runpy
import sys

from cs_runtime import env


def run_script_as(role: str) -> None:
    """Run the user's script (argv[1]) as __main__ with CS_ROLE set to `role`."""
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: python -m {role} SCRIPT [ARGS...]")
    os.environ[env.ROLE.name] = role
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    run_script_as("worker")
