"""The broadcast transport: a committed weight version in fixed-size buckets from trainer rank 0 to the readers that
joined, a faster copy beside the files (:mod:`hpcrl.weights.transport`).

The transport's two sides are here (:class:`BroadcastSender`, :class:`BroadcastReceiver`); the threads that do the
work are ``sender.py`` (trainer) and ``receiver.py`` (reader), on three parts they share: ``rendezvous.py`` (finding
the trainer, the secret handshake), ``group.py`` (the group, its backend, deadlines) and ``wire.py`` (store keys,
the header, the bucketed byte stream).

Every version is still committed as files first by the store (late joiners, restarts, retention, bad markers and
exactly-once are the store's); the broadcast is a faster copy of a *committed* version, never the only one.

Publisher (trainer rank 0), per publish (``seq`` counts publishes of this trainer process)::

    files (manifest = commit) -> header pub/<seq> (BroadcastHeader, wire.py) -> latest=<seq> ->
    (re)form the group if the membership or backend changed -> buckets of ``weights.bucket_mib``,
    double-buffered -> wait for the acks

Membership: a rollout job joins through the secret handshake (``rendezvous.py``) at any time;
it becomes a member at the next publish (a *version boundary*): the group is rebuilt there for
the members present (a new generation = a new ``PrefixStore`` prefix). Until then it takes
versions from files. A member that fails or does not acknowledge within ``timeouts.broadcast_s``
is dropped (logged) and the trainer goes on. Each member's receiver thread bumps a counter in the
store every ``BEAT_S``; a member whose counter has not moved for ``max(4 * BEAT_S,
broadcast_connect_s)`` is dropped before the group is formed, so a rollout job killed between
publishes costs nothing; one that dies within that window before a publish costs at most
``broadcast_s``, once. A dropped member that is alive joins again (a fresh handshake).

Receiver (a rollout job): a receiver thread follows ``latest``; for a header it is a member of,
it receives the buckets straight into one flat buffer (no copy), acknowledges, and keeps the
tensors until :meth:`BroadcastReceiver.receive` asks for that version. ``receive`` waits for a version
whose header is due (``broadcast_connect_s``) or in flight (``broadcast_s``) and hands it to the store, which
checks that the header belongs to the manifest on disk (same ``published_s``), pins the version's folder and
hands over the tensors; anything else (not a member yet, a failed or timed-out broadcast, a dead trainer, a
rollback) takes the files. If the trainer dies mid-broadcast the receiver times out, logs it, and
joins again when a trainer publishes a new rendezvous.

Engines: the receive buffer is a file in the node's shared memory (``shared_memory.py``; private
memory where ``/dev/shm`` cannot hold it), named in the version's ``mapped`` record: vLLM's worker
processes map it and load the tensors in place, so the files are not read; the transformers engine
copies the tensors. The folder stays pinned until the version is released: an engine that cannot
take the tensors reloads from it. With NCCL the buffer is on the receiver's GPU instead.
"""
from __future__ import annotations

import logging
import socket
import time
from typing import Optional

import torch

from hpcrl.config import TimeoutsConfig, WeightsConfig
from hpcrl.rundir.fsio import wait_for
from hpcrl.process import termination
from hpcrl.rundir.paths import RunDir
from hpcrl.weights.group import BroadcastFailed, BroadcastRefused
from hpcrl.weights.manifest import WeightManifest
from hpcrl.weights.receiver import Receiver
from hpcrl.weights.rendezvous import BroadcastRendezvous, describe_rendezvous, is_live, read_rendezvous
from hpcrl.weights.sender import Sender
from hpcrl.weights.transport import Received, Sent, TransportReceiver, TransportSender
from hpcrl.weights.wire import ALIGN_BYTES

log = logging.getLogger(__name__)


def _start(required: bool, what: str, fn):
    """The first attempt at the broadcast side of a job: its result, or None (auto, logged) / raise (required)."""
    try:
        return fn()
    except (BroadcastFailed, OSError, RuntimeError) as e:
        if required or isinstance(e, BroadcastRefused):
            log.error("weights.transport=%s: %s: %s", ("broadcast" if required else "auto"), what, e)
        if required:
            raise BroadcastFailed(f"weights.transport=broadcast: {what}: {e} (set weights.transport=auto to "
                                  "fall back to files)") from None
        log.warning("weights.transport=auto: %s: %s; using files", what, e)
        return None


class BroadcastSender(TransportSender):
    """The trainer's side: the store, the admission thread and a bucketed broadcast of each committed version to the
    readers that joined (module docstring). ``required`` (``weights.transport=broadcast``): a trainer that cannot
    start the broadcast fails with the reason; ``auto``: it logs the reason and publishes files only."""

    def __init__(self, run_dir: RunDir, required: bool, bucket_mib: float, connect_s: float, broadcast_s: float,
                 backend: str = "auto"):
        self.run_dir = run_dir
        self.required, self.connect_s, self.broadcast_s, self.backend = required, connect_s, broadcast_s, backend
        self.bucket_bytes = max(int(bucket_mib * 2**20), ALIGN_BYTES)
        self._sender: Optional[Sender] = None
        self._tried = False

    @classmethod
    def from_config(cls, cfg: WeightsConfig, run_dir: RunDir, timeouts: TimeoutsConfig) -> "BroadcastSender":
        """The sender of ``weights.transport=broadcast`` (required) or ``auto``."""
        return cls(run_dir, cfg.transport == "broadcast", cfg.bucket_mib, timeouts.broadcast_connect_s,
                   timeouts.broadcast_s, cfg.broadcast_backend)

    def start(self) -> None:
        """Start the store and write the rendezvous (a resumed trainer announces its new epoch at once)."""
        if not self._tried:
            self._tried = True
            self._sender = _start(self.required, "starting the broadcast store", lambda: Sender(
                self.run_dir, self.bucket_bytes, self.connect_s, self.broadcast_s, self.backend))

    def send(self, version: int, host_tensors: dict[str, torch.Tensor], device_tensors: dict[str, torch.Tensor],
             aliases: dict[str, str], manifest: WeightManifest) -> Sent:
        if self._sender is None:
            return Sent()
        return self._sender.send(version, host_tensors, device_tensors, aliases, manifest)

    def waiting_members(self) -> int:
        return self._sender.waiting_members() if self._sender is not None else 0

    def close(self) -> None:
        """Stop the admission thread and wait for it (bounded)."""
        if self._sender is not None:
            self._sender.close()


class BroadcastReceiver(TransportReceiver):
    """A reader's side: versions by broadcast where this reader is a member (module docstring). ``required``: a
    reader that cannot join a live trainer at its first receive fails with the reason (one whose rendezvous names a
    dead trainer waits for a live one, bounded); ``auto``: it logs the reason and the store uses files."""

    def __init__(self, run_dir: RunDir, reader: str, required: bool, timeouts: TimeoutsConfig, device: str = "cpu"):
        """``device``: where this reader's engine wants the tensors (``cuda``: it can receive by NCCL)."""
        self.run_dir, self.reader = run_dir, reader
        self.required, self.timeouts, self.device = required, timeouts, device
        self._receiver: Optional[Receiver] = None
        self._tried = False

    @classmethod
    def from_config(cls, cfg: WeightsConfig, run_dir: RunDir, reader: str, timeouts: TimeoutsConfig,
                    device: str = "cpu") -> "BroadcastReceiver":
        """The receiver of ``weights.transport=broadcast`` (required) or ``auto``."""
        return cls(run_dir, reader, cfg.transport == "broadcast", timeouts, device)

    def _live_rendezvous(self) -> Optional[BroadcastRendezvous]:
        rdv = read_rendezvous(self.run_dir)
        return rdv if rdv is not None and is_live(self.run_dir, rdv, self.timeouts.heartbeat_interval_s) else None

    def _wait_for_a_live_trainer(self, deadline_s: float) -> BroadcastRendezvous:
        """Until the rendezvous names a trainer that runs (``rendezvous.is_live``), wait for one, until the
        monotonic ``deadline_s``, saying what is there: both jobs were killed and restarted, or this one started
        while the trainer is down; the resumed trainer re-announces itself at start."""
        t = self.timeouts
        rdv = self._live_rendezvous()
        if rdv is None:
            log.warning("weight broadcast: no live trainer to join yet (%s); waiting up to %.0fs for one",
                        describe_rendezvous(self.run_dir), deadline_s - time.monotonic())
            rdv = wait_for(f"a live trainer's broadcast rendezvous in {self.run_dir.broadcast_rendezvous}",
                           self._live_rendezvous, max(deadline_s - time.monotonic(), 0.0), max(t.poll_interval_s, 0.2),
                           log, t.wait_log_interval_s, describe=lambda: describe_rendezvous(self.run_dir),
                           stop=termination.check)
        return rdv

    def _join_a_live_trainer(self, r: Receiver) -> None:
        """Required mode: join the trainer that runs. A join that fails while that trainer keeps running fails
        the job in one line; one that fails because it just died (it stops beating within three beats) waits
        for its successor, all within ``timeouts.wait_weights_s``."""
        t = self.timeouts
        deadline_s = time.monotonic() + t.wait_weights_s
        while True:
            rdv = self._wait_for_a_live_trainer(deadline_s)
            try:
                return r.join_now()
            except BroadcastRefused:
                raise
            except BroadcastFailed:
                if not self._died(rdv):
                    raise
                log.warning("weight broadcast: the trainer at %s died; waiting for the next one", rdv.address)

    def _died(self, rdv: BroadcastRendezvous) -> bool:
        """After a failed join: whether the trainer of ``rdv`` is gone (on this host: its process; elsewhere: its
        heartbeat stops moving within three beats, or it was alive all along and could not be reached)."""
        interval_s = self.timeouts.heartbeat_interval_s
        end = time.monotonic() + (0.0 if rdv.host == socket.gethostname() else 3 * interval_s + 2.0)
        while True:
            if not is_live(self.run_dir, rdv, interval_s):
                return True
            if time.monotonic() >= end:
                return False
            termination.check()
            time.sleep(0.2)

    def _join_once(self) -> None:
        """At the first receive: join (required: a live trainer, or fail), then follow the publishes on a thread."""
        self._tried = True
        t = self.timeouts
        r = Receiver(self.run_dir, self.reader, self.device, t.broadcast_connect_s, t.broadcast_s)
        _start(self.required, "joining the weight broadcast",
               (lambda: self._join_a_live_trainer(r)) if self.required else r.join_now)
        if not r.joined:  # auto: tried again once a trainer publishes a new rendezvous
            rdv = read_rendezvous(self.run_dir)
            r.failed_epoch = rdv.epoch if rdv is not None else None
        self._receiver = r.start()

    def receive(self, version: int) -> Optional[Received]:
        if not self._tried:
            self._join_once()
        staged = self._receiver.take(version) if self._receiver is not None else None
        if staged is None:
            return None
        receiver = self._receiver
        return Received(staged.state, staged.header.published_s, "broadcast", staged.transfer_s,
                        staged.header.total_bytes, staged.mapped(), _release=lambda: receiver.recycle(staged))

    def close(self) -> None:
        """Stop the receiver thread and wait for it (bounded)."""
        if self._receiver is not None:
            self._receiver.close()
