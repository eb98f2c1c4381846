"""Whether a process id names a running process: one rule for every caller.

A pid is *running* when the kernel knows it and the process has not ended:

- ``os.kill(pid, 0)`` raises ProcessLookupError: no such process, not running;
- it raises PermissionError: the process exists and belongs to another user (a job of the same run started
  under another account, a shared ``/dev/shm``): running. Only the kernel's "no such process" means gone;
- a zombie has ended (only its parent's ``wait`` is missing): not running. ``/proc/<pid>/stat`` says so
  where it can be read; where it cannot (no ``/proc``, or ``hidepid`` hiding another user's process), the
  signal's answer stands;
- ``pid <= 0`` names no process (``os.kill`` would address a process group).

A pid means something only on the host that wrote it: callers compare the host first (a heartbeat's ``host``).
Used by the start-up sweep of leftovers, the reclaim of a gone writer's claims, the broadcast's rendezvous, the
sweep of shared-memory buffers and vLLM's socket folders (:func:`left_by_gone_processes`) and ``hpcrl status``.
"""
from __future__ import annotations

import os
from pathlib import Path


def pid_running(pid: int) -> bool:
    """Whether ``pid`` is a process on this host that has not ended (module docstring)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return not _ended(pid)


def _ended(pid: int) -> bool:
    """A process the signal reached has ended since: a zombie, or gone from ``/proc`` meanwhile."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:  # gone since the signal, where there is a /proc to look in
        return Path("/proc/self/stat").exists()
    except (OSError, IndexError):
        return False


def left_by_gone_processes(folder: Path, prefix: str) -> list[Path]:
    """The entries of ``folder`` named ``<prefix><pid>`` or ``<prefix><pid>-...`` whose process is not this one and
    no longer runs: what a killed process left behind (shared-memory weight buffers, vLLM's socket folders)."""
    gone = []
    for path in folder.glob(f"{prefix}*"):
        try:
            pid = int(path.name[len(prefix):].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not pid_running(pid):
            gone.append(path)
    return gone
