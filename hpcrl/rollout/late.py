"""Groups the commit refused because they could be trained beyond the lag bound, until they start again.

A rollout job that misses a version (slow to notice it: a loaded node, the poll's back-off) finishes groups
under a version two or more behind the newest; the commit checks each group's place in the commit order
against the lag bound (``control/admission.py``, ``Admission.committing``) and refuses those it could not keep.
Here the job takes them out of the shard (``ShardWriter.withdraw``) and, with partial rollout, carries each into
the newest version: its trajectories' last sampled tokens are taken back (``TrajectoryState.reopen``) and
generated again under the version the job loads next, every token keeping the version that sampled it. Without
partial rollout (or with nothing to reopen) the group is dropped and its prompt, still this writer's claim,
generated again from scratch. Both are counted in the version's row (``fully_async/lag_bound/carried``,
``/dropped``). The job starts them again once it has loaded the newest version (:meth:`LateGroups.start`); should
no newer version be there (a count the record rebuilt), they are committed without the check, and the trainer
drops any that lags beyond the bound (``fully_async/count/dropped_lag_bound``).
"""
from __future__ import annotations

import logging
from typing import Callable

from hpcrl.control.admission import Admission
from hpcrl.rollout.in_flight import InFlightStates
from hpcrl.rollout.version_stats import VersionStats
from hpcrl.samples.writer import CommitRefused, ShardWriter

log = logging.getLogger("hpcrl.rollout")


class LateGroups:
    """The prompts of refused groups, waiting for the newest version (module docstring)."""

    def __init__(self, partial_rollout: bool):
        self.partial_rollout = partial_rollout
        self.prompts: list[int] = []
        self.version = -1
        """The version the job held when they were refused."""

    def __bool__(self) -> bool:
        return bool(self.prompts)

    def take(self, refusal: CommitRefused, shards: ShardWriter, states: InFlightStates, stats: VersionStats,
             version: int) -> None:
        """Out of the shard, carried or dropped, counted; the job holds ``version``."""
        for group in shards.withdraw(refusal.prompts):
            stats.withdraw(group)
            if self.partial_rollout and states.carry(group.prompt_index):
                stats.lag_carried += 1
            else:
                states.release([group.prompt_index])
                stats.lag_dropped += 1
            self.prompts.append(group.prompt_index)
        self.version = version
        log.warning("the commit refused %d group(s) (%s): %s the newest version", len(refusal.prompts), refusal.why,
                    "carrying them into" if self.partial_rollout else "generating them again under")

    def start(self, version: int, admission: Admission, submit: Callable[[int], None]) -> None:
        """Start them again now that the job holds ``version`` (``submit(prompt)``); still the version they were
        refused under, unchecked (module docstring)."""
        if not self.prompts:
            return
        if version == self.version:
            log.warning("no version newer than %d to carry %d refused group(s) into: committing them unchecked",
                        version, len(self.prompts))
            admission.unchecked.update(self.prompts)
        for index in self.prompts:
            submit(index)
        self.prompts = []
