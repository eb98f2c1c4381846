"""The fast simulation (hpcrl/plan/events.py) against the reference one (tests/plan_reference.py), and the KV-cache
rule in both and in the simulated engine."""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from hpcrl.config import load_config
from hpcrl.config.simulated import SimulatedConfig
import plan_reference as reference
from hpcrl.plan import events
from hpcrl.plan.model import Draws, Knobs, ServiceOrder
from hpcrl.plan.sweep import knobs_of

SIM = "configs/simulated.yaml"


def _both(sim, k, updates, draws=None, overhead_s=0.0):
    fast = events.predict(sim, k, updates, draws=draws, overhead_s=overhead_s)
    ref = reference.predict(sim, k, updates, draws=draws, overhead_s=overhead_s)
    return fast, ref


def _agree(fast, ref):
    assert fast.tokens == ref.tokens
    assert fast.tokens_per_s == pytest.approx(ref.tokens_per_s, rel=0.01)
    assert fast.step_s == pytest.approx(ref.step_s, rel=0.01)
    assert fast.trainer_busy == pytest.approx(ref.trainer_busy, rel=0.01, abs=0.01)
    assert fast.rollout_busy == pytest.approx(ref.rollout_busy, rel=0.01, abs=0.01)
    assert fast.lag_mean == pytest.approx(ref.lag_mean, abs=0.02) and fast.lag_max == ref.lag_max


@pytest.mark.parametrize("jobs,tg,s,partial,K,req", [
    (1, 1, 0.0, False, 1, 1), (1, 1, 0.5, False, 1, 1), (1, 1, 0.5, True, 1, 1), (2, 2, 1.0, True, 1, 1),
    (3, 1, 1.0, False, 1, 1), (8, 2, 0.5, True, 1, 1), (4, 1, 0.5, True, 2, 2), (6, 2, 0.25, False, 3, 1),
    (5, 3, 2.0, True, 2, 1),
])
def test_fast_equals_the_reference_on_the_simulated_config(jobs, tg, s, partial, K, req):
    cfg = load_config(SIM, [f"async_training.trigger_parameter_sync_step={K}", f"async_training.require_batches={req}"])
    k = knobs_of(cfg, jobs, tg, s, partial, prompt_tokens=2)
    _agree(*_both(cfg.simulated, k, 16))


@pytest.mark.parametrize("partial", [False, True])
def test_fast_equals_the_reference_with_a_queue_kv_limit_prompts_publish_and_overhead(partial):
    """max_num_seqs binds (sequences wait), the KV cache preempts, prompts differ per index, publishing and a
    control-plane overhead delay each version."""
    sim = dataclass_replace(load_config(SIM).simulated, kv_cache_tokens=6000, publish_s=1.5, prefill_per_token_s=1e-4)
    k = Knobs(rollout_jobs=3, trainer_gpus=1, staleness_threshold=1.0, partial_rollout=partial, n=8,
              max_concurrent_groups=3, max_num_seqs=16, response_length=1536, trigger_parameter_sync_step=2)
    draws = Draws(sim, 8, 1536, data_seed=3, prompts=[5, 40, 120, 7])
    _agree(*_both(sim, k, 14, draws, overhead_s=0.7))


def test_fast_equals_the_reference_at_28k_proportions():
    cfg = load_config("configs/simulated-28k.yaml")
    for jobs, tg, s, partial in [(3, 1, 0.25, True), (8, 4, 1.0, False)]:
        _agree(*_both(cfg.simulated, knobs_of(cfg, jobs, tg, s, partial, prompt_tokens=2), 8))


def dataclass_replace(sim, **kw):
    import dataclasses
    return dataclasses.replace(sim, **kw)


def _fixed(tmp_path, length: int) -> str:
    run = tmp_path / f"run{length}"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "staleness.jsonl").write_text(json.dumps({"n_tokens": length}) + "\n")
    return f"empirical:{run}"


def _batch_busy(sim, seqs, max_num_seqs=256):
    """The planner's engine run to empty on ``seqs`` = [(prompt, length)]: its busy modelled seconds."""
    g = events.Group(0, 0, 0.0, len(seqs), 0)
    b = events.Batch(sim, max_num_seqs)
    b.add([events.Seq(g, length, prompt) for prompt, length in seqs], 0.0)
    b.advance_to(float("inf"))
    return b.busy_s, b


def test_kv_cache_runs_sequences_in_waves_by_hand(tmp_path):
    """Prompts of 100 tokens, responses of 10, a cache of 222 tokens: two sequences fit (each admission needs
    room for the next step), so 8 run in 4 waves of 2, each paying its prefill."""
    sim = SimulatedConfig(decode_base_s=0.02, decode_per_seq_s=0.001, prefill_per_token_s=0.0001, kv_cache_tokens=222)
    busy, _ = _batch_busy(sim, [(100, 10)] * 8)
    assert busy == pytest.approx(4 * (2 * 100 * 0.0001 + 10 * (0.02 + 2 * 0.001)))
    unbounded, _ = _batch_busy(SimulatedConfig(decode_base_s=0.02, decode_per_seq_s=0.001, prefill_per_token_s=0.0001),
                               [(100, 10)] * 8)
    assert unbounded == pytest.approx(8 * 100 * 0.0001 + 10 * (0.02 + 8 * 0.001))


def test_kv_cache_preempts_the_newest_and_the_engine_agrees_with_the_planner(tmp_path):
    """A cache that fills mid-generation: the newest sequence is preempted and recomputed. The simulated engine
    (slept) and the planner's engine (computed) take the same modelled time."""
    from hpcrl.rollout.engine import EngineOptions
    from hpcrl.rollout.simulated_engine import SimulatedEngine

    kw = dict(decode_base_s=0.01, decode_per_seq_s=0.002, prefill_per_token_s=0.0005, kv_cache_tokens=250,
              time_scale=2000, lengths=_fixed(tmp_path, 100))
    sim = SimulatedConfig(**kw)
    busy, b = _batch_busy(sim, [(3, 100)] * 4)
    assert b.adm > 4  # somebody was admitted again after a preemption
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64, "eos_token_id": 1}))
    eng = SimulatedEngine(EngineOptions(model_dir=tmp_path, max_new_tokens=200, temperature=1.0, top_p=1.0,
                                        device="cpu", dtype="float32"), sim, max_num_seqs=256)
    out = asyncio.run(eng.generate([5, 6, 7], n=4, seed=1))
    assert [len(s.response_ids) for s in out] == [100] * 4
    assert eng.busy_model_s == pytest.approx(busy)
    assert busy > _batch_busy(SimulatedConfig(**{**kw, "kv_cache_tokens": 0}), [(3, 100)] * 4)[0]


def test_a_kv_cache_smaller_than_one_sequence_is_refused_before_submission():
    from hpcrl.config import ConfigError

    with pytest.raises(ConfigError, match="simulated.kv_cache_tokens"):
        load_config(SIM, ["simulated.kv_cache_tokens=1000"])
    assert load_config(SIM, ["simulated.kv_cache_tokens=4000"]).simulated.kv_cache_tokens == 4000


def test_the_claim_numbers_groups_in_start_order_whoever_starts_them():
    """What the planner assumes (prompt index = the fleet's start count): the shared claim hands out the next
    index never claimed, whichever writer asks."""
    from hpcrl.control import claims

    book = claims.ClaimBook()
    for w in ("w000", "w001", "w002"):
        claims.join(book, w, f"lease-{w}", set())
    order = [claims.claim(book, w, f"lease-{w}") for w in ("w001", "w001", "w000", "w002", "w000", "w001")]
    assert order == list(range(6))


def test_jobs_take_the_budget_first_come_up_to_their_cap_in_an_order_that_changes_per_version():
    """First come (``rollout.budget_share=first_come``): jobs that load a version together take the budget up to
    max_concurrent_groups each, first come first served, in an order that differs from version to version."""
    sim = load_config(SIM).simulated
    k = Knobs(rollout_jobs=4, trainer_gpus=1, staleness_threshold=0.0, partial_rollout=True, ppo_mini_batch_size=4,
              n=2, max_concurrent_groups=2, response_length=1536, budget_share="first_come")
    pipe = events.Pipeline(sim, k, Draws(sim, 2, 1536, prompts=2))
    pipe.run(8)
    per_version: dict[int, list[int]] = {}
    for v, rank in pipe.starts:
        per_version.setdefault(v, []).append(rank)
    for ranks in per_version.values():  # B=4 over jobs of 2: two jobs, two groups each
        assert len(ranks) == 4 and len(set(ranks)) == 2 and all(ranks.count(r) == 2 for r in ranks)
    assert len({frozenset(r) for r in per_version.values()}) > 1  # not the same engines every version
    keys = ServiceOrder(4, 0)
    assert sorted(keys.key(1)) == [0, 1, 2, 3] and not np.array_equal(keys.key(1), keys.key(2))


def test_shared_by_load_every_job_gets_its_part_of_each_versions_budget_whatever_the_order():
    """By load (the default): the same budget, B=4 over 4 jobs, gives each job one group per version, whichever
    order they ask in; the reference simulation agrees."""
    sim = load_config(SIM).simulated
    k = Knobs(rollout_jobs=4, trainer_gpus=1, staleness_threshold=0.0, partial_rollout=True, ppo_mini_batch_size=4,
              n=2, max_concurrent_groups=2, response_length=1536)
    pipe = events.Pipeline(sim, k, Draws(sim, 2, 1536, prompts=2))
    pipe.run(8)
    per_version: dict[int, list[int]] = {}
    for v, rank in pipe.starts:
        per_version.setdefault(v, []).append(rank)
    assert all(sorted(ranks) == [0, 1, 2, 3] for ranks in per_version.values()), per_version
    _agree(*_both(sim, k, 8))


def test_a_draining_job_commits_what_finished_meanwhile_when_the_drain_ends():
    """Without partial rollout a job that sees a new version finishes its groups in flight and seals them only
    then (RolloutJob._drain): the planner holds them too, and holding them costs throughput."""
    cfg = load_config(SIM)
    k = knobs_of(cfg, 1, 1, 0.5, False, prompt_tokens=2)
    pipe = events.Pipeline(cfg.simulated, k, Draws(cfg.simulated, 8, 1536, prompts=2))
    held = []
    commit = pipe.commit

    def spy(groups, now, finished=True):
        if not finished and groups:
            held.append((now, [g.finished_s for g in groups]))
        commit(groups, now, finished)

    pipe.commit = spy
    pipe.run(16)
    assert held and any(len(f) > 1 for _, f in held)
    for now, finished in held:
        assert max(finished) == now and min(finished) <= now
    assert any(min(f) < now for now, f in held)  # some waited for the slowest
    _agree(*_both(cfg.simulated, dataclass_replace(k, commit_while_draining=True), 16))
