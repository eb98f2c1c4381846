"""The candidates of ``hpcrl plan`` and how they are searched.

A candidate is a split of ``--gpus`` into trainer GPUs and rollout engines (``--gpus-per-engine`` each) and an
async setting (staleness_threshold, partial_rollout). The config's own setting is always one; ``--staleness``,
``--partial`` and ``--splits`` choose the rest (:class:`SweepSpec`). Every candidate is predicted with the fast
event simulation (:mod:`hpcrl.plan.events`), unless an upper bound shows it cannot be among the best:

- **the trainer** updates for ``update_model_s(tokens)`` per update and publishes for ``publish_s`` every K, so
  a run trains at most ``tokens / (update + publish / K)`` tokens per second;
- **the engines** together run at most ``B * n`` sequences (the admission budget), each at most
  ``min(max_num_seqs, max_concurrent_groups * n)``; a decoding step's tokens per second grow with the batch
  and flatten (``m / (base + per_seq * m)`` is concave), so spreading them evenly is the most the fleet makes,
  and each engine loses ``weight_load_s`` per version.

``tokens`` is the mean of the candidates' own response lengths. The smaller bound, raised by
:data:`BOUND_MARGIN`, is compared with the ``keep``-th best prediction so far, best bound first; once it is
below, no remaining candidate can enter the best ``keep`` and the search stops (``--all`` simulates every one).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from hpcrl.config import RunConfig
from hpcrl.config.simulated import SimulatedConfig
from hpcrl.plan.events import predict
from hpcrl.plan.model import Draws, Knobs, Prediction

STALENESS = (0.0, 0.5, 1.0)
PARTIAL = (False, True)
BOUND_MARGIN = 0.05
"""The bound uses the mean response length, not each window's: 5 % covers a window of long responses
(``tests/test_plan_sweep.py`` checks the pruned search against the exhaustive one)."""
EVERY_SPLIT_UP_TO = 64
"""Budgets up to this many GPUs try every trainer size a cluster can give; larger ones whole nodes (and 1, 2, 4)."""
GPUS_PER_NODE = 8
"""A node's GPUs when neither ``--gpus-per-node`` nor the config's resources say: a trainer past one node takes whole
nodes of them (the splits tried, the printed resources)."""


def cluster_shape(trainer_gpus: int, gpus_per_node: int) -> bool:
    """A trainer of this many GPUs is a shape a cluster of ``gpus_per_node``-GPU nodes can give: part of one node, or
    whole nodes (``resources.trainer.nodes`` x ``gpus_per_node``; 31 GPUs on one node is no shape of 8-GPU nodes)."""
    return trainer_gpus <= gpus_per_node or trainer_gpus % gpus_per_node == 0


@dataclass
class Candidate:
    knobs: Knobs
    prediction: Optional[Prediction] = None
    bound_tokens_per_s: float = 0.0

    def overrides(self, gpus_per_engine: int, gpus_per_node: int = GPUS_PER_NODE) -> str:
        """What to launch: the async knobs and the resources (a trainer past one node in whole nodes of
        ``gpus_per_node``, one rank per GPU; a simulated run takes the trainer's GPUs as simulated.trainer_gpus)."""
        k = self.knobs
        t = k.trainer_gpus
        nodes, per_node = (t // gpus_per_node, gpus_per_node) if t > gpus_per_node else (1, t)
        trainer = (f"resources.trainer.nodes={nodes} resources.trainer.tasks_per_node={per_node} "
                   f"resources.trainer.gpus_per_node={per_node}" if cluster_shape(t, gpus_per_node)
                   else "resources.trainer as the config has it")  # only the config's own request can be another shape
        return (f"async_training.staleness_threshold={k.staleness_threshold:g} "
                f"async_training.partial_rollout={str(k.partial_rollout).lower()} {trainer} "
                f"resources.rollout_jobs={k.rollout_jobs} resources.rollout.gpus_per_node={gpus_per_engine} "
                f"(simulated: simulated.trainer_gpus={t})")

    @property
    def key(self) -> tuple:
        k = self.knobs
        return (k.trainer_gpus, k.rollout_jobs, k.staleness_threshold, k.partial_rollout)


@dataclass
class SweepSpec:
    """What to try (``hpcrl plan``'s options)."""

    gpus: int
    gpus_per_engine: int = 1
    updates: int = 32
    staleness: tuple = STALENESS
    partial: tuple = PARTIAL
    splits: Optional[list] = None
    """Trainer GPU counts to try; None: every one a cluster can give (:func:`cluster_shape`) up to
    :data:`EVERY_SPLIT_UP_TO` GPUs, else 1, 2, 4 and whole nodes."""
    gpus_per_node: int = GPUS_PER_NODE
    """GPUs of one node: a trainer past it takes whole nodes, an engine fits in one."""


def parse_splits(text: str) -> list[int]:
    """``--splits``: trainer GPU counts as a list (``8,16,32``), a range (``8:64``, every count) or a range with a
    step (``8:64:8``), or several joined by commas; ValueError naming what is wrong."""
    out: list[int] = []
    for part in text.split(","):
        bits = part.strip().split(":")
        try:
            nums = [int(b) for b in bits]
        except ValueError:
            raise ValueError(f"--splits {text}: {part!r} is not a number or a range START:STOP[:STEP] of "
                             "trainer GPUs (e.g. 8,16,32 or 8:64:8)") from None
        if len(nums) == 1:
            out.append(nums[0])
        elif len(nums) in (2, 3) and (len(nums) == 2 or nums[2] >= 1):
            out += list(range(nums[0], nums[1] + 1, nums[2] if len(nums) == 3 else 1))
        else:
            raise ValueError(f"--splits {text}: {part!r} must be START:STOP or START:STOP:STEP with STEP >= 1")
    if not out or min(out) < 1:
        raise ValueError(f"--splits {text}: trainer GPU counts must be >= 1")
    return sorted(set(out))


def parse_floats(text: str, what: str) -> tuple:
    """``--staleness 0,0.25,0.5``: the values, each >= 0."""
    try:
        vals = tuple(sorted({float(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"{what} {text}: a comma-separated list of numbers, e.g. 0,0.25,0.5,1") from None
    if not vals or min(vals) < 0:
        raise ValueError(f"{what} {text}: values must be >= 0")
    return vals


def parse_partial(text: str) -> tuple:
    """``--partial both|on|off``."""
    table = {"both": (False, True), "on": (True,), "off": (False,)}
    if text not in table:
        raise ValueError(f"--partial {text}: one of both, on, off")
    return table[text]


def knobs_of(cfg: RunConfig, rollout_jobs: int, trainer_gpus: int, staleness: float, partial: bool,
             prompt_tokens: int = 16) -> Knobs:
    """The config's own knobs (``RunConfig.knobs``) with a split and async setting replaced."""
    run = {f.name: getattr(cfg.knobs, f.name) for f in dataclasses.fields(cfg.knobs)}
    run.update(rollout_jobs=rollout_jobs, staleness_threshold=staleness, partial_rollout=partial and staleness > 0)
    return Knobs(**run, trainer_gpus=trainer_gpus, response_length=cfg.rollout.response_length,
                 prompt_tokens=prompt_tokens)


def default_splits(gpus: int, gpus_per_engine: int, gpus_per_node: int = GPUS_PER_NODE) -> list[int]:
    """The trainer sizes tried without ``--splits``: shapes of ``gpus_per_node``-GPU nodes that leave an engine."""
    top = gpus - gpus_per_engine
    if gpus <= EVERY_SPLIT_UP_TO:
        return [t for t in range(1, top + 1) if cluster_shape(t, gpus_per_node)]
    return sorted({t for t in (1, 2, 4) if t <= min(top, gpus_per_node)}
                  | set(range(gpus_per_node, top + 1, gpus_per_node)))


def unshaped_splits(spec: SweepSpec) -> Optional[str]:
    """The problem with ``--splits`` or ``--gpus-per-engine`` that no cluster of the spec's nodes can give, or None."""
    node = spec.gpus_per_node
    if spec.gpus_per_engine > node:
        return (f"--gpus-per-engine {spec.gpus_per_engine}: an engine runs on one node of {node} GPUs "
                f"(--gpus-per-node); fix: --gpus-per-engine {node} or less, or --gpus-per-node")
    bad = [t for t in spec.splits or [] if not cluster_shape(t, node)]
    if bad:
        return (f"--splits: {', '.join(map(str, bad))} trainer GPUs is no shape of {node}-GPU nodes (--gpus-per-node): "
                f"past one node a trainer takes whole nodes ({node}, {2 * node}, {3 * node}, ...); fix: leave them out")
    return None


def candidates(cfg: RunConfig, spec: SweepSpec, requested: Optional[Knobs] = None) -> list[Candidate]:
    """Every split x staleness x partial of ``spec`` (the config's own async setting included), deduplicated
    (partial rollout means nothing at s=0); ``requested`` too if given."""
    a = cfg.async_training
    settings = {(s, p and s > 0) for s in spec.staleness for p in spec.partial}
    settings.add((a.staleness_threshold, a.partial_rollout and a.staleness_threshold > 0))
    splits = spec.splits if spec.splits is not None else default_splits(spec.gpus, spec.gpus_per_engine,
                                                                         spec.gpus_per_node)
    out, seen = [], set()
    for trainer_gpus in splits:
        jobs = (spec.gpus - trainer_gpus) // spec.gpus_per_engine
        if jobs < 1:
            continue
        for s, p in sorted(settings):
            c = Candidate(knobs_of(cfg, jobs, trainer_gpus, s, p))
            if c.key not in seen:
                seen.add(c.key)
                out.append(c)
    if requested is not None and (requested.trainer_gpus, requested.rollout_jobs, requested.staleness_threshold,
                                  requested.partial_rollout) not in seen:
        out.append(Candidate(requested))
    return out


def upper_bound(sim: SimulatedConfig, k: Knobs, mean_response: float) -> float:
    """The most tokens per second candidate ``k`` can train (module docstring), before the margin."""
    tokens = k.groups_per_update * k.n * mean_response
    K = k.trigger_parameter_sync_step
    trainer = dataclasses.replace(sim, trainer_gpus=k.trainer_gpus)
    trainer_ub = tokens / (trainer.update_model_s(tokens) + sim.publish_s / K)
    per_engine = min(k.max_num_seqs, k.group_bound * k.n, k.budget * k.n / k.rollout_jobs)
    fleet = k.rollout_jobs * per_engine / sim.decode_step_s(per_engine)
    rollout_ub = tokens / (tokens / fleet + sim.weight_load_s / K)
    return min(trainer_ub, rollout_ub)


COARSE = 8
"""Splits per async setting in the first pass of the coarse-to-fine search."""


class _Search:
    """Predictions made so far, and the rule that skips a candidate whose bound is below the best ``keep``."""

    def __init__(self, sim, draws, updates, data_seed, keep, must, predict_fn):
        self.sim, self.draws, self.updates, self.seed, self.keep, self.must = sim, draws, updates, data_seed, keep, must
        self.predict_fn = predict_fn
        self.best: list[float] = []  # predicted tokens/s, highest first
        self.done: list[Candidate] = []
        self.bounded = 0  # candidates skipped because their bound was below the best ``keep``

    def evaluate(self, c: Candidate) -> Optional[float]:
        """``c``'s tokens/s (predicted now if needed); None if its bound cannot reach the best ``keep``."""
        if c.prediction is not None:
            return c.prediction.tokens_per_s
        if c.key not in self.must and len(self.best) >= self.keep and c.bound_tokens_per_s < self.best[self.keep - 1]:
            self.bounded += 1
            c.prediction = None
            return None
        c.prediction = self.predict_fn(self.sim, c.knobs, self.updates, self.seed, draws=self.draws)
        self.done.append(c)
        self.best = sorted(self.best + [c.prediction.tokens_per_s], reverse=True)
        return c.prediction.tokens_per_s


@dataclass
class SearchResult:
    predicted: list
    """The candidates predicted, highest throughput first."""
    bounded: int
    """Candidates skipped because their upper bound was below the best ``keep``."""


def search(sim: SimulatedConfig, cands: list[Candidate], draws: Draws, updates: int, data_seed: int, keep: int,
           exhaustive: bool = False, must: tuple = (), predict_fn: Callable = predict) -> SearchResult:
    """Predict the candidates (all with ``exhaustive``); the predicted ones, highest throughput first.

    Per async setting, the splits are searched coarse to fine: :data:`COARSE` of them evenly spread, then the
    neighbours of the best at half the spacing, until the spacing is one split. A candidate whose upper bound
    is below the ``keep``-th best prediction so far is skipped; those whose key is in ``must`` never are."""
    groups = updates * cands[0].knobs.groups_per_update if cands else 0
    mean = draws.mean_response(max(groups, 1))
    for c in cands:
        c.bound_tokens_per_s = upper_bound(sim, c.knobs, mean) * (1 + BOUND_MARGIN)
    run = _Search(sim, draws, updates, data_seed, len(cands) if exhaustive else keep, must, predict_fn)
    if exhaustive:
        for c in cands:
            run.evaluate(c)
        return SearchResult(sorted(run.done, key=lambda c: -c.prediction.tokens_per_s), 0)
    settings: dict[tuple, list[Candidate]] = {}
    for c in cands:
        settings.setdefault((c.knobs.staleness_threshold, c.knobs.partial_rollout), []).append(c)
    lines = sorted((sorted(v, key=lambda c: c.knobs.trainer_gpus) for v in settings.values()),
                   key=lambda line: -max(c.bound_tokens_per_s for c in line))
    for line in lines:
        for i in sorted({round(x * (len(line) - 1) / max(COARSE - 1, 1)) for x in range(COARSE)}):
            run.evaluate(line[i])
    for line in lines:
        step = max(1, (len(line) - 1) // max(COARSE - 1, 1))
        while True:
            scored = [(c.prediction.tokens_per_s, i) for i, c in enumerate(line) if c.prediction is not None]
            if not scored:
                break
            i = max(scored)[1]
            for j in (i - step, i + step):
                if 0 <= j < len(line):
                    run.evaluate(line[j])
            if step == 1:
                break
            step = max(1, step // 2)
    for c in cands:
        if c.key in must:
            run.evaluate(c)
    return SearchResult(sorted(run.done, key=lambda c: -c.prediction.tokens_per_s), run.bounded)
