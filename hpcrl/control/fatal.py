"""Errors that a restart would only repeat: one record, and the launcher stops the run at once.

A job that cannot start because of its *inputs* (the model folder, the tokenizer, the
reward file, the prompt file), or whose run directory's filesystem stayed full, fails the same way on every
resubmission. Such a job writes
``control/fatal.json`` (:attr:`hpcrl.rundir.paths.RunDir.fatal`) with a one-line message before
it exits; every other job of the run stops at its next safe point when it sees the record (``control/job.py``:
the trainer checkpoints, a rollout job seals its groups, as for a stop request), whether a launcher follows the run
or not; the launcher's follower reads it, prints the line, waits for the jobs to end (cancelling what is still
starting or left after ``timeouts.stop_s``) and exits non-zero instead of spending ``resources.max_restarts``.
Crashes of any other kind (a node failure, an out-of-memory kill, a bug) are still resubmitted.

Writer: any job (the first one wins; later ones keep it). Readers: the launcher's
follower and ``hpcrl status``, and ``hpcrl run --resume`` (which input failed decides which keys may
change on resume: the reward file after a reward failure, the data file after a data failure).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from hpcrl.control.changes import bump
from hpcrl.rundir.fsio import read_json, write_json_atomic
from hpcrl.rundir.json_record import JsonRecord
from hpcrl.rundir.paths import RunDir


class FatalInputError(RuntimeError):
    """An error in the run's inputs (model, tokenizer, reward, data) that no restart can fix."""


@dataclass
class FatalRecord(JsonRecord):
    """``control/fatal.json``: why the run cannot go on."""

    job: str
    """The job that found the error (``trainer``, ``rollout-w000``)."""
    message: str
    """One line: what failed and why."""
    time_s: float
    input: str = ""
    """Which input failed: one of :data:`INPUTS` (``""``: not said, a record of an older hpcrl)."""


INPUTS = ("model", "data", "reward", "agent", "disk", "reward_model")
"""The inputs a job loads at start, each under its own :func:`fatal_inputs` block, and ``disk``: the run
directory's filesystem stayed full (or failing) past ``timeouts.disk_full_s`` (``control/job.py``); ``reward_model``: a
reward job could not load the reward model (``hpcrl/reward/job.py``)."""


def write_fatal(run_dir: RunDir, job: str, message: str, failed_input: str = "") -> None:
    """Record ``message`` (one line) as the reason the run cannot go on (``failed_input``: which of
    :data:`INPUTS`); keeps an earlier record."""
    if read_json(run_dir.fatal) is None:
        run_dir.control.mkdir(parents=True, exist_ok=True)
        write_json_atomic(run_dir.fatal, FatalRecord(job, " ".join(message.split()), time.time(),
                                                     failed_input).to_json())
        bump(run_dir, "fatal", job)  # the other jobs' stop watches look now


def read_fatal(run_dir: RunDir) -> Optional[str]:
    """``"<job>: <message>"`` if a job recorded a fatal input error, else None."""
    d = read_json(run_dir.fatal)
    if d is None:
        return None
    try:
        rec = FatalRecord.from_json(d)
    except ValueError:  # not our record: still a reason to stop, said as it is
        return f"unreadable {run_dir.fatal}: {str(d)[:200]}"
    return f"{rec.job}: {rec.message}"


def read_fatal_record(run_dir: RunDir) -> Optional[FatalRecord]:
    """The fatal record itself (None if there is none or it is not one)."""
    try:
        d = read_json(run_dir.fatal)
        return FatalRecord.from_json(d) if d is not None else None
    except ValueError:
        return None


def clear_fatal(run_dir: RunDir) -> None:
    """Forget a recorded error (``--resume`` after the user fixed the input)."""
    run_dir.fatal.unlink(missing_ok=True)


@contextmanager
def fatal_inputs(run_dir: RunDir, job: str, what: str, failed_input: str = "") -> Iterator[None]:
    """Around a job's loading of one input (``failed_input``, one of :data:`INPUTS`): an exception is
    recorded as fatal (one line naming ``what``) and re-raised as :class:`FatalInputError`."""
    try:
        yield
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        message = f"{what} failed: {type(e).__name__}: {first}"
        write_fatal(run_dir, job, message, failed_input)
        raise FatalInputError(f"{job}: {message}") from e
