"""Weight exchange by broadcast in fixed-size buckets, on top of the filesystem path.

Every version is still published as files first (:class:`FilesystemTransport`: late joiners,
restarts, retention, bad markers and exactly-once are unchanged); the broadcast is a faster
copy of a *committed* version, never the only one.

Trainer rank 0, per publish (``seq`` counts publishes of this trainer process)::

    files (manifest = commit) -> header pub/<seq> (JSON: version, published_s, members, tensor
    names/dtypes/shapes/byte offsets, tied aliases) -> latest=<seq> -> (re)form the group if the
    membership changed -> buckets of ``weights.bucket_mb``, double-buffered -> wait for the acks

Membership: a rollout job joins through the secret handshake (``process_group.py``) at any time;
it becomes a member at the next publish (a *version boundary*): the group is rebuilt there for
the members present (a new generation = a new ``PrefixStore`` prefix). Until then it takes
versions from files. A member that fails or does not acknowledge within ``timeouts.broadcast_s``
is dropped (logged) and the trainer goes on. Each member's receiver thread bumps a counter in the
store every ``BEAT_S``; a member whose counter has not moved for ``max(4 * BEAT_S,
broadcast_connect_s)`` is dropped before the group is formed, so a rollout job killed between
publishes costs nothing; one that dies within that window before a publish costs at most
``broadcast_s``, once. A dropped member that is alive joins again (a fresh handshake).

Rollout job: a receiver thread follows ``latest``; for a header it is a member of, it receives
the buckets straight into one flat buffer (no copy), acknowledges, and keeps the tensors until
:meth:`BroadcastTransport.load` asks for that version. ``load`` waits for a version whose header
is due (``broadcast_connect_s``) or in flight (``broadcast_s``), checks that the header belongs
to the manifest on disk (same ``published_s``), pins the version's folder and hands the tensors to
``apply``. Anything else (not a member yet, a failed or timed-out broadcast, a dead trainer, a
rollback) loads the files. If the trainer dies mid-broadcast the receiver times out, logs it, and
joins again when a trainer publishes a new rendezvous.

Engines: the receive buffer is a file in the node's shared memory (``shared_memory.py``; private
memory where ``/dev/shm`` cannot hold it). The transformers engine copies the tensors into its
parameters; vLLM's worker processes map the buffer and load the tensors in place
(``collective_rpc``, ``hpcrl/rollout/vllm_worker.py``), so the version's files are not read. The
folder stays pinned during ``apply``: an engine that cannot take the tensors reloads from it.
"""
from __future__ import annotations

import collections
import json
import logging
import threading
import time
from datetime import timedelta
from typing import Optional

import torch

from hpcrl import metric_names as M
from hpcrl.config import TimeoutsConfig, WeightsConfig
from hpcrl.run_dir import RunDir
from hpcrl.weights.base import Apply
from hpcrl.weights.filesystem import FilesystemTransport, _dedupe_tied
from hpcrl.weights.manifest import WeightManifest
from hpcrl.weights.process_group import (ALIGN_BYTES, Admitted, BroadcastFailed, BroadcastRefused, Entry, admit_one,
                                         call_with_deadline, connect_store, join, make_group, plan, put_json,
                                         read_rendezvous, read_secret, recv_buckets, send_buckets, start_store)
from hpcrl.weights.shared_memory import receive_buffer
from hpcrl.process.threads import Tracked, spawn

log = logging.getLogger(__name__)

POLL_S = 0.02
"""How often a receiver looks for a new header in the store."""
BEAT_S = 0.5
"""How often a member's receiver thread bumps its ``alive/<ticket>`` counter in the store."""
MAX_FAILURES = 2
"""Failed receives in a row after which a rollout job stops joining this trainer (each one costs the
trainer up to ``timeouts.broadcast_s``); it joins again when a new trainer publishes a rendezvous."""


class _Sender:
    """Trainer rank 0: the store, the admission thread and the broadcast of each publish."""

    def __init__(self, run_dir: RunDir, bucket_bytes: int, connect_s: float, broadcast_s: float, backend: str):
        self.run_dir, self.bucket_bytes, self.connect_s, self.broadcast_s = run_dir, bucket_bytes, connect_s, broadcast_s
        self.backend = backend
        self.secret = read_secret(run_dir)
        self.store, self.rdv = start_store(run_dir, broadcast_s)
        self.lock = threading.Lock()
        self.seq = 0
        self.members: list[Admitted] = []  # in the next publish (guarded by lock)
        self.last_sign: dict[int, float] = {}  # ticket -> monotonic time its alive counter last moved (lock)
        self.stale_s = max(4 * BEAT_S, connect_s)  # no sign of life for this long: gone, not waited for
        self.group, self.group_tickets, self.gen = None, (), 0
        self.buffers: Optional[list[torch.Tensor]] = None  # the two pack buffers, kept across versions
        self._stop = threading.Event()
        # once stopped, it may be in one handshake (two waits) and the store connection
        self._worker = spawn(self._admit_loop, "broadcast-admission", 2 * connect_s + 2.0, self._stop)
        log.info("weight broadcast store listening at %s (epoch %s), published in %s", self.rdv.address,
                 self.rdv.epoch, run_dir.broadcast_rendezvous)

    def _admit_loop(self) -> None:
        """Handshake every new ticket (serially; a silent joiner costs ``broadcast_connect_s``). Runs on
        its own store connection until the process ends."""
        try:
            client = connect_store(self.rdv, self.connect_s, self.run_dir)
            seen, beats, next_look = 0, {}, 0.0
            while not self._stop.is_set():
                n = client.add("joiners", 0)
                for ticket in range(seen + 1, n + 1):
                    if self._stop.is_set():
                        return
                    admit_one(client, ticket, self.secret, self.rdv.epoch, self._admit, self.connect_s, self.run_dir)
                seen = n
                if time.monotonic() >= next_look:
                    next_look = time.monotonic() + BEAT_S
                    self._look_for_signs_of_life(client, beats)
                self._stop.wait(POLL_S)
        except Exception as e:  # noqa: BLE001 - nobody joins from now on: versions go by files only
            log.error("weight broadcast: admission stopped (run %s): %s; rollout jobs use the files",
                      self.run_dir.root, e)

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
            count = client.add(f"alive/{t}", 0)
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

    def send(self, version: int, tensors: dict[str, torch.Tensor], aliases: dict[str, str],
             manifest: WeightManifest) -> dict:
        """Broadcast the committed ``version`` to the members; its metrics (path, seconds, bytes)."""
        self._drop_silent(version)
        with self.lock:
            self.seq += 1
            seq, members = self.seq, list(self.members)
        tickets = tuple(m.ticket for m in members)
        if tickets != self.group_tickets:
            self.group, self.group_tickets, self.gen = None, tickets, self.gen + 1
        entries, total = plan(tensors)
        header = {"seq": seq, "version": version, "published_s": manifest.published_s, "gen": self.gen,
                  "members": list(tickets), "bucket_bytes": self.bucket_bytes, "total_bytes": total,
                  "tensors": [[e.name, e.dtype, e.shape, e.offset_bytes, e.nbytes] for e in entries],
                  "aliases": aliases}
        peers = ", ".join(m.peer for m in members)
        t0 = time.monotonic()
        put_json(self.store, f"pub/{seq}", header)  # also without members: a new joiner learns the version
        self.store.set("latest", str(seq))
        if not members:
            return {M.WEIGHTS_PATH: "filesystem", M.WEIGHTS_MEMBERS: 0, M.PARAM_SYNC_TRANSFER_S: 0.0}
        try:
            call_with_deadline(lambda: self._transfer(tensors, entries, total, len(members) + 1),
                               self.broadcast_s, f"broadcasting weight version {version} to {peers} "
                               f"(run {self.run_dir.root})")
            transfer_s = time.monotonic() - t0
            left = max(self.broadcast_s - transfer_s, 0.1)
            self.store.wait([f"pub/{seq}/ack/{t}" for t in tickets], timedelta(seconds=left))
        except Exception as e:  # noqa: BLE001 - a dead or slow peer: the files have the version
            log.warning("broadcast of weight version %d to %s failed (run %s): %s; rollout jobs take it from files",
                        version, peers, self.run_dir.root, str(e).splitlines()[0] if str(e) else type(e).__name__)
            self.group, self.buffers = None, None  # an abandoned transfer thread may still hold them
            transfer_s = time.monotonic() - t0
        acked = [m for m in members if self.store.check([f"pub/{seq}/ack/{m.ticket}"])]
        with self.lock:  # an ack is a sign of life (a long receive does not beat)
            self.last_sign.update({m.ticket: time.monotonic() for m in acked})
        self._drop([m for m in members if m not in acked],
                   f"no acknowledgement of weight version {version} in {self.broadcast_s:.0f}s")
        if seq > 2:
            self.store.delete_key(f"pub/{seq - 2}")
        out = {M.WEIGHTS_PATH: "filesystem", M.WEIGHTS_MEMBERS: len(acked), M.PARAM_SYNC_TRANSFER_S: transfer_s}
        if acked:
            out.update({M.WEIGHTS_PATH: "broadcast", M.WEIGHTS_BYTES: total,
                        M.WEIGHTS_GB_PER_S: total / max(transfer_s, 1e-9) / 1e9})
        return out

    def _transfer(self, tensors, entries, total: int, world: int) -> None:
        if self.group is None:
            self.group = make_group(self.store, f"{self.rdv.epoch}/g{self.gen}", 0, world, self.broadcast_s,
                                    self.backend)
        self.buffers = send_buckets(self.group, tensors, entries, total, self.bucket_bytes, self.buffers)

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


_Staged = collections.namedtuple("_Staged", "version published_s state nbytes transfer_s flat")
"""A version received by broadcast, waiting for :meth:`BroadcastTransport.load`."""


class _Receiver:
    """Rollout job: joins the trainer's group and receives the versions it is a member of (a thread)."""

    def __init__(self, run_dir: RunDir, writer: str, connect_s: float, broadcast_s: float, backend: str):
        self.run_dir, self.writer, self.connect_s, self.broadcast_s = run_dir, writer, connect_s, broadcast_s
        self.backend = backend
        self.cond = threading.Condition()
        self.staged: Optional[_Staged] = None
        self.spare: Optional[torch.Tensor] = None  # a flat buffer the engine is done with, for the next receive
        self.receiving: Optional[int] = None  # version in flight
        self.seen_version = -1  # newest version whose header this receiver has read
        self.joined = False
        self.store = self.rdv = None
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
        self.ticket, self.first_seq = join(store, rdv, secret, self.writer, self.connect_s, self.run_dir)
        self.store, self.rdv, self.joined, self.group, self.gen = store, rdv, True, None, -1
        log.info("joined the weight broadcast at %s as ticket %d (member from publish %d on)", rdv.address,
                 self.ticket, self.first_seq)

    def start(self) -> "_Receiver":
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
                    self.store.add(f"alive/{self.ticket}", 1)
                latest = int(self.store.get("latest")) if self.store.check(["latest"]) else 0
                if latest <= seen_seq:
                    self._stop.wait(POLL_S)
                    continue
                seen_seq = latest
                header = json.loads(self.store.get(f"pub/{latest}"))
            except Exception as e:  # noqa: BLE001 - the trainer's store is gone
                return self._lost(f"lost the broadcast store at {self.rdv.address} ({type(e).__name__}); "
                                  "the trainer died or restarted", epoch_dead=True)
            if latest >= self.first_seq and self.ticket not in header["members"]:
                return self._lost("the trainer dropped this job from the broadcast group", epoch_dead=False)
            if self.ticket in header["members"]:
                if not self._receive(header):
                    return
            else:
                with self.cond:
                    self.seen_version = header["version"]
                    self.cond.notify_all()

    def _receive(self, header: dict) -> bool:
        """Receive one version (True), or log why not and leave the group (False)."""
        version = header["version"]
        with self.cond:
            self.receiving, self.seen_version = version, version
            self.cond.notify_all()
        entries = [Entry(*t) for t in header["tensors"]]
        rank, world = header["members"].index(self.ticket) + 1, len(header["members"]) + 1
        t0 = time.monotonic()
        try:
            def transfer():
                if header["gen"] != self.gen:
                    self.group = make_group(self.store, f"{self.rdv.epoch}/g{header['gen']}", rank, world,
                                            self.broadcast_s, self.backend)
                    self.gen = header["gen"]
                with self.cond:
                    out, self.spare = self.spare, None
                return recv_buckets(self.group, entries, header["total_bytes"], header["bucket_bytes"],
                                    header["aliases"], out, allocate=receive_buffer)
            state, flat = call_with_deadline(transfer, self.broadcast_s, f"receiving weight version {version} from the "
                                       f"trainer at {self.rdv.address} as rank {rank}/{world} (run {self.run_dir.root})")
            transfer_s = time.monotonic() - t0
            self.store.set(f"pub/{header['seq']}/ack/{self.ticket}", "1")
        except Exception as e:  # noqa: BLE001 - dead trainer, timeout: the files have the version
            with self.cond:
                self.receiving = None
                self.cond.notify_all()
            self._lost(f"broadcast of weight version {version} failed: {str(e).splitlines()[0] if str(e) else e!r}; "
                       "taking it from files", epoch_dead=False)
            return False
        self.failures = 0
        with self.cond:
            self.staged = _Staged(version, header["published_s"], state, header["total_bytes"], transfer_s, flat)
            self.receiving = None
            self.cond.notify_all()
        return True

    def _lost(self, why: str, epoch_dead: bool) -> None:
        log.warning("weight broadcast: %s (run %s)", why, self.run_dir.root)
        self.joined, self.group = False, None
        self.failures = 0 if epoch_dead else self.failures + 1
        if epoch_dead or self.failures >= MAX_FAILURES:  # wait for a new trainer instead of costing this one
            self.failed_epoch = self.rdv.epoch

    def take(self, version: int) -> Optional[_Staged]:
        """The staged ``version``, waiting while its header is due (``broadcast_connect_s``) or it is in
        flight (``broadcast_s``); None if it will not come by broadcast."""
        header_due = time.monotonic() + self.connect_s
        with self.cond:
            while True:
                if self.staged is not None and self.staged.version == version:
                    staged, self.staged = self.staged, None
                    return staged
                if self.receiving == version:
                    self.cond.wait(self.broadcast_s)  # the receive itself ends within broadcast_s
                    continue
                if not self.joined or self.seen_version >= version or time.monotonic() > header_due:
                    return None
                self.cond.wait(POLL_S)

    def recycle(self, flat: torch.Tensor) -> None:
        """``flat`` is no longer read by anyone: the next receive of the same size reuses it."""
        with self.cond:
            self.spare = flat

    def close(self) -> None:
        """Stop the thread and wait for it (a receive in flight ends at its deadline)."""
        if self._worker is not None:
            self._worker.stop_and_wait()


class BroadcastTransport(FilesystemTransport):
    """Files for every version, plus a bucketed broadcast to the rollout jobs that joined (module
    docstring). ``required`` (``weights.transport=broadcast``): a job that cannot start or join the
    broadcast at its first attempt fails with the reason; ``auto``: it logs the reason and uses files."""

    name = "broadcast"

    def __init__(self, run_dir: RunDir, keep_versions: int, required: bool, bucket_mb: float, connect_s: float,
                 broadcast_s: float, backend: str = "gloo"):
        super().__init__(run_dir, keep_versions)
        self.required, self.connect_s, self.broadcast_s, self.backend = required, connect_s, broadcast_s, backend
        self.bucket_bytes = max(int(bucket_mb * 2**20), ALIGN_BYTES)
        self._sender: Optional[_Sender] = None
        self._receiver: Optional[_Receiver] = None
        self._tried = False

    @classmethod
    def from_config(cls, cfg: WeightsConfig, run_dir: RunDir,
                    timeouts: Optional[TimeoutsConfig] = None) -> "BroadcastTransport":
        t = timeouts or TimeoutsConfig()
        return cls(run_dir, cfg.keep_versions, cfg.transport == "broadcast", cfg.bucket_mb, t.broadcast_connect_s,
                   t.broadcast_s)

    def _start(self, what, fn):
        """The first attempt at the broadcast side of this job: its result, or None (auto) / raise (required)."""
        self._tried = True
        try:
            return fn()
        except (BroadcastFailed, OSError, RuntimeError) as e:
            if self.required or isinstance(e, BroadcastRefused):
                log.error("weights.transport=%s: %s: %s", ("broadcast" if self.required else "auto"), what, e)
            if self.required:
                raise BroadcastFailed(f"weights.transport=broadcast: {what}: {e} (set weights.transport=auto to "
                                      "fall back to files)") from None
            log.warning("weights.transport=auto: %s: %s; using files", what, e)
            return None

    # ---- trainer side
    def publish(self, version: int, state_dict: dict[str, torch.Tensor], model_config_json: str,
                trainer_step: int, consumed_groups: int) -> WeightManifest:
        if not self._tried:  # before the first version's files: a joiner finds the rendezvous with v0
            self._sender = self._start("starting the broadcast store", lambda: _Sender(
                self.run_dir, self.bucket_bytes, self.connect_s, self.broadcast_s, self.backend))
        manifest = super().publish(version, state_dict, model_config_json, trainer_step, consumed_groups)
        stats = {**self.last_publish, M.PARAM_SYNC_TRANSFER_S: 0.0, M.WEIGHTS_MEMBERS: 0}
        if self._sender is not None:
            tensors, aliases = _dedupe_tied(state_dict)
            stats.update(self._sender.send(version, tensors, aliases, manifest))
        self.last_publish = stats
        return manifest

    def waiting_members(self) -> int:
        """Trainer: rollout jobs admitted to the broadcast (0 before the first publish)."""
        return self._sender.waiting_members() if self._sender is not None else 0

    # ---- rollout side
    def load(self, version: int, writer: str, apply: Optional[Apply] = None
             ) -> tuple[WeightManifest, dict[str, torch.Tensor]]:
        if not self._tried:
            r = _Receiver(self.run_dir, writer, self.connect_s, self.broadcast_s, self.backend)
            self._start("joining the weight broadcast", r.join_now)
            if not r.joined:  # auto: tried again once a trainer publishes a new rendezvous
                r.failed_epoch = getattr(read_rendezvous(self.run_dir), "epoch", None)
            self._receiver = r.start()
        t0 = time.monotonic()
        staged = self._receiver.take(version) if self._receiver is not None else None
        manifest = self.read_manifest(version) if staged is not None else None
        if staged is None or manifest is None or manifest.published_s != staged.published_s:
            return self._load_files(version, writer, apply, t0)
        self.pin(writer, version)
        try:
            t1 = time.monotonic()
            if apply is not None:
                apply(staged.state, self.run_dir.weight_version_dir(version))
                self._receiver.recycle(staged.flat)  # the engine copied the tensors: reuse the buffer
            self.last_load = {M.WEIGHTS_PATH: "broadcast", M.LOAD_TRANSFER_S: t1 - t0 + staged.transfer_s,
                              M.LOAD_APPLY_S: time.monotonic() - t1, M.WEIGHTS_BYTES: staged.nbytes,
                              M.WEIGHTS_GB_PER_S: staged.nbytes / max(staged.transfer_s, 1e-9) / 1e9}
        finally:
            self.unpin(writer, version)
        return manifest, ({} if apply is not None else staged.state)

    def _load_files(self, version: int, writer: str, apply: Optional[Apply], t0: float):
        """The filesystem path, timed: transfer = reading and verifying, apply = the engine."""
        marks = {}

        def timed(state, folder):
            marks["apply"] = time.monotonic()
            apply(state, folder)

        manifest, state = super().load(version, writer, timed if apply is not None else None)
        end = time.monotonic()
        got = marks.get("apply", end)
        self.last_load = {M.WEIGHTS_PATH: "filesystem", M.LOAD_TRANSFER_S: got - t0, M.LOAD_APPLY_S: end - got,
                          M.WEIGHTS_BYTES: manifest.total_bytes,
                          M.WEIGHTS_GB_PER_S: manifest.total_bytes / max(got - t0, 1e-9) / 1e9}
        return manifest, state

    def close(self) -> None:
        """Stop the admission or receiver thread and wait for it (bounded)."""
        for part in (self._sender, self._receiver):
            if part is not None:
                part.close()


class AutoTransport(BroadcastTransport):
    """``weights.transport=auto``: the broadcast where it can be formed, files otherwise (logged)."""

    name = "auto"
