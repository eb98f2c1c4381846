"""Delta weight versions in the store (``weights.delta``): which versions are deltas, and how a reader rebuilds one.
The codec is ``delta.py``; the folders, pins and markers are the store's (``folders.py``, ``publisher.py``,
``subscriber.py``).

Writer (trainer rank 0, :class:`DeltaWriter`): it holds the newest *full* version it wrote (the base) in
host memory. Version ``v`` is written as a delta against it unless the base is ``weights.full_every``
versions old or more, is no longer published intact (deleted, marked bad), the tensors' names, dtypes or
shapes changed, or the delta comes out larger than ``weights.delta_max_ratio`` of the full size (then ``v``
is full and becomes the base). A restarted trainer holds no base: its first version is full. Every delta is
against a full version, never against another delta, so a reader needs two files at most.

Reader (:class:`DeltaReader`): it keeps the base in host memory (after taking a full version, when the
run writes deltas). For a delta whose base it does not hold (a new or restarted job, or the base changed),
it reads the base from disk, verified against the hash the delta's manifest names; then it decodes each
tensor into one flat buffer (shared memory, which vLLM's workers map, else private memory) and checks
every rebuilt tensor against the hash of the tensor the trainer had. A mismatch with a base from memory
is retried once from the disk's copy; what still does not verify is damage: :class:`BaseUnusable` names
a base that is gone or damaged, ``DamagedFile`` a damaged delta. The subscriber marks the version bad and
falls back (``base.py``: ``take_newest``), so nothing that did not verify is ever handed to an engine.
"""
from __future__ import annotations

import logging
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from hpcrl.rundir.fsio import read_json
from hpcrl.rundir.paths import WEIGHT_DELTA, WEIGHT_TENSORS, RunDir
from hpcrl.weights.base import MappedBuffer
from hpcrl.weights.delta import CODEC, DeltaMismatch, decode_into, encode, parallel, tensor_hash
from hpcrl.weights.manifest import DeltaBase, FileEntry, TensorEntry, WeightManifest
from hpcrl.weights.file_hash import DamagedFile
from hpcrl.weights.safetensors_io import load_verified
from hpcrl.weights.shared_memory import receive_buffer
from hpcrl.weights.wire import ALIGN_BYTES, DTYPES, Entry, views

log = logging.getLogger(__name__)


def default_threads() -> int:
    """Threads that encode or decode tensors side by side: torch's intra-op count (the job's CPU share)."""
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


@dataclass
class HeldBase:
    """A full version held in host memory (private copies, not views of a file)."""

    version: int
    file: FileEntry
    """Its ``model.safetensors`` entry: size and hash, what a delta's :class:`DeltaBase` must name."""
    tensors: dict[str, torch.Tensor]
    """The stored tensors (tied aliases not repeated)."""

    def names(self, ref: DeltaBase) -> bool:
        """Whether ``ref`` names this base (version number and bytes)."""
        return (ref.version == self.version and ref.hash_algorithm == self.file.hash_algorithm
                and ref.hash_hex == self.file.hash_hex)


@dataclass
class Encoded:
    """A version encoded as a delta: what the publisher writes."""

    base: DeltaBase
    frames: dict[str, bytes]
    """Stored tensor name -> zstd frame of its XOR against the base."""
    entries: list[TensorEntry]
    """Each tensor's dtype, shape and hash (the manifest's ``tensors``)."""
    full_bytes: int

    @property
    def delta_bytes(self) -> int:
        return sum(len(f) for f in self.frames.values())


class DeltaWriter:
    """Trainer rank 0: the base in memory, and whether the next version is a delta (module docstring)."""

    def __init__(self, full_every: int, max_ratio: float, threads: Optional[int] = None):
        self.full_every, self.max_ratio = full_every, max_ratio
        self.threads = threads or default_threads()
        self.base: Optional[HeldBase] = None

    def why_full(self, version: int, tensors: dict[str, torch.Tensor], usable: Callable[[int], bool]) -> str:
        """Why ``version`` must be full ("" if it may be a delta); ``usable(v)``: v is published and not bad."""
        b = self.base
        if b is None:
            return "this trainer process has written no full version yet"
        if version - b.version >= self.full_every:
            return f"weights.full_every={self.full_every} versions since the full version {b.version}"
        if {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()} != {
                k: (t.dtype, tuple(t.shape)) for k, t in b.tensors.items()}:
            return f"its tensors' names, dtypes or shapes differ from the full version {b.version}'s"
        if not usable(b.version):
            return f"the full version {b.version} was deleted or marked bad"
        return ""

    def encode(self, version: int, tensors: dict[str, torch.Tensor],
               usable: Callable[[int], bool]) -> tuple[Optional[Encoded], str]:
        """The delta of ``version`` against the held base, or None and why it must be full."""
        why = self.why_full(version, tensors, usable)
        if why:
            return None, why
        b = self.base
        full_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        names, out, delta_bytes = list(tensors), [], 0
        with ThreadPoolExecutor(self.threads, thread_name_prefix="delta") as pool:
            for i in range(0, len(names), self.threads):  # a batch at a time: stop as soon as it cannot pay
                out += pool.map(lambda k: encode(b.tensors[k], tensors[k]), names[i:i + self.threads])
                delta_bytes = sum(len(frame) for frame, _ in out)
                if delta_bytes > self.max_ratio * full_bytes:
                    return None, (f"its delta against the full version {b.version} exceeds {self.max_ratio:.0%} of "
                                  f"the full size (weights.delta_max_ratio) after {len(out)} of {len(names)} tensors")
        frames = {k: frame for k, (frame, _) in zip(names, out)}
        entries = [TensorEntry(k, str(tensors[k].dtype).removeprefix("torch."), list(tensors[k].shape), h)
                   for k, (_, h) in zip(names, out)]
        ref = DeltaBase(b.version, b.file.hash_algorithm, b.file.hash_hex, CODEC)
        return Encoded(ref, frames, entries, full_bytes), ""

    def hold(self, version: int, tensors: dict[str, torch.Tensor], originals: dict[str, torch.Tensor],
             file: FileEntry) -> None:
        """``version`` was written full from ``tensors``: it is the base from now on. A tensor that is the
        caller's own storage (``originals``: the live model on CPU) is copied; one already copied is kept."""
        def own(k: str, t: torch.Tensor) -> torch.Tensor:
            o = originals.get(k)
            shared = o is not None and o.device.type == "cpu" and t.untyped_storage().data_ptr() == \
                o.untyped_storage().data_ptr()
            return t.clone() if shared else t
        self.base = HeldBase(version, file, {k: own(k, t) for k, t in tensors.items()})


def frame_tensors(encoded: Encoded) -> dict[str, torch.Tensor]:
    """The frames as uint8 tensors over their bytes (no copy; only read, by ``save_hashed``)."""
    with warnings.catch_warnings():  # the bytes are immutable on purpose: nothing writes into them
        warnings.simplefilter("ignore", UserWarning)
        return {k: torch.frombuffer(f, dtype=torch.uint8) if f else torch.empty(0, dtype=torch.uint8)
                for k, f in encoded.frames.items()}


class BaseUnusable(DamagedFile):
    """A delta's base cannot be used: gone, damaged, or republished with other bytes."""

    def __init__(self, base_version: int, damaged: bool, why: str):
        super().__init__(why)
        self.base_version = base_version
        self.damaged = damaged
        """True if the base's own files failed to verify (the base is marked bad too)."""


@dataclass
class Rebuilt:
    """A delta version's tensors rebuilt in one flat buffer."""

    state: dict[str, torch.Tensor]
    """Views of ``flat``, tied aliases restored."""
    flat: torch.Tensor
    shm_path: Optional[str]
    layout: list[Entry]
    nbytes_read: int
    """Bytes read from the filesystem for it (the delta, and the base if it was not held)."""

    def mapped(self, aliases: dict[str, str]) -> Optional[MappedBuffer]:
        """The buffer as vLLM's workers map it (every name, aliases included), if it is a shared file."""
        if self.shm_path is None:
            return None
        rows = {e.name: e for e in self.layout}
        alias_rows = [Entry(a, rows[s].dtype, rows[s].shape, rows[s].offset_bytes, rows[s].nbytes)
                      for a, s in aliases.items()]
        return MappedBuffer(self.shm_path, self.flat.numel(), self.layout + alias_rows)


def _layout(entries: list[TensorEntry]) -> tuple[list[Entry], int]:
    """Each tensor's aligned place in one flat buffer, and the buffer's size."""
    out, off = [], 0
    for e in entries:
        if e.dtype not in DTYPES:
            raise DamagedFile(f"manifest lists tensor {e.name} as {e.dtype!r} (allowed: {sorted(DTYPES)})")
        n = torch.empty(0, dtype=DTYPES[e.dtype]).element_size()
        for d in e.shape:
            n *= d
        out.append(Entry(e.name, e.dtype, list(e.shape), off, n))
        off += -(-n // ALIGN_BYTES) * ALIGN_BYTES
    return out, off


class DeltaReader:
    """A reader's base in memory and the rebuilding of delta versions (module docstring)."""

    def __init__(self, run_dir: RunDir, keep_bases: bool, verify: bool = True, threads: Optional[int] = None):
        """``keep_bases``: hold every full version taken (the run writes deltas); else only a base read for a delta."""
        self.run_dir, self.keep_bases, self.verify = run_dir, keep_bases, verify
        self.threads = threads or default_threads()
        self.base: Optional[HeldBase] = None
        self._spare: Optional[tuple[torch.Tensor, Optional[str]]] = None

    def took_full(self, version: int, manifest: WeightManifest, state: dict[str, torch.Tensor]) -> None:
        """A verified full version was taken: hold a private copy as the base, if the run writes deltas."""
        file = manifest.files.get(WEIGHT_TENSORS)
        if self.base is not None and self.base.version == version and self.base.file == file:
            return
        if self.keep_bases and file is not None:
            stored = {k: v for k, v in state.items() if k not in manifest.aliases}
            self.base = HeldBase(version, file, {k: v.clone() for k, v in stored.items()})

    def _read_base(self, ref: DeltaBase) -> tuple[HeldBase, int]:
        """The base ``ref`` names, from disk, verified; BaseUnusable if it is gone, other bytes or damaged."""
        rd, b = self.run_dir, ref.version
        where = f"its base, full version {b} in {rd.weight_version_dir(b)}"
        try:
            d = read_json(rd.weight_manifest(b))
            manifest = WeightManifest.from_json(d, str(rd.weight_manifest(b))) if d is not None else None
        except (ValueError, UnicodeDecodeError) as e:
            raise BaseUnusable(b, True, f"{where}, has an unreadable manifest ({e})") from None
        if manifest is None:
            raise BaseUnusable(b, False, f"{where}, is gone")
        file = manifest.files.get(WEIGHT_TENSORS)
        if file is None or (file.hash_algorithm, file.hash_hex) != (ref.hash_algorithm, ref.hash_hex):
            raise BaseUnusable(b, False, f"{where}, now holds other bytes than the delta was written against "
                                         "(republished after a trainer rollback)")
        try:
            state = load_verified(rd.weight_file(b, WEIGHT_TENSORS), file.size_bytes, file.hash_algorithm,
                                  file.hash_hex, verify=self.verify)
        except FileNotFoundError:
            raise BaseUnusable(b, False, f"{where}, is gone") from None
        except DamagedFile as e:
            raise BaseUnusable(b, True, f"{where}, is damaged: {e}") from None
        held = HeldBase(b, file, {k: v.clone() for k, v in state.items()})
        log.info("read full weight version %d from disk as the base of delta versions", b)
        return held, file.size_bytes

    def _buffer(self, nbytes: int) -> tuple[torch.Tensor, Optional[str]]:
        spare, self._spare = self._spare, None
        if spare is not None and spare[0].numel() == nbytes:
            return spare
        return receive_buffer(nbytes)

    def recycle(self, rebuilt: Rebuilt) -> None:
        """``rebuilt``'s buffer is no longer read by anyone: the next version of the same size reuses it."""
        self._spare = (rebuilt.flat, rebuilt.shm_path)

    def read(self, version: int, manifest: WeightManifest) -> Rebuilt:
        """Rebuild delta ``version`` (its small files already verified by the caller); BaseUnusable, DamagedFile,
        FileNotFoundError (``model.delta`` gone)."""
        ref = manifest.base
        if ref.codec != CODEC:
            raise DamagedFile(f"{WEIGHT_DELTA}: codec {ref.codec!r} is not one this reader decodes ({CODEC})")
        entry = manifest.files.get(WEIGHT_DELTA)
        if entry is None:
            raise DamagedFile(f"a delta version's manifest lists no {WEIGHT_DELTA}")
        frames = load_verified(self.run_dir.weight_file(version, WEIGHT_DELTA), entry.size_bytes, entry.hash_algorithm,
                               entry.hash_hex, verify=self.verify)
        nbytes = entry.size_bytes
        from_memory = self.base is not None and self.base.names(ref)
        if not from_memory:
            self.base, n = self._read_base(ref)
            nbytes += n
        layout, total = _layout(manifest.tensors)
        flat, shm_path = self._buffer(total)
        state = views(flat, layout)
        bad = self._decode(manifest, frames, state)
        if bad and from_memory:  # our copy of the base is not what the trainer had: read it again, once
            log.warning("weight version %d: %s rebuilt from the base held in memory (v%d) differs from the "
                        "trainer's; reading the base again from disk", version, bad, ref.version)
            self.base, n = self._read_base(ref)
            nbytes += n
            bad = self._decode(manifest, frames, state)
        if bad:
            raise DamagedFile(f"{WEIGHT_DELTA}: tensor {bad} rebuilt against full version {ref.version} differs "
                              "from the trainer's (xxh3_128)")
        for alias, stored in manifest.aliases.items():
            if stored not in state:
                raise DamagedFile(f"alias {alias} -> {stored}, but the version has no {stored}")
            state[alias] = state[stored]
        return Rebuilt(state, flat, shm_path, layout, nbytes)

    def _decode(self, manifest: WeightManifest, frames: dict[str, torch.Tensor],
                out: dict[str, torch.Tensor]) -> Optional[str]:
        """Decode every tensor into ``out``; the name of the first that does not match its hash (None: all do).
        DamagedFile if a frame is missing, not zstd, or the base lacks the tensor."""
        base = self.base.tensors

        def one(e: TensorEntry) -> bool:
            frame, b, o = frames.get(e.name), base.get(e.name), out[e.name]
            if frame is None:
                raise DamagedFile(f"{WEIGHT_DELTA} has no frame for tensor {e.name}")
            if b is None or b.dtype != o.dtype or b.shape != o.shape:
                raise DamagedFile(f"tensor {e.name}: the base version {self.base.version} has no {e.dtype} "
                                  f"{tuple(e.shape)} tensor of that name")
            try:
                decode_into(b, memoryview(frame.numpy()), o)
            except DeltaMismatch as err:
                raise DamagedFile(f"{WEIGHT_DELTA}: tensor {e.name}: {err}") from None
            return not self.verify or tensor_hash(o) == e.hash_hex  # an empty hash never matches

        ok = parallel(one, manifest.tensors, self.threads)
        return next((e.name for e, good in zip(manifest.tensors, ok) if not good), None)
