"""How a rollout job finds the trainer's broadcast and proves it belongs to the run.

Rendezvous (``control/broadcast.json``, :class:`BroadcastRendezvous`): trainer rank 0 starts a
``TCPStore`` on an ephemeral port and writes host, port and a fresh ``epoch`` (tmp -> fsync ->
rename). A rollout job reads it and connects as a store client.

Handshake (store keys in :class:`~hpcrl.weights.wire.StoreKeys`; a ticket comes from the store's
atomic counter, it is not a rank)::

    joiner  t = add(joiners, 1); set hello = Hello{writer, host, pid, nonce_j, device}
    trainer set challenge = Challenge{nonce_t, proof_t = HMAC(secret, trainer|epoch|t|nonce_j)}
    joiner  set proof = HMAC(secret, rollout|epoch|t|nonce_t)
    trainer set verdict = Verdict{ok, first_seq} or Verdict{ok: false, reason}  (a refusal is logged)
    joiner  refuses a trainer whose proof_t is wrong (a stranger's store), else is a member from
            publish ``first_seq`` on

The secret never crosses the wire. Store calls use the store's own timeout; errors name the step,
the peer and the run dir.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from hpcrl.control.records import read_heartbeats
from hpcrl.rundir.fsio import read_json, write_json_atomic
from hpcrl.rundir.json_record import JsonRecord
from hpcrl.process.pids import pid_running
from hpcrl.rundir.paths import RunDir
from hpcrl.weights.group import BroadcastFailed, BroadcastRefused, call_with_deadline
from hpcrl.weights.wire import StoreKeys

log = logging.getLogger(__name__)


@dataclass
class BroadcastRendezvous(JsonRecord):
    """``control/broadcast.json``. Written by trainer rank 0 when its store is listening (tmp ->
    fsync -> rename; a restarted trainer overwrites it); read by rollout jobs to join."""

    host: str
    """Host name the trainer's store listens on (``socket.gethostname()``)."""
    port: int
    """TCP port of the store (ephemeral, chosen by the OS)."""
    epoch: str
    """Random token of this trainer process's store: a new trainer attempt is a new epoch."""
    trainer_pid: int
    created_s: float
    """Unix time the store started."""

    @property
    def address(self) -> str:
        """``host:port`` for log lines."""
        return f"{self.host}:{self.port}"


@dataclass
class Hello(JsonRecord):
    """``join/<t>/hello``: who asks to join."""

    writer: str
    """The reader's name (``w000``)."""
    host: str
    pid: int
    nonce: str
    """The joiner's challenge to the trainer."""
    device: str = "cpu"
    """Where the joiner receives a version: ``cpu`` (host memory) or ``cuda``."""


@dataclass
class Challenge(JsonRecord):
    """``join/<t>/challenge``: the trainer's nonce and its proof that it knows the secret."""

    nonce: str
    proof: str


@dataclass
class Verdict(JsonRecord):
    """``join/<t>/verdict``: admitted from publish ``first_seq`` on, or refused for ``reason``."""

    ok: bool
    first_seq: int = 0
    reason: str = ""


@dataclass
class Admitted:
    """A joiner the trainer let in: its ticket and who it says it is."""

    ticket: int
    writer: str
    host: str
    pid: int
    device: str

    @property
    def peer(self) -> str:
        """``w000@host:pid`` for log lines."""
        return f"{self.writer}@{self.host}:{self.pid}"


def read_rendezvous(run_dir: RunDir) -> Optional[BroadcastRendezvous]:
    """The current rendezvous record; None if there is none or it is not one."""
    try:
        d = read_json(run_dir.broadcast_rendezvous)
        return None if d is None else BroadcastRendezvous.from_json(d)
    except (ValueError, OSError):
        return None


def is_live(run_dir: RunDir, rdv: BroadcastRendezvous, heartbeat_interval_s: float) -> bool:
    """Whether the trainer process that wrote ``rdv`` still runs. Its heartbeat must come from that host and
    process (a restarted trainer beats with a new pid before it re-announces) and not have ended; on this host
    the process is looked up directly, elsewhere its heartbeat must have moved within three beats (a SIGKILLed
    trainer's last beat stays on disk)."""
    beat = read_heartbeats(run_dir).get(RunDir.trainer_job())
    if beat is None or beat.ended or (beat.host, beat.pid) != (rdv.host, rdv.trainer_pid):
        return False
    if rdv.host == socket.gethostname():
        return pid_running(rdv.trainer_pid)
    return beat.age_s(time.time()) <= 3 * heartbeat_interval_s + 1.0


def describe_rendezvous(run_dir: RunDir) -> str:
    """One line for wait messages: the rendezvous record there is, and the trainer's heartbeat."""
    rdv = read_rendezvous(run_dir)
    beat = read_heartbeats(run_dir).get(RunDir.trainer_job())
    there = (f"{run_dir.broadcast_rendezvous} names the trainer at {rdv.address} (pid {rdv.trainer_pid}, epoch "
             f"{rdv.epoch})" if rdv is not None else f"no {run_dir.broadcast_rendezvous}")
    hb = (f"trainer heartbeat: {beat.state}, pid {beat.pid} on {beat.host}, {beat.age_s(time.time()):.0f}s ago"
          if beat is not None else "no trainer heartbeat")
    return f"{there}; {hb}"


def read_secret(run_dir: RunDir) -> bytes:
    """The run's secret; BroadcastRefused (naming the file) if it is missing or empty."""
    try:
        secret = run_dir.secret.read_bytes().strip()
    except OSError as e:
        raise BroadcastRefused(f"cannot read the run's secret {run_dir.secret}: {e}") from None
    if not secret:
        raise BroadcastRefused(f"the run's secret {run_dir.secret} is empty")
    return secret


def proof(secret: bytes, role: str, epoch: str, ticket: int, nonce: str) -> str:
    """HMAC-SHA256 of the challenge: proves knowledge of ``secret`` without sending it."""
    return hmac.new(secret, f"{role}|{epoch}|{ticket}|{nonce}".encode(), hashlib.sha256).hexdigest()


def start_store(run_dir: RunDir, timeout_s: float) -> tuple[dist.TCPStore, BroadcastRendezvous]:
    """Trainer rank 0: a store on an ephemeral port, published in the rendezvous record."""
    store = dist.TCPStore("0.0.0.0", 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    rdv = BroadcastRendezvous(host=socket.gethostname(), port=store.port, epoch=secrets.token_hex(8),
                              trainer_pid=os.getpid(), created_s=time.time())
    write_json_atomic(run_dir.broadcast_rendezvous, rdv.to_json())
    return store, rdv


def connect_store(rdv: BroadcastRendezvous, timeout_s: float, run_dir: RunDir) -> dist.TCPStore:
    """A client of the trainer's store; BroadcastFailed (address, run dir) if it does not answer. A plain
    socket is tried first: a dead trainer's port is refused at once, in one line (the store's own client
    retries until its timeout and prints a C++ trace per try)."""
    try:
        socket.create_connection((rdv.host, rdv.port), timeout=timeout_s).close()
    except OSError as e:
        raise BroadcastFailed(f"connecting to the broadcast store at {rdv.address} (run {run_dir.root}): {e}") from None
    try:
        return call_with_deadline(
            lambda: dist.TCPStore(rdv.host, rdv.port, None, False, timeout=timedelta(seconds=timeout_s)),
            timeout_s + 1.0, f"connecting to the broadcast store at {rdv.address} (run {run_dir.root})")
    except BroadcastFailed:
        raise
    except Exception as e:  # noqa: BLE001 - refused, unreachable, reset: all mean "use the files"
        raise BroadcastFailed(f"connecting to the broadcast store at {rdv.address} (run {run_dir.root}): "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def store_record(store: dist.TCPStore, key: str, record: type[JsonRecord], timeout_s: float, step: str):
    """Wait for ``key`` (at most ``timeout_s``) and parse it as ``record``; BroadcastFailed naming ``step``."""
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        return record.from_json(json.loads(store.get(key)), key)
    except Exception as e:  # noqa: BLE001 - a timeout, a dead peer or a value that is no record, in one line
        raise BroadcastFailed(f"{step}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def put_record(store: dist.TCPStore, key: str, record: JsonRecord) -> None:
    """Set ``key`` to ``record`` as JSON (never pickle: a peer only ever parses JSON)."""
    store.set(key, json.dumps(record.to_json(), separators=(",", ":")))


def admit_one(store: dist.TCPStore, ticket: int, secret: bytes, epoch: str, on_admit: Callable[[Admitted], int],
              timeout_s: float, run_dir: RunDir, refuse: Callable[[Admitted], Optional[str]] = lambda who: None
              ) -> Optional[Admitted]:
    """Trainer: run the handshake of ticket ``ticket``; the member, or None (refused or silent; logged).
    ``refuse`` says why a joiner that knows the secret still cannot be a member (None: it can);
    ``on_admit`` records the member and returns the first publish seq it belongs to."""
    try:
        hello = store_record(store, StoreKeys.hello(ticket), Hello, timeout_s,
                             f"waiting for the hello of broadcast ticket {ticket}")
        who = Admitted(ticket, hello.writer, hello.host, hello.pid, hello.device)
        nonce_t = secrets.token_hex(16)
        put_record(store, StoreKeys.challenge(ticket),
                   Challenge(nonce_t, proof(secret, "trainer", epoch, ticket, hello.nonce)))
        answer = store_record(store, StoreKeys.proof(ticket), Challenge, timeout_s,
                              f"waiting for the proof of {who.peer}")
    except BroadcastFailed as e:
        log.warning("broadcast handshake of ticket %d gave up (run %s): %s", ticket, run_dir.root, e)
        return None
    if not hmac.compare_digest(answer.proof, proof(secret, "rollout", epoch, ticket, nonce_t)):
        log.error("refused broadcast peer %s: it does not know this run's secret (%s)", who.peer, run_dir.secret)
        put_record(store, StoreKeys.verdict(ticket), Verdict(False, reason="wrong secret"))
        return None
    reason = refuse(who)
    if reason is not None:
        log.error("refused broadcast peer %s: %s", who.peer, reason)
        put_record(store, StoreKeys.verdict(ticket), Verdict(False, reason=reason))
        return None
    put_record(store, StoreKeys.verdict(ticket), Verdict(True, first_seq=on_admit(who)))
    log.info("admitted broadcast peer %s as ticket %d", who.peer, ticket)
    return who


def join(store: dist.TCPStore, rdv: BroadcastRendezvous, secret: bytes, writer: str, device: str, timeout_s: float,
         run_dir: RunDir) -> tuple[int, int]:
    """Rollout: prove we know the secret and check that the trainer does; (ticket, first publish
    seq we are a member of). BroadcastRefused or BroadcastFailed (one line) otherwise."""
    where = f"the broadcast store at {rdv.address} (run {run_dir.root})"
    nonce_j = secrets.token_hex(16)
    try:
        ticket = store.add(StoreKeys.JOINERS, 1)
        put_record(store, StoreKeys.hello(ticket), Hello(writer, socket.gethostname(), os.getpid(), nonce_j, device))
    except Exception as e:  # noqa: BLE001
        raise BroadcastFailed(f"sending the hello to {where}: {type(e).__name__}: {e}") from None
    challenge = store_record(store, StoreKeys.challenge(ticket), Challenge, timeout_s,
                             f"waiting for the challenge of {where}")
    put_record(store, StoreKeys.proof(ticket), Challenge("", proof(secret, "rollout", rdv.epoch, ticket,
                                                                   challenge.nonce)))
    verdict = store_record(store, StoreKeys.verdict(ticket), Verdict, timeout_s, f"waiting for the verdict of {where}")
    if not verdict.ok:
        hint = (f"is {run_dir.secret} the trainer's run's secret?" if verdict.reason == "wrong secret"
                else "see weights.broadcast_backend")
        raise BroadcastRefused(f"{where} refused {writer}: {verdict.reason} ({hint})")
    if not hmac.compare_digest(challenge.proof, proof(secret, "trainer", rdv.epoch, ticket, nonce_j)):
        raise BroadcastRefused(f"{where} does not know this run's secret: not our trainer; using files")
    return ticket, verdict.first_seq
