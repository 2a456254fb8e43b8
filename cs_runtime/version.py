"""The installed cs-emulator version, for every command's --version."""
from __future__ import annotations

from importlib import metadata


def version() -> str:
    try:
        return metadata.version("cs-emulator")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def version_line(prog: str) -> str:
    """What `prog --version` prints."""
    return f"{prog} (cs-emulator) {version()}"
