"""The synchronous baseline ``hpcrl plan`` prints next to the async candidates: the same GPUs colocated.

A colocated synchronous run (verl's default) puts the trainer and the engines on the same GPUs and takes turns:
all ``G / gpus_per_engine`` engines generate a batch of ``K * R`` groups (spread evenly, every request queued at
once, so ``max_num_seqs`` and the KV cache bound the batch, not ``rollout.max_concurrent_groups``), then all
``G`` GPUs train ``K`` updates of ``R`` groups, then the new weights go into the engines (``weight_load_s``: an
in-memory reshard, no publish through the filesystem). Nothing overlaps, every response is on-policy, and the
step is ``generation of the slowest engine + K updates + the switch`` per period. The engines run the same
continuous-batching model as the async simulation (:class:`hpcrl.plan.events.Batch`).
"""
from __future__ import annotations

import dataclasses

from hpcrl.config.simulated import SimulatedConfig
from hpcrl.plan.events import Batch, Group, Seq
from hpcrl.plan.model import INF, Draws, Knobs, Prediction


def sync_baseline(sim: SimulatedConfig, k: Knobs, gpus: int, gpus_per_engine: int, draws: Draws,
                  updates: int) -> Prediction:
    """Per update, the colocated synchronous run of ``k``'s batch shape on ``gpus`` GPUs (module docstring), over
    ``updates`` updates (rounded up to whole periods of K)."""
    engines = max(1, gpus // gpus_per_engine)
    K, R = k.trigger_parameter_sync_step, k.groups_per_update
    trainer = dataclasses.replace(sim, trainer_gpus=gpus)
    periods = -(-updates // K)
    window = gen_total = upd_total = 0.0
    tokens = 0
    for p in range(periods):
        batches = [Batch(sim, k.max_num_seqs) for _ in range(engines)]
        group_tokens = []
        for j in range(K * R):
            index = p * K * R + j
            lengths = draws.responses(index)
            g = Group(index, p, 0.0, k.n, sum(lengths))
            batches[j % engines].add([Seq(g, length, draws.prompt(index)) for length in lengths], 0.0)
            group_tokens.append(g.tokens)
        for b in batches:
            b.advance_to(INF)
        gen = max(b.mark_s for b in batches)
        upd = sum(trainer.update_model_s(sum(group_tokens[u * R:(u + 1) * R])) for u in range(K))
        window += gen + upd + sim.weight_load_s
        gen_total, upd_total, tokens = gen_total + gen, upd_total + upd, tokens + sum(group_tokens)
    return Prediction(updates=periods * K, window_s=window, tokens=tokens, trainer_busy=upd_total / window,
                      rollout_busy=gen_total / window, lag_mean=0.0, lag_max=0, updates_per_version=K)
