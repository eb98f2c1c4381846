"""Weights between jobs, by role: a :class:`WeightPublisher` (trainer rank 0) and a
:class:`WeightSubscriber` (every rollout job, and any other reader that follows the versions, such
as an evaluation job). One file per backend holds both sides (``filesystem.py``; ``broadcast.py``
adds a bucketed broadcast on top of the files); ``registry.py`` builds the one ``weights.transport``
names. What a call did comes back in a record (:class:`Published`, :class:`WeightVersion`), never
through state left on the object.

==========================  ==========  ==================================================
method                      side        what it promises
==========================  ==========  ==================================================
publish                     publisher   version ``v`` exists for readers only once complete
withdraw_after              publisher   versions > ``v`` are gone (resume from a checkpoint)
retain                      publisher   old versions deleted, never one a live reader pins,
                                        never the newest intact one
is_bad                      both        a reader found version ``v`` damaged
published_versions          both        complete versions, oldest first (bad ones included)
newest_usable               subscriber  newest complete version not marked bad
take / take_newest          subscriber  pinned and verified before the caller sees a byte; a
                                        damaged version is marked bad and never taken again;
                                        released (unpinned) when the caller is done
load                        subscriber  take + copies of the tensors that outlive the release
==========================  ==========  ==================================================
"""
from __future__ import annotations

import abc
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from hpcrl import metric_names as M
from hpcrl.weights.manifest import AdapterBase, WeightManifest
from hpcrl.weights.wire import Entry

log = logging.getLogger(__name__)


class WeightVersionGone(Exception):
    """The version was deleted (retention, trainer rollback) between discovery and load:
    pick the newest again."""


class WeightVersionBad(Exception):
    """The version is damaged (torn file, flipped bytes, unreadable manifest). It has been
    marked bad; the loader falls back to an older intact version."""


@dataclass
class MappedBuffer:
    """A version's tensors as one flat file in the node's shared memory, which an engine's worker
    processes map instead of receiving the bytes (``hpcrl/rollout/vllm_worker.py``)."""

    path: str
    nbytes: int
    """Size of the file."""
    layout: list[Entry]
    """Every tensor's place in the file; a tied alias is a row of its own pointing at the same bytes."""


@dataclass
class WeightVersion:
    """One version a subscriber took: verified, its folder pinned against retention until :meth:`release`."""

    version: int
    manifest: Optional[WeightManifest]
    """None only for :meth:`in_memory` versions."""
    folder: Optional[Path]
    """The version's folder (``config.json`` + ``model.safetensors``): an engine that loads files reads it.
    None only for :meth:`in_memory` versions."""
    tensors: dict[str, torch.Tensor]
    """Verified tensors under the HF names, tied aliases restored; valid until :meth:`release`."""
    path: str
    """How it arrived: ``filesystem`` or ``broadcast``."""
    transfer_s: float
    """Seconds to get it here: reading and verifying the files, or receiving the broadcast."""
    nbytes: int
    mapped: Optional[MappedBuffer] = None
    """Set when the tensors lie in one shared-memory file (a broadcast received into ``/dev/shm``)."""
    adapter: Optional[dict] = None
    """A LoRA adapter version (``actor.lora_rank``): peft's adapter config (``adapter_config.json``, verified); the
    tensors are then the adapter's under peft's saved names, and ``folder`` is in peft's layout
    (``hpcrl/weights/adapter.py``). None: full weights."""
    _release: Optional[Callable[[], None]] = field(default=None, repr=False)

    @classmethod
    def in_memory(cls, version: int, tensors: dict[str, torch.Tensor], adapter: Optional[dict] = None
                  ) -> "WeightVersion":
        """Tensors handed to an engine directly, with no folder or manifest behind them (tests, benchmarks);
        ``adapter``: peft's config when they are a LoRA adapter's."""
        return cls(version, None, None, tensors, path="memory", transfer_s=0.0,
                   nbytes=sum(t.numel() * t.element_size() for t in tensors.values()), adapter=adapter)

    def release(self) -> None:
        """Unpin the folder and give the buffers back; the tensors are invalid afterwards. Idempotent."""
        done, self._release = self._release, None
        if done is not None:
            done()

    def __enter__(self) -> "WeightVersion":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def metrics(self, apply_s: float) -> dict:
        """The rollout log's columns for this version, with ``apply_s`` seconds for the engine to take it."""
        return {M.WEIGHTS_PATH: self.path, M.LOAD_TRANSFER_S: self.transfer_s, M.LOAD_APPLY_S: apply_s,
                M.WEIGHTS_BYTES: self.nbytes, M.WEIGHTS_GB_PER_S: self.nbytes / max(self.transfer_s, 1e-9) / 1e9}


@dataclass
class Published:
    """What one :meth:`WeightPublisher.publish` did."""

    manifest: WeightManifest
    files_s: float
    """Seconds to write and commit the version's files."""
    path: str = "filesystem"
    """``broadcast`` if at least one member acknowledged the broadcast, else ``filesystem``."""
    transfer_s: float = 0.0
    """Seconds of the broadcast (0 without one)."""
    members: int = 0
    """Broadcast members that acknowledged the version."""
    broadcast_bytes: int = 0
    """Length of the broadcast stream (0 without one)."""
    backend: str = ""
    """The broadcast group's backend for this version (``gloo``, ``nccl``; empty without a broadcast)."""

    def metrics(self) -> dict:
        """The trainer's sync columns (``hpcrl.metric_names``): path, seconds, bytes, throughput."""
        nbytes, seconds = ((self.broadcast_bytes, self.transfer_s) if self.path == "broadcast"
                           else (self.manifest.total_bytes, self.files_s))
        return {M.WEIGHTS_PATH: self.path, M.PARAM_SYNC_FILES_S: self.files_s, M.PARAM_SYNC_TRANSFER_S: self.transfer_s,
                M.WEIGHTS_MEMBERS: self.members, M.WEIGHTS_BYTES: nbytes,
                M.WEIGHTS_GB_PER_S: nbytes / max(seconds, 1e-9) / 1e9}


class WeightPublisher(abc.ABC):
    """Trainer rank 0: makes versions available and keeps the folder tidy (module table)."""

    def start(self) -> None:
        """Announce this trainer to the readers before its first publish (a broadcast's rendezvous: a resumed
        trainer re-announces itself at start, so readers waiting on a dead trainer's record can join). Files-only
        backends have nothing to announce."""

    @abc.abstractmethod
    def publish(self, version: int, state_dict: dict[str, torch.Tensor], model_config_json: str,
                trainer_step: int, consumed_groups: int, model_files: Optional[dict[str, bytes]] = None,
                adapter: Optional[AdapterBase] = None) -> Published:
        """Make ``version`` (HF-named ``state_dict`` plus the model's ``config.json`` and its other files:
        ``model_files``, tokenizer and generation config by name, so the version is a complete HF folder)
        available; readers see it whole or not at all. FileExistsError if it is already published.
        ``adapter``: the version is a LoRA adapter of that base (``state_dict`` the adapter's tensors under peft's
        names, ``model_config_json`` peft's adapter config; ``hpcrl/weights/adapter.py``)."""

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
    def published_versions(self) -> list[int]:
        """Complete versions, oldest first (versions marked bad included)."""

    @abc.abstractmethod
    def is_bad(self, version: int) -> bool:
        """Whether a reader has marked ``version`` damaged."""

    def waiting_members(self) -> int:
        """Readers that will receive the next publish by broadcast (0 for a files-only backend)."""
        return 0

    def close(self) -> None:
        """Stop this publisher's background threads, waiting for them (bounded); safe to call twice."""


class WeightSubscriber(abc.ABC):
    """A reader of versions (module table); ``reader`` is its name in pins and markers (``w000``, ``eval``)."""

    reader: str

    @abc.abstractmethod
    def published_versions(self) -> list[int]:
        """Complete versions, oldest first (versions marked bad included)."""

    @abc.abstractmethod
    def is_bad(self, version: int) -> bool:
        """Whether a reader has marked ``version`` damaged."""

    @abc.abstractmethod
    def read_manifest(self, version: int) -> Optional[WeightManifest]:
        """The manifest of ``version``; None if it is not published; WeightVersionBad if unreadable."""

    @abc.abstractmethod
    def take(self, version: int) -> WeightVersion:
        """Pin ``version``, get and verify it; release it when done. WeightVersionGone if it vanished;
        WeightVersionBad (after marking it bad) if it is damaged."""

    def newest_usable(self) -> Optional[int]:
        """Newest published version not marked bad; None if there is none."""
        for v in reversed(self.published_versions()):
            if not self.is_bad(v):
                return v
        return None

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
        """Stop this subscriber's background threads, waiting for them (bounded); safe to call twice."""
