"""Receive buffers in the node's shared memory, so another process maps the bytes instead of copying them.

A version received by broadcast lands in one flat byte buffer (``wire.recv_buckets``). When
that buffer is a file in ``/dev/shm`` (a tmpfs: RAM, no disk), vLLM's worker process, which holds the
model, maps the same pages and loads the tensors from them (``hpcrl/rollout/vllm_worker.py``): the
rollout process hands over a path and a JSON layout (the subscriber's ``WeightVersion.mapped``), never
the bytes (and nothing is pickled).

- The space is reserved with ``posix_fallocate`` before the buffer is mapped, so a full tmpfs (Docker's
  default is 64 MiB) is a clear ``OSError`` at allocation, and the caller falls back to private memory;
  it is never a SIGBUS on a page fault mid-receive.
- A file lives as long as its buffer tensor (``weakref.finalize``, also at interpreter exit). A job
  killed with SIGKILL leaves its files behind: the next job on the node that allocates one removes the
  files of processes that are gone (their pid is in the name).
"""
from __future__ import annotations

import itertools
import logging
import os
import weakref
from pathlib import Path
from typing import Optional

import torch

from hpcrl.process.pids import left_by_gone_processes

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "hpcrl-weights-"
"""File names: ``hpcrl-weights-<pid>-<n>``."""

_counter = itertools.count()
_swept = False
_warned = False


def sweep_stale(folder: Path = SHM_DIR) -> list[Path]:
    """Remove the buffer files of processes that no longer run (SIGKILLed jobs); the removed paths."""
    removed = []
    for path in left_by_gone_processes(folder, PREFIX):
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    if removed:
        log.info("removed %d weight buffer(s) left in %s by killed jobs", len(removed), folder)
    return removed


def shared_buffer(nbytes: int, folder: Path = SHM_DIR) -> torch.Tensor:
    """A zeroed uint8 tensor of ``nbytes`` backed by a new file in ``folder``; OSError if ``folder`` is
    missing, not writable or has no room for it (reserved up front)."""
    global _swept
    if not _swept:
        _swept = True
        sweep_stale(folder)
    path = folder / f"{PREFIX}{os.getpid()}-{next(_counter)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise OSError(e.errno, f"no room for {nbytes / 2**20:.1f} MiB in {folder} ({e.strerror})") from None
    os.close(fd)
    flat = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    weakref.finalize(flat, _unlink, path)
    return flat


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def receive_buffer(nbytes: int, folder: Path = SHM_DIR) -> tuple[torch.Tensor, Optional[str]]:
    """:func:`shared_buffer` and its file's path, or private memory and None (logged once) where the node's
    shared memory cannot hold it."""
    try:
        flat = shared_buffer(nbytes, folder)
        return flat, flat.untyped_storage().filename
    except OSError as e:
        global _warned
        if not _warned:
            _warned = True
            log.warning("weight buffers in private memory: %s (the vLLM engine then reloads each version from "
                        "its files; a larger /dev/shm avoids that)", e)
        return torch.empty(nbytes, dtype=torch.uint8), None
