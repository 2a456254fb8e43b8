"""The project's errors: one root, and one branch for input the user must fix.

    CsError                    every error this project raises on purpose
      UserInputError           bad input: params, data, a batch, a checkpoint, capture,
                               compile, the command line. One line, exit EXIT_BAD_INPUT,
                               never restarted (a restart would meet the same input).
      (any other CsError)      a fault of ours or of the machine: kept with its traceback,
                               exit 1, eligible for --max_restarts.

The existing errors of each module (config.ParamsError, checkpoint.CheckpointError,
data.mnist.DataError, ...) derive from these; those that did from ValueError still
do, so `except ValueError` in a user's code keeps working.

An exception out of the user's own code (model_fn, the input functions, a loss)
is neither: `user_traceback` trims its traceback to the user's frames, so the
user sees their file and line, not ours.
"""
from __future__ import annotations

import atexit
import functools
import os
import sys
import sysconfig
import traceback

# A process exits with this when its input is bad: the launcher fails the job at
# once and never restarts it (cs_runtime/launch/restart.py).
EXIT_BAD_INPUT = 2


class CsError(Exception):
    """Root of the project's errors."""


class UserInputError(CsError, ValueError):
    """Input the user must fix (params, data, batch, checkpoint, capture, compile, CLI):
    its message is the one line shown; exit EXIT_BAD_INPUT, no restart."""


def is_user_input(exc: BaseException) -> bool:
    return isinstance(exc, UserInputError)


# Folders whose frames are not the user's: this project's packages, Python's own library.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_USER_FOLDERS_IN_REPO = ("examples",)   # a model script there is written as a user's would be


@functools.lru_cache(maxsize=1)
def _library_folders() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def is_user_file(filename: str) -> bool:
    """A frame's file is the user's: not this project's packages, not Python's or an installed package's."""
    if filename.startswith("<"):   # <frozen runpy>, <string>
        return False
    path = os.path.realpath(filename)
    if path.startswith(_library_folders()):
        return False
    relative = os.path.relpath(path, _REPO)
    if relative.startswith(".."):
        return True
    top = relative.split(os.sep)[0]
    return top in _USER_FOLDERS_IN_REPO or not os.path.isfile(os.path.join(_REPO, top, "__init__.py"))


def user_traceback(exc: BaseException, where: str) -> str | None:
    """The traceback of an exception that passed through the user's code, trimmed to the
    user's frames and headed by `where` (role and host); None when no frame is the user's
    (then it is ours, and keeps its whole traceback)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
    if not frames:
        return None
    lines = [f"error: {type(exc).__name__} in your code ({where}):",
             "Traceback (your frames only, most recent call last):",
             *(line.rstrip("\n") for line in traceback.format_list(frames)),
             *(line.rstrip("\n") for line in traceback.format_exception_only(type(exc), exc))]
    return "\n".join(lines)


def say_error(text: str) -> None:
    """Every error line on stderr, flushed (stdout may be a pipe that buffers)."""
    print(text, file=sys.stderr, flush=True)


def report(exc: BaseException, where: str) -> int | None:
    """Say `exc` as its kind is said, on stderr, and return the exit code; None for a
    fault of ours, which the caller re-raises so that it keeps its whole traceback.
    `where`: the role and host, e.g. 'worker 1 on node3'."""
    if is_user_input(exc):
        for line in str(exc).splitlines():   # a ParamsError may hold several problems, a line each
            say_error(f"error: {line}")
        return EXIT_BAD_INPUT
    trimmed = user_traceback(exc, where)
    if trimmed is None:
        return None
    say_error(trimmed)
    return 1   # the user's code may have met a passing fault (a file system): a restart may help


def exit_on_user_input_error() -> None:
    """Make an uncaught UserInputError in this process's main thread end it as the project's
    own entry points do: its one line on stderr, exit EXIT_BAD_INPUT, no traceback. A script
    that is not ours (the model zoo's run.py) catches nothing, so without this Python would
    print the traceback above the line and exit 1. Every other exception goes to the hook
    that was there before; so does everything in an interactive session, which must go on.
    Installing twice keeps one hook."""
    previous = sys.excepthook
    if getattr(previous, "one_line_user_errors", False):
        return

    def hook(kind, exc, tb):
        if not is_user_input(exc) or hasattr(sys, "ps1") or sys.flags.interactive:
            return previous(kind, exc, tb)
        for line in str(exc).splitlines():
            say_error(f"error: {line}")
        _exit_after_cleanup(EXIT_BAD_INPUT)

    hook.one_line_user_errors = True
    sys.excepthook = hook


def _exit_after_cleanup(code: int) -> None:
    """Exit with `code` from inside sys.excepthook, where Python would exit 1 whatever the hook
    does: the atexit handlers run first (they stop what the run started and flush the logs),
    then the output is flushed, as a normal exit would."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):   # closed, or replaced by None
            pass
    os._exit(code)
