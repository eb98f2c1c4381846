"""The records both sides of the weight store share: what a publish did (:class:`Published`), a version a reader took
(:class:`WeightVersion`, with its tensors and how it came), a shared-memory buffer engine workers map
(:class:`MappedBuffer`), and the two ways a take fails (:class:`WeightVersionGone`, :class:`WeightVersionBad`). What a
call did comes back in a record, never through state left on the object.

The store itself is ``publisher.py`` (trainer rank 0) and ``subscriber.py`` (every reader) on ``folders.py``; a
transport's fast path is ``transport.py``'s interface, one file per transport (``broadcast.py``); ``registry.py``
builds the store with the transport ``weights.transport`` names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from hpcrl.logs import metric_names as M
from hpcrl.weights.manifest import WeightManifest
from hpcrl.weights.wire import Entry



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
    """How it arrived: ``filesystem``, or the transport's name (``broadcast``)."""
    transfer_s: float
    """Seconds to get it here: reading and verifying the files, or the transport's receive."""
    nbytes: int
    mapped: Optional[MappedBuffer] = None
    """Set when the tensors lie in one shared-memory file (a broadcast received into ``/dev/shm``, a rebuilt delta)."""
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
    """The transport's name (``broadcast``) if at least one reader took the version by it, else ``filesystem``."""
    transfer_s: float = 0.0
    """Seconds of the transport's send (0 without one)."""
    members: int = 0
    """Readers that acknowledged the version by the transport."""
    sent_bytes: int = 0
    """Bytes the transport sent (0 without one)."""
    backend: str = ""
    """How the transport sent them (the broadcast group's ``gloo`` or ``nccl``; empty without one)."""

    def metrics(self) -> dict:
        """The trainer's sync columns (``hpcrl.logs.metric_names``): path, seconds, bytes, throughput."""
        nbytes, seconds = ((self.sent_bytes, self.transfer_s) if self.path != "filesystem"
                           else (self.manifest.total_bytes, self.files_s))
        return {M.WEIGHTS_PATH: self.path, M.PARAM_SYNC_FILES_S: self.files_s, M.PARAM_SYNC_TRANSFER_S: self.transfer_s,
                M.WEIGHTS_MEMBERS: self.members, M.WEIGHTS_BYTES: nbytes,
                M.WEIGHTS_GB_PER_S: nbytes / max(seconds, 1e-9) / 1e9}
