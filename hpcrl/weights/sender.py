"""The trainer's side of the weight broadcast (``broadcast.py`` tells the protocol): the store, the
admission thread that runs each joiner's handshake and watches the members' beats, and the
broadcast of each published version to the members present.

What it waits for, each with a deadline: a joiner's handshake (``broadcast_connect_s`` per step),
the group's formation, the buckets and the acknowledgements (``broadcast_s`` together). A member
that misses it is dropped and reads that version from files; the trainer goes on.
"""
from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Optional

import torch

from hpcrl.process.threads import spawn
from hpcrl.rundir.paths import RunDir
from hpcrl.weights.group import backend_choice, call_with_deadline, first_line, gloo_interface, group_device, \
    make_group
from hpcrl.weights.manifest import WeightManifest
from hpcrl.weights.rendezvous import Admitted, admit_one, connect_store, put_record, read_secret, start_store
from hpcrl.weights.transport import FILES, Sent
from hpcrl.weights.wire import BEAT_S, POLL_S, BroadcastHeader, StoreKeys, plan, send_buckets

log = logging.getLogger(__name__)


class Sender:
    """Trainer rank 0: the store, the admission thread and the broadcast of each publish."""

    def __init__(self, run_dir: RunDir, bucket_bytes: int, connect_s: float, broadcast_s: float, backend: str):
        self.run_dir, self.bucket_bytes, self.connect_s, self.broadcast_s = run_dir, bucket_bytes, connect_s, broadcast_s
        self.backend = backend  # as configured: auto, gloo or nccl
        self.secret = read_secret(run_dir)
        self.store, self.rdv = start_store(run_dir, broadcast_s)
        self.lock = threading.Lock()
        self.seq = 0
        self.members: list[Admitted] = []  # in the next publish (guarded by lock)
        self.last_sign: dict[int, float] = {}  # ticket -> monotonic time its alive counter last moved (lock)
        self.stale_s = max(4 * BEAT_S, connect_s)  # no sign of life for this long: gone, not waited for
        self.group, self.group_key, self.gen = None, None, 0
        self.buffers: Optional[list[torch.Tensor]] = None  # the two pack buffers, kept across versions
        self._stop = threading.Event()
        # once stopped, it may be in one handshake (two waits) and the store connection
        self._worker = spawn(self._admit_loop, "broadcast-admission", 2 * connect_s + 2.0, self._stop)
        log.info("weight broadcast store listening at %s (epoch %s, backend %s), published in %s", self.rdv.address,
                 self.rdv.epoch, backend, run_dir.broadcast_rendezvous)

    def _admit_loop(self) -> None:
        """Handshake every new ticket (serially; a silent joiner costs ``broadcast_connect_s``). Runs on
        its own store connection until the process ends."""
        try:
            client = connect_store(self.rdv, self.connect_s, self.run_dir)
            seen, beats, next_look = 0, {}, 0.0
            while not self._stop.is_set():
                n = client.add(StoreKeys.JOINERS, 0)
                for ticket in range(seen + 1, n + 1):
                    if self._stop.is_set():
                        return
                    admit_one(client, ticket, self.secret, self.rdv.epoch, self._admit, self.connect_s, self.run_dir,
                              refuse=self._refuse)
                seen = n
                if time.monotonic() >= next_look:
                    next_look = time.monotonic() + BEAT_S
                    self._look_for_signs_of_life(client, beats)
                self._stop.wait(POLL_S)
        except Exception as e:  # noqa: BLE001 - nobody joins from now on: versions go by files only
            log.error("weight broadcast: admission stopped (run %s): %s; rollout jobs use the files",
                      self.run_dir.root, e)

    def _refuse(self, who: Admitted) -> Optional[str]:
        if self.backend == "nccl" and who.device != "cuda":
            return (f"weights.broadcast_backend=nccl, but it receives into {who.device} memory (an engine that "
                    "holds its weights on the GPU can take nccl; set weights.broadcast_backend=auto or gloo)")
        return None

    def _admit(self, who: Admitted) -> int:
        with self.lock:
            self.members.append(who)
            self.last_sign[who.ticket] = time.monotonic()
            return self.seq + 1

    def _look_for_signs_of_life(self, client, beats: dict[int, int]) -> None:
        """Note which members' receivers bumped their alive counter since the last look."""
        with self.lock:
            tickets = [m.ticket for m in self.members]
        for t in tickets:
            count = client.add(StoreKeys.alive(t), 0)
            if beats.get(t) != count:
                beats[t] = count
                with self.lock:
                    self.last_sign[t] = time.monotonic()

    def _drop_silent(self, version: int) -> None:
        """Drop members whose receiver has shown no sign of life for ``stale_s`` (a job killed between
        publishes): forming the group with them would cost ``broadcast_s``."""
        now = time.monotonic()
        with self.lock:
            silent = [m for m in self.members if now - self.last_sign.get(m.ticket, now) > self.stale_s]
        self._drop(silent, f"no sign of life for over {self.stale_s:.0f}s before weight version {version} (the job "
                           "died or hangs)")

    def waiting_members(self) -> int:
        """Members admitted so far (they receive from the next publish on)."""
        with self.lock:
            return len(self.members)

    def send(self, version: int, host_tensors: dict[str, torch.Tensor], device_tensors: dict[str, torch.Tensor],
             aliases: dict[str, str], manifest: WeightManifest) -> Sent:
        """Broadcast the committed ``version`` to the members (from ``device_tensors`` with NCCL, else from
        ``host_tensors``); what it did."""
        self._drop_silent(version)
        with self.lock:
            self.seq += 1
            seq, members = self.seq, list(self.members)
        sender_device = next(iter(device_tensors.values())).device.type if device_tensors else "cpu"
        backend, why = backend_choice(self.backend, sender_device, {m.peer: m.device for m in members})
        key = (tuple(m.ticket for m in members), backend)
        if key != self.group_key:
            self.group, self.group_key, self.gen = None, key, self.gen + 1
        tensors = device_tensors if backend == "nccl" else host_tensors
        entries, total = plan(tensors)
        header = BroadcastHeader(seq, version, manifest.published_s, self.gen, list(key[0]), backend,
                                 self.bucket_bytes, total, entries, aliases, why)
        peers = ", ".join(m.peer for m in members)
        if members:
            log.info("weight version %d: broadcast over %s to %s (%s)", version, backend, peers, why)
        t0 = time.monotonic()
        put_record(self.store, StoreKeys.header(seq), header)  # also without members: a new joiner learns the version
        self.store.set(StoreKeys.LATEST, str(seq))
        if not members:
            return Sent(backend=backend)
        try:
            call_with_deadline(lambda: self._transfer(tensors, header, len(members) + 1, [m.host for m in members]),
                               self.broadcast_s,
                               f"broadcasting weight version {version} to {peers} over {backend} "
                               f"(run {self.run_dir.root})")
            transfer_s = time.monotonic() - t0
            left = max(self.broadcast_s - transfer_s, 0.1)
            self.store.wait([StoreKeys.ack(seq, m.ticket) for m in members], timedelta(seconds=left))
        except Exception as e:  # noqa: BLE001 - a dead or slow peer: the files have the version
            log.warning("broadcast of weight version %d to %s failed (run %s): %s; rollout jobs take it from files",
                        version, peers, self.run_dir.root, first_line(e))
            self.group, self.buffers = None, None  # an abandoned transfer thread may still hold them
            transfer_s = time.monotonic() - t0
        acked = [m for m in members if self.store.check([StoreKeys.ack(seq, m.ticket)])]
        with self.lock:  # an ack is a sign of life (a long receive does not beat)
            self.last_sign.update({m.ticket: time.monotonic() for m in acked})
        self._drop([m for m in members if m not in acked],
                   f"no acknowledgement of weight version {version} in {self.broadcast_s:.0f}s")
        if seq > 2:
            self.store.delete_key(StoreKeys.header(seq - 2))
        return Sent("broadcast" if acked else FILES, len(acked), transfer_s, total if acked else 0, backend)

    def _transfer(self, tensors, header: BroadcastHeader, world: int, hosts: list[str]) -> None:
        if self.group is None:
            interface, why = gloo_interface(hosts)
            log.info("forming the weight broadcast group of generation %d (%d members) over %s; gloo on %s",
                     header.gen, world - 1, header.backend, why)
            self.group = make_group(self.store, StoreKeys.group(self.rdv.epoch, header.gen), 0, world,
                                    self.broadcast_s, header.backend, interface)
        self.buffers = send_buckets(self.group, tensors, header.tensors, header.total_bytes, header.bucket_bytes,
                                    self.buffers, group_device(header.backend))

    def _drop(self, dropped: list[Admitted], why: str) -> None:
        """Leave ``dropped`` out of the group from the next publish on (logged with ``why``)."""
        if not dropped:
            return
        log.warning("dropping broadcast peers %s: %s; the group is re-formed at the next version (they load from "
                    "files, and join again if alive)", ", ".join(m.peer for m in dropped), why)
        with self.lock:
            self.members = [m for m in self.members if m not in dropped]
            for m in dropped:
                self.last_sign.pop(m.ticket, None)
        self.group = None

    def close(self) -> None:
        """Stop admitting and wait for the admission thread (the store closes with the process)."""
        self._worker.stop_and_wait()
