"""Weight exchange through the shared filesystem (always available).

Publish (trainer rank 0)::

    weights/v000007.tmp/ <- model.safetensors (hashed while written), config.json, the model's tokenizer
                            and generation files (WEIGHT_MODEL_FILES: a complete HF folder), each fsync'd
    rename -> weights/v000007/, fsync weights/
    weights/v000007/manifest.json (tmp -> fsync -> replace): the version now exists

Take (a subscriber: rollout job, evaluation): poll for the newest version with a manifest and no
``bad.json`` (no inotify on Lustre), announce it in ``control/loading/<reader>.json`` (the pin), map
the file, check its size and hash against the manifest (one pass over the bytes), and only then
hand the tensors to the caller in a ``WeightVersion``; its release withdraws the announcement. A
damaged version (torn file, flipped bytes, unreadable manifest or header) is named in the log,
marked with ``bad.json`` and never taken again; ``take_newest`` falls back to the newest intact
one and the trainer publishes its current weights as a new version.

Delta versions (``weights.delta``, ``delta_versions.py``): a version may hold ``model.delta`` (its changes
against an older full version, the *base*, named with its hash in the manifest) instead of
``model.safetensors``. The subscriber rebuilds it against the base it holds in memory (else the base's
files), checks every rebuilt tensor against the trainer's hash, and hands it over in one flat buffer
(``mapped`` for vLLM; the folder is not a loadable model, so ``folder`` is None). A delta that cannot be
rebuilt (its file damaged or missing, its base gone or damaged) is named, marked bad and skipped like any
damaged version; a damaged base is marked bad too, and the trainer's next version is then full.

Retention (trainer): keep the newest ``keep_versions``, the newest intact version, and the base of every
delta it keeps; an older version is deleted only if no live rollout job (fresh heartbeat) has announced it
is loading it (AReaL #710). A dead job's announcement does not pin anything. A version is deleted by
renaming its folder to ``vNNNNNN.deleting`` (it vanishes whole) and removing that; one a killed trainer left
is removed by the next trainer's start (:meth:`VersionFolders.sweep`).
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Optional

import torch

from hpcrl.config import TimeoutsConfig, WeightsConfig
from hpcrl.control.changes import bump
from hpcrl.control.records import LoadingAnnouncement, live_jobs
from hpcrl.fsio import fsync_path, guarded, read_json, write_json_atomic
from hpcrl.process import faults
from hpcrl.run_dir import WEIGHT_DELTA, WEIGHT_TENSORS, RunDir
from hpcrl.weights.adapter import read_adapter_config, version_files
from hpcrl.weights.base import (Published, WeightPublisher, WeightSubscriber, WeightVersion, WeightVersionBad,
                                WeightVersionGone)
from hpcrl.weights.delta_versions import BaseUnusable, DeltaReader, DeltaWriter, Encoded, Rebuilt, frame_tensors
from hpcrl.weights.manifest import AdapterBase, BadVersionMarker, FileEntry, TensorEntry, WeightManifest
from hpcrl.weights.file_hash import HASH_ALGORITHM, HASHES, DamagedFile, check_file, write_hashed
from hpcrl.weights.safetensors_io import load_verified, save_hashed

log = logging.getLogger(__name__)


def dedupe_tied(state_dict: dict[str, torch.Tensor], to_cpu: bool = True
                ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Each storage once (safetensors refuses shared storage: tied embeddings) and the aliases of the rest;
    contiguous copies in host memory unless ``to_cpu`` is False."""
    seen: dict[tuple, str] = {}
    tensors, aliases = {}, {}
    for k, v in state_dict.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.dtype) if v.numel() else None
        if key is not None and key in seen:
            aliases[k] = seen[key]
            continue
        if key is not None:
            seen[key] = k
        tensors[k] = (v.detach().to("cpu") if to_cpu else v.detach()).contiguous()
    return tensors, aliases


def delta_writer(cfg: WeightsConfig) -> Optional[DeltaWriter]:
    """The trainer's delta policy of ``weights.delta`` / ``full_every`` / ``delta_max_ratio`` (None: all full)."""
    return DeltaWriter(cfg.full_every, cfg.delta_max_ratio) if cfg.delta else None


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


class FilesystemPublisher(WeightPublisher):
    """Trainer rank 0: versions as safetensors folders in ``RUN/weights`` (module docstring)."""

    def __init__(self, run_dir: RunDir, keep_versions: int, checksum: bool = True,
                 deltas: Optional[DeltaWriter] = None):
        """``checksum`` exists for the benchmark (what hashing costs); jobs keep it on. ``deltas``: write versions
        as deltas where they pay (``weights.delta``); None: every version full."""
        self.run_dir = run_dir
        self.folders = VersionFolders(run_dir)
        self.keep_versions = keep_versions
        self.checksum = checksum
        self.deltas = deltas
        self._bases: dict[tuple[int, int], Optional[int]] = {}  # (version, manifest inode) -> its base (None: full)

    @classmethod
    def from_config(cls, cfg: WeightsConfig, run_dir: RunDir, timeouts: TimeoutsConfig) -> "FilesystemPublisher":
        """The publisher the trainer uses (``weights.keep_versions``, ``weights.delta``)."""
        return cls(run_dir, cfg.keep_versions, deltas=delta_writer(cfg))

    def publish(self, version: int, state_dict: dict[str, torch.Tensor], model_config_json: str,
                trainer_step: int, consumed_groups: int, model_files: Optional[dict[str, bytes]] = None,
                adapter: Optional[AdapterBase] = None) -> Published:
        t0 = time.monotonic()
        manifest = self.write_version(version, *dedupe_tied(state_dict), model_config_json, trainer_step,
                                      consumed_groups, model_files, adapter, originals=state_dict)
        return Published(manifest, files_s=time.monotonic() - t0)

    def _encode(self, version: int, tensors: dict[str, torch.Tensor]) -> Optional[Encoded]:
        """The delta of ``version`` if it is to be one (logged either way); None: write it full."""
        if self.deltas is None:
            return None
        newest = self.published_versions()[-1:]
        if newest and self.is_bad(newest[0]):  # whatever was damaged, readers start again from a full version
            encoded, why = None, f"the newest version {newest[0]} was found damaged"
        else:
            encoded, why = self.deltas.encode(version, tensors, lambda v: self.run_dir.weight_manifest(v).is_file()
                                              and not self.is_bad(v))
        if encoded is None:
            log.info("weight version %d is written full: %s", version, why)
        else:
            log.info("weight version %d is written as a delta against full version %d: %.1f MB, %.1f%% of the "
                     "%.1f MB full", version, encoded.base.version, encoded.delta_bytes / 1e6,
                     100 * encoded.delta_bytes / max(encoded.full_bytes, 1), encoded.full_bytes / 1e6)
        return encoded

    def write_version(self, version: int, tensors: dict[str, torch.Tensor], aliases: dict[str, str],
                      model_config_json: str, trainer_step: int, consumed_groups: int,
                      model_files: Optional[dict[str, bytes]] = None,
                      adapter: Optional[AdapterBase] = None,
                      originals: Optional[dict[str, torch.Tensor]] = None) -> WeightManifest:
        """The files of ``version`` (``tensors`` stored once, ``aliases`` in the manifest; ``model_files``: the
        tokenizer and generation files, by name; ``adapter``: a LoRA adapter version of that base, in peft's file
        names, always written whole), committed by the manifest written last. Every file is listed and hashed in
        the manifest. ``originals``: the state dict ``tensors`` came from (a full version kept as the base of
        deltas is copied where it is the caller's own storage). On a full disk the version's staging folder is
        removed and the version written again once there is room (``fsio.guarded``)."""
        final = self.run_dir.weight_version_dir(version)
        if self.run_dir.weight_manifest(version).exists():
            raise FileExistsError(f"weight version {version} already published at {final}")
        encoded = self._encode(version, tensors) if adapter is None else None
        staging = self.run_dir.staging(final)
        nbytes = (encoded.delta_bytes if encoded is not None else
                  sum(t.numel() * t.element_size() for t in tensors.values()))
        return guarded(f"weight version {version}", staging, nbytes,
                       lambda: self._write_files(version, tensors, aliases, model_config_json, trainer_step,
                                                 consumed_groups, model_files, encoded, originals, adapter),
                       undo=lambda: shutil.rmtree(staging, ignore_errors=True))

    def _write_files(self, version: int, tensors: dict[str, torch.Tensor], aliases: dict[str, str],
                     model_config_json: str, trainer_step: int, consumed_groups: int,
                     model_files: Optional[dict[str, bytes]], encoded: Optional[Encoded],
                     originals: Optional[dict[str, torch.Tensor]],
                     adapter: Optional[AdapterBase] = None) -> WeightManifest:
        rd = self.run_dir
        final = rd.weight_version_dir(version)
        if rd.weight_manifest(version).exists():
            raise FileExistsError(f"weight version {version} already published at {final}")
        tmp = rd.staging(final)
        shutil.rmtree(tmp, ignore_errors=True)
        if final.exists():  # renamed by a trainer killed before its manifest: never visible, rewrite it
            shutil.rmtree(final)
        tmp.mkdir(parents=True)
        metadata = {"format": "pt", "param_version": str(version)}
        tensors_name, config_name = version_files(adapter)
        if encoded is None:
            size, digest = save_hashed(tensors, tmp / tensors_name, metadata)
            files = {tensors_name: FileEntry(size, HASH_ALGORITHM, digest)}
            entries = [TensorEntry(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in tensors.items()]
        else:
            size, digest = save_hashed(frame_tensors(encoded), tmp / WEIGHT_DELTA,
                                       {**metadata, "codec": encoded.base.codec, "base_version": str(encoded.base.version)})
            files = {WEIGHT_DELTA: FileEntry(size, HASH_ALGORITHM, digest)}
            entries = encoded.entries
            faults.point("delta_write")
        for name, data in {config_name: model_config_json.encode(), **(model_files or {})}.items():
            rd.weight_file(version, name)  # a known file name (ValueError otherwise)
            h = HASHES[HASH_ALGORITHM]()
            size = write_hashed(tmp / name, data, h)
            files[name] = FileEntry(size, HASH_ALGORITHM, h.hexdigest())
        if not self.checksum:
            files = {k: FileEntry(f.size_bytes, "", "") for k, f in files.items()}
        fsync_path(tmp)
        os.rename(tmp, final)
        fsync_path(final.parent)
        manifest = WeightManifest(
            param_version=version, trainer_step=trainer_step, consumed_groups=consumed_groups, files=files,
            tensors=entries, total_bytes=sum(f.size_bytes for f in files.values()), published_s=time.time(),
            aliases=aliases, base=encoded.base if encoded is not None else None, adapter=adapter)
        write_json_atomic(rd.weight_manifest(version), manifest.to_json())  # the commit point
        bump(rd, f"weight version {version} published", "trainer")
        if encoded is None and adapter is None and self.deltas is not None:
            self.deltas.hold(version, tensors, originals or {}, files[WEIGHT_TENSORS])
        return manifest

    def withdraw_after(self, version: int) -> list[int]:
        self.folders.sweep()  # at the trainer's start: what a killed trainer left half-written or half-removed
        removed = []
        for v in self.published_versions():
            if v > version:
                log.warning("removing weight version %d published after the checkpoint we resume from (v%d)",
                            v, version)
                if self.folders.delete(v):
                    removed.append(v)
        if removed:
            bump(self.run_dir, f"weight versions {removed} withdrawn", "trainer")
        return removed

    def retain(self, heartbeat_stale_s: float) -> list[int]:
        versions = self.published_versions()
        protected = set(versions[-self.keep_versions:])
        intact = [v for v in versions if not self.is_bad(v)]
        if intact:
            protected.add(intact[-1])  # readers fall back to it while the newest ones are damaged
        protected |= self.folders.pinned_by_live_readers(heartbeat_stale_s)
        protected |= {b for v in list(protected) if (b := self._base_of(v)) is not None}  # what kept deltas need
        if self.deltas is not None and self.deltas.base is not None:
            protected.add(self.deltas.base.version)  # the next delta's base
        return [v for v in versions if v not in protected and self.folders.delete(v)]

    def _base_of(self, version: int) -> Optional[int]:
        """The base of delta ``version`` (None for a full version, or an unreadable or vanished manifest)."""
        path = self.run_dir.weight_manifest(version)
        try:
            key = (version, path.stat().st_ino)
        except FileNotFoundError:
            return None
        if key not in self._bases:
            try:
                self._bases[key] = WeightManifest.from_json(read_json(path), str(path)).base_version
            except (ValueError, OSError, UnicodeDecodeError):
                return None  # a damaged manifest: that version is never rebuilt, its base not needed for it
        return self._bases[key]

    def published_versions(self) -> list[int]:
        return self.folders.published_versions()

    def is_bad(self, version: int) -> bool:
        return self.folders.is_bad(version)


class FilesystemSubscriber(WeightSubscriber):
    """A reader of the safetensors folders in ``RUN/weights`` (module docstring)."""

    def __init__(self, run_dir: RunDir, reader: str, verify: bool = True, keep_bases: bool = False):
        """``verify`` exists for the benchmark (what checking the hashes costs); jobs keep it on. ``keep_bases``:
        hold each full version taken in host memory as the base of the deltas after it (``weights.delta``)."""
        self.run_dir = run_dir
        self.reader = reader
        self.folders = VersionFolders(run_dir)
        self.verify = verify
        self.deltas = DeltaReader(run_dir, keep_bases, verify)
        """Rebuilds delta versions (whatever this reader's config says: the trainer decides what it writes)."""

    @classmethod
    def from_config(cls, cfg: WeightsConfig, run_dir: RunDir, reader: str, timeouts: TimeoutsConfig,
                    device: str = "cpu") -> "FilesystemSubscriber":
        """The subscriber a reader named ``reader`` uses."""
        return cls(run_dir, reader, keep_bases=cfg.delta)

    def published_versions(self) -> list[int]:
        return self.folders.published_versions()

    def is_bad(self, version: int) -> bool:
        return self.folders.is_bad(version)

    def read_manifest(self, version: int) -> Optional[WeightManifest]:
        return self.folders.read_manifest(version)

    def take(self, version: int) -> WeightVersion:
        t0 = time.monotonic()
        self.folders.pin(self.reader, version, True)
        try:
            manifest, tensors, rebuilt = self._read_verified(version)
            adapter = self.adapter_config(version, manifest)
        except BaseException:
            self.folders.pin(self.reader, version, False)
            raise

        def release() -> None:
            self.folders.pin(self.reader, version, False)
            if rebuilt is not None:
                self.deltas.recycle(rebuilt)

        if rebuilt is None:
            return WeightVersion(version, manifest, self.run_dir.weight_version_dir(version), tensors,
                                 path="filesystem", transfer_s=time.monotonic() - t0, nbytes=manifest.total_bytes,
                                 adapter=adapter, _release=release)
        # a delta's folder is not a model an engine could load: the rebuilt buffer is the only way in
        return WeightVersion(version, manifest, None, tensors, path="filesystem", transfer_s=time.monotonic() - t0,
                             nbytes=rebuilt.nbytes_read, mapped=rebuilt.mapped(manifest.aliases), _release=release)

    def adapter_config(self, version: int, manifest: WeightManifest) -> Optional[dict]:
        """peft's config of an adapter version, verified (None for full weights); WeightVersionBad (marked) if
        it is damaged."""
        if manifest.adapter is None:
            return None
        _, name = version_files(manifest.adapter)
        try:
            return read_adapter_config(self.run_dir.weight_file(version, name), manifest.files[name])
        except (DamagedFile, FileNotFoundError, KeyError) as e:
            reason = f"weight version {version}: {name} is damaged or missing ({e})"
            self.folders.mark_bad(version, self.reader, reason)
            raise WeightVersionBad(reason) from None

    def _read_verified(self, version: int) -> tuple[WeightManifest, dict[str, torch.Tensor], Optional[Rebuilt]]:
        """The manifest and verified tensors of ``version`` (and the rebuilt buffer of a delta version);
        WeightVersionGone / WeightVersionBad (marked; a damaged base of a delta is marked too)."""
        rd = self.run_dir
        try:
            try:
                manifest = self.read_manifest(version)
                if manifest is None:
                    self.folders.forget(version)
                    raise WeightVersionGone(f"weight version {version} disappeared from {rd.weights} "
                                            "before it was loaded")
                return (manifest, *self._read(version, manifest))
            except BaseUnusable as e:
                if e.damaged:
                    self.folders.mark_bad(e.base_version, self.reader, f"found damaged as the base of delta "
                                                                       f"version {version}: {e}")
                raise WeightVersionBad(f"weight version {version} (a delta) cannot be rebuilt: {e}") from None
            except FileNotFoundError as e:
                if not rd.weight_manifest(version).exists():
                    raise WeightVersionGone(f"weight version {version} was deleted while it was loaded") from None
                raise WeightVersionBad(f"weight version {version}: {e.filename} is missing") from None
            except DamagedFile as e:
                raise WeightVersionBad(f"weight version {version} in {rd.weight_version_dir(version)} "
                                       f"is damaged: {e}") from None
        except WeightVersionBad as e:
            self.folders.mark_bad(version, self.reader, str(e))
            raise

    def _read(self, version: int, manifest: WeightManifest) -> tuple[dict[str, torch.Tensor], Optional[Rebuilt]]:
        """The verified tensors of ``version`` with tied aliases restored (and the buffer of a delta version);
        DamagedFile if anything differs, BaseUnusable if a delta's base cannot be used."""
        rd = self.run_dir
        tensors_name, config_name = version_files(manifest.adapter)
        if manifest.base is not None:
            tensors_name = WEIGHT_DELTA
        if not {tensors_name, config_name} <= set(manifest.files):
            raise DamagedFile(f"manifest lists {sorted(manifest.files)}, expected {tensors_name} and "
                              f"{config_name} among them")
        for name, entry in manifest.files.items():  # config.json and the tokenizer files: each verified
            if name == tensors_name:
                continue
            try:
                path = rd.weight_file(version, name)
            except ValueError as e:
                raise DamagedFile(f"manifest lists an unknown file: {e}") from None
            check_file(path, entry.size_bytes, entry.hash_algorithm if self.verify else "", entry.hash_hex)
        if manifest.base is not None:
            rebuilt = self.deltas.read(version, manifest)
            return rebuilt.state, rebuilt
        entry = manifest.files[tensors_name]
        state = load_verified(rd.weight_file(version, tensors_name), entry.size_bytes, entry.hash_algorithm,
                              entry.hash_hex, verify=self.verify)
        self.deltas.took_full(version, manifest, state)
        for alias, stored in manifest.aliases.items():
            if stored not in state:
                raise DamagedFile(f"alias {alias} -> {stored}, but {tensors_name} has no {stored}")
            state[alias] = state[stored]
        return state, None
