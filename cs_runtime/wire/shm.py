"""Same-host shared memory for the weight stream: arenas and the segments they announce.

Over tcp every streamed byte is copied into the kernel and out again, twice
per hop. When MemoryX, SwarmX and the WSEs share a host (the launcher says
so with CS_SHM_DIR), the big tensors instead live in shared-memory segments:
MemoryX keeps its master weights in its arena, a WSE writes its gradients
into its own; a message then carries, for such an array, a reference
(segment, offset) in place of a frame, and the receiver maps the segment
read-only and reads the tensor where it lies. The message still crosses the
ZeroMQ socket, so ordering and the protocol's validation are unchanged.

Why it is safe to hand out live memory: the step protocol is lockstep. A
WSE reads layer l's weights only between their WEIGHTS message and its
GRADS for layer l, and MemoryX updates layer l only after those gradients
arrived; a WSE overwrites its gradient buffer for layer l only in the next
step, after MemoryX has applied (or copied) this step's.

A segment is a file in CS_SHM_DIR (/dev/shm: memory, not disk) named
`cs-<job>-<role><rank>-<n>-l<launcher pid>`, created 0600 by the job's own user. A receiver
maps only regular files whose name has that shape and names its job, that lie
in its own CS_SHM_DIR and that belong to its own user (opened O_NOFOLLOW and
O_NONBLOCK, then checked with fstat: a symlink, directory or FIFO named like a
segment is refused, never followed or waited on), and checks every reference
against the file's size before it builds a view. The launcher deletes the job's
segments when the job ends, however it ends; those of a launcher that was
itself killed (kill -9) are deleted by its services (process/orphan.py), and any
left all the same by the next launcher.

    python -m pytest tests/test_shm.py -q
"""
from __future__ import annotations

import math
import mmap
import os
import re
import stat
from pathlib import Path

import numpy as np

from cs_runtime.errors import CsError
from cs_runtime import env
from cs_runtime.wire.auth import pid_alive  # also how stale key folders are found

SHM_ENV = env.SHM_DIR.name
SEGMENT_NAME = re.compile(r"^cs-[A-Za-z0-9_.-]{1,120}$")
LAUNCHER_SUFFIX = re.compile(r"-l(\d+)$")
ALIGN = 64          # bytes: every array starts on a cache line
# Below this an array goes as a frame (ZeroMQ copies small frames anyway).
MIN_SHARED_BYTES = 64 * 1024


class SharedMemoryError(CsError, ValueError):
    """A reference that must not be followed (bad name, owner, bounds)."""


_process_segments: "Segments | None" = None


def process_segments() -> "Segments | None":
    """This process's Segments, or None when the launcher did not ask for shared memory."""
    global _process_segments
    folder = shm_dir()
    if folder is None:
        return None
    if _process_segments is None:
        _process_segments = Segments(folder, env.JOB_ID.get())
    return _process_segments


def new_arena(job: str, owner: str, size: int) -> "Arena | None":
    """A fresh arena of this process for `job`, registered with its Segments (None without shm)."""
    segments = process_segments()
    if segments is None or size <= 0:
        return None
    segments.arenas_made += 1
    # The launcher that started us is our parent: named here, its death orphans the segment.
    name = f"{segment_prefix(job)}{owner}-{segments.arenas_made}-l{os.getppid()}"
    arena = Arena(segments.folder, name, size)
    segments.add_arena(arena)
    return arena


def arena_bytes(shapes, itemsize: int) -> int:
    """Bytes an arena needs for arrays of these shapes (with alignment)."""
    return sum(int(np.prod(s, dtype=np.int64)) * itemsize + ALIGN for s in shapes)


def shm_dir() -> Path | None:
    """Where this job's segments live, or None when the job does not share memory."""
    value = env.SHM_DIR.get()
    return Path(value) if value else None


def segment_prefix(job: str) -> str:
    return f"cs-{job}-"


def remove_orphaned_segments(folder: Path) -> int:
    """Delete segments whose launcher is dead (it was killed before it could); returns how many."""
    removed = 0
    for path in folder.glob("cs-*-l*"):
        found = LAUNCHER_SUFFIX.search(path.name)
        try:
            if not found or path.stat().st_uid != os.getuid() or pid_alive(int(found.group(1))):
                continue
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def remove_job_segments(folder: Path, job: str) -> int:
    """Delete every segment of `job` (the launcher's clean-up); returns how many."""
    removed = 0
    for path in folder.glob(f"{segment_prefix(job)}*"):
        try:
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


class Arena:
    """A fixed-size segment that hands out arrays (bump allocation, never freed)."""

    def __init__(self, folder: Path, name: str, size: int):
        if not SEGMENT_NAME.match(name):
            raise SharedMemoryError(f"bad segment name {name!r}")
        self.name, self.path, self.size = name, folder / name, int(size)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self.size)
            self.map = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.base = np.frombuffer(self.map, dtype=np.uint8)
        self.used = 0

    def empty(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        start = -(-self.used // ALIGN) * ALIGN
        if start + nbytes > self.size:
            raise MemoryError(f"arena {self.name}: {nbytes} bytes do not fit ({self.size - start} left)")
        self.used = start + nbytes
        return self.base[start:start + nbytes].view(dtype).reshape(shape)

    def copy_of(self, arr: np.ndarray) -> np.ndarray:
        out = self.empty(arr.shape, arr.dtype)
        np.copyto(out, arr)
        return out

    def close(self) -> None:
        """Unmap and delete the segment (receivers keep their own mappings)."""
        self.base = None
        try:
            self.map.close()
        except BufferError:
            pass  # views still exported: the mapping goes when they do
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


class Segments:
    """Every segment one process knows: its own arenas and the peers' it has mapped.

    `locate` turns an array into a reference if it lies in one of them (so a
    tensor received from a peer's segment can be sent on by reference too);
    `resolve` turns a reference back into a read-only array.
    """

    def __init__(self, folder: Path, job: str = ""):
        self.folder = folder.resolve()
        self.job = job    # set: only this job's segments are mapped (a CS system serves many jobs)
        self.uid = os.getuid()
        # name -> (address, size, the whole segment as a uint8 array): resolve slices it, far
        # cheaper per message than a fresh buffer export of the mapping
        self.spans: dict[str, tuple[int, int, np.ndarray]] = {}
        self.arenas_made = 0

    def add_arena(self, arena: Arena) -> None:
        self.spans[arena.name] = (arena.base.ctypes.data, arena.size, arena.base)

    def release(self, arena: Arena | None) -> None:
        """Forget and delete an arena of this process (at the end of a job)."""
        if arena is not None:
            self.spans.pop(arena.name, None)
            arena.close()

    def forget_peers(self, job: str) -> None:
        """Drop the mappings of `job`'s peer segments (they are deleted with the job)."""
        for name in [n for n in self.spans if n.startswith(segment_prefix(job))]:
            self.spans.pop(name)

    def locate(self, arr: np.ndarray) -> tuple[str, int] | None:
        if arr.nbytes < MIN_SHARED_BYTES or not arr.flags.c_contiguous:
            return None
        address = arr.ctypes.data
        for name, (start, size, _) in self.spans.items():
            if start <= address and address + arr.nbytes <= start + size:
                return name, address - start
        return None

    def resolve(self, name: str, offset: int, dtype: str, shape: tuple) -> np.ndarray:
        # Python ints: no overflow, and no numpy reduction per message
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        start, size, whole = self.spans.get(name) or self._map(name)
        if not (isinstance(offset, int) and 0 <= offset and offset + nbytes <= size):
            raise SharedMemoryError(f"reference {name}+{offset} ({nbytes} bytes) outside the segment of {size}")
        arr = whole[offset:offset + nbytes].view(dtype).reshape(shape)
        arr.flags.writeable = False
        return arr

    def _map(self, name: str):
        if not SEGMENT_NAME.match(name):
            raise SharedMemoryError(f"bad segment name {name[:40]!r}")
        if self.job and not name.startswith(segment_prefix(self.job)):
            raise SharedMemoryError(f"segment {name[:60]} is not of this job ({self.job})")
        path = self.folder / name
        try:
            # NOFOLLOW: a symlink is refused, not followed; NONBLOCK: opening a FIFO
            # returns at once instead of waiting for a writer (fstat then refuses it).
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise SharedMemoryError(f"segment {name}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            check_segment_file(name, st, self.uid)
            try:
                mapped = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
            except (OSError, ValueError) as exc:
                raise SharedMemoryError(f"segment {name} cannot be mapped: {exc}") from None
        finally:
            os.close(fd)
        whole = np.frombuffer(mapped, dtype=np.uint8)   # read-only: the mapping is PROT_READ
        span = (whole.ctypes.data, st.st_size, whole)
        self.spans[name] = span
        return span


def check_segment_file(name: str, st: os.stat_result, uid: int) -> None:
    """Only a non-empty regular file of our own user is a segment (not a
    directory, FIFO, device or socket named like one, nor another user's file)."""
    if not stat.S_ISREG(st.st_mode):
        raise SharedMemoryError(f"segment {name} is not a regular file")
    if st.st_uid != uid:
        raise SharedMemoryError(f"segment {name} belongs to uid {st.st_uid}, not {uid}")
    if st.st_size == 0:
        raise SharedMemoryError(f"segment {name} is empty")
