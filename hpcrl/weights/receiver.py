"""A reader's side of the weight broadcast (``broadcast.py`` tells the protocol): a thread that joins
the trainer's group through the rendezvous, follows its publishes, receives the versions it is a
member of into one flat buffer each, acknowledges them, and keeps the newest until the subscriber
takes it.

What it waits for: the trainer's headers (polled every ``POLL_S``), a receive (``broadcast_s``).
When the trainer dies, the store is lost: the thread logs it and joins again once a trainer
publishes a new rendezvous epoch; meanwhile every version comes from files.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch

from hpcrl.process.threads import Tracked, spawn
from hpcrl.rundir.paths import RunDir
from hpcrl.weights.base import MappedBuffer
from hpcrl.weights.group import BroadcastFailed, call_with_deadline, first_line, gloo_interface, group_device, \
    make_group
from hpcrl.weights.rendezvous import connect_store, join, read_rendezvous, read_secret
from hpcrl.weights.shared_memory import receive_buffer
from hpcrl.weights.wire import BEAT_S, POLL_S, BroadcastHeader, Entry, StoreKeys, recv_buckets, views

log = logging.getLogger(__name__)

MAX_FAILURES = 2
"""Failed receives in a row after which a rollout job stops joining this trainer (each one costs the
trainer up to ``timeouts.broadcast_s``); it joins again when a new trainer publishes a rendezvous."""


@dataclass
class Staged:
    """A version received by broadcast, waiting for :meth:`~hpcrl.weights.broadcast.BroadcastReceiver.receive`."""

    header: BroadcastHeader
    state: dict[str, torch.Tensor]
    flat: torch.Tensor
    shm_path: Optional[str]
    """The shared-memory file ``flat`` lives in (None: private or GPU memory)."""
    transfer_s: float

    def mapped(self) -> Optional[MappedBuffer]:
        """The buffer as engine workers map it (every name, aliases included), if it is a shared file."""
        if self.shm_path is None:
            return None
        rows = {e.name: e for e in self.header.tensors}
        layout = list(rows.values()) + [Entry(a, rows[s].dtype, rows[s].shape, rows[s].offset_bytes, rows[s].nbytes)
                                        for a, s in self.header.aliases.items()]
        return MappedBuffer(self.shm_path, self.flat.numel(), layout)


class Receiver:
    """A subscriber's thread: joins the trainer's group and receives the versions it is a member of."""

    def __init__(self, run_dir: RunDir, reader: str, device: str, connect_s: float, broadcast_s: float):
        self.run_dir, self.reader, self.device = run_dir, reader, device
        self.connect_s, self.broadcast_s = connect_s, broadcast_s
        self.cond = threading.Condition()
        self.staged: Optional[Staged] = None
        self.spare: Optional[tuple[torch.Tensor, Optional[str]]] = None  # a buffer the engine is done with
        self.receiving: Optional[int] = None  # version in flight
        self.seen_version = -1  # newest version whose header this receiver has read
        self.joined = False
        self.store = self.rdv = self.group = None
        self.gen = -1
        self.interface: Optional[str] = None  # gloo's device: the route to the trainer (group.gloo_interface)
        self.ticket = self.first_seq = 0
        self.failed_epoch: Optional[str] = None  # do not join this epoch again
        self.failures = 0  # failed receives in a row in this epoch
        self._stop = threading.Event()
        self._worker: Optional[Tracked] = None

    def join_now(self) -> None:
        """Read the rendezvous record and run the handshake; BroadcastFailed / BroadcastRefused."""
        rdv = read_rendezvous(self.run_dir)
        if rdv is None:
            raise BroadcastFailed(f"no broadcast rendezvous in {self.run_dir.broadcast_rendezvous}")
        secret = read_secret(self.run_dir)
        store = connect_store(rdv, self.connect_s, self.run_dir)
        self.ticket, self.first_seq = join(store, rdv, secret, self.reader, self.device, self.connect_s, self.run_dir)
        self.store, self.rdv, self.joined, self.group, self.gen = store, rdv, True, None, -1
        self.interface, why = gloo_interface([rdv.host])
        log.info("joined the weight broadcast at %s as ticket %d (member from publish %d on); gloo on %s", rdv.address,
                 self.ticket, self.first_seq, why)

    def start(self) -> "Receiver":
        """Follow the trainer's publishes on a thread."""
        # once stopped, it may be in a receive (broadcast_s) or a join (connect, hello, proof)
        bound_s = max(self.broadcast_s, 4 * self.connect_s + 1.0) + 1.0
        self._worker = spawn(self._run, "broadcast-receiver", bound_s, self._stop)
        return self

    def _run(self) -> None:
        """Follow the trainer's publishes; after a loss, join again once the trainer publishes a new
        rendezvous epoch (a restarted trainer), or at once if it only dropped us."""
        while not self._stop.is_set():
            if not self.joined:
                rdv = read_rendezvous(self.run_dir)
                if rdv is None or rdv.epoch == self.failed_epoch:
                    self._stop.wait(max(self.connect_s, 1.0))
                    continue
                try:
                    self.join_now()
                except BroadcastFailed as e:
                    log.warning("weight broadcast: %s; versions come from files", e)
                    self.failed_epoch = rdv.epoch
                    continue
            self._follow()

    def _follow(self) -> None:
        """Receive every publish we are a member of until the store is lost or we were dropped."""
        seen_seq, next_beat = 0, 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_beat:  # the trainer drops a member that stops beating
                    next_beat = time.monotonic() + BEAT_S
                    self.store.add(StoreKeys.alive(self.ticket), 1)
                latest = int(self.store.get(StoreKeys.LATEST)) if self.store.check([StoreKeys.LATEST]) else 0
                if latest <= seen_seq:
                    self._stop.wait(POLL_S)
                    continue
                seen_seq = latest
                header = BroadcastHeader.from_json(json.loads(self.store.get(StoreKeys.header(latest))))
            except Exception as e:  # noqa: BLE001 - the trainer's store is gone (or speaks another format)
                return self._lost(f"lost the broadcast store at {self.rdv.address} ({type(e).__name__}); "
                                  "the trainer died or restarted", epoch_dead=True)
            if latest >= self.first_seq and self.ticket not in header.members:
                return self._lost("the trainer dropped this job from the broadcast group", epoch_dead=False)
            if self.ticket in header.members:
                if not self._receive(header):
                    return
            else:
                with self.cond:
                    self.seen_version = header.version
                    self.cond.notify_all()

    def _buffer(self, header: BroadcastHeader) -> tuple[torch.Tensor, Optional[str]]:
        """Where the stream lands: the spare buffer if it fits, else a new one (shared memory for gloo,
        the GPU for nccl)."""
        with self.cond:
            spare, self.spare = self.spare, None
        device = group_device(header.backend)
        if spare is not None and spare[0].numel() == header.total_bytes and spare[0].device.type == device:
            return spare
        if device == "cuda":
            return torch.empty(header.total_bytes, dtype=torch.uint8, device="cuda"), None
        return receive_buffer(header.total_bytes)

    def _receive(self, header: BroadcastHeader) -> bool:
        """Receive one version (True), or log why not and leave the group (False)."""
        with self.cond:
            self.receiving, self.seen_version = header.version, header.version
            self.cond.notify_all()
        rank, world = header.members.index(self.ticket) + 1, len(header.members) + 1
        t0 = time.monotonic()
        try:
            def transfer():
                if header.gen != self.gen:
                    self.group = make_group(self.store, StoreKeys.group(self.rdv.epoch, header.gen), rank, world,
                                            self.broadcast_s, header.backend, self.interface)
                    self.gen = header.gen
                flat, path = self._buffer(header)
                recv_buckets(self.group, header.tensors, header.total_bytes, header.bucket_bytes, flat)
                return flat, path

            flat, path = call_with_deadline(transfer, self.broadcast_s, f"receiving weight version {header.version} "
                                            f"from the trainer at {self.rdv.address} as rank {rank}/{world} "
                                            f"(run {self.run_dir.root})")
            transfer_s = time.monotonic() - t0
            self.store.set(StoreKeys.ack(header.seq, self.ticket), "1")
        except Exception as e:  # noqa: BLE001 - dead trainer, timeout: the files have the version
            with self.cond:
                self.receiving = None
                self.cond.notify_all()
            self._lost(f"broadcast of weight version {header.version} failed: {first_line(e)}; taking it from files",
                       epoch_dead=False)
            return False
        self.failures = 0
        log.info("received weight version %d by broadcast over %s in %.2fs (%s)", header.version, header.backend,
                 transfer_s, header.backend_why or "the trainer gave no reason")
        staged = Staged(header, views(flat, header.tensors, header.aliases), flat, path, transfer_s)
        with self.cond:
            self.staged, self.receiving = staged, None
            self.cond.notify_all()
        return True

    def _lost(self, why: str, epoch_dead: bool) -> None:
        log.warning("weight broadcast: %s (run %s)", why, self.run_dir.root)
        self.joined, self.group = False, None
        self.failures = 0 if epoch_dead else self.failures + 1
        if epoch_dead or self.failures >= MAX_FAILURES:  # wait for a new trainer instead of costing this one
            self.failed_epoch = self.rdv.epoch

    def take(self, version: int) -> Optional[Staged]:
        """The staged ``version``, waiting while its header is due (``broadcast_connect_s``) or it is in
        flight (``broadcast_s``); None if it will not come by broadcast."""
        header_due = time.monotonic() + self.connect_s
        with self.cond:
            while True:
                if self.staged is not None and self.staged.header.version == version:
                    staged, self.staged = self.staged, None
                    return staged
                if self.receiving == version:
                    self.cond.wait(self.broadcast_s)  # the receive itself ends within broadcast_s
                    continue
                if not self.joined or self.seen_version >= version or time.monotonic() > header_due:
                    return None
                self.cond.wait(POLL_S)

    def recycle(self, staged: Staged) -> None:
        """``staged``'s buffer is no longer read by anyone: the next receive of the same size reuses it."""
        with self.cond:
            self.spare = (staged.flat, staged.shm_path)

    def close(self) -> None:
        """Stop the thread and wait for it (a receive in flight ends at its deadline)."""
        if self._worker is not None:
            self._worker.stop_and_wait()
