"""``hpcrl plan CONFIG [key=value ...] --gpus N``: which trainer:rollout split and async knobs to ask for.

The phase model is the config's ``simulated`` section (plain numbers: a paper's table fits in it), or is
measured from a probe run's logs (``--probe RUN``: the update time per token and the weight switch fitted
from its metrics, its response lengths as the length distribution; the decode model stays the config's).
For every split of ``--gpus`` into trainer GPUs and rollout engines (``--gpus-per-engine`` each) and every
staleness / partial-rollout setting, :mod:`hpcrl.plan.pipeline` simulates the run's events (no sleeping;
a few milliseconds each) and the best configurations are printed with the overrides and resources to
launch them.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from hpcrl import metric_names as M
from hpcrl.config import RunConfig, load_config
from hpcrl.config.simulated import SimulatedConfig, empirical_run, read_lengths
from hpcrl.plan.pipeline import Knobs, Prediction, predict
from hpcrl.run_dir import RunDir

def empirical_lengths(spec: str):
    """The lengths of ``simulated.lengths=empirical:RUN`` (None for a named distribution)."""
    run = empirical_run(spec)
    return read_lengths(RunDir(run).staleness, spec) if run is not None else None


STALENESS = (0.0, 0.5, 1.0)
PARTIAL = (False, True)


@dataclass
class Candidate:
    knobs: Knobs
    prediction: Prediction

    def overrides(self, gpus_per_engine: int) -> str:
        """What to launch: the async knobs and the resources (a trainer over more than one node needs
        resources.trainer.nodes too; a simulated run takes the trainer's GPUs as simulated.trainer_gpus)."""
        k = self.knobs
        return (f"async_training.staleness_threshold={k.staleness_threshold:g} "
                f"async_training.partial_rollout={str(k.partial_rollout).lower()} "
                f"resources.trainer.gpus_per_node={k.trainer_gpus} resources.rollout_jobs={k.rollout_jobs} "
                f"resources.rollout.gpus_per_node={gpus_per_engine} (simulated: simulated.trainer_gpus={k.trainer_gpus})")


def knobs_of(cfg: RunConfig, rollout_jobs: int, trainer_gpus: int, staleness: float, partial: bool,
             prompt_tokens: int = 16) -> Knobs:
    """The knobs of ``cfg`` with a split and async setting replaced."""
    return Knobs(rollout_jobs=rollout_jobs, trainer_gpus=trainer_gpus, staleness_threshold=staleness,
                 partial_rollout=partial and staleness > 0, require_batches=cfg.async_training.require_batches,
                 trigger_parameter_sync_step=cfg.async_training.trigger_parameter_sync_step,
                 ppo_mini_batch_size=cfg.actor.ppo_mini_batch_size, n=cfg.rollout.n,
                 max_concurrent_groups=cfg.rollout.max_concurrent_groups, max_num_seqs=cfg.rollout.max_num_seqs,
                 response_length=cfg.rollout.response_length, prompt_tokens=prompt_tokens)


def probe_model(sim: SimulatedConfig, run_dir: Path) -> tuple[SimulatedConfig, list[str]]:
    """``sim`` with the update model, the weight switch and the lengths measured from ``run_dir``'s logs (in the
    probe's modelled seconds: a simulated probe's wall times times its time_scale); what was fitted, in words."""
    rd = RunDir(run_dir)
    probe_cfg = rd.load_config()
    scale = probe_cfg.simulated.time_scale if probe_cfg.is_simulated else 1.0
    rows = [json.loads(x) for x in rd.metrics.read_text().splitlines() if x.strip()]
    if len(rows) < 3:
        raise ValueError(f"hpcrl plan --probe {run_dir}: {len(rows)} updates in logs/metrics.jsonl; at least 3 needed")
    tokens = np.array([r[M.N_TOKENS] for r in rows], dtype=float)
    secs = np.array([r[M.UPDATE_S] for r in rows], dtype=float) * scale
    if np.ptp(tokens) > 0:
        per_token, base = np.polyfit(tokens, secs, 1)
    else:
        per_token, base = 0.0, float(secs.mean())
    gpus = probe_cfg.simulated.trainer_gpus if probe_cfg.trainer.simulated else max(1, probe_cfg.resources.trainer.gpus_per_node)
    loads = [json.loads(x).get(M.LOAD_WEIGHTS_S, 0.0) for p in rd.rollout_metrics_logs().values()
             for x in p.read_text().splitlines() if x.strip()]
    out = dataclasses.replace(sim, update_base_s=max(0.0, float(base)), update_per_token_s=max(0.0, float(per_token)) * gpus,
                              weight_load_s=float(np.median(loads)) * scale if loads else sim.weight_load_s,
                              lengths=f"empirical:{run_dir}", time_scale=1.0)
    notes = [f"probe {run_dir} ({len(rows)} updates, time x{scale:g}): update {out.update_base_s:.3f}s + "
             f"{out.update_per_token_s:.2g}s/token on one GPU, weight switch {out.weight_load_s:.3f}s, "
             f"lengths from its {len(empirical_lengths(out.lengths))} responses; decode model from the config"]
    return out, notes


def sweep(cfg: RunConfig, sim: SimulatedConfig, gpus: int, gpus_per_engine: int, updates: int,
          staleness=STALENESS, partial=PARTIAL, prompt_tokens: int = 16) -> list[Candidate]:
    """Every split of ``gpus`` (at least one trainer GPU and one engine) x staleness x partial, predicted."""
    empirical = empirical_lengths(sim.lengths)
    out, seen = [], set()
    for trainer_gpus in range(1, gpus):
        jobs = (gpus - trainer_gpus) // gpus_per_engine
        if jobs < 1:
            continue
        for s in staleness:
            for p in partial:
                k = knobs_of(cfg, jobs, trainer_gpus, s, p, prompt_tokens)
                key = (jobs, trainer_gpus, s, k.partial_rollout)
                if key in seen:
                    continue
                seen.add(key)
                out.append(Candidate(k, predict(sim, k, updates, cfg.data.seed, empirical)))
    return out


def table_rows(cands: list[Candidate]) -> list[list[str]]:
    return [[f"{c.knobs.trainer_gpus}:{c.knobs.rollout_jobs}", f"{c.knobs.staleness_threshold:g}",
             "yes" if c.knobs.partial_rollout else "no", f"{c.prediction.step_s:.1f}", f"{c.prediction.tokens_per_s:.0f}",
             f"{c.prediction.trainer_busy:.2f}", f"{c.prediction.rollout_busy:.2f}", f"{c.prediction.lag_mean:.2f}",
             f"{c.prediction.lag_max}"] for c in cands]


def table(header: list[str], rows: list[list[str]]) -> str:
    """Right-aligned plain-text table with a dashed rule under the header."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda r: "  ".join(str(x).rjust(w) for x, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


HEADER = ["trainer:engines", "s", "partial", "step s", "tokens/s", "trainer busy", "rollout busy", "lag mean",
          "lag max"]


def plan_command(config: str, overrides: list[str], gpus: int, gpus_per_engine: int, updates: int,
                 probe: Optional[str], top: int, show_all: bool) -> list[str]:
    """The lines ``hpcrl plan`` prints."""
    cfg = load_config(config, overrides)
    sim, notes = cfg.simulated, []
    if probe is not None:
        sim, notes = probe_model(sim, Path(probe))
    cands = sweep(cfg, sim, gpus, gpus_per_engine, updates)
    if not cands:
        raise ValueError(f"hpcrl plan: --gpus {gpus} leaves no split with one trainer GPU and one engine of "
                         f"{gpus_per_engine} GPUs; raise --gpus or lower --gpus-per-engine")
    best = sorted(cands, key=lambda c: -c.prediction.tokens_per_s)
    lines = [*notes, f"phase model (modelled GPU seconds): decode step {sim.decode_base_s:g}s + {sim.decode_per_seq_s:g}s/seq, "
             f"update {sim.update_base_s:g}s + {sim.update_per_token_s:g}s/token/GPU, weight switch {sim.weight_load_s:g}s, "
             f"lengths {sim.lengths} (mean {sim.length_mean:g}) cut at {cfg.rollout.response_length}; R={cfg.groups_per_update} "
             f"groups x n={cfg.rollout.n}, K={cfg.async_training.trigger_parameter_sync_step}; {gpus} GPUs, "
             f"{gpus_per_engine} per engine; {updates} updates simulated per row", ""]
    lines.append(table(HEADER, table_rows(cands if show_all else best[:top])))
    lines += ["", "best (highest throughput first):"]
    for c in best[:min(top, 3)]:
        lines.append(f"  {c.prediction.tokens_per_s:.0f} tokens/s, step {c.prediction.step_s:.1f}s: "
                     f"{c.overrides(gpus_per_engine)}")
    return lines
