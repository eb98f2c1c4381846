"""Files written and checked by hash, without torch: the hash a manifest names, the check of a small file against
its manifest entry and a write that hashes the bytes it writes (one pass). :mod:`hpcrl.weights.safetensors_io`
builds weight files on these; the launcher uses them alone (a base model's hash on a login node, where importing
torch costs seconds)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

import xxhash

HASH_ALGORITHM = "xxh3_128"
"""What the trainer writes into :attr:`FileEntry.hash_algorithm`."""
HASHES: dict[str, Callable] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
"""Algorithms a reader can verify."""
CHUNK_BYTES = 1 << 20
"""Write and hash granularity: small enough that the hash reads what the write just touched."""


class DamagedFile(Exception):
    """A weight file is not what its manifest says (size, hash) or not a safetensors file."""


def write_hashed(path: Path, data: bytes | memoryview, f_hash) -> int:
    """Write ``data`` to ``path`` in chunks, feeding each to ``f_hash``; fsync; return the size."""
    mv = memoryview(data)
    with open(path, "wb", buffering=0) as f:
        for i in range(0, len(mv), CHUNK_BYTES):
            chunk = mv[i:i + CHUNK_BYTES]
            f_hash.update(chunk)
            f.write(chunk)
        os.fsync(f.fileno())
    return len(mv)


def check_file(path: Path, size_bytes: int, hash_algorithm: str, hash_hex: str) -> None:
    """Verify a small file's size and hash (``config.json``); DamagedFile if it differs."""
    if hash_algorithm and hash_algorithm not in HASHES:
        raise DamagedFile(f"{path.name}: unknown hash {hash_algorithm!r} in the manifest (known: {sorted(HASHES)})")
    data = path.read_bytes()
    if len(data) != size_bytes:
        raise DamagedFile(f"{path.name}: {len(data)} bytes, manifest says {size_bytes} (torn file)")
    if hash_algorithm and HASHES[hash_algorithm](data).hexdigest() != hash_hex:
        raise DamagedFile(f"{path.name}: {hash_algorithm} differs from the manifest (damaged bytes)")
