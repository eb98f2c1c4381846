"""CUDA's tensor rules, enforced on CPU for the test session and every Python process it starts.

CPU torch quietly allows a few things CUDA refuses, so CPU-green code can crash at its first step
on a GPU (it did: a float64 group mean put into a float32 tensor by a boolean mask). This module
makes the CPU refuse them too, for code of this repository only (a frame whose file lies under
the repository root; torch, transformers and vLLM are left alone):

- **index put**: an assignment through an advanced index (a tensor, list or array among the
  indices: ``x[mask] = v``, ``x[idx] = v``, ``x.index_put_(...)``) whose value is a tensor of
  another dtype. CUDA raises "Index put requires the source and destination dtypes match"; CPU
  raises it too except for a 0-dim value under a boolean mask, which it casts silently.

Device mismatches cannot be emulated on a CPU-only machine this way; ``tests/test_cuda_math.py``
runs the trainer's math with a ``meta`` default device, so a tensor created without ``device=``
meets its inputs on another device, as on CUDA.

Installed by ``tests/conftest.py`` (``install()``) and, through the ``sitecustomize.py`` beside
this file that conftest puts on ``PYTHONPATH``, in every job a test starts. ``HPCRL_CUDA_RULES=0``
turns it off (to see whether a failure is this module's).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[2]) + os.sep
"""Code under this folder is checked (hpcrl/, tests/, bench/)."""


class CudaRuleError(RuntimeError):
    """What CUDA would have refused; the message says the fix."""


def _advanced(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(type(i).__name__ in ("Tensor", "ndarray", "list", "Parameter") for i in items)


def _ours(depth: int) -> bool:
    frame = sys._getframe(depth)
    return frame.f_code.co_filename.startswith(REPO) and "cuda_rules" not in frame.f_code.co_filename


def _check_index_put(dst, value, where: str) -> None:
    import torch

    if isinstance(value, torch.Tensor) and value.dtype != dst.dtype and _ours(3):
        frame = sys._getframe(2)
        raise CudaRuleError(
            f"{where}: the value is {value.dtype} and the destination {dst.dtype} (at "
            f"{frame.f_code.co_filename}:{frame.f_lineno}). CUDA refuses an indexed assignment across dtypes "
            f"('Index put requires the source and destination dtypes match'); CPU casts a 0-dim value silently. "
            f"Cast the value first: .to(dst.dtype)")


def install() -> None:
    """Wrap ``Tensor.__setitem__`` and ``Tensor.index_put_``/``index_put`` (once per process)."""
    import torch

    if os.environ.get("HPCRL_CUDA_RULES", "1") == "0" or getattr(torch.Tensor, "_hpcrl_cuda_rules", False):
        return
    setitem, index_put_, index_put = torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put

    def __setitem__(self, index, value):
        if _advanced(index):
            _check_index_put(self, value, "indexed assignment")
        return setitem(self, index, value)

    def checked_index_put_(self, indices, values, accumulate=False):
        _check_index_put(self, values, "index_put_")
        return index_put_(self, indices, values, accumulate)

    def checked_index_put(self, indices, values, accumulate=False):
        _check_index_put(self, values, "index_put")
        return index_put(self, indices, values, accumulate)

    torch.Tensor.__setitem__ = __setitem__
    torch.Tensor.index_put_ = checked_index_put_
    torch.Tensor.index_put = checked_index_put
    torch.Tensor._hpcrl_cuda_rules = True
