"""A watchdog that kills the processes an engine started when the job that owns them dies.

vLLM's AsyncLLM runs its engine core (and, with tensor parallelism, its workers) as child processes. A rollout
job that exits normally shuts them down; one killed with SIGKILL leaves them running,
re-parented to init and holding the GPU's memory (seen here: the ``VLLM::EngineCore`` of a
SIGKILLed rollout job was still alive minutes later). Under Slurm the job's cgroup is killed
whole; with ``--executor local``, or a job restarted in the same allocation, nothing would
clean them up, and the restarted engine would find its GPU full.

:func:`start_reaper` snapshots the job's descendants (pid and start time, so that a reused
pid is never touched) and starts a small process that polls its parent: once the parent is
gone it SIGKILLs the snapshot and exits. Linux only (``/proc``); elsewhere it does nothing.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

POLL_S = 0.5
"""How often the reaper checks that its parent is alive."""


def _stat(pid: int | str) -> Optional[tuple[int, str]]:
    """(parent pid, start time in clock ticks) from /proc/<pid>/stat; None if the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), fields[19]
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every live descendant of ``pid``."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(entry.name)) is not None:
            children.setdefault(stat[0], []).append((int(entry.name), stat[1]))
    out, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children.get(child[0], []))
    return out


def _watch(parent: int, targets: list[tuple[int, str]]) -> None:
    """The reaper process: once ``parent`` is gone, SIGKILL each target still the same process."""
    while os.getppid() == parent:
        time.sleep(POLL_S)
    for pid, start in targets:
        if (stat := _stat(pid)) is not None and stat[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def start_reaper(what: str) -> Optional[subprocess.Popen]:
    """Kill this process's current descendants when it dies; None where /proc is missing or
    there is nothing to watch. Stop it with :func:`stop_reaper` before a normal shutdown."""
    if not Path("/proc/self/stat").exists():
        return None
    targets = descendants(os.getpid())
    if not targets:
        return None
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.process.reaper", str(os.getpid()),
                             *(f"{p}:{s}" for p, s in targets)], stdin=subprocess.DEVNULL, close_fds=True)
    log.info("reaper %d will kill %s (%s) if this job dies", proc.pid, what, ", ".join(str(p) for p, _ in targets))
    return proc


def stop_reaper(proc: Optional[subprocess.Popen]) -> None:
    """The job is shutting its processes down itself: stop watching."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


if __name__ == "__main__":
    _watch(int(sys.argv[1]), [(int(p), s) for p, s in (t.split(":") for t in sys.argv[2:])])
