"""SampleReader: the trainer side of the sample exchange, exactly-once.

The reader tails every writer's ``manifest.jsonl`` (only complete lines count),
opens the listed shards (sealed, immutable: safe on NFS), checks their size and
checksum, and hands groups out in commit order.

The **cursor** ``{writer: {"line": L, "row": r}}`` names the next group not yet
handed out: manifest line ``L`` of that writer, row ``r`` inside its shard. It
is saved in the trainer checkpoint with the model and optimizer, so a resumed
trainer re-reads from exactly where the checkpointed model stopped: nothing
consumed twice, nothing skipped.

A shard that is truncated, corrupted or inconsistent is reported (file and
reason), counted and skipped; it never stops the trainer. With a
:class:`~hpcrl.samples.skips.SkipLog` (the trainer passes one) the skip is first
recorded in ``control/skipped_shards.jsonl``, so its writer regenerates the
prompts and admission returns their budget; a shard recorded there is skipped
without being read again.

Each shard is read once: the bytes are hashed and parsed from memory.

Metadata operations per poll (a shared filesystem's metadata server serves every one): a stat of
``samples/`` (the writer folders are listed again only when it changed, or every
:data:`WRITERS_RESCAN_S`), and a stat of each writer's manifest, opened only when it grew. The skip
log is read once: the trainer is its only writer, and records its own skips in the same instance.
"""
from __future__ import annotations

import hashlib
import heapq
import io
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import h5py

from hpcrl.rundir.fsio import read_jsonl
from hpcrl.rundir.paths import RunDir
from hpcrl.samples.schema import (DATASET_DTYPES, OPTIONAL_DTYPES, SCHEMA_VERSION, Group, ShardFormatError,
                                 ShardManifestLine, arrays_from_layout, arrays_to_groups)
from hpcrl.samples.skips import SkipLog, SkippedShard

log = logging.getLogger(__name__)

WRITERS_RESCAN_S = 10.0
"""The writer folders are listed at least this often (a new folder whose creation left ``samples/``'s
modification time as it was, within the clock's granularity, is found then)."""


class ShardCorrupt(Exception):
    """A listed shard is missing, truncated, corrupted or inconsistent (the message says which)."""


def read_shard(path: Path, line: ShardManifestLine, writer: str) -> list[Group]:
    """Read and verify one sealed shard against its manifest line (one read of the file)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise ShardCorrupt("file listed in the manifest is missing") from None
    if len(data) != line.size_bytes:
        raise ShardCorrupt(f"size {len(data)} bytes, manifest says {line.size_bytes} (truncated or overwritten)")
    digest = hashlib.sha256(data).hexdigest()
    if digest != line.sha256:
        raise ShardCorrupt(f"sha256 {digest[:12]}.. differs from manifest {line.sha256[:12]}.. (corrupted)")
    try:
        if line.layout and line.schema_version == SCHEMA_VERSION:
            return _finish(arrays_to_groups(arrays_from_layout(data, line.layout), writer), line)
        with h5py.File(io.BytesIO(data), "r") as f:
            version = int(f.attrs.get("schema_version", -1))
            if version != SCHEMA_VERSION:
                raise ShardCorrupt(f"schema_version {version}, this hpcrl reads {SCHEMA_VERSION}")
            arrays = {}
            for name in DATASET_DTYPES | OPTIONAL_DTYPES:  # by name: walking the file (visititems) cost more
                dset = f.get(name)
                if isinstance(dset, h5py.Dataset):
                    arrays[name] = dset[()]
        groups = arrays_to_groups(arrays, writer)
    except (OSError, KeyError, ShardFormatError) as e:
        raise ShardCorrupt(f"unreadable shard: {e}") from None
    return _finish(groups, line)


def _finish(groups: list[Group], line: ShardManifestLine) -> list[Group]:
    if [g.prompt_index for g in groups] != list(line.prompt_indices):
        raise ShardCorrupt("prompt indices differ from the manifest line")
    for g in groups:
        g.committed_s = line.committed_s
        g.shard = line.shard
    return groups


@dataclass
class _WriterState:
    line: int = 0            # next manifest line to hand out groups from
    row: int = 0             # next row inside that line's shard
    manifest_offset: int = 0  # bytes of manifest.jsonl already parsed
    lines: list = field(default_factory=list)  # parsed manifest lines (all of them)
    pending: deque = field(default_factory=deque)  # loaded groups not yet handed out, in row order
    loaded_upto: int = 0     # manifest lines whose groups are loaded into `pending` (or skipped)


class SampleReader:
    """Hands out committed groups exactly once, in commit order (see the module docstring)."""

    def __init__(self, run_dir: RunDir, cursor: Optional[dict] = None, verify_retries: int = 2,
                 skip_log: Optional[SkipLog] = None):
        self.run_dir = run_dir
        self.verify_retries = verify_retries
        self.skip_log = skip_log
        self._writers: dict[str, _WriterState] = {}
        for writer, pos in (cursor or {}).items():
            self._writers[writer] = _WriterState(line=int(pos["line"]), row=int(pos["row"]),
                                                 loaded_upto=int(pos["line"]))
        self.skipped: list[dict] = []  # {"writer", "shard", "reason", "n_groups", "prompt_indices"}
        self.lines_seen = 0
        """Manifest lines parsed so far, every writer (grows when a poll found new commits)."""
        self._skips_read = False
        self._writer_names: list[str] = []
        self._samples_stamp: Optional[tuple[int, int]] = None
        self._writers_listed_s = 0.0

    # ---- discovering committed groups
    def _tail_manifest(self, writer: str, st: _WriterState) -> None:
        path = self.run_dir.shard_manifest(writer)
        try:
            if os.stat(path).st_size <= st.manifest_offset:  # append-only: nothing new (a stat, not an open)
                return
            with open(path, "rb") as f:
                f.seek(st.manifest_offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # only complete lines are committed
        for raw in data[:end].splitlines():
            try:
                st.lines.append(ShardManifestLine.from_json(json.loads(raw)))
            except ValueError as e:  # not JSON, or JSON that is not a manifest line (RecordError)
                # a writer killed mid-line leaves a fragment, then appends a newline after it
                log.warning("writer %s: unparsable manifest line skipped (%s): %r", writer, e, raw[:80])
            self.lines_seen += 1
        st.manifest_offset += end

    def _load_next_shards(self, writer: str, st: _WriterState) -> None:
        while st.loaded_upto < len(st.lines) and not st.pending:
            line = st.lines[st.loaded_upto]
            path = self.run_dir.writer_dir(writer) / line.shard
            start_row = st.row if st.line == st.loaded_upto else 0
            groups = self._read_verified(path, line, writer, start_row)
            if groups is None:  # skipped
                if st.line == st.loaded_upto:
                    st.line, st.row = st.loaded_upto + 1, 0
            else:
                st.pending.extend(groups[start_row:])
                if not st.pending and st.line == st.loaded_upto:
                    st.line, st.row = st.loaded_upto + 1, 0
            st.loaded_upto += 1

    def _read_verified(self, path: Path, line: ShardManifestLine, writer: str,
                       start_row: int) -> Optional[list[Group]]:
        """The shard's groups, or None if it is skipped from ``start_row`` on (the rows before
        the cursor were trained on already)."""
        if self.skip_log is not None and self.skip_log.is_skipped(writer, line.shard):
            return self._skip(path, line, writer, f"recorded as skipped in {self.skip_log.path}", start_row)
        for attempt in range(self.verify_retries + 1):
            try:
                return read_shard(path, line, writer)
            except ShardCorrupt as e:
                if attempt < self.verify_retries:
                    time.sleep(0.2)  # a lagging shared-filesystem client may not show the bytes yet
                    continue
                return self._skip(path, line, writer, str(e), start_row)
        return None

    def _skip(self, path: Path, line: ShardManifestLine, writer: str, reason: str, start_row: int) -> None:
        """Record the skip of rows ``start_row:`` (durably, before the cursor can move past the
        shard) and report it. Rows before ``start_row`` were trained on: they are not handed back."""
        prompts = list(line.prompt_indices[start_row:])
        if self.skip_log is not None:  # only prompts not recorded before are added (a resumed trainer re-skips)
            self.skip_log.record(SkippedShard(writer=writer, shard=line.shard, prompt_indices=prompts,
                                              n_groups=len(prompts), reason=reason, time_s=time.time()))
        log.error("SKIPPING shard %s (%d of its %d groups, prompts %s): %s", path, len(prompts), line.n_groups,
                  prompts[:8], reason)
        self.skipped.append({"writer": writer, "shard": line.shard, "reason": reason, "n_groups": len(prompts),
                             "prompt_indices": prompts})
        return None

    @property
    def writers_seen(self) -> int:
        """Writer folders found by the last poll (each poll stats one manifest per writer)."""
        return len(self._writer_names)

    def _writer_folders(self) -> list[str]:
        """The writer folders: listed again only if ``samples/`` changed, or every :data:`WRITERS_RESCAN_S`."""
        try:
            st = os.stat(self.run_dir.samples)
        except FileNotFoundError:
            return []
        stamp, now = (st.st_ino, st.st_mtime_ns), time.monotonic()
        if stamp != self._samples_stamp or now - self._writers_listed_s >= WRITERS_RESCAN_S:
            self._samples_stamp, self._writers_listed_s = stamp, now
            self._writer_names = self.run_dir.writers()
        return self._writer_names

    def poll(self) -> int:
        """Discover new writers and commits; return how many groups are ready."""
        if self.skip_log is not None and not self._skips_read:
            self._skips_read = True
            self.skip_log.poll()
        for writer in self._writer_folders():
            st = self._writers.setdefault(writer, _WriterState())
            self._tail_manifest(writer, st)
            self._load_next_shards(writer, st)
        return self.ready()

    def ready(self) -> int:
        """Groups committed and not handed out yet (loaded or still to be read)."""
        return sum(len(st.pending) + sum(l.n_groups for l in st.lines[st.loaded_upto:])
                   for st in self._writers.values())

    # ---- handing groups out
    def take(self, n: int) -> list[Group]:
        """Pop up to ``n`` loaded groups, oldest commit first, advancing the cursor."""
        out: list[Group] = []
        heap = [(st.pending[0].committed_s, w) for w, st in self._writers.items() if st.pending]
        heapq.heapify(heap)
        while heap and len(out) < n:
            _, writer = heapq.heappop(heap)
            st = self._writers[writer]
            g = st.pending.popleft()
            out.append(g)
            st.row = g.row + 1
            if not st.pending:
                st.line, st.row = st.line + 1, 0
                self._load_next_shards(writer, st)
            if st.pending:
                heapq.heappush(heap, (st.pending[0].committed_s, writer))
        return out

    def cursor(self) -> dict:
        """Position of the next group not handed out, per writer (JSON-able)."""
        return {w: {"line": st.line, "row": st.row} for w, st in sorted(self._writers.items())}


def delete_consumed(run_dir: RunDir, cursor: dict, keep: int, done: Optional[dict[str, int]] = None) -> int:
    """Trainer rank 0, once a checkpoint holding ``cursor`` is durable: remove the shard files of each writer's
    manifest lines wholly before the cursor but the newest ``keep`` of them (``trainer.keep_consumed_shards``; -1
    keeps all). No reader ever opens them again (a resume starts at the cursor); their manifest lines stay, the
    record of what was committed. ``done`` (writer -> lines already handled) spares a second pass over old lines.
    Returns the files removed."""
    if keep < 0:
        return 0
    done = done if done is not None else {}
    removed = 0
    for writer, pos in cursor.items():
        upto = int(pos["line"]) - keep
        if upto <= done.get(writer, 0):
            continue
        for i, d in enumerate(read_jsonl(run_dir.shard_manifest(writer))):
            if i >= upto:
                break
            if i < done.get(writer, 0) or not isinstance(d, dict) or not isinstance(d.get("shard"), str):
                continue
            try:
                (run_dir.writer_dir(writer) / d["shard"]).unlink()
                removed += 1
            except FileNotFoundError:
                pass
        done[writer] = upto
    return removed
