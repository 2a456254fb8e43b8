"""cerebras.appliance.storage: where checkpoints are written, by path.

    base_storage.py   StorageWriter, StorageReader, StorageDeleter and S3Writer for local paths

The emulated cluster writes to the local file system only: an `s3://` path is not
a valid path of any writer here, so the model zoo refuses it in one line ("Invalid
checkpoint path") before the run, as it does any path no writer takes.
"""
from .base_storage import S3Writer, StorageDeleter, StorageReader, StorageWriter

__all__ = ["S3Writer", "StorageDeleter", "StorageReader", "StorageWriter"]
