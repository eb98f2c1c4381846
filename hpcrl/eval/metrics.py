"""verl's validation metrics, with verl's names and definitions (verl 0.9.1:
``verl/trainer/ppo/metric_utils.py: process_validation_metrics`` and ``ray_trainer.py: _val_metrics_update``).

Inputs, per response: its data source, its prompt's id (verl's ``uid``) and its values by key: ``reward``
(the score) and every field a dict-valued reward returned (``score``, ``acc``, ``pred``, ...). Then, as verl:

1. **Per prompt and key** (None values dropped; a key whose first value is a string, such as ``pred``, is
   no metric), with N the prompt's number of values: ``mean@N`` = the mean; for N > 1 ``std@N`` = the
   population standard deviation, and for each k in 2, 4, 8, ... below N, and N itself, from 1000 bootstrap
   draws of k values with replacement: ``best@k/mean|std`` and ``worst@k/mean|std`` (mean and std of the
   draws' max and min) and, when every response has a ``pred``, ``maj@k/mean|std``: per draw the value of
   the most frequent ``pred`` (ties: the one drawn first; its value: that of its first draw).
   **The bootstrap**: every draw of every (prompt, key, k) uses the indices of a fresh
   ``numpy.random.RandomState(seed)`` (``seed`` = 42, verl's default): ``choice(N, size=(1000, k))``, which
   is what verl's ``np.random.seed(seed); np.random.choice(...)`` draws (here without touching numpy's
   global state). So two prompts with the same N and k see the same indices, as in verl.
2. **Per data source**: each metric is the mean over the prompts that have it.
3. **Names**: ``val-core/<data_source>/<key>/<metric>`` for the core key (``acc`` if the source reports it,
   else ``reward``) and the metrics starting with ``mean``, ``maj`` or ``best`` that mention ``@<largest
   N>``; ``val-aux/...`` for everything else (verl's rule, including its substring test).

hpcrl adds, per data source, ``val-aux/<data_source>/response_length/mean`` and ``.../clip_ratio``, and over
all responses ``val-aux/num_turns/{min,max,mean}`` (verl's, for its agent loops). The headline
:func:`headline` is the mean over data sources of their core ``mean@N``.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import numpy as np

from hpcrl.logs import metric_names as M

N_BOOTSTRAP = 1000
"""Bootstrap draws per (prompt, key, k), as verl."""
SEED = 42
"""verl's default seed of ``process_validation_metrics``."""


def bootstrap_sizes(n: int) -> list[int]:
    """The k of best@k / worst@k / maj@k for a prompt with n values: 2, 4, 8, ... below n, then n (none for n <= 1)."""
    if n <= 1:
        return []
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def bootstrap_indices(n_data: int, k: int, seed: int = SEED, n_bootstrap: int = N_BOOTSTRAP) -> np.ndarray:
    """verl's draws: ``np.random.seed(seed); np.random.choice(n_data, size=(n_bootstrap, k), replace=True)``."""
    return np.random.RandomState(seed).choice(n_data, size=(n_bootstrap, k), replace=True)


def majority_values(values: np.ndarray, preds: list, idx: np.ndarray) -> np.ndarray:
    """Per draw (row of ``idx``): the value of the most frequent pred, ties to the pred drawn first, the value of
    its first draw (verl's ``calc_maj_val`` on each draw, vectorised)."""
    codes = {}
    code = np.array([codes.setdefault(p, len(codes)) for p in preds])[idx]       # (draws, k)
    count_at = (code[:, :, None] == code[:, None, :]).sum(axis=2)               # count of each drawn pred
    first = np.argmax(count_at == count_at.max(axis=1, keepdims=True), axis=1)  # first draw of a most frequent
    return values[idx[np.arange(len(idx)), first]]


def prompt_metrics(values: list, preds: Optional[list], seed: int = SEED) -> dict[str, float]:
    """Step 1 of the module docstring for one prompt and key (``values`` without Nones)."""
    vals = np.asarray(values, dtype=np.float64)
    n = len(vals)
    out = {f"mean@{n}": float(np.mean(vals))}
    if n <= 1:
        return out
    out[f"std@{n}"] = float(np.std(vals))
    with_pred = preds is not None and len(preds) == n and all(p is not None for p in preds)
    for k in bootstrap_sizes(n):
        idx = bootstrap_indices(n, k, seed)
        drawn = vals[idx]
        for name, stat in (("best", drawn.max(axis=1)), ("worst", drawn.min(axis=1))):
            out[f"{name}@{k}/mean"], out[f"{name}@{k}/std"] = float(np.mean(stat)), float(np.std(stat))
        if with_pred:
            maj = majority_values(vals, preds, idx)
            out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = float(np.mean(maj)), float(np.std(maj))
    return out


def validation_metrics(data_sources: list[str], uids: list[str], infos: dict[str, list[Any]],
                       seed: int = SEED) -> dict[str, dict[str, dict[str, float]]]:
    """``{data_source: {key: {metric: value}}}`` (steps 1 and 2): verl's ``process_validation_metrics``
    without its ``expected_acc_counts`` (every response here is scored)."""
    grouped: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for i, (source, uid) in enumerate(zip(data_sources, uids)):
        for key, vals in infos.items():
            grouped[source][uid][key].append(vals[i])
    per_source: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for source, by_uid in grouped.items():
        for uid, by_key in by_uid.items():
            preds = by_key.get("pred")
            for key, raw in by_key.items():
                vals = [v for v in raw if v is not None]
                if not vals or isinstance(vals[0], str):
                    continue
                if not all(isinstance(v, (int, float, bool)) for v in vals):  # verl would fail on these
                    continue
                for metric, value in prompt_metrics(vals, preds, seed).items():
                    per_source[source][key][metric].append(value)
    return {source: {key: {metric: float(np.mean(v)) for metric, v in by_metric.items()}
                     for key, by_metric in by_key.items()} for source, by_key in per_source.items()}


def core_key(by_key: dict) -> str:
    """The key a data source is judged by: ``acc`` if it reports one, else ``reward`` (verl)."""
    return "acc" if "acc" in by_key else "reward"


def largest_n(by_metric: dict) -> int:
    """The largest N among a key's metric names (``mean@8``, ``best@4/std``, ...)."""
    return max(int(name.split("@")[-1].split("/")[0]) for name in by_metric)


def metric_names(nested: dict) -> dict[str, float]:
    """Step 3: the flat ``val-core/...`` / ``val-aux/...`` metrics of :func:`validation_metrics`'s result."""
    out = {}
    for source, by_key in nested.items():
        core = core_key(by_key)
        for key, by_metric in by_key.items():
            n_max = largest_n(by_metric)
            for metric, value in by_metric.items():
                is_core = key == core and metric.startswith(("mean", "maj", "best")) and f"@{n_max}" in metric
                out[f"{M.VAL_CORE if is_core else M.VAL_AUX}/{source}/{key}/{metric}"] = value
    return out


def headline(nested: dict) -> tuple[Optional[float], str]:
    """(the mean over data sources of their core ``mean@N``, what it is); (None, "") without data."""
    names = []
    values = []
    for source, by_key in sorted(nested.items()):
        core = core_key(by_key)
        if core not in by_key:
            continue
        n = largest_n(by_key[core])
        if f"mean@{n}" in by_key[core]:
            names.append(f"{M.VAL_CORE}/{source}/{core}/mean@{n}")
            values.append(by_key[core][f"mean@{n}"])
    if not values:
        return None, ""
    name = names[0] if len(names) == 1 else f"mean over {len(names)} data sources of {', '.join(names)}"
    return float(np.mean(values)), name


def response_metrics(data_sources: list[str], lengths: list[int], clipped: list[bool],
                     turns: list[int]) -> dict[str, float]:
    """hpcrl's additions: response length and clip ratio per data source, turns over all responses."""
    out: dict[str, float] = {}
    for source in sorted(set(data_sources)):
        mine = [i for i, s in enumerate(data_sources) if s == source]
        out[f"{M.VAL_AUX}/{source}/{M.VAL_RESPONSE_LENGTH}"] = float(np.mean([lengths[i] for i in mine]))
        out[f"{M.VAL_AUX}/{source}/{M.VAL_CLIP_RATIO}"] = float(np.mean([clipped[i] for i in mine]))
    if turns:
        out[f"{M.VAL_AUX}/num_turns/min"] = float(np.min(turns))
        out[f"{M.VAL_AUX}/num_turns/max"] = float(np.max(turns))
        out[f"{M.VAL_AUX}/num_turns/mean"] = float(np.mean(turns))
    return out
