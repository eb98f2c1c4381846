"""The delta codec: a tensor as its changes against the same tensor of a base version.

After one optimizer step at RL learning rates only a few per cent of the bf16 values of a policy change
(fp32 master weights move by ~lr per step; a bf16 value changes when that crosses a rounding boundary).
So a version is written as, per tensor, the XOR of its raw bits with the base's (zero wherever nothing
changed), compressed with zstd (level 1: the runs of zeros are what it removes, and level 1 already
finds them). ``bench/bench_delta.py`` measured this against sparse indices + values on a 0.5B model's real
updates (docs/weights-and-samples.md, "Delta weight versions").

Why XOR and not a difference: it is exact for every dtype (no float rounding, NaN and -0.0 survive),
needs no arithmetic in the tensor's dtype, and decoding is one pass that lands in the output buffer.

File: ``model.delta`` is a safetensors file (``safetensors_io.save_hashed``: hashed while written,
verified before use) holding one uint8 tensor per stored tensor, the zstd frame of its XOR. It is not
named ``*.safetensors``, so no engine ever loads it as weights. What the rebuilt tensors must be (dtype,
shape, xxh3_128 of their bytes) is in the version's manifest.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import torch
import xxhash
import zstandard

CODEC = "xor-zstd"
"""What :attr:`hpcrl.weights.manifest.DeltaBase.codec` names for this module's encoding."""
ZSTD_LEVEL = 1
"""Compression level (bench/bench_delta.py: higher levels cost several times the time for a few per cent)."""

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaMismatch(ValueError):
    """A frame does not decode to the size its tensor needs (a damaged or foreign ``model.delta``)."""


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a contiguous tensor as a flat integer tensor of the same element size (no copy)."""
    return t.reshape(-1).view(_BITS[t.element_size()])


def tensor_hash(t: torch.Tensor) -> str:
    """xxh3_128 hex of a contiguous CPU tensor's bytes (what a manifest's :attr:`TensorEntry.hash_hex` holds)."""
    return xxhash.xxh3_128(memoryview(t.reshape(-1).view(torch.uint8).numpy())).hexdigest()


def encode(base: torch.Tensor, new: torch.Tensor) -> tuple[bytes, str]:
    """The zstd frame of ``new`` XOR ``base`` (same dtype, shape, CPU, contiguous) and the hash of ``new``."""
    if base.dtype != new.dtype or base.shape != new.shape:
        raise ValueError(f"delta of a {new.dtype} {tuple(new.shape)} tensor against a {base.dtype} "
                         f"{tuple(base.shape)} one")
    x = torch.bitwise_xor(bits(base), bits(new))
    frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(memoryview(x.view(torch.uint8).numpy()))
    return frame, tensor_hash(new)


def decode_into(base: torch.Tensor, frame: memoryview, out: torch.Tensor) -> None:
    """Write ``base`` XOR (the decoded ``frame``) into ``out`` (contiguous, ``base``'s dtype and size, CPU);
    DeltaMismatch if the frame does not decode to exactly that many bytes."""
    n = out.numel() * out.element_size()
    raw = out.reshape(-1).view(torch.uint8)
    got = 0
    if n:
        view = memoryview(raw.numpy())
        try:
            with zstandard.ZstdDecompressor().stream_reader(frame) as reader:
                while got < n:
                    k = reader.readinto(view[got:])
                    if not k:
                        break
                    got += k
                extra = reader.read(1)
        except zstandard.ZstdError as e:
            raise DeltaMismatch(f"not a zstd frame ({e})") from None
        if got != n or extra:
            raise DeltaMismatch(f"decodes to {'more than ' if extra else ''}{got} bytes, the tensor has {n}")
    torch.bitwise_xor(bits(out), bits(base), out=bits(out))


def parallel(fn: Callable, items: Iterable, threads: int) -> list:
    """``[fn(x) for x in items]`` on ``threads`` threads, in order (zstd and torch's XOR release the GIL)."""
    items = list(items)
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="delta") as pool:
        return list(pool.map(fn, items))


def changed_elements(base: torch.Tensor, new: torch.Tensor) -> int:
    """How many elements of ``new`` differ bitwise from ``base``: what a delta has to carry."""
    return int((bits(base) != bits(new)).sum())
