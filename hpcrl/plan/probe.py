"""``hpcrl plan --probe RUN``: the update model, the weight switch and the response lengths measured from a run's
logs (the decode model stays the config's)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from hpcrl.logs import metric_names as M
from hpcrl.config.simulated import SimulatedConfig, empirical_run
from hpcrl.logs.run_logs import read_lengths
from hpcrl.rundir.paths import RunDir


def empirical_lengths(spec: str):
    """The lengths of ``simulated.lengths=empirical:RUN`` (None for a named distribution)."""
    run = empirical_run(spec)
    return read_lengths(RunDir(run).staleness, spec) if run is not None else None


def probe_model(sim: SimulatedConfig, run_dir: Path) -> tuple[SimulatedConfig, list[str]]:
    """``sim`` with the update model, the weight switch and the lengths measured from ``run_dir``'s logs (in the
    probe's modelled seconds: a simulated probe's wall times times its time_scale); what was fitted, in words."""
    rd = RunDir(run_dir)
    probe_cfg = rd.load_config()
    scale = probe_cfg.simulated.time_scale if probe_cfg.trainer.simulated else 1.0  # a sizing probe's are real
    rows = [json.loads(x) for x in rd.metrics.read_text().splitlines() if x.strip()]
    if len(rows) < 3:
        raise ValueError(f"hpcrl plan --probe {run_dir}: {len(rows)} updates in logs/metrics.jsonl; at least 3 needed")
    tokens = np.array([r[M.N_TOKENS] for r in rows], dtype=float)
    secs = np.array([r[M.UPDATE_S] for r in rows], dtype=float) * scale
    if np.ptp(tokens) > 0:
        per_token, base = np.polyfit(tokens, secs, 1)
    else:
        per_token, base = 0.0, float(secs.mean())
    res = probe_cfg.resources.trainer
    gpus = probe_cfg.simulated.trainer_gpus if probe_cfg.trainer.simulated else max(1, res.gpus_per_node)
    loads = [json.loads(x).get(M.LOAD_WEIGHTS_S, 0.0) for p in rd.rollout_metrics_logs().values()
             for x in p.read_text().splitlines() if x.strip()]
    measured_switch = loads and not probe_cfg.is_sizing_probe  # a sizing probe's engine only sleeps its switch
    out = dataclasses.replace(sim, update_base_s=max(0.0, float(base)),
                              update_per_token_s=max(0.0, float(per_token)) * gpus,
                              weight_load_s=float(np.median(loads)) * scale if measured_switch else sim.weight_load_s,
                              lengths=f"empirical:{run_dir}", time_scale=1.0)
    switch_from = "" if measured_switch else " (from the config)"
    notes = [f"probe {run_dir} ({len(rows)} updates, time x{scale:g}): update {out.update_base_s:.3f}s + "
             f"{out.update_per_token_s:.2g}s/token on one GPU, weight switch {out.weight_load_s:.3f}s{switch_from}, "
             "lengths from its "
             f"{len(empirical_lengths(out.lengths))} responses; decode model from the config"]
    peaks = _memory_note(rows, probe_cfg)
    return out, notes + ([peaks] if peaks else [])


def _memory_note(rows: list[dict], probe_cfg) -> str:
    """The probe's largest per-update peaks (verl's perf/* metrics) and the largest update's tokens, in words."""
    gpu = max((r.get(M.MAX_MEMORY_ALLOCATED_GB, 0.0) for r in rows), default=0.0)
    host = max((r.get(M.CPU_MEMORY_USED_GB, 0.0) for r in rows), default=0.0)
    if not gpu and not host:
        return ""
    a = probe_cfg.actor
    how = (f"{a.ppo_max_token_len_per_gpu}-token micro-batches" if a.use_dynamic_bsz else
           f"micro-batches of {a.ppo_micro_batch_size} groups")
    ckpt = ", checkpointed layers" if a.gradient_checkpointing else ""
    return (f"probe memory: peak per update {gpu:.1f} GiB GPU, {host:.1f} GiB host ({how}{ckpt}, ZeRO "
            f"{a.zero_stage}; the largest update had {max(r[M.N_TOKENS] for r in rows)} response tokens)")
