"""ShardWriter: the rollout side of the sample exchange (one per writer folder).

Groups are buffered in memory and *sealed* into an immutable shard. The shard
file is built in memory (HDF5 core driver), hashed there, and written once:
``shard-N.h5.tmp`` -> write + fsync -> rename -> fsync folder -> append one
fsync'd line to ``manifest.jsonl`` (the commit point), which carries the size
and sha256 of exactly those bytes. Plain non-SWMR HDF5 is unreadable after a
kill mid-write, so no reader ever opens a file that is still being written.

Rules that make a kill at any instant safe (issue #14):

- every seal takes a fresh shard index, before anything is written: a shard
  file is never overwritten, so a committed line always describes its file;
- the commit (manifest append, then recording it in memory) runs inside
  :func:`hpcrl.process.termination.deferred`: a SIGTERM cannot land between
  "durable" and "recorded", where the shutdown path used to seal the same
  groups a second time;
- if the append itself fails, nobody knows whether the line is durable: the
  writer refuses to seal again (its restarted successor reads the manifest).

On restart the writer recovers from its own folder: a torn last manifest line is
cut off, orphan ``.tmp`` files and renamed-but-unlisted shards (killed before the
manifest line) are deleted, the next shard index continues after every index
seen, and the set of committed prompt indices tells the rollout loop which
prompts still need generating. Prompts of shards the trainer skipped
(``samples/skips.py``) do not count as committed: they are generated again.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import time
from collections import Counter
from contextlib import nullcontext
from typing import Callable, ContextManager, Optional

import h5py

from hpcrl.process import faults, termination
from hpcrl.rundir.fsio import JsonlAppender, fsync_path, read_jsonl, truncate_torn_tail, write_file_durably
from hpcrl.rundir.disk import guarded, make_dirs
from hpcrl.rundir.paths import RunDir
from hpcrl.samples.schema import SCHEMA_VERSION, Group, ShardManifestLine, groups_to_arrays
from hpcrl.samples.skips import SkipLog

log = logging.getLogger(__name__)


class CommitRefused(Exception):
    """The commit guard refused some groups of a shard before its manifest line (nothing was committed, the
    shard file is removed, every group stays buffered): the caller withdraws :attr:`prompts`
    (:meth:`ShardWriter.withdraw`) and seals the rest again. The admission's lag check raises it
    (``control/admission.py``, ``Admission.committing``)."""

    def __init__(self, prompts: list[int], why: str):
        super().__init__(f"prompts {prompts[:10]}{' ...' if len(prompts) > 10 else ''}: {why}")
        self.prompts = list(prompts)
        self.why = why


def shard_image(groups: list[Group], writer: str, shard_index: int) -> tuple[bytes, dict[str, list[int]]]:
    """The bytes of a shard file holding ``groups`` (built in memory, nothing touches the disk),
    and where each dataset's raw data lies in them: ``{name: [byte offset, elements]}``."""
    arrays = groups_to_arrays(groups)
    buf = io.BytesIO()
    layout = {}
    with h5py.File(buf, "w", libver="latest") as f:
        f.attrs["schema_version"] = SCHEMA_VERSION
        f.attrs["writer"] = writer
        f.attrs["shard_index"] = shard_index
        dsets = {name: f.create_dataset(name, data=arr) for name, arr in arrays.items()}
        f.flush()
        for name, d in dsets.items():
            offset = d.id.get_offset()  # contiguous layout; None when empty
            layout[name] = [-1 if offset is None else int(offset), int(d.size)]
    return buf.getvalue(), layout


class ShardWriter:
    """Buffers groups and commits them as shards of one writer folder (see the module docstring).

    ``skips`` (the run's :class:`SkipLog`) makes prompts of shards the trainer skipped
    count as not committed; :meth:`take_skipped_prompts` hands newly skipped ones back.
    ``commit_guard(prompt_indices, newest_tokens)``, if given, is a context manager around each manifest append
    (the rollout job's prompt claims and lag check: ``control/admission.py`` ``Admission.committing``; each group's
    newest token version with its prompt): if it raises, nothing is committed (:class:`CommitRefused`: the shard
    file is removed too).
    """

    def __init__(self, run_dir: RunDir, writer: str, seal_groups: int, seal_interval_s: float,
                 skips: Optional[SkipLog] = None,
                 commit_guard: Optional[Callable[[list[int]], ContextManager]] = None):
        self.run_dir = run_dir
        self.writer = writer
        self.seal_groups = seal_groups
        self.seal_interval_s = seal_interval_s
        self.folder = run_dir.writer_dir(writer)
        make_dirs(self.folder)
        self.skips = skips
        self.commit_guard = commit_guard
        self._buffer: list[Group] = []
        self._first_buffered_s = 0.0
        self._lines: dict[str, list[int]] = {}  # committed shard -> its prompt indices
        self._live: Counter = Counter()  # prompt index -> committed lines listing it, skipped shards excluded
        self.committed_groups = 0
        """Groups in every committed line, skipped shards included (admission counts those as started)."""
        self._broken: Optional[str] = None
        self.next_shard_index = self._recover()
        self._manifest = JsonlAppender(run_dir.shard_manifest(writer))
        self.skipped_at_start = self.take_skipped_prompts()
        """Prompts of shards skipped while this writer was down: generated again."""

    @property
    def committed_prompt_indices(self) -> set[int]:
        """Prompts committed in a shard the trainer has not skipped: never generated again."""
        return set(self._live)

    def _recover(self) -> int:
        manifest = self.run_dir.shard_manifest(self.writer)
        if truncate_torn_tail(manifest):
            log.warning("writer %s: cut off a torn last manifest line (killed mid-append; never read)", self.writer)
        highest = -1
        for d in read_jsonl(manifest, on_bad_line=lambda n, t: log.warning("manifest line %d unparsable, ignored: %r",
                                                                           n, t[:80])):
            try:
                line = ShardManifestLine.from_json(d, str(manifest))
            except ValueError as e:  # JSON, but not a manifest line: the reader skips it too, so it commits nothing
                log.error("writer %s: %s; its prompts are generated again", self.writer, e)
                continue
            if line.shard in self._lines:
                log.error("writer %s: %s listed twice in its manifest (written by an older hpcrl)", self.writer,
                          line.shard)
                continue
            self._lines[line.shard] = list(line.prompt_indices)
            self._live.update(line.prompt_indices)
            self.committed_groups += line.n_groups
            highest = max(highest, line.shard_index)
        for p in self.folder.iterdir():
            parsed = RunDir.parse_shard_name(p.name)
            if parsed is None:
                continue
            highest = max(highest, parsed[0])
            if parsed[1] or p.name not in self._lines:
                # .tmp: killed before the rename; unlisted: killed before the commit line.
                # Neither was ever visible to a reader, so removing it loses nothing.
                log.warning("removing uncommitted shard left by a previous run of writer %s: %s", self.writer, p.name)
                p.unlink()
        if self._lines:
            log.info("writer %s recovered: %d shards, %d groups committed", self.writer, len(self._lines),
                     self.committed_groups)
        return highest + 1

    def take_skipped_prompts(self) -> list[int]:
        """Prompts of this writer's shards newly recorded as skipped by the trainer: generate them again."""
        if self.skips is None:
            return []
        out = []
        for rec in self.skips.poll():
            if rec.writer != self.writer:
                continue
            prompts = rec.prompt_indices  # the rows of the shard the trainer had not trained on
            self._live.subtract(prompts)
            for p in prompts:
                if self._live[p] <= 0:
                    del self._live[p]
                    out.append(p)
            log.warning("writer %s: the trainer skipped %s (%s); generating its %d prompt(s) again", self.writer,
                        rec.shard, rec.reason, len(prompts))
        return sorted(out)

    # ---- buffering and sealing
    def add(self, group: Group) -> None:
        """Buffer a finished group; its prompt must not be committed already."""
        if group.prompt_index in self._live or any(g.prompt_index == group.prompt_index for g in self._buffer):
            raise RuntimeError(f"prompt {group.prompt_index} already committed by writer {self.writer}")
        if not self._buffer:
            self._first_buffered_s = time.monotonic()
        self._buffer.append(group)

    def withdraw(self, prompts: list[int]) -> list[Group]:
        """Take the buffered groups of ``prompts`` back (refused at commit: :class:`CommitRefused`)."""
        out = [g for g in self._buffer if g.prompt_index in set(prompts)]
        self._buffer = [g for g in self._buffer if g.prompt_index not in set(prompts)]
        return out

    @property
    def buffered(self) -> int:
        """Groups waiting for the next seal."""
        return len(self._buffer)

    def seal_due(self) -> bool:
        """The buffer is full or its oldest group has waited ``seal_interval_s``."""
        return bool(self._buffer) and (len(self._buffer) >= self.seal_groups or
                                       time.monotonic() - self._first_buffered_s >= self.seal_interval_s)

    def seal(self) -> Optional[ShardManifestLine]:
        """Commit the buffered groups as one shard; return its manifest line."""
        if self._broken:
            raise RuntimeError(f"writer {self.writer} cannot seal: {self._broken}")
        if not self._buffer:
            return None
        groups = list(self._buffer)  # cleared only once committed: a failed write keeps them for the next try
        index = self.next_shard_index
        self.next_shard_index += 1  # taken before anything is written: a retry never reuses (overwrites) it
        final = self.run_dir.shard_path(self.writer, index)
        tmp = RunDir.staging(final)
        image, layout = shard_image(groups, self.writer, index)
        line = ShardManifestLine(
            shard=final.name, shard_index=index, n_groups=len(groups),
            n_trajectories=sum(len(g.trajectories) for g in groups), size_bytes=len(image),
            sha256=hashlib.sha256(image).hexdigest(), prompt_indices=[g.prompt_index for g in groups],
            committed_s=0.0, layout=layout)
        write_file_durably(tmp, image, what=f"shard {final.name}")
        guarded(f"the rename of {tmp.name}", final, 0, lambda: (os.rename(tmp, final), fsync_path(self.folder)))
        guard = self.commit_guard(line.prompt_indices, [g.version_end for g in groups]) if self.commit_guard \
            else nullcontext()
        with termination.deferred():  # durable and recorded in memory, or neither
            faults.point("seal_manifest")
            try:
                with guard:
                    line.committed_s = time.time()  # under the guard's lock: the order the trainer takes them in
                    try:
                        self._manifest.append(line.to_json())  # the commit point
                    except BaseException as e:
                        self._broken = f"appending the manifest line of {final.name} failed ({e!r}); it may be durable"
                        raise
            except CommitRefused:  # raised before the append: never listed, nobody read it
                final.unlink()
                raise
            self._buffer = []
            self._lines[line.shard] = list(line.prompt_indices)
            self._live.update(line.prompt_indices)
            self.committed_groups += len(groups)
        return line

    def close(self) -> None:
        """Seal what is buffered (unless a commit failed) and close the manifest. Groups the guard refuses are left
        uncommitted (their prompts stay this writer's claims: its next job generates them again)."""
        try:
            while not self._broken:
                try:
                    self.seal()
                    break
                except CommitRefused as e:
                    self.withdraw(e.prompts)
                    log.warning("writer %s: not committing %d group(s) at close (%s); generated again by its next "
                                "job", self.writer, len(e.prompts), e.why)
        finally:
            self._manifest.close()
