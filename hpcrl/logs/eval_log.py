"""The evaluation's records: ``logs/eval.jsonl`` (one :class:`EvalRow` per weight version) and
``logs/eval_samples.jsonl.gz`` (one :class:`EvalSample` per evaluated response), defined once here.

=========================  =============================  ===========================================
file                       written by                     read by
=========================  =============================  ===========================================
logs/eval.jsonl            evaluation job, ``hpcrl eval``  the evaluation job at restart (which versions
                                                          are done), ``hpcrl status``, ``hpcrl report``,
                                                          the launcher's follower
logs/eval_samples.jsonl.gz the same                        ``hpcrl report`` (examples), users
=========================  =============================  ===========================================

Both are append-only with one writer at a time (the evaluation job, or an offline ``hpcrl eval`` while
no evaluation job is alive). A version's samples are appended first, then its row: **the row is the
commit point**. It records the samples file's size after them (``samples_bytes``), so a restarted writer
cuts the samples of a version whose row never came (:func:`committed_samples_bytes`). The samples are
compressed, a gzip member per version (responses are most of a run's evaluation bytes), so that size falls
where a member ends; an older run's plain ``logs/eval_samples.jsonl`` is read and continued as it is. A version is
*handled* once it has a row: ``evaluated``, ``skipped`` (the job was behind, or it was deleted before the
job got to it; ``reason`` says which) or ``damaged`` (its files failed verification: marked bad, never
evaluated).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from hpcrl.rundir.fsio import read_jsonl
from hpcrl.rundir.json_record import JsonRecord, RecordError

log = logging.getLogger(__name__)

EVALUATED, SKIPPED, DAMAGED = "evaluated", "skipped", "damaged"
""":attr:`EvalRow.status` values."""
STATUSES = (EVALUATED, SKIPPED, DAMAGED)
JOB, OFFLINE = "job", "offline"
""":attr:`EvalRow.source` values: the run's evaluation job, or ``hpcrl eval``."""


@dataclass
class EvalRow(JsonRecord):
    """One row of ``logs/eval.jsonl``: what became of one weight version (or model folder)."""

    version: int
    """The weight version; -1 for a model folder (``hpcrl eval --model``)."""
    status: str
    """``evaluated``, ``skipped`` or ``damaged`` (module docstring)."""
    source: str = JOB
    """``job`` (the evaluation job) or ``offline`` (``hpcrl eval``)."""
    trainer_step: int = -1
    """Local updates the trainer had done when it published the version (the x axis of the curves)."""
    published_s: float = 0.0
    """Unix time the version was published (its manifest's ``published_s``; 0 for a model folder)."""
    started_s: float = 0.0
    """Unix time the evaluation (or the decision to skip) began."""
    finished_s: float = 0.0
    """Unix time the row was written."""
    load_s: float = 0.0
    """Seconds to take (verify) the version and load it into the engine."""
    eval_s: float = 0.0
    """Seconds to generate and score every response."""
    prompts: int = 0
    """Held-out prompts evaluated."""
    n: int = 0
    """Responses per prompt."""
    samples: int = 0
    """Rows this version added to ``logs/eval_samples.jsonl.gz``."""
    score: Optional[float] = None
    """The headline: the mean over data sources of their core ``mean@n`` (:attr:`score_name`); None unless evaluated."""
    score_name: str = ""
    """What :attr:`score` is (``val-core/<data_source>/<key>/mean@<n>``, or the mean of several such)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """verl's validation metrics (``val-core/...``, ``val-aux/...``) and the response lengths."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """How responses were sampled (n, do_sample, temperature, top_p, top_k, response_length, engine)."""
    reason: str = ""
    """Why a version was skipped or found damaged."""
    model: str = ""
    """The model folder of an offline ``hpcrl eval --model`` (empty for weight versions)."""
    samples_bytes: int = 0
    """Size of ``logs/eval_samples.jsonl.gz`` after this version's samples (what a restarted writer keeps)."""

    def check(self) -> None:
        """A known status and source."""
        if self.status not in STATUSES:
            raise RecordError(f"EvalRow.status {self.status!r}; allowed: {', '.join(STATUSES)}")
        if self.source not in (JOB, OFFLINE):
            raise RecordError(f"EvalRow.source {self.source!r}; allowed: {JOB}, {OFFLINE}")


@dataclass
class EvalSample(JsonRecord):
    """One row of ``logs/eval_samples.jsonl.gz``: one response to one held-out prompt."""

    version: int
    """The weight version it was generated with (-1: a model folder)."""
    prompt_id: str
    """``<file index>:<row index>`` of the prompt in ``data.val_files`` (verl's ``uid``)."""
    data_source: str
    index: int
    """Which of the prompt's n responses (0-based)."""
    prompt: str
    """The prompt as text (chat template applied, special tokens dropped)."""
    response: str
    """The response as the reward saw it."""
    ground_truth: str
    reward: float
    """The score the reward gave (0 if it raised)."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Everything else a dict-valued reward returned (``acc``, ``pred``, ...)."""
    response_tokens: int = 0
    finish_reason: str = ""
    """``stop`` (EOS), ``length`` (cut at the response length) or an agent loop's reason."""
    num_turns: int = 0
    source: str = JOB


def split_metric(name: str) -> tuple[str, str, str, str]:
    """``val-core/openai/gsm8k/acc/best@4/mean`` -> (``val-core``, ``openai/gsm8k``, ``acc``, ``best@4/mean``): a
    data source may hold slashes, so the name is read from the right (a metric is ``mean@8``, ``mean`` or
    ``<stat>@<k>/<mean|std>``). ``val-aux/num_turns/mean`` has no data source (``""``)."""
    parts = name.split("/")
    cut = 2 if len(parts) >= 4 and parts[-1] in ("mean", "std") and "@" in parts[-2] else 1
    metric, key = "/".join(parts[-cut:]), parts[-cut - 1]
    return parts[0], "/".join(parts[1:-cut - 1]), key, metric


def finite_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of ``metrics`` that JSON can hold (finite floats)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
            out[k] = float(v)
    return out


def read_eval_rows(path: os.PathLike | str, source: Optional[str] = None) -> list[EvalRow]:
    """The complete, valid rows of an eval log (``source``: only those of ``job`` or ``offline``); a torn
    or invalid line is skipped with a warning."""
    rows = []
    for i, d in enumerate(read_jsonl(path, on_bad_line=lambda n, text: log.warning(
            "%s line %d is incomplete or invalid, skipped: %r", path, n, text[:80])), 1):
        try:
            row = EvalRow.from_json(d, f"{path} row {i}")
        except RecordError as e:
            log.warning("%s", e)
            continue
        if source is None or row.source == source:
            rows.append(row)
    return rows


def read_eval_samples(path: os.PathLike | str, version: Optional[int] = None) -> list[EvalSample]:
    """The valid rows of an eval samples log (of one ``version`` if given); invalid lines are skipped."""
    out = []
    for d in read_jsonl(path):
        try:
            s = EvalSample.from_json(d)
        except RecordError:
            continue
        if version is None or s.version == version:
            out.append(s)
    return out


def committed_samples_bytes(rows: list[EvalRow]) -> int:
    """How much of the samples log the rows commit: the last row's ``samples_bytes`` (0 without rows)."""
    return rows[-1].samples_bytes if rows else 0


def last_evaluated(rows: list[EvalRow]) -> Optional[EvalRow]:
    """The newest evaluated row (by version, then time), or None."""
    done = [r for r in rows if r.status == EVALUATED]
    return max(done, key=lambda r: (r.version, r.finished_s)) if done else None
