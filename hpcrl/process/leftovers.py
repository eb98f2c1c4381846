"""Leftovers of an earlier attempt of the same job on this node, ended at job start with a log line.

A crashed or requeued run can leave processes behind on a node (a rank stuck in a collective that Slurm's
process tracking lost, an engine's workers re-parented to init): the next attempt then finds its port
taken, its GPU full or its shared-memory space gone, and hangs. Every process of a job carries its mark,
``HPCRL_JOB_MARK=<run dir>|<job name>``, in the environment it started with (the sbatch scripts and the
launcher's setup lines export it before ``srun``; :func:`mark_job` puts it into the job's own environment
so that whatever the job starts inherits it), and the job process itself names the run directory on its
command line (``hpcrl trainer RUN``).

:func:`sweep_leftovers` finds the processes of this node that carry the same job's mark (or its command
line) but belong to another attempt, SIGKILLs them and waits for them to go (bounded). An attempt is told
by the job ids in its environment (``SLURM_JOB_ID``, ``SLURM_RESTART_COUNT``, ``SUBMITIT_LOCAL_JOB_ID``): the ranks of this attempt share them and are never touched. A process without
any job id beside one that has none (runs by hand) is logged, not ended: nothing tells it from a rank of
this attempt. Linux only (``/proc``).
"""
from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

from hpcrl.process.pids import pid_running

log = logging.getLogger(__name__)

MARK_ENV = "HPCRL_JOB_MARK"
ATTEMPT_VARS = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SUBMITIT_LOCAL_JOB_ID")
"""Environment variables whose values tell one attempt of a job from another. Not the step id: the batch
script's ``srun ... hpcrl trainer RUN`` (no step id) belongs to the same attempt as the ranks it started."""
GONE_S = 10.0
"""How long the sweep waits for the processes it killed to disappear."""


def job_mark(run_dir: Path, job: str) -> str:
    """The mark of ``job`` of the run in ``run_dir``."""
    return f"{Path(run_dir).resolve()}|{job}"


def mark_job(run_dir: Path, job: str) -> None:
    """Put this job's mark into the environment (inherited by every process the job starts)."""
    os.environ[MARK_ENV] = job_mark(run_dir, job)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _runs_command(pid: int, run_dir: Path, command: tuple[str, ...]) -> bool:
    """Whether the process runs ``... hpcrl <command[0]> RUN ...`` on ``run_dir`` with ``command[1:]`` among the
    words after RUN (a relative RUN is taken from the process's working directory)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    for i, tok in enumerate(argv[:-2]):
        if tok.endswith("hpcrl") and argv[i + 1] == command[0]:
            run = Path(argv[i + 2])
            run = run if run.is_absolute() else Path(os.readlink(f"/proc/{pid}/cwd")) / run
            rest, want = argv[i + 3:], list(command[1:])
            has_rest = not want or any(rest[j:j + len(want)] == want for j in range(len(rest)))
            return has_rest and run.resolve() == run_dir
    return False


def _family(pid: int) -> set[int]:
    """This process and its ancestors (never swept: a wrapper, srun's step daemon, the launcher)."""
    out = set()
    while pid > 1:
        out.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return out


def _attempt(env: dict[str, str]) -> tuple[str, ...]:
    return tuple(env.get(v, "") for v in ATTEMPT_VARS)


def find_leftovers(run_dir: Path, job: str, command: tuple[str, ...]) -> tuple[list[int], list[int]]:
    """(pids of other attempts of ``job``, pids that carry its mark or command but cannot be told from this
    attempt). ``command``: the job process's arguments after ``hpcrl`` without the run directory, e.g.
    ``("rollout", "--writer-rank", "0")`` (matched as its first word and the rest in order)."""
    mark, run_dir = job_mark(run_dir, job), Path(run_dir).resolve()
    ours = _attempt(dict(os.environ))
    family = _family(os.getpid())
    others, unsure = [], []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in family:
            continue
        pid = int(entry.name)
        try:
            env = _environ(pid)
            if env.get(MARK_ENV) != mark and not _runs_command(pid, run_dir, command):
                continue
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
        theirs = _attempt(env)
        if theirs == ours:
            if not any(ours):
                unsure.append(pid)
            continue
        others.append(pid)
    return others, unsure


def sweep_leftovers(run_dir: Path, job: str, command: tuple[str, ...]) -> list[int]:
    """SIGKILL the processes of other attempts of ``job`` on this node (module docstring; ``command`` as in
    :func:`find_leftovers`), logged in one line (also when there are none); the pids ended."""
    others, unsure = find_leftovers(run_dir, job, command)
    for pid in others:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + GONE_S
    while any(pid_running(p) for p in others) and time.monotonic() < deadline:
        time.sleep(0.05)
    still = [p for p in others if pid_running(p)]
    if others:
        log.warning("start-up sweep: ended %d leftover process(es) of an earlier attempt of %s on this node: pids %s%s",
                    len(others), job, ", ".join(map(str, others)),
                    f" ({len(still)} still there after {GONE_S:.0f}s: {still})" if still else "")
    else:
        log.info("start-up sweep: no leftover processes of %s (run %s) on this node", job, run_dir)
    if unsure:
        log.warning("start-up sweep: pids %s also run %s of this run but carry no job id (started by hand?); left "
                    "running", ", ".join(map(str, unsure)), job)
    return others
