"""``RUN/weights`` as the store's two sides see it: which versions are complete, their manifests, the bad markers and
the readers' pins (``control/loading/<reader>.json``), deleting a version whole and sweeping what a killed trainer
left (:class:`VersionFolders`, used by :mod:`hpcrl.weights.publisher` and :mod:`hpcrl.weights.subscriber`).

A version exists once ``weights/vNNNNNN/manifest.json`` does (written last); a version is deleted by renaming its
folder to ``vNNNNNN.deleting`` first (it vanishes whole), and a reader's marker ``bad.json`` keeps every reader
off it. A dead reader's pin protects nothing.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Optional

from hpcrl.control.changes import bump
from hpcrl.control.records import LoadingAnnouncement, live_jobs
from hpcrl.rundir.fsio import read_json, write_json_atomic
from hpcrl.rundir.paths import RunDir
from hpcrl.weights.base import WeightVersionBad
from hpcrl.weights.manifest import BadVersionMarker, WeightManifest

log = logging.getLogger(__name__)


class VersionFolders:
    """``RUN/weights`` as both sides see it: which versions are complete, their manifests, bad markers
    and the readers' pins (``control/loading/<reader>.json``)."""

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir
        # Versions this process found damaged, with the identity of the manifest it saw: never
        # tried again even if the marker could not be written, but a version number the trainer
        # withdrew and published again (after a rollback) is a new version.
        self._bad: dict[int, Optional[tuple[int, int]]] = {}
        # Versions seen with a manifest: a folder keeps its manifest until it is renamed away whole (delete), so
        # a listing stats only the folders not seen complete before (forget() drops one found without it).
        self._complete: set[int] = set()

    def published_versions(self) -> list[int]:
        """Versions whose manifest exists, oldest first (one listing, and a stat per folder not seen before)."""
        rd = self.run_dir
        try:
            names = os.listdir(rd.weights)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            v = rd.parse_weight_version(name)
            if v is not None and (v in self._complete or rd.weight_manifest(v).is_file()):
                out.append(v)
        self._complete = set(out)
        return sorted(out)

    def forget(self, version: int) -> None:
        """``version`` was found without its manifest: stat it again at the next listing."""
        self._complete.discard(version)

    def read_manifest(self, version: int) -> Optional[WeightManifest]:
        """The manifest of ``version``; None if there is none; WeightVersionBad if it is not one."""
        path = self.run_dir.weight_manifest(version)
        try:
            d = read_json(path)
            if d is None:
                return None
            manifest = WeightManifest.from_json(d, str(path))
        except (ValueError, UnicodeDecodeError) as e:
            raise WeightVersionBad(f"weight version {version}: {path} is not a manifest ({e})") from None
        if manifest.param_version != version:
            raise WeightVersionBad(f"weight version {version}: {path} says param_version {manifest.param_version}")
        return manifest

    def is_bad(self, version: int) -> bool:
        """This process found it damaged, or a reader left its marker."""
        if version in self._bad and self._bad[version] == self._manifest_stamp(version):
            return True
        return self.run_dir.weight_bad_marker(version).exists()

    def _manifest_stamp(self, version: int) -> Optional[tuple[int, int]]:
        try:
            st = self.run_dir.weight_manifest(version).stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    def mark_bad(self, version: int, reader: str, reason: str) -> None:
        """Record that ``version`` is damaged so no reader loads it again and the trainer republishes."""
        self._bad[version] = self._manifest_stamp(version)
        marker = BadVersionMarker(param_version=version, writer=reader, reason=reason, time_s=time.time())
        try:
            write_json_atomic(self.run_dir.weight_bad_marker(version), marker.to_json())
        except FileNotFoundError:
            return  # the version was deleted meanwhile: nobody can load it anyway
        bump(self.run_dir, f"weight version {version} marked bad", reader)

    def pin(self, reader: str, version: int, pinned: bool) -> None:
        """Announce that ``reader`` is loading ``version`` (retention must not delete it), or is done with it."""
        write_json_atomic(self.run_dir.loading_announcement(reader), LoadingAnnouncement(
            writer=reader, version=version, state="loading" if pinned else "loaded", time_s=time.time()).to_json())

    def pinned_by_live_readers(self, heartbeat_stale_s: float) -> set[int]:
        """Versions a reader with a fresh heartbeat announced it is loading (a dead reader pins nothing)."""
        alive = live_jobs(self.run_dir, heartbeat_stale_s)
        out = set()
        for path in self.run_dir.loading.glob("*.json"):
            try:
                pin = LoadingAnnouncement.from_json(read_json(path))
            except (ValueError, OSError):
                continue  # not a record (rewritten atomically, so never torn): pins nothing
            if pin.state == "loading" and pin.writer in alive:
                out.add(pin.version)
        return out

    def delete(self, version: int) -> bool:
        """Remove ``version``: its folder is renamed out of the version names first (from that instant it does not
        exist for readers; a trainer killed in the middle leaves a ``.deleting`` folder that :meth:`sweep` removes,
        never a version folder without its manifest), then removed."""
        folder = self.run_dir.weight_version_dir(version)
        doomed = RunDir.doomed(folder)
        try:
            os.replace(folder, doomed)
        except FileNotFoundError:
            return False
        shutil.rmtree(doomed, ignore_errors=True)
        return True

    def sweep(self) -> list[str]:
        """Trainer rank 0 at start (nothing is being written): remove what a killed trainer left half-written or
        half-removed (a staging folder, a ``.deleting`` folder, a version folder without its manifest), one log
        line each; the names removed."""
        rd, removed = self.run_dir, []
        for p in sorted(rd.weights.iterdir()) if rd.weights.is_dir() else []:
            v, stem = rd.parse_weight_version(p.name), p.with_suffix("")
            why = ("left half-removed" if RunDir.doomed(stem) == p else
                   "left half-written" if RunDir.staging(stem) == p else
                   "without its manifest (never published)" if v is not None and not rd.weight_manifest(v).exists()
                   else None)
            if why is not None and p.is_dir():
                log.warning("start-up sweep: removing %s, %s by a trainer killed before", p, why)
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
        return removed
