"""ShardWriter: the rollout side of the sample exchange (one per writer folder).

Groups are buffered in memory and *sealed* into an immutable shard:
``shard-N.h5.tmp`` -> close -> fsync -> rename -> fsync folder -> append one
fsync'd line to ``manifest.jsonl`` (the commit point). Plain non-SWMR HDF5 is
unreadable after a kill mid-write, so no reader ever opens a file that is still
being written.

On restart the writer recovers from its own folder: orphan ``.tmp`` files and
renamed-but-unlisted shards (killed before the manifest line) are deleted, the
next shard index continues after every file seen, and the set of committed
prompt indices tells the rollout loop which prompts still need generating.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import h5py

from hpcrl.fsio import JsonlAppender, file_sha256, fsync_path, read_jsonl
from hpcrl.run_dir import RunDir
from hpcrl.samples.schema import SCHEMA_VERSION, Group, ShardManifestLine, groups_to_arrays

log = logging.getLogger(__name__)



def write_shard_file(path: Path, groups: list[Group], writer: str, shard_index: int) -> None:
    """Write ``groups`` to ``path`` durably (caller renames it into place)."""
    arrays = groups_to_arrays(groups)
    with h5py.File(path, "w", locking=False, libver="latest") as f:
        f.attrs["schema_version"] = SCHEMA_VERSION
        f.attrs["writer"] = writer
        f.attrs["shard_index"] = shard_index
        for name, arr in arrays.items():
            f.create_dataset(name, data=arr)
    fsync_path(path)


class ShardWriter:
    def __init__(self, run_dir: RunDir, writer: str, seal_groups: int, seal_interval_s: float):
        self.run_dir = run_dir
        self.writer = writer
        self.seal_groups = seal_groups
        self.seal_interval_s = seal_interval_s
        self.folder = run_dir.writer_dir(writer)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._buffer: list[Group] = []
        self._first_buffered_s = 0.0
        self.committed_prompt_indices: set[int] = set()
        self.committed_groups = 0
        self.next_shard_index = self._recover()
        self._manifest = JsonlAppender(run_dir.shard_manifest(writer))

    def _recover(self) -> int:
        listed = set()
        for d in read_jsonl(self.run_dir.shard_manifest(self.writer),
                            on_bad_line=lambda n, t: log.warning("manifest line %d torn, ignored: %r", n, t[:80])):
            line = ShardManifestLine.from_json(d)
            listed.add(line.shard)
            self.committed_prompt_indices.update(line.prompt_indices)
            self.committed_groups += line.n_groups
        highest = -1
        for p in self.folder.iterdir():
            parsed = RunDir.parse_shard_name(p.name)
            if parsed is None:
                continue
            index, is_tmp = parsed
            highest = max(highest, index)
            if is_tmp or p.name not in listed:
                # .tmp: killed before the rename; unlisted: killed before the commit line.
                # Neither was ever visible to a reader, so removing it loses nothing.
                log.warning("removing uncommitted shard left by a previous run of writer %s: %s", self.writer, p.name)
                p.unlink()
        if listed:
            log.info("writer %s recovered: %d shards, %d groups committed", self.writer, len(listed),
                     self.committed_groups)
        return highest + 1

    # ---- buffering and sealing
    def add(self, group: Group) -> None:
        if group.prompt_index in self.committed_prompt_indices:
            raise RuntimeError(f"prompt {group.prompt_index} already committed by writer {self.writer}")
        if not self._buffer:
            self._first_buffered_s = time.monotonic()
        self._buffer.append(group)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def seal_due(self) -> bool:
        return bool(self._buffer) and (len(self._buffer) >= self.seal_groups or
                                       time.monotonic() - self._first_buffered_s >= self.seal_interval_s)

    def seal(self) -> ShardManifestLine | None:
        """Commit the buffered groups as one shard; return its manifest line."""
        if not self._buffer:
            return None
        groups = self._buffer  # cleared only once committed: a failed write keeps them for the next try
        index = self.next_shard_index
        final = self.run_dir.shard_path(self.writer, index)
        tmp = RunDir.staging(final)
        write_shard_file(tmp, groups, self.writer, index)
        os.rename(tmp, final)
        fsync_path(self.folder)
        line = ShardManifestLine(
            shard=final.name, shard_index=index, n_groups=len(groups),
            n_trajectories=sum(len(g.trajectories) for g in groups), size_bytes=final.stat().st_size,
            sha256=file_sha256(final), prompt_indices=[g.prompt_index for g in groups], committed_s=time.time())
        self._manifest.append(line.to_json())  # the commit point
        self._buffer = []
        self.next_shard_index += 1
        self.committed_prompt_indices.update(line.prompt_indices)
        self.committed_groups += len(groups)
        return line

    def close(self) -> None:
        self.seal()
        self._manifest.close()
