"""Storage by path: local files and folders (the emulator has no object store)."""
from __future__ import annotations

import os
import shutil

_REMOTE = ("s3://",)


def _is_local(path) -> bool:
    return not str(path).startswith(_REMOTE)


class StorageWriter:
    @staticmethod
    def is_valid_path(path) -> bool:
        return _is_local(path)

    @staticmethod
    def path_exists(path) -> bool:
        return _is_local(path) and os.path.exists(path)


class StorageReader(StorageWriter):
    """Reading takes the same paths as writing."""


class S3Writer:
    @staticmethod
    def is_valid_path(path) -> bool:
        """False: no object store is emulated, so no path is one of its (an s3:// path is refused above)."""
        return False


class StorageDeleter:
    def __init__(self, path):
        self.path = path

    @classmethod
    def get(cls, path) -> "StorageDeleter":
        if not _is_local(path):
            raise ValueError(f"StorageDeleter: {path} is not a local path (no object store is emulated)")
        return cls(path)

    def delete(self) -> None:
        if os.path.isdir(self.path):
            shutil.rmtree(self.path)
        elif os.path.lexists(self.path):
            os.remove(self.path)
