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

Retention (trainer): keep the newest ``keep_versions`` and the newest intact version; an
older version is deleted only if no live rollout job (fresh heartbeat) has announced it
is loading it (AReaL #710). A dead job's announcement does not pin anything.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Optional

import torch

from hpcrl.config import TimeoutsConfig, WeightsConfig
from hpcrl.control.records import LoadingAnnouncement, live_jobs
from hpcrl.fsio import fsync_path, guarded, read_json, write_json_atomic
from hpcrl.run_dir import RunDir
from hpcrl.weights.adapter import read_adapter_config, version_files
from hpcrl.weights.base import (Published, WeightPublisher, WeightSubscriber, WeightVersion, WeightVersionBad,
                                WeightVersionGone)
from hpcrl.weights.manifest import AdapterBase, BadVersionMarker, FileEntry, TensorEntry, WeightManifest
from hpcrl.weights.safetensors_io import (HASH_ALGORITHM, HASHES, DamagedFile, check_file, load_verified,
                                          save_hashed, write_hashed)

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


class VersionFolders:
    """``RUN/weights`` as both sides see it: which versions are complete, their manifests, bad markers
    and the readers' pins (``control/loading/<reader>.json``)."""

    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir
        # Versions this process found damaged, with the identity of the manifest it saw: never
        # tried again even if the marker could not be written, but a version number the trainer
        # withdrew and published again (after a rollback) is a new version.
        self._bad: dict[int, Optional[tuple[int, int]]] = {}

    def published_versions(self) -> list[int]:
        """Versions whose manifest exists, oldest first."""
        rd = self.run_dir
        if not rd.weights.is_dir():
            return []
        out = []
        for p in rd.weights.iterdir():
            v = rd.parse_weight_version(p.name)
            if v is not None and rd.weight_manifest(v).is_file():
                out.append(v)
        return sorted(out)

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
            pass  # the version was deleted meanwhile: nobody can load it anyway

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

    def __init__(self, run_dir: RunDir, keep_versions: int, checksum: bool = True):
        """``checksum`` exists for the benchmark (what hashing costs); jobs keep it on."""
        self.run_dir = run_dir
        self.folders = VersionFolders(run_dir)
        self.keep_versions = keep_versions
        self.checksum = checksum

    @classmethod
    def from_config(cls, cfg: WeightsConfig, run_dir: RunDir, timeouts: TimeoutsConfig) -> "FilesystemPublisher":
        """The publisher the trainer uses (``weights.keep_versions``)."""
        return cls(run_dir, cfg.keep_versions)

    def publish(self, version: int, state_dict: dict[str, torch.Tensor], model_config_json: str,
                trainer_step: int, consumed_groups: int, model_files: Optional[dict[str, bytes]] = None,
                adapter: Optional[AdapterBase] = None) -> Published:
        t0 = time.monotonic()
        manifest = self.write_version(version, *dedupe_tied(state_dict), model_config_json, trainer_step,
                                      consumed_groups, model_files, adapter)
        return Published(manifest, files_s=time.monotonic() - t0)

    def write_version(self, version: int, tensors: dict[str, torch.Tensor], aliases: dict[str, str],
                      model_config_json: str, trainer_step: int, consumed_groups: int,
                      model_files: Optional[dict[str, bytes]] = None,
                      adapter: Optional[AdapterBase] = None) -> WeightManifest:
        """The files of ``version`` (``tensors`` stored once, ``aliases`` in the manifest; ``model_files``: the
        tokenizer and generation files, by name; ``adapter``: a LoRA adapter version of that base, in peft's file
        names), committed by the manifest written last. Every file is listed
        and hashed in the manifest. On a full disk the version's staging folder is removed and the version written
        again once there is room (``fsio.guarded``)."""
        staging = self.run_dir.staging(self.run_dir.weight_version_dir(version))
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return guarded(f"weight version {version}", staging, nbytes,
                       lambda: self._write_files(version, tensors, aliases, model_config_json, trainer_step,
                                                 consumed_groups, model_files, adapter),
                       undo=lambda: shutil.rmtree(staging, ignore_errors=True))

    def _write_files(self, version: int, tensors: dict[str, torch.Tensor], aliases: dict[str, str],
                     model_config_json: str, trainer_step: int, consumed_groups: int,
                     model_files: Optional[dict[str, bytes]], adapter: Optional[AdapterBase] = None) -> WeightManifest:
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
        size, digest = save_hashed(tensors, tmp / tensors_name, metadata)
        files = {tensors_name: FileEntry(size, HASH_ALGORITHM, digest)}
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
            tensors=[TensorEntry(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in tensors.items()],
            total_bytes=sum(f.size_bytes for f in files.values()), published_s=time.time(), aliases=aliases,
            adapter=adapter)
        write_json_atomic(rd.weight_manifest(version), manifest.to_json())  # the commit point
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
        return removed

    def retain(self, heartbeat_stale_s: float) -> list[int]:
        versions = self.published_versions()
        protected = set(versions[-self.keep_versions:])
        intact = [v for v in versions if not self.is_bad(v)]
        if intact:
            protected.add(intact[-1])  # readers fall back to it while the newest ones are damaged
        protected |= self.folders.pinned_by_live_readers(heartbeat_stale_s)
        return [v for v in versions if v not in protected and self.folders.delete(v)]

    def published_versions(self) -> list[int]:
        return self.folders.published_versions()

    def is_bad(self, version: int) -> bool:
        return self.folders.is_bad(version)


class FilesystemSubscriber(WeightSubscriber):
    """A reader of the safetensors folders in ``RUN/weights`` (module docstring)."""

    def __init__(self, run_dir: RunDir, reader: str, verify: bool = True):
        """``verify`` exists for the benchmark (what checking the hashes costs); jobs keep it on."""
        self.run_dir = run_dir
        self.reader = reader
        self.folders = VersionFolders(run_dir)
        self.verify = verify

    @classmethod
    def from_config(cls, cfg: WeightsConfig, run_dir: RunDir, reader: str, timeouts: TimeoutsConfig,
                    device: str = "cpu") -> "FilesystemSubscriber":
        """The subscriber a reader named ``reader`` uses."""
        return cls(run_dir, reader)

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
            manifest, tensors = self._read_verified(version)
            adapter = self.adapter_config(version, manifest)
        except BaseException:
            self.folders.pin(self.reader, version, False)
            raise
        return WeightVersion(version, manifest, self.run_dir.weight_version_dir(version), tensors, path="filesystem",
                             transfer_s=time.monotonic() - t0, nbytes=manifest.total_bytes, adapter=adapter,
                             _release=lambda: self.folders.pin(self.reader, version, False))

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

    def _read_verified(self, version: int) -> tuple[WeightManifest, dict[str, torch.Tensor]]:
        """The manifest and verified tensors of ``version``; WeightVersionGone / WeightVersionBad (marked)."""
        rd = self.run_dir
        try:
            try:
                manifest = self.read_manifest(version)
                if manifest is None:
                    raise WeightVersionGone(f"weight version {version} disappeared from {rd.weights} "
                                            "before it was loaded")
                return manifest, self._read(version, manifest)
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

    def _read(self, version: int, manifest: WeightManifest) -> dict[str, torch.Tensor]:
        """The verified tensors of ``version`` with tied aliases restored; DamagedFile if anything differs."""
        rd = self.run_dir
        tensors_name, config_name = version_files(manifest.adapter)
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
        entry = manifest.files[tensors_name]
        state = load_verified(rd.weight_file(version, tensors_name), entry.size_bytes, entry.hash_algorithm,
                              entry.hash_hex, verify=self.verify)
        for alias, stored in manifest.aliases.items():
            if stored not in state:
                raise DamagedFile(f"alias {alias} -> {stored}, but {tensors_name} has no {stored}")
            state[alias] = state[stored]
        return state
