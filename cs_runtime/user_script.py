"""Running the user's script as one role: `python -m chief|worker run.py ARGS...`.

The role entry points share this; the script then reads CS_ROLE (through
cs_runtime.runner) to hand over to the role's code.
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
