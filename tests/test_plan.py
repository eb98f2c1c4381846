"""hpcrl plan's event simulation against closed forms, and its lengths against the simulated engine's."""
from __future__ import annotations

import json

import pytest

from hpcrl.config import load_config
from hpcrl.config.simulated import SimulatedConfig
from hpcrl.rundir.fsio import JsonlAppender
from plan_reference import Knobs, predict, prompt_seed
from hpcrl.plan.command import plan_command
from hpcrl.plan.sweep import SweepSpec

L = 100  # every response this long (empirical lengths of one value)


def _fixed(tmp_path, length=L) -> str:
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "logs" / "staleness.jsonl").write_text(json.dumps({"n_tokens": length}) + "\n")
    return f"empirical:{tmp_path}"


def _sim(tmp_path, **kw) -> SimulatedConfig:
    base = dict(decode_base_s=0.02, decode_per_seq_s=0.001, prefill_per_token_s=0.0, weight_load_s=1.0,
                update_base_s=2.0, update_per_token_s=0.001, lengths=_fixed(tmp_path))
    return SimulatedConfig(**{**base, **kw})


def _empirical(sim):
    from hpcrl.plan.probe import empirical_lengths
    return empirical_lengths(sim.lengths)


def test_on_policy_step_is_load_plus_generation_plus_update(tmp_path):
    sim = _sim(tmp_path)
    k = Knobs(rollout_jobs=1, trainer_gpus=1, staleness_threshold=0.0, partial_rollout=False, ppo_mini_batch_size=4,
              n=8, max_concurrent_groups=8, response_length=1000)
    p = predict(sim, k, updates=10, empirical=_empirical(sim))
    generation = L * (0.02 + 0.001 * 32)  # 4 groups x 8 in one batch, L steps
    update = 2.0 + 0.001 * 32 * L
    assert p.step_s == pytest.approx(1.0 + generation + update)
    assert p.trainer_busy == pytest.approx(update / (1.0 + generation + update))
    assert p.lag_max == 0 and p.tokens == 9 * 32 * L


def test_the_publish_time_adds_to_an_on_policy_step(tmp_path):
    sim = _sim(tmp_path, publish_s=3.0)
    k = Knobs(rollout_jobs=1, trainer_gpus=1, staleness_threshold=0.0, partial_rollout=False, response_length=1000)
    p = predict(sim, k, updates=6, empirical=_empirical(sim))
    assert p.step_s == pytest.approx(3.0 + 1.0 + L * (0.02 + 0.001 * 32) + 2.0 + 0.001 * 32 * L)


def test_trainer_gpus_divide_the_per_token_time(tmp_path):
    sim = _sim(tmp_path)
    k = Knobs(rollout_jobs=1, trainer_gpus=4, staleness_threshold=0.0, partial_rollout=False, response_length=1000)
    p = predict(sim, k, updates=6, empirical=_empirical(sim))
    assert p.step_s == pytest.approx(1.0 + L * (0.02 + 0.001 * 32) + 2.0 + 0.001 * 32 * L / 4)


def test_trainer_bound_run_with_room_to_run_ahead_steps_at_the_update_time(tmp_path):
    sim = _sim(tmp_path, decode_base_s=0.001, decode_per_seq_s=0.0, weight_load_s=0.0)
    k = Knobs(rollout_jobs=2, trainer_gpus=1, staleness_threshold=2.0, partial_rollout=True, response_length=1000)
    p = predict(sim, k, updates=12, empirical=_empirical(sim))
    assert p.step_s == pytest.approx(2.0 + 0.001 * 32 * L)
    assert p.trainer_busy == pytest.approx(1.0)
    assert 0 < p.lag_mean and p.lag_max <= 2


def test_the_cap_cuts_lengths(tmp_path):
    sim = _sim(tmp_path)
    k = Knobs(rollout_jobs=1, trainer_gpus=1, staleness_threshold=0.0, partial_rollout=False, response_length=40)
    p = predict(sim, k, updates=4, empirical=_empirical(sim))
    assert p.tokens == 3 * 32 * 40


def test_lengths_and_seeds_are_the_simulated_engines():
    from hpcrl.rollout.agent_loop import group_seed
    from hpcrl.rollout.simulated_engine import response_length
    import numpy as np

    sim = SimulatedConfig()
    for index in (0, 7, 12345):
        assert prompt_seed(3, index) == group_seed(3, index)
        ours = int(sim.draw_lengths(np.random.default_rng([prompt_seed(3, index), 2]), 1)[0])
        assert ours == response_length(sim, group_seed(3, index), 2)


def test_plan_prints_a_table_and_the_best_configurations():
    lines = plan_command("configs/simulated.yaml", ["rollout.total_rollout_steps=64"], SweepSpec(gpus=4, updates=8),
                         top=5)
    text = "\n".join(lines)
    assert "trainer:engines" in text and "best (highest throughput first):" in text
    assert "resources.rollout_jobs=" in text and "resources.trainer.gpus_per_node=" in text
    assert "simulated.trainer_gpus=" in text


def test_plan_refuses_a_budget_without_a_split():
    with pytest.raises(ValueError, match="no split"):
        plan_command("configs/simulated.yaml", [], SweepSpec(gpus=1, updates=4), top=5)


def test_config_file_parses():
    assert load_config("configs/simulated.yaml").is_simulated


def test_probe_fits_the_update_model_switch_and_lengths_from_a_runs_logs(tmp_path):
    from hpcrl.config import dump_config
    from hpcrl.plan.probe import probe_model
    from hpcrl.rundir.paths import RunDir

    rd = RunDir(tmp_path / "probe")
    cfg = load_config("configs/simulated.yaml", ["simulated.time_scale=10", "simulated.trainer_gpus=2"])
    rd.logs.mkdir(parents=True)
    rd.config_path.write_text(dump_config(cfg))
    # wall seconds of a probe at time_scale 10 whose update is 3 s + 0.002 s/token on 2 GPUs
    rd.metrics.write_text("".join(json.dumps({"n_tokens": n, "timing_s/update": (3.0 + 0.001 * n) / 10}) + "\n"
                                  for n in (1000, 2000, 4000, 8000)))
    rd.rollout_metrics("w000").write_text("".join(json.dumps({"timing_s/load_weights": 0.05}) + "\n" for _ in range(3)))
    JsonlAppender(rd.staleness).append_many([{"n_tokens": n} for n in (10, 20, 30)])
    sim, notes = probe_model(SimulatedConfig(), rd.root)
    assert sim.update_base_s == pytest.approx(3.0) and sim.update_per_token_s == pytest.approx(0.002)
    assert sim.weight_load_s == pytest.approx(0.5) and sim.time_scale == 1.0
    assert sim.lengths == f"empirical:{rd.root}" and "3 responses" in notes[0]
