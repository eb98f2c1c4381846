"""The trainer's side of the weight store (trainer rank 0): every version committed as a folder, then, where the run's
transport has a sender, moved to the readers that joined it too (:mod:`hpcrl.weights.transport`).

Publish::

    weights/v000007.tmp/ <- model.safetensors (hashed while written), config.json, the model's tokenizer
                            and generation files (WEIGHT_MODEL_FILES: a complete HF folder), each fsync'd
    rename -> weights/v000007/, fsync weights/
    weights/v000007/manifest.json (tmp -> fsync -> replace): the version now exists
    the transport's sender, if any: the committed version to its readers (never the only copy)

Delta versions (``weights.delta``, ``delta_versions.py``): a version may hold ``model.delta`` (its changes against an
older full version, the *base*, named with its hash in the manifest) instead of ``model.safetensors``, where that
pays; a version is full at the trainer's first publish, every ``weights.full_every``, when the delta would be too
large, and after a damaged one.

Retention: keep the newest ``keep_versions``, the newest intact version, and the base of every delta it keeps; an
older version is deleted only if no live reader (fresh heartbeat) has announced it is loading it (AReaL #710).
Withdrawal (a trainer resumed from a checkpoint): the versions it published after the checkpoint are removed, after
the start-up sweep of what a killed trainer left (:meth:`VersionFolders.sweep`).
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Optional

import torch

from hpcrl.config import WeightsConfig
from hpcrl.control.changes import bump
from hpcrl.rundir.fsio import fsync_path, read_json, write_json_atomic
from hpcrl.rundir.disk import guarded
from hpcrl.process import faults
from hpcrl.rundir.paths import WEIGHT_DELTA, WEIGHT_TENSORS, RunDir
from hpcrl.weights.adapter import version_files
from hpcrl.weights.base import Published
from hpcrl.weights.delta_versions import DeltaWriter, Encoded, frame_tensors
from hpcrl.weights.file_hash import HASH_ALGORITHM, HASHES, write_hashed
from hpcrl.weights.folders import VersionFolders
from hpcrl.weights.manifest import AdapterBase, FileEntry, TensorEntry, WeightManifest
from hpcrl.weights.safetensors_io import save_hashed
from hpcrl.weights.transport import TransportSender

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


class WeightPublisher:
    """Trainer rank 0: versions as safetensors folders in ``RUN/weights``, and by the transport's sender where the run
    has one (module docstring)."""

    def __init__(self, run_dir: RunDir, keep_versions: int, checksum: bool = True,
                 deltas: Optional[DeltaWriter] = None, sender: Optional[TransportSender] = None):
        """``checksum`` exists for the benchmark (what hashing costs); jobs keep it on. ``deltas``: write versions
        as deltas where they pay (``weights.delta``); None: every version full. ``sender``: the transport's
        (``weights.transport``), None: files only."""
        self.run_dir = run_dir
        self.sender = sender
        self.folders = VersionFolders(run_dir)
        self.keep_versions = keep_versions
        self.checksum = checksum
        self.deltas = deltas
        self._bases: dict[tuple[int, int], Optional[int]] = {}  # (version, manifest inode) -> its base (None: full)

    def start(self) -> None:
        """Announce this trainer to the transport's readers before its first publish (a resumed trainer re-announces
        itself at start, so readers waiting on a dead trainer's record can join); nothing for files alone."""
        if self.sender is not None:
            self.sender.start()

    def publish(self, version: int, state_dict: dict[str, torch.Tensor], model_config_json: str,
                trainer_step: int, consumed_groups: int, model_files: Optional[dict[str, bytes]] = None,
                adapter: Optional[AdapterBase] = None) -> Published:
        """Make ``version`` (HF-named ``state_dict`` plus the model's ``config.json`` and its other files:
        ``model_files``, tokenizer and generation config by name, so the version is a complete HF folder)
        available; readers see it whole or not at all. FileExistsError if it is already published.
        ``adapter``: the version is a LoRA adapter of that base (``state_dict`` the adapter's tensors under peft's
        names, ``model_config_json`` peft's adapter config; ``hpcrl/weights/adapter.py``). Then the transport's
        sender moves the committed version."""
        self.start()  # before the first version's files: a joiner finds the trainer with v0
        t0 = time.monotonic()
        tensors, aliases = dedupe_tied(state_dict)  # an adapter version: the adapter's tensors only
        manifest = self.write_version(version, tensors, aliases, model_config_json, trainer_step, consumed_groups,
                                      model_files, adapter, originals=state_dict)
        files_s = time.monotonic() - t0
        if self.sender is None:
            return Published(manifest, files_s)
        on_device = next(iter(state_dict.values())).device.type != "cpu" if state_dict else False
        device_tensors = dedupe_tied(state_dict, to_cpu=False)[0] if on_device else tensors
        sent = self.sender.send(version, tensors, device_tensors, aliases, manifest)
        return Published(manifest, files_s, path=sent.path, transfer_s=sent.transfer_s, members=sent.members,
                         sent_bytes=sent.nbytes, backend=sent.backend)

    def waiting_members(self) -> int:
        """Readers that will take the next publish by the transport (0 for files alone)."""
        return self.sender.waiting_members() if self.sender is not None else 0

    def close(self) -> None:
        """Stop the transport's threads and wait for them (bounded); safe to call twice."""
        if self.sender is not None:
            self.sender.close()

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
        removed and the version written again once there is room (``disk.guarded``)."""
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
        """Remove every published version newer than ``version`` (the trainer resumed from a checkpoint at
        ``version``; what it published after is re-published from the restored model). Returns the removed ones."""
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
        """Delete old versions (module docstring); a reader pins a version while its heartbeat is fresher than
        ``heartbeat_stale_s``. Returns the deleted versions."""
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
        """Complete versions, oldest first (versions marked bad included)."""
        return self.folders.published_versions()

    def is_bad(self, version: int) -> bool:
        """Whether a reader has marked ``version`` damaged."""
        return self.folders.is_bad(version)
