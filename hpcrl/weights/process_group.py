"""The broadcast group's plumbing: rendezvous record, secret handshake, group construction, deadlines.

Rendezvous (``control/broadcast.json``, :class:`BroadcastRendezvous`): trainer rank 0 starts a
``TCPStore`` on an ephemeral port and writes host, port and a fresh ``epoch`` (tmp -> fsync ->
rename). A rollout job reads it and connects as a store client. Nothing else of the run's own
``torch.distributed`` world is touched: the group is a ``ProcessGroupGloo`` built directly on a
``PrefixStore`` of that store (FACTS.md "torch.distributed across two independent jobs").

Handshake (store keys ``join/<j>/...``; ``j`` is a ticket the store's atomic counter hands out,
not a rank)::

    joiner  j = add(joiners, 1); set hello = {writer, host, pid, nonce_j}
    trainer set challenge = {nonce_t, proof_t = HMAC(secret, trainer|epoch|j|nonce_j)}
    joiner  set proof = HMAC(secret, rollout|epoch|j|nonce_t)
    trainer set verdict = {ok, first_seq} or {ok: false, reason}   (logs the refusal with host/pid)
    joiner  refuses a trainer whose proof_t is wrong (a stranger's store), else is a member from
            publish ``first_seq`` on

The secret never crosses the wire. Ranks in a group are assigned by the trainer per publish
(the header lists the member tickets; rank = position + 1, the trainer is rank 0).

Every step has a deadline: store calls use the store's own timeout; group construction and the
transfer run on a worker thread waited on with a deadline (:func:`call_with_deadline`), and gloo's
own collective timeout is set to the same value. Errors name the step, the peer and the run dir.

Backend: gloo on CPU (tested). On GPUs the branch in :func:`make_group` is torch's
``ProcessGroupNCCL`` over the same ``PrefixStore``, chosen over vLLM's ``StatelessProcessGroup`` +
``PyNcclCommunicator`` because the trainer's environment has no vLLM and it takes the same store
and timeout as the gloo branch; it is untested (one GPU here: NCCL refuses two ranks on one device).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

from hpcrl.fsio import read_json, write_json_atomic
from hpcrl.run_dir import RunDir

log = logging.getLogger(__name__)


class BroadcastFailed(RuntimeError):
    """A broadcast step failed or ran past its deadline; the version is taken from files."""


class BroadcastRefused(BroadcastFailed):
    """The secret handshake failed (a peer that does not know the run's secret)."""


@dataclass
class BroadcastRendezvous:
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

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def address(self) -> str:
        """``host:port`` for log lines."""
        return f"{self.host}:{self.port}"


def read_rendezvous(run_dir: RunDir) -> Optional[BroadcastRendezvous]:
    """The current rendezvous record; None if there is none or it is not one."""
    try:
        d = read_json(run_dir.broadcast_rendezvous)
        return BroadcastRendezvous(**d) if isinstance(d, dict) else None
    except (ValueError, TypeError, OSError):
        return None


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


def call_with_deadline(fn: Callable[[], Any], timeout_s: float, step: str) -> Any:
    """Run ``fn`` on a worker thread and wait at most ``timeout_s``: its result, its exception,
    or BroadcastFailed naming ``step`` (the thread is abandoned; the backend's own timeout ends it)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            box["error"] = e

    t = threading.Thread(target=target, name=f"broadcast:{step[:40]}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise BroadcastFailed(f"{step}: no answer in {timeout_s:.1f}s")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def start_store(run_dir: RunDir, timeout_s: float) -> tuple[dist.TCPStore, BroadcastRendezvous]:
    """Trainer rank 0: a store on an ephemeral port, published in the rendezvous record."""
    store = dist.TCPStore("0.0.0.0", 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    rdv = BroadcastRendezvous(host=socket.gethostname(), port=store.port, epoch=secrets.token_hex(8),
                              trainer_pid=os.getpid(), created_s=time.time())
    write_json_atomic(run_dir.broadcast_rendezvous, rdv.to_json())
    return store, rdv


def connect_store(rdv: BroadcastRendezvous, timeout_s: float, run_dir: RunDir) -> dist.TCPStore:
    """A client of the trainer's store; BroadcastFailed (address, run dir) if it does not answer."""
    try:
        return call_with_deadline(
            lambda: dist.TCPStore(rdv.host, rdv.port, None, False, timeout=timedelta(seconds=timeout_s)),
            timeout_s + 1.0, f"connecting to the broadcast store at {rdv.address} (run {run_dir.root})")
    except BroadcastFailed:
        raise
    except Exception as e:  # noqa: BLE001 - refused, unreachable, reset: all mean "use the files"
        raise BroadcastFailed(f"connecting to the broadcast store at {rdv.address} (run {run_dir.root}): "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def store_json(store: dist.TCPStore, key: str, timeout_s: float, step: str) -> dict:
    """Wait for ``key`` (at most ``timeout_s``) and parse its JSON value; BroadcastFailed naming ``step``."""
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        return json.loads(store.get(key))
    except Exception as e:  # noqa: BLE001 - a timeout or a dead peer, said in one line
        raise BroadcastFailed(f"{step}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def put_json(store: dist.TCPStore, key: str, value: dict) -> None:
    """Set ``key`` to ``value`` as JSON (never pickle: a peer only ever parses JSON)."""
    store.set(key, json.dumps(value, separators=(",", ":")))


@dataclass
class Admitted:
    """A joiner the trainer let in: its ticket and who it says it is."""

    ticket: int
    writer: str
    host: str
    pid: int

    @property
    def peer(self) -> str:
        """``w000@host:pid`` for log lines."""
        return f"{self.writer}@{self.host}:{self.pid}"


def admit_one(store: dist.TCPStore, ticket: int, secret: bytes, epoch: str, on_admit: Callable[[Admitted], int],
              timeout_s: float, run_dir: RunDir) -> Optional[Admitted]:
    """Trainer: run the handshake of ticket ``ticket``; the member, or None (refused or silent; logged).
    ``on_admit`` records the member and returns the first publish seq it belongs to."""
    pre = f"join/{ticket}/"
    try:
        hello = store_json(store, pre + "hello", timeout_s, f"waiting for the hello of broadcast ticket {ticket}")
        who = Admitted(ticket, str(hello["writer"]), str(hello["host"]), int(hello["pid"]))
        nonce_t = secrets.token_hex(16)
        put_json(store, pre + "challenge", {"nonce": nonce_t, "proof": proof(secret, "trainer", epoch, ticket,
                                                                             str(hello["nonce"]))})
        answer = store_json(store, pre + "proof", timeout_s, f"waiting for the proof of {who.peer}")
    except (BroadcastFailed, KeyError, ValueError, TypeError) as e:
        log.warning("broadcast handshake of ticket %d gave up (run %s): %s", ticket, run_dir.root, e)
        return None
    if not hmac.compare_digest(str(answer.get("proof", "")), proof(secret, "rollout", epoch, ticket, nonce_t)):
        log.error("refused broadcast peer %s: it does not know this run's secret (%s)", who.peer, run_dir.secret)
        put_json(store, pre + "verdict", {"ok": False, "reason": "wrong secret"})
        return None
    put_json(store, pre + "verdict", {"ok": True, "first_seq": on_admit(who)})
    log.info("admitted broadcast peer %s as ticket %d", who.peer, ticket)
    return who


def join(store: dist.TCPStore, rdv: BroadcastRendezvous, secret: bytes, writer: str, timeout_s: float,
         run_dir: RunDir) -> tuple[int, int]:
    """Rollout: prove we know the secret and check that the trainer does; (ticket, first publish
    seq we are a member of). BroadcastRefused or BroadcastFailed (one line) otherwise."""
    where = f"the broadcast store at {rdv.address} (run {run_dir.root})"
    try:
        ticket = store.add("joiners", 1)
        nonce_j = secrets.token_hex(16)
        put_json(store, f"join/{ticket}/hello", {"writer": writer, "host": socket.gethostname(), "pid": os.getpid(),
                                                 "nonce": nonce_j})
    except Exception as e:  # noqa: BLE001
        raise BroadcastFailed(f"sending the hello to {where}: {type(e).__name__}: {e}") from None
    challenge = store_json(store, f"join/{ticket}/challenge", timeout_s, f"waiting for the challenge of {where}")
    put_json(store, f"join/{ticket}/proof",
             {"proof": proof(secret, "rollout", rdv.epoch, ticket, str(challenge.get("nonce", "")))})
    verdict = store_json(store, f"join/{ticket}/verdict", timeout_s, f"waiting for the verdict of {where}")
    if not verdict.get("ok"):
        raise BroadcastRefused(f"{where} refused {writer}: {verdict.get('reason')} (is {run_dir.secret} the "
                               "trainer's run's secret?)")
    if not hmac.compare_digest(str(challenge.get("proof", "")), proof(secret, "trainer", rdv.epoch, ticket, nonce_j)):
        raise BroadcastRefused(f"{where} does not know this run's secret: not our trainer; using files")
    return ticket, int(verdict["first_seq"])


def make_group(store: dist.Store, prefix: str, rank: int, world: int, timeout_s: float, backend: str = "gloo"):
    """The broadcast group of one membership (``prefix`` = epoch and generation), built directly on a
    ``PrefixStore``: the job's own default process group is never touched. Blocks until all ``world``
    members connected or ``timeout_s``; call it through :func:`call_with_deadline`."""
    pstore = dist.PrefixStore(prefix, store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(pstore, rank, world, timeout)
    if backend == "nccl":  # untested here (see the module docstring)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(pstore, rank, world, opts)
    raise ValueError(f"broadcast backend {backend!r}: allowed 'gloo' (CPU) or 'nccl' (GPUs)")


def broadcast_async(group, tensor, root: int = 0):
    """Start a broadcast of ``tensor`` from ``root`` on ``group``; returns the work to wait on."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    return group.broadcast([tensor], opts)
