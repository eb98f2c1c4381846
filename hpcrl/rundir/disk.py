"""Writes that survive a misbehaving filesystem: a full disk or quota, a flaky one, a slow one; and the room a job
holds ahead.

Every write also survives a misbehaving filesystem (:func:`guarded`): a write that fails leaves nothing torn
(its temporary file removed, a log cut back to its last whole line); a full disk or quota (ENOSPC, EDQUOT) is
said in one line (which path, how many bytes, how much is free) and waited out with back-off for
:data:`POLICY`'s ``full_wait_s`` (a job sets it from ``timeouts.disk_full_s``), then :class:`WriteFailed`; an I/O
error or a stale NFS handle (EIO, ESTALE) is retried a few times, then :class:`WriteFailed` too; a write slower
than ``slow_write_s`` (an fsync stalling under a metadata storm) is named in the log.
"""
from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TypeVar

from hpcrl.process import faults

log = logging.getLogger(__name__)

T = TypeVar("T")

FULL = (errno.ENOSPC, errno.EDQUOT)
"""A full filesystem or an exceeded quota: waited out."""
FLAKY = (errno.EIO, errno.ESTALE)
"""An I/O error or a stale NFS handle: retried a few times."""


@dataclass
class DiskPolicy:
    """How long writes wait out a full disk and retry a failing one (one per process: :data:`POLICY`)."""

    full_wait_s: float = 300.0
    """Wait for space this long (``timeouts.disk_full_s``), then give up with :class:`WriteFailed`."""
    flaky_retries: int = 5
    """Retries of a write that met EIO or ESTALE before giving up."""
    slow_write_s: float = 10.0
    """A write (with its fsync) slower than this is named in the log."""
    backoff_max_s: float = 30.0
    """The longest pause between two tries."""


POLICY = DiskPolicy()
"""This process's policy; a job sets it from its config when it starts (``control/job.py``)."""


class WriteFailed(RuntimeError):
    """A write to the run directory that no wait or retry could make: ``path`` on a full disk (``full``) or a
    failing one; the message says which, how many bytes and how much was free."""

    def __init__(self, message: str, path: Path, full: bool):
        super().__init__(message)
        self.path, self.full = path, full


def free_bytes(path: os.PathLike | str) -> tuple[int, int]:
    """(bytes free to this user, total bytes) of the filesystem holding ``path`` (or its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def size_text(n: float) -> str:
    """Bytes in words: ``512 B``, ``97.7 KiB``, ``1.2 MiB``, ``3.4 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def guarded(what: str, path: os.PathLike | str, nbytes: int, write: Callable[[], T],
            undo: Optional[Callable[[], None]] = None, wait: bool = True) -> T:
    """``write()`` (``what`` of ``nbytes`` to ``path``), surviving the filesystem as the module docstring says.
    ``undo()`` runs after each failed try and must leave nothing torn (remove the try's temporary file); ``wait``
    False: a full disk raises at once (a heartbeat skips a beat rather than holding its thread)."""
    path = Path(path)
    pause, retries, full_since, said_s = 1.0, 0, None, 0.0
    while True:
        t0 = time.monotonic()
        try:
            faults.point("write")
            out = write()
        except OSError as e:
            if undo is not None:
                try:
                    undo()
                except OSError:
                    pass
            if e.errno not in FULL + FLAKY:
                raise
            if e.errno in FLAKY:
                retries += 1
                if retries > POLICY.flaky_retries:
                    raise WriteFailed(f"I/O error at {path}: {what} failed {retries} times ({e.strerror})", path,
                                      full=False) from e
                log.warning("%s writing %s (%s): try %d of %d in %.0fs", e.strerror, path, what, retries + 1,
                            POLICY.flaky_retries + 1, pause)
            else:
                free, total = free_bytes(path)
                now = time.monotonic()
                full_since = full_since if full_since is not None else now
                if not wait or now - full_since >= POLICY.full_wait_s:
                    waited = f"; waited {now - full_since:.0f}s (timeouts.disk_full_s)" if wait else ""
                    raise WriteFailed(f"disk full at {path}: {what} needs {size_text(nbytes)}, {size_text(free)} "
                                      f"free of {size_text(total)}{waited}", path, full=True) from e
                if now - said_s >= 60.0:
                    said_s = now
                    log.error("%s writing %s (%s): needs %s, %s free of %s on its filesystem; waiting for space "
                              "(%.0fs so far, at most %.0fs: timeouts.disk_full_s)", e.strerror, path, what,
                              size_text(nbytes), size_text(free), size_text(total), now - full_since,
                              POLICY.full_wait_s)
            time.sleep(pause)
            pause = min(2 * pause, POLICY.backoff_max_s)
            continue
        took = time.monotonic() - t0
        if took > POLICY.slow_write_s:
            log.warning("slow write: %s to %s took %.1fs (%s)", what, path, took, size_text(nbytes))
        if full_since is not None:
            log.info("%s written to %s after %.0fs waiting for space", what, path, time.monotonic() - full_since)
        return out


def wait_for_room(what: str, path: os.PathLike | str, nbytes: int) -> None:
    """Before a write of many files that cannot be retried piece by piece (a DeepSpeed checkpoint): wait, as
    :func:`guarded` does, until the filesystem of ``path`` has ``nbytes`` free."""
    def room() -> None:
        free, _ = free_bytes(path)
        if free < nbytes:
            raise OSError(errno.ENOSPC, f"{size_text(free)} free, {size_text(nbytes)} needed")
    guarded(what, path, nbytes, room)


def tree_bytes(path: os.PathLike | str) -> int:
    """Bytes of the files under ``path`` (0 if it does not exist); files that vanish meanwhile count 0."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def make_dirs(path: os.PathLike | str) -> None:
    """``mkdir -p`` that waits out a full disk (a new folder needs room too)."""
    guarded("a new folder", path, 4096, lambda: Path(path).mkdir(parents=True, exist_ok=True))



_FALLOC_FL_KEEP_SIZE = 1
_FALLOC_FL_PUNCH_HOLE = 2
_libc_fallocate: Optional[Callable[..., int]] = None


def _fallocate() -> Optional[Callable[..., int]]:
    """libc's ``fallocate`` (None where there is none)."""
    global _libc_fallocate
    if _libc_fallocate is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if not hasattr(libc, "fallocate"):
            return None
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        _libc_fallocate = libc.fallocate
    return _libc_fallocate


def allocate_ahead(fd: int, offset: int, nbytes: int) -> bool:
    """Allocate ``nbytes`` of the open file ``fd`` from ``offset`` without changing its size (Linux
    ``fallocate(FALLOC_FL_KEEP_SIZE)``): later appends into that range cannot meet a full disk. False where there is
    no room, or the filesystem or platform cannot (the caller then appends as usual)."""
    fallocate = _fallocate()
    return fallocate is not None and fallocate(fd, _FALLOC_FL_KEEP_SIZE, offset, nbytes) == 0


def release_head(path: os.PathLike | str, nbytes: int) -> bool:
    """Give the filesystem back the first ``nbytes`` of a log (Linux ``fallocate(FALLOC_FL_PUNCH_HOLE)``): they read
    as zeros from then on, and the file's size and every offset into it stay as they were, so an offset a record
    holds stays true. The retention of a compressed log whose head is no longer wanted: its readers skip the zeros
    (a gzip member never starts with one). False where the filesystem or platform cannot."""
    fallocate = _fallocate()
    if fallocate is None or nbytes <= 0:
        return False
    fd = os.open(path, os.O_WRONLY)
    try:
        return fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, nbytes) == 0
    finally:
        os.close(fd)
