"""Groups in flight saved for the job's successor (``control/in_flight/<writer>.json``).

With partial rollout a group in flight is a list of trajectory states
(:class:`~hpcrl.rollout.trajectory.TrajectoryState`: responses so far, or a tool agent's state
machine with its pending calls and turn counters) that the next version continues. This file keeps
them across a restart of the rollout job: it is written (JSON, tmp -> fsync -> rename) whenever
every group in flight is parked (at each weight switch) and when the job stops, and read once by the
successor (same writer), which continues a saved prompt index where it stopped instead of starting it
over. A SIGKILL loses only what was generated since the last switch.

Nothing here can break exactly-once: a group exists for the trainer only once its shard is
committed, a saved state is used only for a prompt index the successor admits (an index that was
committed is never admitted again; the successor drops, when it starts, the saved groups of prompts it no
longer holds a claim on, as after its writer was reclaimed: ``control/reclaim.py``), and a file that is not
the record (unreadable, torn, ``null``, ``[]``, a field of the wrong type) is logged and ignored: the prompts
are generated from scratch, as without it.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from hpcrl.rundir.fsio import read_json, write_json_atomic
from hpcrl.rundir.disk import make_dirs
from hpcrl.rundir.json_record import JsonRecord, RecordError
from hpcrl.process import faults
from hpcrl.rollout.trajectory import TrajectoryState

log = logging.getLogger(__name__)

SCHEMA = 1


@dataclass
class SavedGroup(JsonRecord):
    """One group in flight: its prompt, the loop that generates it, its trajectories so far."""

    prompt_index: int
    agent: str
    """The agent loop's name."""
    trajectories: list[TrajectoryState]


@dataclass
class SavedGroups(JsonRecord):
    """``control/in_flight/<writer>.json``: written and read by the same writer's jobs."""

    schema: int
    groups: list[SavedGroup] = field(default_factory=list)

    def check(self) -> None:
        """The schema this code writes."""
        if self.schema != SCHEMA:
            raise RecordError(f"schema {self.schema!r}, expected {SCHEMA}")


class InFlightStates:
    """The live states of this job's groups in flight, and those its predecessor saved."""

    def __init__(self, path: Path, enabled: bool, held: Optional[Iterable[int]] = None):
        """``enabled`` is ``async_training.partial_rollout``: without it a group is never continued
        under another version, so saved states are ignored. ``held``: the prompts this writer holds claims on
        (``Admission.join``); saved groups of other prompts are dropped (None: all are kept)."""
        self.path = path
        self.enabled = enabled
        self._lock = threading.Lock()
        self._live: dict[int, SavedGroup] = {}
        self._finished: dict[int, SavedGroup] = {}  # finished, not committed yet: carried if refused at commit
        self._carried: dict[int, SavedGroup] = {}  # reopened (:meth:`carry`), to continue under the next version
        self._saved: dict[int, SavedGroup] = self._read() if enabled else {}
        if held is not None:
            self._keep_only(set(held))
        if self._saved:
            log.info("continuing %d groups in flight saved by this writer's previous job (%s)", len(self._saved),
                     self.path)

    def _keep_only(self, held: set[int]) -> None:
        """Drop saved groups whose prompts this writer no longer holds: committed after they were saved, or
        released while it was down (reclaimed by the other writers, drained): another writer generates them."""
        dropped = sorted(set(self._saved) - held)
        for index in dropped:
            del self._saved[index]
        if dropped:
            log.info("dropped %d groups in flight saved by this writer's previous job (prompts %s%s): this writer "
                     "no longer holds their claims", len(dropped), dropped[:10], " ..." if len(dropped) > 10 else "")

    def _read(self) -> dict[int, SavedGroup]:
        if not self.path.exists():
            return {}
        try:
            saved = {g.prompt_index: g for g in SavedGroups.from_json(read_json(self.path), str(self.path)).groups}
        except (OSError, ValueError, UnicodeDecodeError) as e:  # RecordError is a ValueError
            log.warning("ignoring the groups in flight saved in %s (%s: %s): their prompts start over",
                        self.path, type(e).__name__, e)
            return {}
        return saved

    def start(self, prompt_index: int, agent: str, fresh: list[TrajectoryState]) -> tuple[list[TrajectoryState], bool]:
        """The states a group starts from, and whether they were saved: the predecessor's for
        ``prompt_index`` (same loop and size), else ``fresh``. They are live (saved by :meth:`save`)."""
        with self._lock:
            carried = self._carried.pop(prompt_index, None)
            if carried is not None:
                self._live[prompt_index] = carried
                return carried.trajectories, False
            saved = self._saved.pop(prompt_index, None)
            resumed = saved is not None and saved.agent == agent and len(saved.trajectories) == len(fresh)
            if resumed:
                log.info("prompt %d continues from its saved state (%d tokens so far)", prompt_index,
                         sum(len(s.tokens) for s in saved.trajectories))
            else:
                saved = SavedGroup(prompt_index, agent, fresh)
            self._live[prompt_index] = saved
            return saved.trajectories, resumed

    def finish(self, prompt_index: int) -> None:
        """The group is done: nothing to save for it; its states are kept until it is committed (:meth:`release`)
        or carried (:meth:`carry`)."""
        with self._lock:
            done = self._live.pop(prompt_index, None)
            if done is not None:
                self._finished[prompt_index] = done

    def release(self, prompt_indices) -> None:
        """The groups are committed (or generated again from scratch): their states are gone."""
        with self._lock:
            for index in prompt_indices:
                self._finished.pop(index, None)
                self._carried.pop(index, None)

    def carry(self, prompt_index: int) -> bool:
        """Reopen a finished group's sampled trajectories (:meth:`TrajectoryState.reopen`) so that it continues
        under the next version the job loads (its next :meth:`start`); False (its states dropped) if none could
        be reopened."""
        with self._lock:
            group = self._finished.pop(prompt_index, None)
            if group is None or not sum([t.reopen() for t in group.trajectories if not t.greedy]):
                return False
            self._carried[prompt_index] = group
            return True

    def save(self) -> None:
        """Write the states of every group started and not finished (each is parked or stopped when this is
        called, so no thread changes it now), plus saved ones not started yet. A state moves from the saved set
        to the live one in one locked step when its group starts, so it is in one of them at every instant: a
        stop at any moment saves it (it is not matched against the loop's own list of groups in flight, which
        a group joins a moment later)."""
        if not self.enabled:
            return
        with self._lock:
            groups = {**self._saved, **self._carried, **self._live}
            doc = SavedGroups(SCHEMA, [groups[i] for i in sorted(groups)]).to_json()
        faults.point("states_save")
        make_dirs(self.path.parent)
        write_json_atomic(self.path, doc)

    def saved_count(self) -> int:
        """Saved groups not yet continued."""
        with self._lock:
            return len(self._saved)
