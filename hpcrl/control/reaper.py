"""A watchdog that kills the processes an engine started when the job that owns them dies.

vLLM's AsyncLLM runs its engine core (and, on CPU, a worker) as child processes. A rollout
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
import subprocess
import sys
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

POLL_S = 0.5
"""How often the reaper checks that its parent is alive."""


def _start_time(pid: int) -> Optional[str]:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks); None if the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every live descendant of ``pid``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        start = _start_time(p)
        if start is not None:
            out.append((p, start))
            todo.extend(children.get(p, []))
    return out


_REAPER = r'''
import os, signal, sys, time
parent, poll_s, targets = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
def start(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None
while os.getppid() == parent:
    time.sleep(poll_s)
for t in targets:
    pid, st = t.split(":")
    if start(int(pid)) == st:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
'''


def start_reaper(what: str) -> Optional[subprocess.Popen]:
    """Kill this process's current descendants when it dies; None where /proc is missing or
    there is nothing to watch. Stop it with :func:`stop_reaper` before a normal shutdown."""
    if not Path("/proc/self/stat").exists():
        return None
    targets = descendants(os.getpid())
    if not targets:
        return None
    proc = subprocess.Popen([sys.executable, "-c", _REAPER, str(os.getpid()), str(POLL_S),
                             *(f"{p}:{s}" for p, s in targets)], stdin=subprocess.DEVNULL, close_fds=True)
    log.info("reaper %d will kill %s (%s) if this job dies", proc.pid, what, ", ".join(str(p) for p, _ in targets))
    return proc


def stop_reaper(proc: Optional[subprocess.Popen]) -> None:
    """The job is shutting its processes down itself: stop watching."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)
