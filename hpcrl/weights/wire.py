"""The weight broadcast's wire format: every store key, the header of a publish, and a version as one
byte stream cut into messages that both sides derive from the header.

Store keys (the trainer's ``TCPStore``; :class:`StoreKeys` spells each once)::

    key                         written by      read by         what
    joiners                     rollout (add)   trainer         a counter: each joiner takes the next ticket
    join/<t>/hello              rollout         trainer         Hello: writer, host, pid, nonce, device
    join/<t>/challenge          trainer         rollout         Challenge: nonce, the trainer's proof
    join/<t>/proof              rollout         trainer         the joiner's proof
    join/<t>/verdict            trainer         rollout         Verdict: ok and first_seq, or the reason
    alive/<t>                   rollout (add)   trainer         bumped every BEAT_S by a member's receiver
    pub/<seq>                   trainer         rollout         BroadcastHeader of publish ``seq``
    pub/<seq>/ack/<t>           rollout         trainer         member ``t`` received publish ``seq`` whole
    latest                      trainer         rollout         the newest ``seq``
    <epoch>/g<gen>/...          both            both            the group of one membership (PrefixStore)

A version travels as one flat byte stream: every tensor at an aligned offset (:func:`plan`), cut into
messages of at most ``bucket_bytes`` (:func:`messages`). A large tensor goes straight from its storage;
runs of small ones are packed into a bucket. The receiver lands every message at its place in one
flat buffer, so the tensors are views of it (:func:`views`) and nothing is copied twice.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from hpcrl.rundir.json_record import JsonRecord, RecordError
from hpcrl.process import faults

ALIGN_BYTES = 64
"""Every tensor starts at a multiple of this in the flat byte stream (any dtype can view it)."""
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                     torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                                     torch.bool)}
"""dtype names a header may carry (parsed from JSON, never unpickled)."""
POLL_S = 0.02
"""How often a receiver looks for a new header, and the admission thread for a new joiner."""
BEAT_S = 0.5
"""How often a member's receiver bumps its ``alive/<ticket>`` counter; the trainer drops a member whose
counter has not moved for ``max(4 * BEAT_S, broadcast_connect_s)`` before it forms a group."""
DIRECT_MIN_BYTES = 1 << 20
"""A tensor this large (or half a bucket, if less) is sent straight from its storage: copying it into a
bucket costs more CPU than the extra message (~0.3-1 ms each on 2 shared cores)."""


class StoreKeys:
    """The keys of the broadcast's store (module docstring), each spelt here only."""

    JOINERS = "joiners"
    LATEST = "latest"

    @staticmethod
    def hello(ticket: int) -> str:
        """The joiner's hello."""
        return f"join/{ticket}/hello"

    @staticmethod
    def challenge(ticket: int) -> str:
        """The trainer's challenge and proof."""
        return f"join/{ticket}/challenge"

    @staticmethod
    def proof(ticket: int) -> str:
        """The joiner's proof."""
        return f"join/{ticket}/proof"

    @staticmethod
    def verdict(ticket: int) -> str:
        """The trainer's verdict."""
        return f"join/{ticket}/verdict"

    @staticmethod
    def alive(ticket: int) -> str:
        """A member's beat counter."""
        return f"alive/{ticket}"

    @staticmethod
    def header(seq: int) -> str:
        """The header of publish ``seq``."""
        return f"pub/{seq}"

    @staticmethod
    def ack(seq: int, ticket: int) -> str:
        """Member ``ticket`` received publish ``seq``."""
        return f"pub/{seq}/ack/{ticket}"

    @staticmethod
    def group(epoch: str, gen: int) -> str:
        """The prefix under which the group of membership generation ``gen`` forms."""
        return f"{epoch}/g{gen}"


@dataclass
class Entry(JsonRecord):
    """One tensor in the flat byte stream of a version."""

    name: str
    dtype: str
    """torch dtype without ``torch.``; one of :data:`DTYPES`."""
    shape: list[int]
    offset_bytes: int
    nbytes: int

    def check(self) -> None:
        """The dtype is one a view can take, and the extent is not negative."""
        if self.dtype not in DTYPES or self.offset_bytes < 0 or self.nbytes < 0:
            raise RecordError(f"tensor entry {self.name}: dtype {self.dtype!r}, offset {self.offset_bytes}, "
                              f"{self.nbytes} bytes")

    def row(self) -> list:
        """The entry as a JSON-able list (what a vLLM worker is handed)."""
        return [self.name, self.dtype, list(self.shape), self.offset_bytes, self.nbytes]


@dataclass
class BroadcastHeader(JsonRecord):
    """``pub/<seq>``: one publish. Written by trainer rank 0 after the version's files are committed
    (also with no member: a new joiner learns the version); read by every receiver."""

    seq: int
    """Publishes of this trainer process, from 1."""
    version: int
    """The weight version (its files are committed)."""
    published_s: float
    """The version's manifest ``published_s``: a receiver checks it against the files it would use."""
    gen: int
    """Membership generation: the group is re-formed when it changes."""
    members: list[int]
    """Tickets of the receivers, in rank order (rank = position + 1; the trainer is rank 0)."""
    backend: str
    """``gloo`` or ``nccl``: the group's backend for this generation."""
    bucket_bytes: int
    total_bytes: int
    """Length of the flat byte stream."""
    tensors: list[Entry]
    aliases: dict[str, str] = field(default_factory=dict)
    """Tied tensors sent once: name -> the name it shares storage with."""
    backend_why: str = ""
    """Why ``backend`` (``group.backend_choice``): both ends log it with the version."""

    def check(self) -> None:
        """The stream holds every tensor and the aliases name sent tensors."""
        names = {e.name for e in self.tensors}
        if any(e.offset_bytes + e.nbytes > self.total_bytes for e in self.tensors) or self.bucket_bytes < 1:
            raise RecordError(f"broadcast header {self.seq}: tensors past {self.total_bytes} bytes")
        if not set(self.aliases.values()) <= names:
            raise RecordError(f"broadcast header {self.seq}: an alias names no sent tensor")


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


def broadcast_async(group, tensor: torch.Tensor, root: int = 0):
    """Start a broadcast of ``tensor`` from ``root`` on ``group``; returns the work to wait on."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    return group.broadcast([tensor], opts)


def send_buckets(group, tensors: dict[str, torch.Tensor], entries: list[Entry], total_bytes: int, bucket_bytes: int,
                 buffers: Optional[list[torch.Tensor]] = None, device: str = "cpu") -> list[torch.Tensor]:
    """Root: broadcast the stream as :func:`messages`, one message on the wire at a time (two in flight
    were slower on 2 cores: they compete for the same CPUs). A message goes straight from a tensor's
    storage when the tensor lies on ``device`` (the group's: ``cuda`` for NCCL); everything else is
    packed into the other of two ``buffers`` on ``device`` while the previous message is on the wire.
    Blocks until the last message is sent; returns the buffers (reused across calls if given back)."""
    views_ = [tensors[e.name].reshape(-1).view(torch.uint8) for e in entries]
    starts = [e.offset_bytes for e in entries]
    if not buffers or buffers[0].numel() < bucket_bytes or buffers[0].device.type != device:
        buffers = [torch.empty(bucket_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
    work, n_packed = None, 0
    for lo, hi, idx in messages(entries, total_bytes, bucket_bytes):
        faults.point("broadcast_bucket")
        if idx >= 0 and views_[idx].device.type == device:
            off = entries[idx].offset_bytes
            msg = views_[idx][lo - off:hi - off]
        else:  # the buffer not on the wire now (the one before was waited for)
            msg = buffers[n_packed % 2][:hi - lo]
            n_packed += 1
            i = max(bisect.bisect_right(starts, lo) - 1, 0)
            while i < len(entries) and starts[i] < hi:
                e = entries[i]
                a, z = max(lo, e.offset_bytes), min(hi, e.offset_bytes + e.nbytes)
                if a < z:
                    msg[a - lo:z - lo].copy_(views_[i][a - e.offset_bytes:z - e.offset_bytes])
                i += 1
        if work is not None:
            work.wait()
        work = broadcast_async(group, msg)
    if work is not None:
        work.wait()
    return buffers


def views(flat: torch.Tensor, entries: list[Entry], aliases: Optional[dict[str, str]] = None) -> dict[str, torch.Tensor]:
    """The tensors of a version's flat byte stream, as views of ``flat`` (no copy); tied aliases share
    their stored tensor."""
    state = {e.name: flat[e.offset_bytes:e.offset_bytes + e.nbytes].view(DTYPES[e.dtype]).reshape(e.shape)
             for e in entries}
    for alias, stored in (aliases or {}).items():
        state[alias] = state[stored]
    return state


def recv_buckets(group, entries: list[Entry], total_bytes: int, bucket_bytes: int, flat: torch.Tensor) -> None:
    """Receiver: every message lands straight at its place in ``flat`` (``total_bytes`` long, on the
    group's device)."""
    if flat.numel() != total_bytes:
        raise ValueError(f"receive buffer of {flat.numel()} bytes for a stream of {total_bytes}")
    for lo, hi, _ in messages(entries, total_bytes, bucket_bytes):
        faults.point("broadcast_bucket")
        broadcast_async(group, flat[lo:hi]).wait()
