"""``hpcrl plan CONFIG [key=value ...] --gpus N``: which trainer:rollout split and async knobs to ask for.

The phase model is the config's ``simulated`` section (plain numbers: a paper's table fits in it), or is
measured from a probe run's logs (``--probe RUN``, :mod:`hpcrl.plan.probe`). The candidates and their search are
:mod:`hpcrl.plan.sweep`; each is predicted by the fast event simulation (:mod:`hpcrl.plan.events`). Printed: the best candidates, the configuration the config
itself asks for, and the synchronous colocated baseline (:mod:`hpcrl.plan.baseline`) on the same GPUs, each per
update and per parameter-sync period, with the overrides and resources to launch the best.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Optional

from hpcrl.config import ConfigError, RunConfig, given_keys, load_config
from hpcrl.config.names import FIRST_COME, SHARE_BY_LOAD
from hpcrl.plan.baseline import sync_baseline
from hpcrl.plan.events import predict
from hpcrl.plan.memory import ModelShape, memory_lines, model_shape
from hpcrl.plan.model import Draws, Knobs, Prediction
from hpcrl.plan.probe import empirical_lengths, probe_model
from hpcrl.plan.prompts import prompt_lengths
from hpcrl.plan.sweep import Candidate, SweepSpec, candidates, knobs_of, search, unshaped_splits

HEADER = ["trainer:engines", "s", "partial", "s/update", "s/sync", "tokens/s", "vs sync", "trainer busy",
          "rollout busy", "lag mean", "lag max", ""]
BEST_SHOWN = 3
"""The best rows printed with their launch overrides (and the least the search keeps exact)."""


def table(header: list[str], rows: list[list[str]]) -> str:
    """Right-aligned plain-text table with a dashed rule under the header."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda r: "  ".join(str(x).rjust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def _row(split: str, s: str, partial: str, p: Prediction, sync: Prediction, note: str) -> list[str]:
    return [split, s, partial, f"{p.step_s:.1f}", f"{p.sync_period_s:.1f}", f"{p.tokens_per_s:.0f}",
            f"{p.tokens_per_s / sync.tokens_per_s:.2f}x", f"{p.trainer_busy:.2f}", f"{p.rollout_busy:.2f}",
            f"{p.lag_mean:.2f}", f"{p.lag_max}", note]


def candidate_row(c: Candidate, sync: Prediction, note: str = "") -> list[str]:
    k = c.knobs
    return _row(f"{k.trainer_gpus}:{k.rollout_jobs}", f"{k.staleness_threshold:g}",
                "yes" if k.partial_rollout else "no", c.prediction, sync, note)


def requested_knobs(cfg: RunConfig, gpus: int, gpus_per_engine: int) -> tuple[Optional[Knobs], str]:
    """The configuration the config asks for (its trainer GPUs and rollout jobs, its async settings) on ``gpus``
    GPUs; a line saying how it was read."""
    r = cfg.resources
    trainer = cfg.simulated.trainer_gpus if cfg.trainer.simulated else r.trainer.nodes * r.trainer.gpus_per_node
    trainer = max(1, trainer)
    jobs = r.rollout_jobs
    a = cfg.async_training
    what = f"trainer {trainer} GPUs, {jobs} rollout jobs of {gpus_per_engine}"
    if trainer + jobs * gpus_per_engine != gpus:
        if trainer >= gpus:
            return None, f"requested ({what}): its trainer alone needs {trainer} of the {gpus} GPUs; not predicted"
        jobs = (gpus - trainer) // gpus_per_engine
        what += f" = {trainer + r.rollout_jobs * gpus_per_engine} GPUs, not {gpus}: its trainer and {jobs} engines"
    k = knobs_of(cfg, jobs, trainer, a.staleness_threshold, a.partial_rollout)
    return k, f"requested: the config's resources ({what}), s={a.staleness_threshold:g}, " \
              f"partial_rollout={str(k.partial_rollout).lower()}"


def spread_note(k: Knobs) -> Optional[str]:
    """When the budget of a version fills fewer engines than there are (``rollout.budget_share=first_come``: jobs
    take up to their bound each, first come first served), say so and what spreads it."""
    used = math.ceil(k.budget / k.group_bound)
    if k.budget_share != FIRST_COME or used >= k.rollout_jobs:
        return None
    return (f"note: at a version switch the budget B={k.budget} groups fills {used} of the {k.rollout_jobs} engines "
            f"(rollout.max_concurrent_groups={k.max_concurrent_groups} each, first come first served); "
            f"rollout.budget_share={SHARE_BY_LOAD} spreads it over all")


PHASE_KEYS = ("decode_base_s", "decode_per_seq_s", "prefill_per_token_s", "weight_load_s", "update_base_s",
              "update_per_token_s", "publish_s", "lengths", "length_mean")
"""The ``simulated`` keys the prediction rests on; those the config leaves at hpcrl's defaults are named."""
PROBED = ("update_base_s", "update_per_token_s", "weight_load_s", "lengths")
"""What ``--probe RUN`` measures (:mod:`hpcrl.plan.probe`)."""


def defaults_note(config: str, overrides: list[str], probe: Optional[str]) -> list[str]:
    """A line when phase numbers are hpcrl's built-in defaults rather than the config's (or a probe's): then the
    times and the speedups are a guess, not a prediction for the user's GPUs and model."""
    given = {k[len("simulated."):] for k in given_keys(config, overrides) if k.startswith("simulated.")}
    left = [k for k in PHASE_KEYS if k not in given and not (probe and k in PROBED)]
    if not left:
        return []
    fix = ("write the numbers of your GPUs and model in simulated: (docs/planner.md, 'Sizing a run with hpcrl plan')"
           + ("" if probe else ", or measure the update, weight switch and lengths with --probe RUN"))
    if len(left) == len(PHASE_KEYS):
        return [f"note: the config has no simulated: section, so every phase number below is hpcrl's built-in default "
                f"(not a measurement of your GPUs or model): the times and the 'vs sync' ratios are a guess; {fix}"]
    return [f"note: {', '.join('simulated.' + k for k in left)} are hpcrl's built-in defaults (the config does not set "
            f"them{'' if not probe else ' and --probe does not measure them'}); {fix}"]


def trainer_memory(cfg: RunConfig, model_config: Optional[str]) -> tuple[Optional[ModelShape], list[str]]:
    """The model's shape (``--model-config FILE``, else ``model.path``'s config.json) and the trainer's predicted
    memory per GPU at the config's own trainer size: ConfigError when it cannot fit
    ``resources.trainer.gpu_memory_gib`` (hpcrl/plan/memory.py)."""
    shape = ModelShape.of_file(Path(model_config)) if model_config else model_shape(cfg)
    if shape is None:
        return None, [f"trainer memory not predicted: model.path ({cfg.model.path}) has no config.json here; pass "
                      "--model-config FILE (a model's config.json, e.g. configs/shapes/qwen2.5-7b.json)"]
    return shape, memory_lines(cfg, shape)


def plan_command(config: str, overrides: list[str], spec: SweepSpec, probe: Optional[str] = None, top: int = 10,
                 show_all: bool = False, prompt_tokens: Optional[int] = None,
                 model_config: Optional[str] = None) -> list[str]:
    """The lines ``hpcrl plan`` prints; ConfigError when the config's trainer cannot fit its GPUs."""
    t0 = time.monotonic()
    cfg = load_config(config, overrides)
    unshaped = unshaped_splits(spec)
    if unshaped:
        raise ValueError(unshaped)
    shape, memory = trainer_memory(cfg, model_config)
    sim, notes = cfg.simulated, defaults_note(config, overrides, probe)
    if probe is not None:
        sim, probed = probe_model(sim, Path(probe))
        notes += probed
    prompts, prompt_line = prompt_lengths(cfg, prompt_tokens)
    longest = max(prompts) if isinstance(prompts, list) else prompts
    if 0 < sim.kv_cache_tokens < longest + cfg.rollout.response_length + 1:
        raise ValueError(f"simulated.kv_cache_tokens={sim.kv_cache_tokens} cannot hold one sequence (longest prompt "
                         f"{longest} + rollout.response_length {cfg.rollout.response_length} + 1); raise it")
    draws = Draws(sim, cfg.rollout.n, cfg.rollout.response_length, cfg.data.seed, empirical_lengths(sim.lengths),
                  prompts)
    requested, requested_line = requested_knobs(cfg, spec.gpus, spec.gpus_per_engine)
    cands = candidates(cfg, spec, requested)
    if not cands:
        raise ValueError(f"hpcrl plan: --gpus {spec.gpus} leaves no split with one trainer GPU and one engine of "
                         f"{spec.gpus_per_engine} GPUs; raise --gpus or lower --gpus-per-engine")
    req_key = None if requested is None else Candidate(requested).key
    found = search(sim, cands, draws, spec.updates, cfg.data.seed, BEST_SHOWN, exhaustive=show_all, must=(req_key,),
                   predict_fn=predict)
    done = found.predicted
    sync = sync_baseline(sim, done[0].knobs, spec.gpus, spec.gpus_per_engine, draws, spec.updates)
    K = cfg.async_training.trigger_parameter_sync_step
    lines = [*notes, f"phase model (modelled GPU seconds): decode step {sim.decode_base_s:g}s + "
             f"{sim.decode_per_seq_s:g}s/seq, update {sim.update_base_s:g}s + {sim.update_per_token_s:g}s/token/GPU, "
             f"publish {sim.publish_s:g}s, weight switch {sim.weight_load_s:g}s, KV cache "
             f"{sim.kv_cache_tokens or 'unbounded'} tokens; lengths {sim.lengths} (mean {sim.length_mean:g}) cut at "
             f"{cfg.rollout.response_length}; {prompt_line}; R={cfg.groups_per_update} groups x n={cfg.rollout.n} "
             f"per update, K={K} updates per sync; {spec.gpus} GPUs on nodes of {spec.gpus_per_node}, "
             f"{spec.gpus_per_engine} per engine; "
             f"{spec.updates} updates simulated per row",
             f"searched {len(cands)} candidates, simulated {len(done)} in {time.monotonic() - t0:.1f}s"
             + ("" if show_all else f" (coarse to fine over the splits of each async setting; {found.bounded} skipped "
                f"as their upper bound is below the best {BEST_SHOWN}, the rest lie between splits simulated; --all "
                "simulates every one)"), ""]
    shown = done if show_all else done[:top]
    rows = [candidate_row(c, sync, "requested" if c.key == req_key else "") for c in shown]
    rows += [candidate_row(c, sync, "requested") for c in done if c.key == req_key and c not in shown]
    rows.append(_row(f"coloc({spec.gpus})", "0", "no", sync, sync, "synchronous baseline"))
    lines.append(table(HEADER, rows))
    lines += ["", f"s/update: one local update of R={cfg.groups_per_update} groups; s/sync: a parameter-sync period "
              f"of K={K} updates; vs sync: tokens/s over the synchronous baseline (all {spec.gpus} GPUs colocated, "
              "generate then train, on-policy)", requested_line, "", "best (highest throughput first):"]
    for c in done[:BEST_SHOWN]:
        p = c.prediction
        launch = c.overrides(spec.gpus_per_engine, spec.gpus_per_node)
        lines.append(f"  {p.tokens_per_s:.0f} tokens/s ({p.tokens_per_s / sync.tokens_per_s:.2f}x synchronous), "
                     f"{p.step_s:.1f}s/update, {p.sync_period_s:.1f}s/sync: {launch}")
    note = spread_note(done[0].knobs)
    if note:
        lines += ["", note]
    lines += ["", *memory]
    best_gpus = done[0].knobs.trainer_gpus
    if shape is not None and best_gpus != cfg.resources.trainer.world_size and cfg.resources.trainer.gpus_per_node:
        try:
            lines += [f"at the best split ({best_gpus} trainer GPUs): " + x for x in memory_lines(cfg, shape, best_gpus)]
        except ConfigError as e:
            lines.append(f"at the best split ({best_gpus} trainer GPUs) the trainer would not fit: {e}")
    return lines
