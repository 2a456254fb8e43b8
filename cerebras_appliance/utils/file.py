"""File helpers."""
from __future__ import annotations

import os


def create_symlink(link: str, target: str, **kwargs) -> None:
    """A symlink at `link` to `target`, replacing an older link there."""
    if os.path.islink(link):
        os.unlink(link)
    os.symlink(target, link, **kwargs)
