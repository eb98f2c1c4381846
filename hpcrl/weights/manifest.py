"""The records of a weight version: its manifest (what makes ``weights/vNNNNNN/`` complete)
and the marker a reader leaves on a damaged version.

=====================  ===============================  ===========================================
record                 written by                       read by
=====================  ===============================  ===========================================
``manifest.json``      trainer rank 0, last, after the  rollout jobs (which version, its budget
(WeightManifest)       folder is durable and renamed    origin, sizes and hashes to verify);
                                                        trainer (withdraw, retention)
``bad.json``           a rollout job whose load found   every rollout job (never loads it again);
(BadVersionMarker)     the version damaged              trainer (re-publishes); retention
=====================  ===============================  ===========================================

A version folder without ``manifest.json`` does not exist for readers. Both records
are written tmp -> fsync -> rename (``hpcrl.rundir.fsio.write_json_atomic``).

A *full* version holds ``model.safetensors``; a *delta* version (``base`` set) holds ``model.delta``
instead: each tensor's bits XOR its base version's, compressed (``weights/delta.py``), and every
tensor's hash, against which the reader checks what it rebuilt.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from hpcrl.rundir.json_record import JsonRecord


@dataclass
class FileEntry(JsonRecord):
    """One file of a version folder, as the trainer wrote it."""

    size_bytes: int
    """File size; a reader that finds another size has a torn file (checked before hashing)."""
    hash_algorithm: str
    """``xxh3_128`` (what the trainer writes: computed while writing, fast enough to verify
    on every load), ``sha256``, or ``""`` (not hashed: nothing to verify)."""
    hash_hex: str
    """Hex digest of the file's bytes under ``hash_algorithm``."""


@dataclass
class TensorEntry(JsonRecord):
    """One stored tensor (tied aliases are listed in :attr:`WeightManifest.aliases` instead)."""

    name: str
    """HF parameter name (``model.layers.0.mlp.up_proj.weight``)."""
    dtype: str
    """torch dtype without the ``torch.`` prefix (``bfloat16``)."""
    shape: list[int]
    hash_hex: str = ""
    """Delta versions: xxh3_128 of the full tensor's bytes as the trainer had them; a reader checks every
    tensor it rebuilds against it. Empty in full versions (the file's hash covers them)."""


@dataclass
class DeltaBase(JsonRecord):
    """What a delta version was written against: a full version of the same run."""

    version: int
    """The base version (a full one, older than the delta)."""
    hash_algorithm: str
    hash_hex: str
    """The base's ``model.safetensors`` hash as its manifest gives it: a version number republished with
    other bytes (a trainer rollback) is another base."""
    codec: str
    """How ``model.delta`` encodes each tensor: ``xor-zstd`` (``weights/delta.py``)."""


@dataclass
class AdapterBase(JsonRecord):
    """The base model a LoRA adapter version applies to (``WeightManifest.adapter``)."""

    path: str
    """The base model's folder, as the run's config names it (``model.path`` resolved)."""
    hash: str
    """``xxh3_128:<hex>`` of the base's weight files (``model.base_hash``, written at launch); a reader whose base
    differs must not apply the adapter."""


@dataclass
class WeightManifest(JsonRecord):
    """``weights/vNNNNNN/manifest.json``. Written by the trainer (rank 0) last; read by rollout
    jobs before and while they load the version, and by the trainer's retention/withdraw."""

    param_version: int
    """Policy version: 0 = initial model, +1 per K local updates, and +1 when the trainer
    re-publishes its current weights because its newest version was found damaged."""
    trainer_step: int
    """Local updates the trainer had made when it published this version."""
    consumed_groups: int
    """Groups the trainer had consumed (trained or dropped) when it published this
    version, less those its dynamic sampling dropped (``algorithm.filter_groups``: their places are given back as
    they drop, ``control/filtered_groups.json``). The rollout fleet's admission budget for this version is counted
    from here."""
    files: dict[str, FileEntry]
    """File name (``model.safetensors`` or ``model.delta``, ``config.json``, ...) -> size and hash; a reader
    verifies every one before the version is used."""
    tensors: list[TensorEntry]
    """What ``model.safetensors`` holds (informational: the file's own header is what is read); for a delta
    version, what the reader rebuilds (dtype, shape and hash of each tensor)."""
    total_bytes: int
    """Sum of ``files[*].size_bytes``."""
    published_s: float
    """Unix time the manifest was written."""
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    """Tied tensors stored once: name -> the stored name it shares storage with."""
    base: Optional[DeltaBase] = None
    """Set for a delta version (``model.delta`` instead of ``model.safetensors``); None for a full one."""

    @property
    def base_version(self) -> Optional[int]:
        """The full version a delta version was written against; None for a full version."""
        return self.base.version if self.base is not None else None
    adapter: Optional[AdapterBase] = None
    """Set for a LoRA adapter version (``actor.lora_rank``): the folder holds ``adapter_model.safetensors`` and
    ``adapter_config.json`` (peft's layout: tensors under peft's saved names) instead of ``model.safetensors``
    and ``config.json``, to be applied to this base. None: full weights."""



@dataclass
class BadVersionMarker(JsonRecord):
    """``weights/vNNNNNN/bad.json``: the version is damaged. Written by the rollout job that
    found it; read by every rollout job (skip it), the trainer (publish a new version) and
    retention (it is not an intact version)."""

    param_version: int
    writer: str
    """The rollout job's writer name (``w000``) that found the damage."""
    reason: str
    """What was wrong (``model.safetensors: 1234 bytes, manifest says 1244``)."""
    time_s: float
    """Unix time the damage was found."""
