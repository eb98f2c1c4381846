"""Weight exchange through the shared filesystem (always available).

Publish (trainer rank 0)::

    weights/v000007.tmp/ <- model.safetensors (hashed while written), config.json, each fsync'd
    rename -> weights/v000007/, fsync weights/
    weights/v000007/manifest.json (tmp -> fsync -> replace): the version now exists

Load (rollout): poll for the newest version with a manifest and no ``bad.json`` (no
inotify on Lustre), announce it in ``control/loading/<writer>.json`` (the pin), map the
file, check its size and hash against the manifest (one pass over the bytes), and only
then hand the tensors to ``apply``; release the announcement. A damaged version (torn
file, flipped bytes, unreadable manifest or header) is named in the log, marked with
``bad.json`` and never loaded again; ``load_newest`` falls back to the newest intact one
and the trainer publishes its current weights as a new version.

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

from hpcrl import metric_names as M
from hpcrl.config import TimeoutsConfig, WeightsConfig
from hpcrl.control.records import LoadingAnnouncement, live_jobs
from hpcrl.fsio import fsync_path, read_json, write_json_atomic
from hpcrl.run_dir import WEIGHT_MODEL_CONFIG, WEIGHT_TENSORS, RunDir
from hpcrl.weights.base import Apply, WeightTransport, WeightVersionBad, WeightVersionGone
from hpcrl.weights.manifest import BadVersionMarker, FileEntry, TensorEntry, WeightManifest
from hpcrl.weights.safetensors_io import (HASH_ALGORITHM, HASHES, DamagedFile, check_file, load_verified,
                                          save_hashed, write_hashed)

log = logging.getLogger(__name__)


def _dedupe_tied(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses shared storage (tied embeddings): store each storage once."""
    seen: dict[tuple, str] = {}
    tensors, aliases = {}, {}
    for k, v in state_dict.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.dtype) if v.numel() else None
        if key is not None and key in seen:
            aliases[k] = seen[key]
            continue
        if key is not None:
            seen[key] = k
        tensors[k] = v.detach().to("cpu").contiguous()
    return tensors, aliases


class FilesystemTransport(WeightTransport):
    """Versions as safetensors folders in ``RUN/weights`` (see the module docstring)."""

    name = "filesystem"

    def __init__(self, run_dir: RunDir, keep_versions: int, verify: bool = True, checksum: bool = True):
        """``verify``/``checksum`` exist for the benchmark (what hashing costs); jobs keep both on."""
        self.run_dir = run_dir
        self.keep_versions = keep_versions
        self.verify = verify
        self.checksum = checksum
        # Versions this process found damaged, with the identity of the manifest it saw: never
        # tried again even if the marker could not be written, but a version number the trainer
        # withdrew and published again (after a rollback) is a new version.
        self._bad: dict[int, Optional[tuple[int, int]]] = {}

    @classmethod
    def from_config(cls, cfg: WeightsConfig, run_dir: RunDir,
                    timeouts: Optional[TimeoutsConfig] = None) -> "FilesystemTransport":
        """The transport a job uses (``weights.keep_versions``)."""
        return cls(run_dir, cfg.keep_versions)

    # ---- trainer side
    def publish(self, version: int, state_dict: dict[str, torch.Tensor], model_config_json: str,
                trainer_step: int, consumed_groups: int) -> WeightManifest:
        rd = self.run_dir
        t0 = time.monotonic()
        final = rd.weight_version_dir(version)
        if rd.weight_manifest(version).exists():
            raise FileExistsError(f"weight version {version} already published at {final}")
        tmp = rd.staging(final)
        shutil.rmtree(tmp, ignore_errors=True)
        if final.exists():  # renamed by a trainer killed before its manifest: never visible, rewrite it
            shutil.rmtree(final)
        tmp.mkdir(parents=True)
        tensors, aliases = _dedupe_tied(state_dict)
        metadata = {"format": "pt", "param_version": str(version)}
        size, digest = save_hashed(tensors, tmp / WEIGHT_TENSORS, metadata)
        files = {WEIGHT_TENSORS: FileEntry(size, HASH_ALGORITHM, digest)}
        h = HASHES[HASH_ALGORITHM]()
        size = write_hashed(tmp / WEIGHT_MODEL_CONFIG, model_config_json.encode(), h)
        files[WEIGHT_MODEL_CONFIG] = FileEntry(size, HASH_ALGORITHM, h.hexdigest())
        if not self.checksum:
            files = {k: FileEntry(f.size_bytes, "", "") for k, f in files.items()}
        fsync_path(tmp)
        os.rename(tmp, final)
        fsync_path(final.parent)
        manifest = WeightManifest(
            param_version=version, trainer_step=trainer_step, consumed_groups=consumed_groups, files=files,
            tensors=[TensorEntry(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in tensors.items()],
            total_bytes=sum(f.size_bytes for f in files.values()), published_s=time.time(), aliases=aliases)
        write_json_atomic(rd.weight_manifest(version), manifest.to_json())  # the commit point
        files_s = time.monotonic() - t0
        self.last_publish = {M.WEIGHTS_PATH: "filesystem", M.PARAM_SYNC_FILES_S: files_s,
                             M.WEIGHTS_BYTES: manifest.total_bytes,
                             M.WEIGHTS_GB_PER_S: manifest.total_bytes / max(files_s, 1e-9) / 1e9}
        return manifest

    def _delete(self, version: int) -> bool:
        # manifest first: from this instant the version does not exist for readers
        try:
            self.run_dir.weight_manifest(version).unlink()
        except FileNotFoundError:
            return False
        shutil.rmtree(self.run_dir.weight_version_dir(version), ignore_errors=True)
        return True

    def withdraw_after(self, version: int) -> list[int]:
        removed = []
        for v in self.published_versions():
            if v > version:
                log.warning("removing weight version %d published after the checkpoint we resume from (v%d)",
                            v, version)
                if self._delete(v):
                    removed.append(v)
        return removed

    def retain(self, heartbeat_stale_s: float) -> list[int]:
        versions = self.published_versions()
        protected = set(versions[-self.keep_versions:])
        intact = [v for v in versions if not self.is_bad(v)]
        if intact:
            protected.add(intact[-1])  # readers fall back to it while the newest ones are damaged
        alive = live_jobs(self.run_dir, heartbeat_stale_s)
        for path in self.run_dir.loading.glob("*.json"):
            try:
                d = read_json(path)
            except (ValueError, OSError):
                continue  # not a record (rewritten atomically, so never torn): pins nothing
            if isinstance(d, dict) and d.get("state") == "loading" and d.get("writer") in alive:
                protected.add(int(d["version"]))
        return [v for v in versions if v not in protected and self._delete(v)]

    def is_bad(self, version: int) -> bool:
        if version in self._bad and self._bad[version] == self._manifest_stamp(version):
            return True
        return self.run_dir.weight_bad_marker(version).exists()

    def _manifest_stamp(self, version: int) -> Optional[tuple[int, int]]:
        try:
            st = self.run_dir.weight_manifest(version).stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    # ---- both sides
    def published_versions(self) -> list[int]:
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
        path = self.run_dir.weight_manifest(version)
        try:
            d = read_json(path)
            if d is None:
                return None
            manifest = WeightManifest.from_json(d)
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as e:
            raise WeightVersionBad(f"weight version {version}: {path} is not a manifest ({e!r})") from None
        if manifest.param_version != version:
            raise WeightVersionBad(f"weight version {version}: {path} says param_version {manifest.param_version}")
        return manifest

    # ---- rollout side
    def _announce(self, writer: str, version: int, state: str) -> None:
        write_json_atomic(self.run_dir.loading_announcement(writer),
                          LoadingAnnouncement(writer=writer, version=version, state=state, time_s=time.time()).to_json())

    def pin(self, writer: str, version: int) -> None:
        self._announce(writer, version, "loading")

    def unpin(self, writer: str, version: int) -> None:
        self._announce(writer, version, "loaded")

    def mark_bad(self, version: int, writer: str, reason: str) -> None:
        self._bad[version] = self._manifest_stamp(version)
        marker = BadVersionMarker(param_version=version, writer=writer, reason=reason, time_s=time.time())
        try:
            write_json_atomic(self.run_dir.weight_bad_marker(version), marker.to_json())
        except FileNotFoundError:
            pass  # the version was deleted meanwhile: nobody can load it anyway

    def load(self, version: int, writer: str, apply: Optional[Apply] = None
             ) -> tuple[WeightManifest, dict[str, torch.Tensor]]:
        rd = self.run_dir
        self.pin(writer, version)
        try:
            try:
                manifest = self.read_manifest(version)
                if manifest is None:
                    raise WeightVersionGone(f"weight version {version} disappeared from {rd.weights} "
                                            "before it was loaded")
                state = self._read(version, manifest)
            except FileNotFoundError as e:
                if not rd.weight_manifest(version).exists():
                    raise WeightVersionGone(f"weight version {version} was deleted while it was loaded") from None
                raise WeightVersionBad(f"weight version {version}: {e.filename} is missing") from None
            except DamagedFile as e:
                raise WeightVersionBad(f"weight version {version} in {rd.weight_version_dir(version)} "
                                       f"is damaged: {e}") from None
            self.last_load = {M.WEIGHTS_PATH: "filesystem", M.WEIGHTS_BYTES: manifest.total_bytes}
            if apply is not None:
                apply(state, rd.weight_version_dir(version))
                return manifest, {}
            # the tensors view a read-only mapping of the file: hand out copies that outlive it
            return manifest, {k: v.clone() for k, v in state.items()}
        except WeightVersionBad as e:
            self.mark_bad(version, writer, str(e))
            raise
        finally:
            self.unpin(writer, version)

    def _read(self, version: int, manifest: WeightManifest) -> dict[str, torch.Tensor]:
        """The verified tensors of ``version`` with tied aliases restored; DamagedFile if anything differs."""
        rd = self.run_dir
        if set(manifest.files) != {WEIGHT_TENSORS, WEIGHT_MODEL_CONFIG}:
            raise DamagedFile(f"manifest lists {sorted(manifest.files)}, expected "
                              f"{sorted([WEIGHT_TENSORS, WEIGHT_MODEL_CONFIG])}")
        cfg = manifest.files[WEIGHT_MODEL_CONFIG]
        check_file(rd.weight_file(version, WEIGHT_MODEL_CONFIG), cfg.size_bytes,
                   cfg.hash_algorithm if self.verify else "", cfg.hash_hex)
        entry = manifest.files[WEIGHT_TENSORS]
        state = load_verified(rd.weight_file(version, WEIGHT_TENSORS), entry.size_bytes, entry.hash_algorithm,
                              entry.hash_hex, verify=self.verify)
        for alias, stored in manifest.aliases.items():
            if stored not in state:
                raise DamagedFile(f"alias {alias} -> {stored}, but {WEIGHT_TENSORS} has no {stored}")
            state[alias] = state[stored]
        return state
