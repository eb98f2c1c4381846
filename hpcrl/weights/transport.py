"""A weight transport: the fast path a committed version may also take to its readers (PRIME-RL's transport base).

The durable version store (``publisher.py``, ``subscriber.py`` on ``folders.py``: every version committed as files,
retention, withdrawal, bad markers, pins, deltas) is the same for every run and is not a transport's business. A
transport only moves a version the store has already committed, faster than the files: a :class:`TransportSender`
on trainer rank 0 and a :class:`TransportReceiver` on each reader, in one file of its own, named by one entry of
``config/registries.py:WEIGHT_TRANSPORTS`` (``filesystem`` has none: the files alone). The store calls them:

==================  ==========  =============================================================================
method              side        what it promises
==================  ==========  =============================================================================
start               sender      before the first publish (and again at a resumed trainer's start): announce
send                sender      after ``version``'s files are committed: move it to the readers that can take
                                it; :class:`Sent` says how many did (0: they read the files)
waiting_members     sender      readers that will take the next version this way
receive             receiver    ``version`` as it came this way (:class:`Received`), or None: read the files.
                                The store pins the folder and checks the copy belongs to the committed version
                                (its manifest's ``published_s``) before the caller sees it
close               both        stop the transport's threads, waiting for them (bounded); safe to call twice
==================  ==========  =============================================================================

A transport that fails, times out or falls behind costs a version's speed, never the version: the files have it.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from hpcrl.weights.base import MappedBuffer
from hpcrl.weights.manifest import WeightManifest

FILES = "filesystem"
"""The path of a version that came from the files (:attr:`Sent.path`, ``WeightVersion.path``)."""


@dataclass
class Sent:
    """What a sender did with one version."""

    path: str = FILES
    """The transport's name if at least one reader took the version this way, else :data:`FILES`."""
    members: int = 0
    """Readers that acknowledged the version."""
    transfer_s: float = 0.0
    nbytes: int = 0
    """Bytes sent (0: none)."""
    backend: str = ""
    """How the bytes went (the broadcast's ``gloo`` or ``nccl``; empty if the transport has no choice)."""


@dataclass
class Received:
    """A version's tensors as a receiver got them."""

    state: dict[str, torch.Tensor]
    """Every tensor under its HF name, tied aliases restored; valid until :attr:`release` is called."""
    published_s: float
    """The ``published_s`` of the manifest the sender sent it after (the store compares it with the one on disk)."""
    path: str
    """The transport's name (``WeightVersion.path``)."""
    transfer_s: float
    nbytes: int
    mapped: Optional[MappedBuffer] = None
    """Set when ``state`` lies in one shared-memory file that engine workers can map."""
    _release: Optional[Callable[[], None]] = field(default=None, repr=False)

    def release(self) -> None:
        """Give the buffers back (the tensors are invalid afterwards)."""
        if self._release is not None:
            self._release()


class TransportSender(abc.ABC):
    """Trainer rank 0's side of a transport (module table)."""

    @classmethod
    @abc.abstractmethod
    def from_config(cls, cfg, run_dir, timeouts) -> "TransportSender":
        """Built from ``weights.*`` (a WeightsConfig), the RunDir and the run's TimeoutsConfig."""

    def start(self) -> None:
        """Announce this trainer to the readers (a rendezvous); called before every publish, so do it once."""

    @abc.abstractmethod
    def send(self, version: int, host_tensors: dict[str, torch.Tensor], device_tensors: dict[str, torch.Tensor],
             aliases: dict[str, str], manifest: WeightManifest) -> Sent:
        """Move the committed ``version`` (each storage once: ``host_tensors`` in host memory, ``device_tensors`` where
        the trainer holds them, which may be the same; ``aliases``: tied names -> stored names; ``manifest``: the one
        written)."""

    def waiting_members(self) -> int:
        """Readers that will take the next version this way."""
        return 0

    def close(self) -> None:
        """Stop the transport's threads (bounded); safe to call twice."""


class TransportReceiver(abc.ABC):
    """A reader's side of a transport (module table)."""

    @classmethod
    @abc.abstractmethod
    def from_config(cls, cfg, run_dir, reader: str, timeouts, device: str) -> "TransportReceiver":
        """Built from ``weights.*``, the RunDir, the reader's name (``w000``, ``eval``), the run's TimeoutsConfig and
        where its engine wants the tensors (``cpu``, ``cuda``)."""

    @abc.abstractmethod
    def receive(self, version: int) -> Optional[Received]:
        """``version`` as it came this way (waiting a bounded while for one due), or None: the store reads the
        files."""

    def close(self) -> None:
        """Stop the transport's threads (bounded); safe to call twice."""
