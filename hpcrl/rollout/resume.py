"""Groups in flight saved for the job's successor (``control/in_flight/<writer>.json``).

With partial rollout a group in flight is a set of trajectory states -- responses so far, or a
tool agent's state machine (:class:`~hpcrl.rollout.agent.AgentTrajectory`: its state, pending
tool calls, turn counters) -- that the next version continues. This file keeps them across a
restart of the rollout job: it is written (JSON, tmp -> fsync -> rename) whenever every group
in flight is parked (at each weight switch) and when the job stops, and read once by the
successor (same writer), which continues a saved prompt index where it stopped instead of
starting it over. A SIGKILL loses only what was generated since the last switch.

Nothing here can break exactly-once: a group exists for the trainer only once its shard is
committed, a saved state is used only for a prompt index the successor admits (an index
that was committed is never admitted again), and an unreadable file is logged and ignored
(the prompts are generated from scratch, as without it).
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Union

from hpcrl.fsio import read_json, write_json_atomic
from hpcrl.rollout.agent import SINGLE_TURN, TOOL_AGENT, AgentTrajectory
from hpcrl.rollout.partial import Response

log = logging.getLogger(__name__)

STATE_CLASSES = {SINGLE_TURN: Response, TOOL_AGENT: AgentTrajectory}
SCHEMA = 1

TrajectoryState = Union[Response, AgentTrajectory]


class InFlightStates:
    """The live states of this job's groups in flight, and those its predecessor saved."""

    def __init__(self, path: Path, enabled: bool):
        """``enabled`` is ``async_training.partial_rollout``: without it a group is never continued
        under another version, so saved states are ignored."""
        self.path = path
        self.enabled = enabled
        self._lock = threading.Lock()
        self._live: dict[int, tuple[str, list]] = {}
        self._saved: dict[int, tuple[str, list]] = self._read() if enabled else {}

    def _read(self) -> dict[int, tuple[str, list]]:
        if not self.path.exists():
            return {}
        try:
            doc = read_json(self.path)
            if doc.get("schema") != SCHEMA:
                raise ValueError(f"schema {doc.get('schema')!r}, expected {SCHEMA}")
            saved = {}
            for g in doc["groups"]:
                cls = STATE_CLASSES[g["agent"]]
                saved[int(g["prompt_index"])] = (g["agent"], [cls.from_json(t) for t in g["trajectories"]])
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring the groups in flight saved in %s (%s: %s): their prompts start over",
                        self.path, type(e).__name__, e)
            return {}
        if saved:
            log.info("continuing %d groups in flight saved by this writer's previous job (%s)", len(saved), self.path)
        return saved

    def start(self, prompt_index: int, agent: str, fresh: list[TrajectoryState]) -> tuple[list[TrajectoryState], bool]:
        """The states a group starts from, and whether they were saved: the predecessor's for
        ``prompt_index`` (same agent and size), else ``fresh``. They are live (saved by :meth:`save`)."""
        with self._lock:
            kind, states = self._saved.pop(prompt_index, (None, None))
            resumed = kind == agent and states is not None and len(states) == len(fresh)
            if resumed:
                log.info("prompt %d continues from its saved state (%d tokens so far)", prompt_index,
                         sum(len(s.tokens) for s in states))
            else:
                states = fresh
            self._live[prompt_index] = (agent, states)
            return states, resumed

    def finish(self, prompt_index: int) -> None:
        """The group is done (or dropped): nothing to save for it."""
        with self._lock:
            self._live.pop(prompt_index, None)

    def save(self, in_flight: set[int]) -> None:
        """Write the states of the groups in ``in_flight`` (every one parked or stopped, so no thread
        changes them now), plus saved ones not admitted yet."""
        if not self.enabled:
            return
        with self._lock:
            groups = dict(self._saved)
            groups.update({i: g for i, g in self._live.items() if i in in_flight})
            doc = {"schema": SCHEMA, "groups": [
                {"prompt_index": i, "agent": kind, "trajectories": [s.to_json() for s in states]}
                for i, (kind, states) in sorted(groups.items())]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, doc)

    def saved_count(self) -> int:
        """Saved groups not yet continued."""
        with self._lock:
            return len(self._saved)
