"""Code that runs inside vLLM's worker processes (``worker_extension_cls``): load a weight version from a
buffer in the node's shared memory (``hpcrl/weights/shared_memory.py``).

The rollout process received the version by broadcast into a file in ``/dev/shm``; it calls
``collective_rpc("hpcrl_load_mapped", kwargs={path, nbytes, layout})`` on the paused engine. Every
worker (one per tensor-parallel rank) maps the file (privately: it only reads) and hands vLLM's in-place reload the
tensors as views of the mapping, in the checkpoint's (HF) names; vLLM's ``load_weights`` shards them
and copies them into its parameters (onto the GPU on GPUs). Nothing is copied between processes and
nothing is pickled: the layout is JSON-able lists.
"""
from __future__ import annotations

import os
import time
from typing import Iterator

import torch

WORKER_EXTENSION = "hpcrl.rollout.vllm_worker.MappedWeightsLoader"
"""The qualified name given to vLLM as ``worker_extension_cls``."""


def mapped_tensors(path: str, nbytes: int, layout: list[list]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views of the buffer file at ``path`` (``layout``: ``wire.Entry`` rows, the
    rollout process's ``WeightVersion.mapped``)."""
    from hpcrl.weights.wire import Entry, views

    size = os.stat(path).st_size  # FileNotFoundError if gone: never map (or create) a file of zeros
    if size != nbytes:
        raise ValueError(f"weight buffer {path} has {size} bytes, the layout {nbytes}")
    flat = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)  # private: cannot create the file
    return iter(views(flat, [Entry(*row) for row in layout]).items())


class MappedWeightsLoader:
    """Mixed into vLLM's worker class by vLLM (``self`` is the worker)."""

    def hpcrl_load_mapped(self, path: str, nbytes: int, layout: list[list]) -> dict:
        """Load the tensors of the buffer at ``path`` into this worker's model in place; how many
        tensors and how long it took."""
        t0 = time.monotonic()
        self.reload_weights(weights_iterator=mapped_tensors(path, nbytes, layout), is_checkpoint_format=True)
        return {"tensors": len(layout), "seconds": time.monotonic() - t0}
