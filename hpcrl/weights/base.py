"""The weight transport: how the trainer hands a policy version to rollout jobs.

One interface, one file per backend (``filesystem.py``; ``broadcast.py`` adds a bucketed
broadcast on top of it). The trainer and the rollout job call only these methods; they get
their transport from :func:`hpcrl.weights.make_transport` (``weights.transport``).

Who calls what:

==========================  =========  ==================================================
method                      caller     what it promises
==========================  =========  ==================================================
publish                     trainer    version ``v`` exists for readers only once complete
withdraw_after              trainer    versions > ``v`` are gone (resume from a checkpoint)
retain                      trainer    old versions deleted, never one a live reader pins,
                                       never the newest intact one
is_bad                      trainer    a reader found version ``v`` damaged: publish again
published_versions          both       complete versions, oldest first (bad ones included)
newest_usable               rollout    newest complete version not marked bad
load / load_newest          rollout    verified before ``apply`` sees a byte; a damaged
                                       version is marked bad and never returned again
pin / unpin                 rollout    (inside load) the loading announcement that keeps
                                       retention from deleting the version mid-read
==========================  =========  ==================================================
"""
from __future__ import annotations

import abc
import logging
from pathlib import Path
from typing import Callable, Optional

import torch

from hpcrl.config import TimeoutsConfig, WeightsConfig
from hpcrl.run_dir import RunDir
from hpcrl.weights.manifest import WeightManifest

log = logging.getLogger(__name__)

Apply = Callable[[dict[str, torch.Tensor], Optional[Path]], None]
"""Receives a verified state dict (HF names, tied aliases restored) and the folder it was read
from (None for a transport without files), and loads it into the engine. The tensors, and the
folder's protection from retention, are only valid during the call."""


class WeightVersionGone(Exception):
    """The version was deleted (retention, trainer rollback) between discovery and load:
    pick the newest again."""


class WeightVersionBad(Exception):
    """The version is damaged (torn file, flipped bytes, unreadable manifest). It has been
    marked bad; the loader falls back to an older intact version."""


class WeightTransport(abc.ABC):
    """Publishes policy versions (trainer) and loads them (rollout jobs). See the module table."""

    name: str = ""
    """The ``weights.transport`` value that selects this backend."""
    last_publish: dict = {}
    """Trainer: metrics of the last :meth:`publish` (``hpcrl.metric_names``: path, seconds, bytes)."""
    last_load: dict = {}
    """Rollout: metrics of the last :meth:`load` (path, transfer and apply seconds, bytes)."""

    @classmethod
    @abc.abstractmethod
    def from_config(cls, cfg: WeightsConfig, run_dir: RunDir,
                    timeouts: Optional[TimeoutsConfig] = None) -> "WeightTransport":
        """The backend as the jobs of the run in ``run_dir`` use it (``timeouts``: the run's deadlines)."""

    # ---- trainer side
    @abc.abstractmethod
    def publish(self, version: int, state_dict: dict[str, torch.Tensor], model_config_json: str,
                trainer_step: int, consumed_groups: int) -> WeightManifest:
        """Make ``version`` (HF-named ``state_dict`` plus the model's ``config.json``) available;
        readers see it whole or not at all. FileExistsError if it is already published."""

    @abc.abstractmethod
    def withdraw_after(self, version: int) -> list[int]:
        """Remove every published version newer than ``version`` (the trainer resumed from a
        checkpoint at ``version``; what it published after is re-published from the restored
        model). Returns the removed versions."""

    @abc.abstractmethod
    def retain(self, heartbeat_stale_s: float) -> list[int]:
        """Delete old versions: keep the newest ``weights.keep_versions``, the newest intact
        one, and any a live reader (heartbeat fresher than ``heartbeat_stale_s``) has pinned.
        Returns the deleted versions."""

    @abc.abstractmethod
    def is_bad(self, version: int) -> bool:
        """Whether a reader has marked ``version`` damaged."""

    # ---- both sides
    @abc.abstractmethod
    def published_versions(self) -> list[int]:
        """Complete versions, oldest first (versions marked bad included)."""

    @abc.abstractmethod
    def read_manifest(self, version: int) -> Optional[WeightManifest]:
        """The manifest of ``version``; None if it is not published; WeightVersionBad if unreadable."""

    # ---- rollout side
    @abc.abstractmethod
    def pin(self, writer: str, version: int) -> None:
        """Announce that ``writer`` is loading ``version``: retention must not delete it."""

    @abc.abstractmethod
    def unpin(self, writer: str, version: int) -> None:
        """``writer`` has finished with ``version`` (loaded it, or gave up on it)."""

    @abc.abstractmethod
    def mark_bad(self, version: int, writer: str, reason: str) -> None:
        """Record that ``version`` is damaged so no reader loads it again and the trainer republishes."""

    @abc.abstractmethod
    def load(self, version: int, writer: str, apply: Optional[Apply] = None
             ) -> tuple[WeightManifest, dict[str, torch.Tensor]]:
        """Pin ``version``, read and verify it, hand it to ``apply``, unpin. Without ``apply`` the
        returned state dict holds the tensors (else it is empty). WeightVersionGone if it
        vanished; WeightVersionBad (after :meth:`mark_bad`) if it is damaged."""

    def newest_usable(self) -> Optional[int]:
        """Newest published version not marked bad; None if there is none."""
        for v in reversed(self.published_versions()):
            if not self.is_bad(v):
                return v
        return None

    def load_newest(self, writer: str, apply: Optional[Apply] = None) -> Optional[WeightManifest]:
        """Load the newest usable version into ``apply``; a damaged one is marked bad and the next
        older intact one is tried; a vanished one makes it look again. None if no usable version
        is left (wait for the trainer to publish one)."""
        while True:
            v = self.newest_usable()
            if v is None:
                return None
            try:
                manifest, _ = self.load(v, writer, apply)
                return manifest
            except WeightVersionGone as e:
                log.warning("%s; picking the newest again", e)
            except WeightVersionBad as e:
                log.error("%s; falling back to the newest intact version", e)

    def close(self) -> None:
        """Stop this transport's background threads, waiting for them (bounded); safe to call twice.
        The jobs call it at exit; files-only transports have nothing to stop."""
