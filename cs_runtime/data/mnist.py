"""MNIST: the IDX files, and the handwritten digits embedded in the package.

``load_mnist(data_dir, split)`` reads the real MNIST IDX files when a directory
is given, and otherwise falls back to a small set of real handwritten digits
embedded in the package (the UCI "Optical Recognition of Handwritten Digits"
data, as shipped by scikit-learn), reshaped to MNIST geometry so a fresh install
can train without any download. Which samples form which batch is batches.py's.

Returned arrays are read-only (``flags.writeable`` is False): the embedded
digits are cached in-process and shared between callers, and MNIST arrays are
marked the same way for consistency.  Call ``.copy()`` before mutating.
"""

from __future__ import annotations

import functools
import gzip
import math
import os
import zlib
from importlib import resources
from typing import TYPE_CHECKING

import numpy as np

from cs_runtime.errors import UserInputError

if TYPE_CHECKING:
    from importlib.abc import Traversable

__all__ = [
    "DataError",
    "read_idx",
    "load_mnist",
    "load_embedded_digits",
    "IMAGE_SIZE",
    "NUM_CLASSES",
    "EMBEDDED_TRAIN_SIZE",
]

IMAGE_SIZE = 28 * 28
NUM_CLASSES = 10
# First 1500 embedded rows train, the remaining 297 test: a fixed split so the
# oracle and the distributed run always agree on what "train" means.
EMBEDDED_TRAIN_SIZE = 1500

SPLITS = ("train", "test")


class DataError(UserInputError):
    """A data set is missing, malformed, or inconsistent with the request."""


# --------------------------------------------------------------------------
# IDX files
# --------------------------------------------------------------------------

# IDX type codes (third byte of the magic number); all multi-byte types are
# big-endian on disk.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

_MNIST_FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _read_bytes(path: str) -> bytes:
    """Whole file contents, transparently gunzipped when the name ends in .gz."""
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read()
        with open(path, "rb") as f:
            return f.read()
    except (EOFError, OSError, zlib.error) as exc:
        # A cut-off .gz raises EOFError, a non-gzip file BadGzipFile (an
        # OSError), a corrupt deflate stream zlib.error.
        raise DataError(f"{path}: cannot read: {exc}") from exc


def _parse_idx(raw: bytes, path: str) -> np.ndarray:
    """Validate an IDX header and return the payload with its shape."""
    if len(raw) < 4:
        raise DataError(f"{path}: truncated: {len(raw)} bytes, no IDX header")
    zero0, zero1, code, ndim = raw[0], raw[1], raw[2], raw[3]
    if zero0 != 0 or zero1 != 0 or code not in _IDX_DTYPES or ndim == 0:
        raise DataError(f"{path}: bad IDX magic number 0x{raw[:4].hex()}")
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise DataError(f"{path}: truncated: header needs {header_len} bytes, file has {len(raw)}")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[code]
    expected = header_len + math.prod(dims) * dtype.itemsize
    if len(raw) < expected:
        raise DataError(f"{path}: truncated: dims {dims} need {expected} bytes, file has {len(raw)}")
    if len(raw) > expected:
        # Trailing garbage usually means the header is wrong, so refuse it too.
        raise DataError(f"{path}: {len(raw) - expected} unexpected trailing bytes after dims {dims}")
    data = np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(dims)
    return data.astype(dtype.newbyteorder("="))


def read_idx(path: str) -> np.ndarray:
    """Read one IDX file (plain or .gz) into a native-endian numpy array."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found")
    return _parse_idx(_read_bytes(path), path)


def _find_idx(data_dir: str, name: str) -> str:
    """Locate an MNIST file under its dash or dot spelling, plain or gzipped, in
    data_dir or in torchvision's layout below it (MNIST/raw/, what the model zoo's
    FC-MNIST downloads into its data_dir)."""
    dotted = name.replace("-idx", ".idx")  # train-images.idx3-ubyte circulates too
    for folder in (data_dir, os.path.join(data_dir, "MNIST", "raw")):
        for base in (name, dotted):
            for candidate in (base, base + ".gz"):
                path = os.path.join(folder, candidate)
                if os.path.isfile(path):
                    return path
    raise DataError(f"{os.path.join(data_dir, name)}: file not found (also tried .gz, {dotted} and "
                    f"torchvision's {os.path.join(data_dir, 'MNIST', 'raw')}/)")


def _read_mnist_split(data_dir: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    image_name, label_name = _MNIST_FILES[split]
    image_path = _find_idx(data_dir, image_name)
    label_path = _find_idx(data_dir, label_name)
    images = read_idx(image_path)
    labels = read_idx(label_path)
    if images.ndim != 3 or images.shape[1:] != (28, 28) or images.dtype != np.uint8:
        raise DataError(f"{image_path}: expected uint8 images of shape [n, 28, 28], got {images.dtype} {images.shape}")
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise DataError(f"{label_path}: expected uint8 labels of shape [n], got {labels.dtype} {labels.shape}")
    if images.shape[0] != labels.shape[0]:
        raise DataError(f"{label_path}: {labels.shape[0]} labels but {image_path} has {images.shape[0]} images")
    if labels.size and labels.max() >= NUM_CLASSES:
        raise DataError(f"{label_path}: label {int(labels.max())} out of range 0..{NUM_CLASSES - 1}")
    x = images.reshape(-1, IMAGE_SIZE).astype(np.float32) / np.float32(255.0)
    y = labels.astype(np.int64)
    return x, y


# --------------------------------------------------------------------------
# Embedded digits
# --------------------------------------------------------------------------

def _embedded_path() -> Traversable:
    return resources.files("cs_runtime").joinpath("data", "digits.csv.gz")


def _to_mnist_geometry(pixels: np.ndarray) -> np.ndarray:
    """[n, 64] counts 0..16 -> [n, 784] float32 in [0, 1], 28x28 like MNIST.

    Upscaling 3x to 24x24 and padding 2 each side mirrors MNIST's own layout
    (a ~20-24 px digit centred in a 28x28 frame), so models built for MNIST
    take the embedded digits unchanged.
    """
    img = pixels.reshape(-1, 8, 8)
    img = np.repeat(np.repeat(img, 3, axis=1), 3, axis=2)
    img = np.pad(img, ((0, 0), (2, 2), (2, 2)))
    return (img.reshape(-1, IMAGE_SIZE) / np.float32(16.0)).astype(np.float32)


@functools.lru_cache(maxsize=1)
def load_embedded_digits() -> tuple[np.ndarray, np.ndarray]:
    """All 1797 embedded digits as ([n, 784] float32, [n] int64), read-only."""
    path = _embedded_path()
    try:
        with path.open("rb") as raw, gzip.open(raw, "rt") as text:
            table = np.loadtxt(text, delimiter=",", dtype=np.int64, ndmin=2)
    except (OSError, EOFError, zlib.error, ValueError) as exc:
        raise DataError(f"{path}: cannot read embedded digits: {exc}") from exc
    if table.shape[1] != 65 or table[:, :64].min() < 0 or table[:, :64].max() > 16:
        raise DataError(f"{path}: expected 65 columns of 0..16 pixels + label, got shape {table.shape}")
    x = _to_mnist_geometry(table[:, :64])
    y = table[:, 64].astype(np.int64)
    return _readonly(x), _readonly(y)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def load_mnist(data_dir: str | None, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Images [n, 784] float32 in [0, 1] and labels [n] int64 for ``split``.

    ``data_dir`` holds the MNIST IDX files; ``None`` uses the embedded digits
    (train = first 1500, test = last 297).  Arrays are read-only.
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {SPLITS}")
    if data_dir is None:
        x, y = load_embedded_digits()
        rows = slice(0, EMBEDDED_TRAIN_SIZE) if split == "train" else slice(EMBEDDED_TRAIN_SIZE, None)
        return x[rows], y[rows]
    if not os.path.isdir(data_dir):
        raise DataError(f"{data_dir}: data directory not found")
    x, y = _read_mnist_split(data_dir, split)
    return _readonly(x), _readonly(y)
