"""The broadcast group and its wire: rendezvous record, secret handshake, group construction,
deadlines, and the bucketed byte stream of a version (:func:`plan`, :func:`messages`).

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

import bisect
import dataclasses
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
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from hpcrl.process import faults
from hpcrl.fsio import read_json, write_json_atomic
from hpcrl.run_dir import RunDir
from hpcrl.process.threads import spawn

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

    t = spawn(target, f"broadcast:{step[:40]}", bound_s=2 * timeout_s).thread  # abandoned: the backend's timeout ends it
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


# ---- buckets: the version as one byte stream, cut into messages both sides derive from the header

ALIGN_BYTES = 64
"""Every tensor starts at a multiple of this in the flat byte stream (any dtype can view it)."""
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                     torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                                     torch.bool)}
"""dtype names a header may carry (parsed from JSON, never unpickled)."""

@dataclass
class Entry:
    """One tensor in the flat byte stream of a version."""

    name: str
    dtype: str
    shape: list[int]
    offset_bytes: int
    nbytes: int


def plan(tensors: dict[str, torch.Tensor]) -> tuple[list[Entry], int]:
    """Byte offsets of ``tensors`` (in insertion order, each aligned) and the stream's total bytes."""
    out, off = [], 0
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise TypeError(f"tensor {name}: dtype {t.dtype} cannot be broadcast (allowed: {sorted(DTYPES)})")
        n = t.numel() * t.element_size()
        out.append(Entry(name, dtype, list(t.shape), off, n))
        off += -(-n // ALIGN_BYTES) * ALIGN_BYTES
    return out, off


DIRECT_MIN_BYTES = 1 << 20
"""A tensor this large (or half a bucket, if less) is sent straight from its storage: copying it into a
bucket costs more CPU than the extra message (~0.3-1 ms each on 2 shared cores)."""


def messages(entries: list[Entry], total_bytes: int, bucket_bytes: int) -> list[tuple[int, int, int]]:
    """The messages ``(lo, hi, entry index or -1)`` of the stream, each at most ``bucket_bytes``, which
    both sides derive from the header: a large tensor goes as bucket-sized chunks straight from its
    storage (its index: no copy); runs of smaller ones are packed into one bucket (-1: one copy)."""
    direct = min(bucket_bytes // 2, DIRECT_MIN_BYTES)
    out, lo, hi = [], None, 0
    for i, e in enumerate(entries):
        if e.nbytes == 0:
            continue
        if e.nbytes >= direct:
            if lo is not None:
                out.append((lo, hi, -1))
                lo = None
            end = e.offset_bytes + e.nbytes
            out += [(a, min(a + bucket_bytes, end), i) for a in range(e.offset_bytes, end, bucket_bytes)]
            continue
        if lo is not None and e.offset_bytes + e.nbytes - lo > bucket_bytes:
            out.append((lo, hi, -1))
            lo = None
        lo = e.offset_bytes if lo is None else lo
        hi = e.offset_bytes + e.nbytes
    if lo is not None:
        out.append((lo, hi, -1))
    assert not out or out[-1][1] <= total_bytes
    return out


def send_buckets(group, tensors: dict[str, torch.Tensor], entries: list[Entry], total_bytes: int, bucket_bytes: int,
                 buffers: Optional[list[torch.Tensor]] = None) -> list[torch.Tensor]:
    """Root: broadcast the stream as :func:`messages`, one message on the wire at a time (two in flight
    were slower on 2 cores: they compete for the same CPUs); the next small-tensor bucket is packed into
    the other of two ``buffers`` while the previous message is on the wire. Blocks until the last
    message is sent; returns the buffers (reused across calls if given back)."""
    views = [tensors[e.name].reshape(-1).view(torch.uint8) for e in entries]
    starts = [e.offset_bytes for e in entries]
    if not buffers or buffers[0].numel() < bucket_bytes:
        buffers = [torch.empty(bucket_bytes, dtype=torch.uint8) for _ in range(2)]
    work, n_packed = None, 0
    for lo, hi, idx in messages(entries, total_bytes, bucket_bytes):
        faults.point("broadcast_bucket")
        if idx >= 0:
            off = entries[idx].offset_bytes
            msg = views[idx][lo - off:hi - off]
        else:  # the buffer not on the wire now (the one before was waited for)
            msg = buffers[n_packed % 2][:hi - lo]
            n_packed += 1
            i = max(bisect.bisect_right(starts, lo) - 1, 0)
            while i < len(entries) and starts[i] < hi:
                e = entries[i]
                a, z = max(lo, e.offset_bytes), min(hi, e.offset_bytes + e.nbytes)
                if a < z:
                    msg[a - lo:z - lo].copy_(views[i][a - e.offset_bytes:z - e.offset_bytes])
                i += 1
        if work is not None:
            work.wait()
        work = broadcast_async(group, msg)
    if work is not None:
        work.wait()
    return buffers


def views(flat: torch.Tensor, entries: list[Entry]) -> dict[str, torch.Tensor]:
    """The tensors of a version's flat byte stream, as views of ``flat`` (no copy)."""
    return {e.name: flat[e.offset_bytes:e.offset_bytes + e.nbytes].view(DTYPES[e.dtype]).reshape(e.shape)
            for e in entries}


def recv_buckets(group, entries: list[Entry], total_bytes: int, bucket_bytes: int, aliases: dict[str, str],
                 out: Optional[torch.Tensor] = None, allocate: Optional[Callable[[int], torch.Tensor]] = None
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Receiver: every message lands straight at its place in one flat buffer (``out`` if it has the
    right size: reusing it saves the page faults of a fresh one; else ``allocate(total_bytes)``, private
    memory by default); the tensors are views of it. Returns the tensors and the buffer."""
    if out is not None and out.numel() == total_bytes:
        flat = out
    else:
        flat = allocate(total_bytes) if allocate is not None else torch.empty(total_bytes, dtype=torch.uint8)
    for lo, hi, _ in messages(entries, total_bytes, bucket_bytes):
        faults.point("broadcast_bucket")
        broadcast_async(group, flat[lo:hi]).wait()
    state = views(flat, entries)
    for alias, stored in aliases.items():
        state[alias] = state[stored]
    return state, flat
