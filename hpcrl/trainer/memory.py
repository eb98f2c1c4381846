"""The trainer's peak memory per update: verl's ``perf/*`` memory metrics, measured, not estimated.

On a GPU, torch's allocator counts the peak allocated and reserved bytes since :func:`reset_peaks`. On the host,
the kernel keeps the process's resident-set high-water mark (``VmHWM`` in ``/proc/self/status``); writing ``5`` to
``/proc/self/clear_refs`` resets it to the current resident size (Linux >= 4.0), so the mark read after the update
is the update's own peak. Where ``/proc`` says neither (another OS), ``ru_maxrss`` (the process's lifetime peak)
stands in.
"""
from __future__ import annotations

import math
import resource
from pathlib import Path

import torch

from hpcrl.logs import metric_names as M

GIB = 2**30
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def reset_peaks() -> None:
    """Start counting the peaks of the next update (GPU allocator and host high-water mark)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        pass  # no /proc (or a kernel that refuses): the lifetime peak stands in


def _status_gib(field: str) -> float:
    """A ``/proc/self/status`` memory field (``VmHWM``, ``VmRSS``), GiB; NaN where there is none."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return math.nan


def host_peak_gib() -> float:
    """The process's resident high-water mark, GiB (since :func:`reset_peaks` where the kernel allows)."""
    peak = _status_gib("VmHWM")
    return peak if not math.isnan(peak) else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def peaks() -> dict[str, float]:
    """verl's three memory metrics of the update since :func:`reset_peaks`, GiB."""
    cuda = torch.cuda.is_available()
    return {M.MAX_MEMORY_ALLOCATED_GB: torch.cuda.max_memory_allocated() / GIB if cuda else 0.0,
            M.MAX_MEMORY_RESERVED_GB: torch.cuda.max_memory_reserved() / GIB if cuda else 0.0,
            M.CPU_MEMORY_USED_GB: host_peak_gib()}


def current_gib() -> float:
    """The process's resident memory now, GiB (``VmRSS``)."""
    return _status_gib("VmRSS")
