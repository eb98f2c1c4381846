"""Skipped shards: committed groups the trainer will never train on, handed back to their writer.

A shard can fail verification (truncated, corrupted, deleted). The trainer
skips it, and then its groups must not simply vanish: at ``s=0`` the rollout
fleet has spent the version's admission budget on them and the trainer would
wait for its last groups forever. So the skip is a recorded decision:

1. the trainer's :class:`~hpcrl.samples.reader.SampleReader` appends one
   :class:`SkippedShard` line (fsync'd) to ``control/skipped_shards.jsonl``
   **before** its cursor moves past the shard; from then on no trainer reads that
   shard again, even if its bytes come back (a restart from an older checkpoint
   skips it from the record, so a prompt is never trained on twice);
2. admission (``control/admission.py``) subtracts every skipped group from the
   groups started: the budget they held is returned;
3. the shard's writer regenerates the prompts listed in the line (its
   :class:`~hpcrl.samples.writer.ShardWriter` no longer counts them as committed).

One writer (trainer rank 0), many readers; a line without its newline (the
trainer killed mid-line) was never read by anyone and is cut off when the
trainer opens the log again. A shard is named by writer and file name, which
is unique: a shard index is never reused.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

from hpcrl.rundir.fsio import JsonlAppender, JsonlTail, truncate_torn_tail
from hpcrl.rundir.json_record import JsonRecord
from hpcrl.rundir.paths import RunDir

log = logging.getLogger(__name__)


@dataclass
class SkippedShard(JsonRecord):
    """One line of ``control/skipped_shards.jsonl``. Written by the trainer, read by rollout jobs."""

    writer: str
    shard: str
    """File name in the writer's folder, e.g. ``shard-000042.h5``."""
    prompt_indices: list[int]
    """Prompt indices of the groups skipped (the shard's rows from the trainer's cursor on: rows
    before it were trained on already): the writer generates them again."""
    n_groups: int
    reason: str
    time_s: float



class SkipLog:
    """Reads (and, for the trainer, appends to) ``control/skipped_shards.jsonl``.

    Each instance tails the file on its own. A shard may be recorded more than once (a
    trainer that skipped it from row r, died before its checkpoint, and resumed with a
    cursor at an earlier row of it records the rows in between); each prompt counts once.
    """

    def __init__(self, run_dir: RunDir):
        self.path = run_dir.skipped_shards
        self._tail = JsonlTail(self.path)
        self._seen: dict[tuple[str, str], set[int]] = {}  # (writer, shard) -> prompts skipped
        self._appender: Optional[JsonlAppender] = None
        self._rows_read = 0

    def poll(self) -> list[SkippedShard]:
        """Records not seen by this instance before, in file order."""
        rows = self._tail.poll()
        new = []
        for d in rows[self._rows_read:]:
            try:
                rec = SkippedShard.from_json(d, str(self.path))
            except ValueError as e:  # not a record (RecordError): named and ignored, never a crash
                log.warning("%s: malformed record ignored (%s)", self.path, e)
                continue
            fresh = self._add(rec)
            if fresh is not None:
                new.append(fresh)
        self._rows_read = len(rows)
        return new

    def _add(self, rec: SkippedShard) -> Optional[SkippedShard]:
        """Merge a record; the part of it not seen before (None if nothing is new)."""
        seen = self._seen.setdefault((rec.writer, rec.shard), set())
        new = [p for p in rec.prompt_indices if p not in seen]
        if not new:
            return None
        seen.update(new)
        return dataclasses.replace(rec, prompt_indices=new, n_groups=len(new))

    def is_skipped(self, writer: str, shard: str) -> bool:
        """True if the shard is recorded as skipped (as of the last :meth:`poll`)."""
        return (writer, shard) in self._seen

    def skipped_groups(self) -> int:
        """Groups skipped in all shards, every writer (as of the last :meth:`poll`)."""
        return sum(len(p) for p in self._seen.values())

    def record(self, rec: SkippedShard) -> Optional[SkippedShard]:
        """Trainer: make the skip of the prompts not recorded before durable; returns what
        was new (None if every prompt was recorded already)."""
        self.poll()
        seen = self._seen.get((rec.writer, rec.shard), set())
        rec = dataclasses.replace(rec, prompt_indices=[p for p in rec.prompt_indices if p not in seen])
        rec.n_groups = len(rec.prompt_indices)
        if not rec.prompt_indices:
            return None
        if self._appender is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if truncate_torn_tail(self.path):
                log.warning("%s: cut off a torn last line left by a trainer killed mid-append", self.path)
            self._appender = JsonlAppender(self.path)
        self._appender.append(rec.to_json())
        return self._add(rec)  # the tail reads it back later: already seen
