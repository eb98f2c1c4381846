"""Rank 0 reads the samples; every trainer rank gets the same groups, without pickle.

The groups travel as the shard schema's flat arrays (``groups_to_arrays``) in
``torch.distributed.broadcast`` calls, after a header with a status code, so a
rank never unpickles anything and all ranks agree on what happens next:

- ``BATCH``: a batch follows;
- ``PREEMPT``: checkpoint now and requeue (USR2 reached rank 0);
- ``STOP``: checkpoint now and end (the launcher asked the run to stop);
- ``ABORT``: rank 0 failed (e.g. timed out waiting for samples); every rank raises;
- ``REPUBLISH``: a rollout job marked the newest weight version damaged: every rank
  takes part in publishing the current weights as a new version.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from hpcrl.samples.schema import DATASET_DTYPES, OPTIONAL_DTYPES, Group, arrays_to_groups, groups_to_arrays

BATCH, PREEMPT, ABORT, REPUBLISH, STOP = 0, 1, 2, 3, 4
_DTYPES = DATASET_DTYPES | OPTIONAL_DTYPES
_NAMES = list(_DTYPES)
ABSENT = -1
"""Header length of an optional dataset the batch does not have."""


def share_groups(status: int, groups: Optional[list[Group]]) -> tuple[int, list[Group]]:
    """Call on every rank; rank 0 passes its status and groups, the others (None, None)."""
    if dist.get_world_size() == 1:
        return status, groups or []
    rank0 = dist.get_rank() == 0
    arrays = groups_to_arrays(groups) if rank0 and status == BATCH else {}
    header = torch.zeros(1 + len(_NAMES), dtype=torch.int64)
    if rank0:
        header[0] = status
        for i, name in enumerate(_NAMES):
            header[1 + i] = len(arrays[name]) if name in arrays else ABSENT
    dist.broadcast(header, src=0)
    status = int(header[0])
    if status != BATCH:
        return status, []
    out = {}
    for i, name in enumerate(_NAMES):
        if int(header[1 + i]) == ABSENT:
            continue
        dtype = np.dtype(_DTYPES[name])
        # int8/float32/... travel as their own dtype; gloo handles them all
        t = torch.from_numpy(arrays[name]) if rank0 else torch.empty(int(header[1 + i]),
                                                                      dtype=torch.from_numpy(np.zeros(0, dtype)).dtype)
        dist.broadcast(t, src=0)
        out[name] = t.numpy()
    return BATCH, groups if rank0 else arrays_to_groups(out, writer="")


def share_json(obj) -> dict:
    """Rank 0's JSON-able object on every rank (as UTF-8 bytes, not pickle)."""
    if dist.get_world_size() == 1:
        return obj
    import json

    data = json.dumps(obj).encode() if dist.get_rank() == 0 else b""
    n = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(n, src=0)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return json.loads(bytes(buf.numpy()).decode())
