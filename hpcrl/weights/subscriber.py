"""A reader's side of the weight store (a rollout job, the evaluation, any reader that follows the versions):
:class:`WeightSubscriber`.

Take: poll for the newest version with a manifest and no ``bad.json`` (no inotify on Lustre), announce it in
``control/loading/<reader>.json`` (the pin), get its tensors (by the run's transport where its receiver has the
version, else by mapping the file and checking its size and hash against the manifest, one pass over the bytes), and
only then hand them to the caller in a ``WeightVersion``; its release withdraws the announcement. A damaged version
(torn file, flipped bytes, unreadable manifest or header) is named in the log, marked with ``bad.json`` and never
taken again; ``take_newest`` falls back to the newest intact one and the trainer publishes its current weights as a
new version. A copy from a transport is used only if it belongs to the committed version (its manifest's
``published_s``): after a trainer's rollback a number may name another version.

Delta versions (``weights.delta``, ``delta_versions.py``): the subscriber rebuilds one against the base it holds in
memory (else the base's files), checks every rebuilt tensor against the trainer's hash, and hands it over in one
flat buffer (``mapped`` for vLLM; the folder is not a loadable model, so ``folder`` is None). A delta that cannot be
rebuilt (its file damaged or missing, its base gone or damaged) is named, marked bad and skipped like any damaged
version; a damaged base is marked bad too, and the trainer's next version is then full.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from hpcrl.rundir.paths import WEIGHT_DELTA, RunDir
from hpcrl.weights.adapter import read_adapter_config, version_files
from hpcrl.weights.base import WeightVersion, WeightVersionBad, WeightVersionGone
from hpcrl.weights.delta_versions import BaseUnusable, DeltaReader, Rebuilt
from hpcrl.weights.file_hash import DamagedFile, check_file
from hpcrl.weights.folders import VersionFolders
from hpcrl.weights.manifest import WeightManifest
from hpcrl.weights.safetensors_io import load_verified
from hpcrl.weights.transport import FILES, Received, TransportReceiver

log = logging.getLogger(__name__)


class WeightSubscriber:
    """A reader of the versions in ``RUN/weights`` (module docstring); ``reader`` is its name in pins and markers
    (``w000``, ``eval``)."""

    def __init__(self, run_dir: RunDir, reader: str, verify: bool = True, keep_bases: bool = False,
                 receiver: Optional[TransportReceiver] = None):
        """``verify`` exists for the benchmark (what checking the hashes costs); jobs keep it on. ``keep_bases``:
        hold each full version taken in host memory as the base of the deltas after it (``weights.delta``).
        ``receiver``: the transport's (``weights.transport``), None: files only."""
        self.run_dir = run_dir
        self.reader = reader
        self.receiver = receiver
        self.folders = VersionFolders(run_dir)
        self.verify = verify
        self.deltas = DeltaReader(run_dir, keep_bases, verify)
        """Rebuilds delta versions (whatever this reader's config says: the trainer decides what it writes)."""

    def published_versions(self) -> list[int]:
        """Complete versions, oldest first (versions marked bad included)."""
        return self.folders.published_versions()

    def is_bad(self, version: int) -> bool:
        """Whether a reader has marked ``version`` damaged."""
        return self.folders.is_bad(version)

    def read_manifest(self, version: int) -> Optional[WeightManifest]:
        """The manifest of ``version``; None if it is not published; WeightVersionBad if unreadable."""
        return self.folders.read_manifest(version)

    def newest_usable(self) -> Optional[int]:
        """Newest published version not marked bad; None if there is none."""
        for v in reversed(self.published_versions()):
            if not self.is_bad(v):
                return v
        return None

    def take(self, version: int) -> WeightVersion:
        """Pin ``version``, get and verify it (by the transport if its receiver has it, else from the files); release
        it when done. WeightVersionGone if it vanished; WeightVersionBad (after marking it bad) if it is damaged."""
        if self.receiver is None:
            return self._take_files(version)
        t0 = time.monotonic()
        received = self.receiver.receive(version)
        wv = self._take_received(version, received, t0) if received is not None else None
        if wv is None:
            wv = self._take_files(version)
            wv.transfer_s = time.monotonic() - t0  # the wait for a copy that did not come counts
        return wv

    def take_newest(self) -> Optional[WeightVersion]:
        """:meth:`take` the newest usable version; a damaged one is marked bad and the next older intact
        one is tried; a vanished one makes it look again. None if no usable version is left (wait for
        the trainer to publish one)."""
        while True:
            v = self.newest_usable()
            if v is None:
                return None
            try:
                return self.take(v)
            except WeightVersionGone as e:
                log.warning("%s; picking the newest again", e)
            except WeightVersionBad as e:
                log.error("%s; falling back to the newest intact version", e)

    def load(self, version: int) -> WeightVersion:
        """:meth:`take` ``version`` and release it at once, keeping copies of its tensors (for a reader
        that holds them: tests, an evaluation)."""
        with self.take(version) as wv:
            wv.tensors = {k: v.clone() for k, v in wv.tensors.items()}
            wv.mapped = None
        return wv

    def close(self) -> None:
        """Stop the transport's threads and wait for them (bounded); safe to call twice."""
        if self.receiver is not None:
            self.receiver.close()

    def _take_received(self, version: int, got: Received, t0: float) -> Optional[WeightVersion]:
        """The transport's copy of ``version``, pinned, if it belongs to the committed version on disk (else None,
        its buffers given back: the files are read)."""
        manifest = self.read_manifest(version)
        if manifest is None or manifest.published_s != got.published_s:
            got.release()
            return None
        self.folders.pin(self.reader, version, True)
        try:
            adapter = self.adapter_config(version, manifest)
        except BaseException:
            self.folders.pin(self.reader, version, False)
            got.release()
            raise

        def release() -> None:
            self.folders.pin(self.reader, version, False)
            got.release()

        folder = self.run_dir.weight_version_dir(version) if manifest.base is None else None  # a delta's: no model
        return WeightVersion(version, manifest, folder, got.state, path=got.path,
                             transfer_s=time.monotonic() - t0 + got.transfer_s, nbytes=got.nbytes, mapped=got.mapped,
                             adapter=adapter, _release=release)

    def _take_files(self, version: int) -> WeightVersion:
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
                                 path=FILES, transfer_s=time.monotonic() - t0, nbytes=manifest.total_bytes,
                                 adapter=adapter, _release=release)
        # a delta's folder is not a model an engine could load: the rebuilt buffer is the only way in
        return WeightVersion(version, manifest, None, tensors, path=FILES, transfer_s=time.monotonic() - t0,
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
