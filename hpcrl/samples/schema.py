"""The sample shard schema: the one definition of what a rollout job hands the trainer.

Unit of exchange: a **group** = one prompt and its ``n`` trajectories (GRPO
normalises within a group, so a group is never split).

A shard ``samples/<writer>/shard-NNNNNN.h5`` holds whole groups as flat, fixed-type
1-D datasets plus offsets (the layout that is also SWMR-safe; no vlen types):

====================  =======  ======  ==========================================
dataset               dtype    length  meaning (written by the rollout job)
====================  =======  ======  ==========================================
traj/prompt_tokens    int32    sum P   prompt token ids, trajectories concatenated
traj/prompt_offsets   int64    T + 1   trajectory t's prompt is [off[t], off[t+1])
traj/response_tokens  int32    sum L   sampled response token ids
traj/response_offsets int64    T + 1   as prompt_offsets, for the response arrays
traj/response_mask    int8     sum L   1 = model token (trained), 0 = tool/env token
traj/logprobs         float32  sum L   engine log-prob of each sampled token (after
                                       temperature / top-p: the behaviour policy)
traj/token_versions   int32    sum L   policy version that sampled each token
traj/reward           float32  T       scalar reward of the trajectory
group/traj_offsets    int64    G + 1   group g owns trajectories [off[g], off[g+1])
group/prompt_index    int64    G       position in the writer's prompt stream
group/created_s       float64  G       unix time generation of the group started
group/finished_s      float64  G       unix time the group was complete (reward too)
group/reward_baseline float32  G       *optional*: the reward of one greedy response to
                                       the prompt (``adv_estimator=remax`` only)
traj/truncated        int8     T       *optional*: 1 = the response hit
                                       rollout.response_length (finish reason
                                       ``length``) (``actor.overlong_filter`` only)
traj/filter_metric    float32  T       *optional*: the value of
                                       ``algorithm.filter_groups.metric`` (NaN:
                                       the result lacks it), when that is not the
                                       reward itself (dynamic sampling only)
====================  =======  ======  ==========================================

Optional datasets (:data:`OPTIONAL_DTYPES`) are written only by runs that need them, and
``schema_version`` stays 1: a reader that does not know one ignores it (it reads datasets by
name, from the manifest's layout or the file), and this reader gives ``None`` for one that a
shard lacks (a shard of an older writer, or of a run without remax).

File attributes: ``schema_version``, ``writer``, ``shard_index``.

Commit point: the shard is written as ``shard-N.h5.tmp``, closed, fsync'd and
renamed; then one line is appended (and fsync'd) to ``samples/<writer>/manifest.jsonl``
(:class:`ShardManifestLine`). A group exists for the trainer only once that line
is durable. The trainer reads nothing that is not listed there.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np

from hpcrl.rundir.json_record import JsonRecord

SCHEMA_VERSION = 1


@dataclass
class Trajectory:
    """One response to a prompt. All response arrays have the same length."""

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    logprobs: np.ndarray
    token_versions: np.ndarray
    reward: float
    truncated: Optional[bool] = None
    """The response hit rollout.response_length (None: the run records none; ``traj/truncated``)."""
    filter_metric: Optional[float] = None
    """``algorithm.filter_groups.metric``'s value (None: the run records none; ``traj/filter_metric``)."""

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int32)
        self.response_ids = np.asarray(self.response_ids, dtype=np.int32)
        self.response_mask = np.asarray(self.response_mask, dtype=np.int8)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
        self.token_versions = np.asarray(self.token_versions, dtype=np.int32)
        n = len(self.response_ids)
        for name in ("response_mask", "logprobs", "token_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"trajectory {name} has length {len(getattr(self, name))}, response has {n}")


@dataclass
class Group:
    """A prompt and its trajectories, plus where it came from.

    ``committed_s``, ``shard`` and ``row`` are filled in by the reader (they are
    properties of the commit, not of the generation).
    """

    writer: str
    prompt_index: int
    trajectories: list[Trajectory]
    created_s: float
    finished_s: float
    committed_s: float = float("nan")
    shard: Optional[str] = None
    row: int = -1
    reward_baseline: Optional[float] = None
    """remax's baseline: the reward of a greedy response to the prompt (None: the run writes none)."""

    @property
    def sample_id(self) -> str:
        """Stable id: each prompt index is committed at most once per writer."""
        return f"{self.writer}/{self.prompt_index}"

    @property
    def version_start(self) -> int:
        return int(min(t.token_versions.min(initial=2**31 - 1) for t in self.trajectories))

    @property
    def version_end(self) -> int:
        return int(max(t.token_versions.max(initial=-1) for t in self.trajectories))


@dataclass
class ShardManifestLine(JsonRecord):
    """One line of ``samples/<writer>/manifest.jsonl``: the commit record of a shard.

    Written by the shard's writer after the shard file is durable; read by the trainer.
    """

    shard: str
    """File name inside the writer folder, e.g. ``shard-000042.h5``."""
    shard_index: int
    n_groups: int
    n_trajectories: int
    size_bytes: int
    """Exact file size; a mismatch marks the shard as truncated."""
    sha256: str
    """Checksum of the file; a mismatch marks the shard as corrupted."""
    prompt_indices: list[int]
    """Prompt indices of the groups, in row order."""
    committed_s: float
    """Unix time stamped just before this line was appended (the shard file is already durable)."""
    schema_version: int = SCHEMA_VERSION
    layout: dict = dataclasses.field(default_factory=dict)
    """``{dataset: [byte offset, elements]}`` of each dataset's raw data in the file (-1: empty).
    The reader, having checked sha256, takes the arrays straight from the bytes; without it
    (shards of older writers) it parses the HDF5 file."""



DATASET_DTYPES: dict[str, type] = {
    "traj/prompt_tokens": np.int32,
    "traj/prompt_offsets": np.int64,
    "traj/response_tokens": np.int32,
    "traj/response_offsets": np.int64,
    "traj/response_mask": np.int8,
    "traj/logprobs": np.float32,
    "traj/token_versions": np.int32,
    "traj/reward": np.float32,
    "group/traj_offsets": np.int64,
    "group/prompt_index": np.int64,
    "group/created_s": np.float64,
    "group/finished_s": np.float64,
}
"""Every dataset of a shard and its dtype (the table in the module docstring)."""

OPTIONAL_DTYPES: dict[str, type] = {
    "group/reward_baseline": np.float32,
    "traj/truncated": np.int8,
    "traj/filter_metric": np.float32,
}
"""Datasets a shard may lack (module docstring): one value per group (``group/``) or per trajectory (``traj/``)."""

_TRAJ_OPTIONAL = {"traj/truncated": ("truncated", np.int8), "traj/filter_metric": ("filter_metric", np.float32)}
"""The per-trajectory optional datasets and the :class:`Trajectory` field each holds."""


def groups_to_arrays(groups: list[Group]) -> dict[str, np.ndarray]:
    """The flat datasets of a shard (the table in the module docstring) for ``groups``, in row order."""
    trajs = [t for g in groups for t in g.trajectories]

    def offsets(lengths: list[int]) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)

    cat = lambda name, dt: (np.concatenate([getattr(t, name) for t in trajs]).astype(dt)  # noqa: E731
                            if trajs else np.zeros(0, dt))
    with_baseline = [g.reward_baseline is not None for g in groups]
    assert all(with_baseline) or not any(with_baseline), "a shard's groups all have a reward baseline or none"
    optional = ({"group/reward_baseline": np.array([g.reward_baseline for g in groups], dtype=np.float32)}
                if groups and all(with_baseline) else {})
    for name, (attr, dt) in _TRAJ_OPTIONAL.items():
        given = [getattr(t, attr) is not None for t in trajs]
        assert all(given) or not any(given), f"a shard's trajectories all have {attr} or none"
        if trajs and all(given):
            optional[name] = np.array([getattr(t, attr) for t in trajs], dtype=dt)
    return {
        "traj/prompt_tokens": cat("prompt_ids", np.int32),
        "traj/prompt_offsets": offsets([len(t.prompt_ids) for t in trajs]),
        "traj/response_tokens": cat("response_ids", np.int32),
        "traj/response_offsets": offsets([len(t.response_ids) for t in trajs]),
        "traj/response_mask": cat("response_mask", np.int8),
        "traj/logprobs": cat("logprobs", np.float32),
        "traj/token_versions": cat("token_versions", np.int32),
        "traj/reward": np.array([t.reward for t in trajs], dtype=np.float32),
        "group/traj_offsets": offsets([len(g.trajectories) for g in groups]),
        "group/prompt_index": np.array([g.prompt_index for g in groups], dtype=np.int64),
        "group/created_s": np.array([g.created_s for g in groups], dtype=np.float64),
        "group/finished_s": np.array([g.finished_s for g in groups], dtype=np.float64),
    } | optional


class ShardFormatError(ValueError):
    """A shard's arrays are inconsistent (wrong dtype, offsets out of range, ...)."""


def arrays_from_layout(data: bytes, layout: dict) -> dict[str, np.ndarray]:
    """The datasets of a verified shard image, read at the offsets its manifest line gives
    (copies: the groups outlive ``data``; ``arrays_to_groups`` checks every offset and length)."""
    out = {}
    for name, dt in (DATASET_DTYPES | OPTIONAL_DTYPES).items():
        if name not in layout:
            if name in OPTIONAL_DTYPES:
                continue
            raise ShardFormatError(f"dataset {name} missing from the manifest layout")
        offset, n = layout[name]
        dt = np.dtype(dt).newbyteorder("<")
        if n == 0:
            out[name] = np.zeros(0, dt)
            continue
        if offset < 0 or offset + n * dt.itemsize > len(data):
            raise ShardFormatError(f"dataset {name} at [{offset}, +{n}] lies outside the {len(data)}-byte file")
        out[name] = np.frombuffer(data, dt, n, offset).astype(dt.newbyteorder("="))
    return out


def arrays_to_groups(a: dict[str, np.ndarray], writer: str) -> list[Group]:
    """Rebuild groups, checking every offset so a damaged shard fails here, loudly."""
    for name, dt in DATASET_DTYPES.items():
        if name not in a:
            raise ShardFormatError(f"dataset {name} missing")
        if a[name].dtype != np.dtype(dt) or a[name].ndim != 1:
            raise ShardFormatError(f"dataset {name} has dtype {a[name].dtype} shape {a[name].shape}, expected 1-D {np.dtype(dt)}")
    for name, dt in OPTIONAL_DTYPES.items():
        per, rows = ("group", "group/prompt_index") if name.startswith("group/") else ("trajectory", "traj/reward")
        if name in a and (a[name].dtype != np.dtype(dt) or a[name].shape != a[rows].shape):
            raise ShardFormatError(f"dataset {name} has dtype {a[name].dtype} shape {a[name].shape}, expected "
                                   f"{np.dtype(dt)} with one value per {per}")
    baselines = a.get("group/reward_baseline")
    truncated, metric = a.get("traj/truncated"), a.get("traj/filter_metric")
    g_off = a["group/traj_offsets"]
    n_groups = len(a["group/prompt_index"])
    n_traj = len(a["traj/reward"])
    p_off, r_off = a["traj/prompt_offsets"], a["traj/response_offsets"]
    checks = [
        (len(g_off) == n_groups + 1, "group/traj_offsets length"),
        (len(a["group/created_s"]) == n_groups and len(a["group/finished_s"]) == n_groups, "group time arrays length"),
        (len(p_off) == n_traj + 1 and len(r_off) == n_traj + 1, "trajectory offsets length"),
        (n_groups == 0 or (g_off[0] == 0 and g_off[-1] == n_traj and np.all(np.diff(g_off) >= 1)), "group/traj_offsets values"),
        (n_traj == 0 or (p_off[0] == 0 and p_off[-1] == len(a["traj/prompt_tokens"]) and np.all(np.diff(p_off) >= 0)),
         "traj/prompt_offsets values"),
        (n_traj == 0 or (r_off[0] == 0 and r_off[-1] == len(a["traj/response_tokens"]) and np.all(np.diff(r_off) >= 0)),
         "traj/response_offsets values"),
        (all(len(a[k]) == len(a["traj/response_tokens"]) for k in
             ("traj/response_mask", "traj/logprobs", "traj/token_versions")), "per-token array lengths"),
    ]
    for ok, what in checks:
        if not ok:
            raise ShardFormatError(f"inconsistent {what}")
    groups = []
    for g in range(n_groups):
        trajs = []
        for t in range(int(g_off[g]), int(g_off[g + 1])):
            ps, pe, rs, re_ = int(p_off[t]), int(p_off[t + 1]), int(r_off[t]), int(r_off[t + 1])
            trajs.append(Trajectory(
                prompt_ids=a["traj/prompt_tokens"][ps:pe], response_ids=a["traj/response_tokens"][rs:re_],
                response_mask=a["traj/response_mask"][rs:re_], logprobs=a["traj/logprobs"][rs:re_],
                token_versions=a["traj/token_versions"][rs:re_], reward=float(a["traj/reward"][t]),
                truncated=None if truncated is None else bool(truncated[t]),
                filter_metric=None if metric is None else float(metric[t])))
        groups.append(Group(writer=writer, prompt_index=int(a["group/prompt_index"][g]), trajectories=trajs,
                            created_s=float(a["group/created_s"][g]), finished_s=float(a["group/finished_s"][g]), row=g,
                            reward_baseline=None if baselines is None else float(baselines[g])))
    return groups
