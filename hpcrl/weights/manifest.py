"""The weight-version manifest: what makes ``weights/vNNNNNN/`` complete.

Written by the trainer, last, after the folder's files are durable and the folder
is renamed into place; read by rollout jobs. A version folder without
``manifest.json`` does not exist for readers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class TensorEntry:
    name: str
    dtype: str
    shape: list[int]


@dataclass
class WeightManifest:
    param_version: int
    """Policy version: 0 = initial model, +1 per K local updates."""
    trainer_step: int
    """Local updates the trainer had made when it published this version."""
    consumed_groups: int
    """Groups the trainer had consumed (trained or dropped) when it published this
    version. The admission budget of the rollout fleet is counted from here."""
    files: dict[str, dict]
    """File name -> {"size_bytes": int, "sha256": str} for every file in the folder."""
    tensors: list[TensorEntry]
    total_bytes: int
    published_s: float
    """Unix time the manifest was written."""
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    """Tied tensors stored once: name -> the stored name it shares storage with."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "WeightManifest":
        d = dict(d)
        d["tensors"] = [TensorEntry(**t) for t in d["tensors"]]
        return cls(**d)
