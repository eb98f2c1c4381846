"""``hpcrl plan``'s sweep: the options that narrow and widen it, the search against every candidate, the upper
bound, the requested configuration, the step per update and per sync period, prompts from the data, and the
synchronous baseline."""
from __future__ import annotations

import json

import pytest

from hpcrl.cli import main
from hpcrl.config import load_config
from hpcrl.config.simulated import SimulatedConfig
from hpcrl.plan.baseline import sync_baseline
from hpcrl.plan.command import plan_command
from hpcrl.plan.model import Draws, Knobs
from hpcrl.plan.sweep import (Candidate, SweepSpec, candidates, default_splits, parse_floats, parse_partial,
                              parse_splits, search, upper_bound)

SIM = "configs/simulated.yaml"


def _cli(capsys, *argv) -> tuple[int, str]:
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


def _rows(text: str) -> list[list[str]]:
    """The table's rows (after the dashed rule, up to the blank line)."""
    lines = text.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("-")) + 1
    return [x.split() for x in lines[start:lines.index("", start)]]


def test_plan_help_lists_every_sweep_option(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    for opt in ("--gpus", "--gpus-per-engine", "--gpus-per-node", "--splits", "--staleness", "--partial", "--prompt-tokens", "--updates",
                "--probe", "--top", "--all"):
        assert opt in out


def test_splits_parse_lists_ranges_and_steps():
    assert parse_splits("8,16,32") == [8, 16, 32]
    assert parse_splits("2:5") == [2, 3, 4, 5]
    assert parse_splits("8:32:8,1") == [1, 8, 16, 24, 32]
    for bad in ("a", "8:", "0:4", "4:8:0", ""):
        with pytest.raises(ValueError, match="--splits"):
            parse_splits(bad)
    assert parse_floats("0.3, 0.1,0.3", "--staleness") == (0.1, 0.3)
    with pytest.raises(ValueError, match="--staleness"):
        parse_floats("-1", "--staleness")
    assert parse_partial("on") == (True,) and parse_partial("both") == (False, True)
    with pytest.raises(ValueError, match="--partial"):
        parse_partial("maybe")


def test_default_splits_are_every_count_then_whole_nodes():
    assert default_splits(8, 1) == list(range(1, 8))
    assert default_splits(128, 1) == [1, 2, 4] + list(range(8, 121, 8))
    assert default_splits(16, 4) == list(range(1, 9)), "9-12 GPUs is no shape of 8-GPU nodes"
    assert default_splits(64, 1) == list(range(1, 9)) + list(range(16, 57, 8))
    assert default_splits(64, 1, gpus_per_node=4) == [1, 2, 3, 4] + list(range(8, 61, 4))


def test_the_advice_is_in_shapes_a_cluster_can_give(capsys):
    """At 64 GPUs the best split was once 'resources.trainer.nodes=1 ... gpus_per_node=31'."""
    for node, argv in ((8, []), (4, ["--gpus-per-node", "4"])):
        rc, out = _cli(capsys, SIM, "--gpus", "64", "--updates", "4", "--staleness", "0.5", "--partial", "off", *argv)
        assert rc == 0, out
        best = [line for line in out.splitlines() if "resources.trainer.nodes=" in line]
        assert len(best) == 3, out
        for line in best:
            nodes = int(line.split("resources.trainer.nodes=")[1].split()[0])
            per_node = int(line.split("resources.trainer.gpus_per_node=")[1].split()[0])
            assert per_node <= node and (nodes == 1 or per_node == node), line
        trainers = {int(r[0].split(":")[0]) for r in _rows(out) if not r[0].startswith("coloc")}
        assert all(t <= node or t % node == 0 for t in trainers - {1}), trainers  # 1: the config's own request
    rc, out = _cli(capsys, SIM, "--gpus", "64", "--splits", "12,16", "--updates", "4")
    assert rc == 2 and "--splits: 12 trainer GPUs is no shape of 8-GPU nodes" in out, out
    rc, out = _cli(capsys, SIM, "--gpus", "64", "--gpus-per-engine", "16", "--updates", "4")
    assert rc == 2 and "--gpus-per-engine 16: an engine runs on one node of 8 GPUs" in out, out


def test_a_line_says_when_the_phase_numbers_are_hpcrls_defaults(capsys):
    rc, out = _cli(capsys, "configs/tiny.yaml", "--gpus", "8", "--updates", "4", "--staleness", "0", "--partial", "off")
    assert rc == 0 and out.startswith("note: the config has no simulated: section, so every phase number below is "
                                      "hpcrl's built-in default"), out
    rc, out = _cli(capsys, SIM, "--gpus", "8", "--updates", "4", "--staleness", "0", "--partial", "off")
    assert rc == 0 and "built-in default" not in out, out
    rc, out = _cli(capsys, SIM, "simulated.publish_s=0", "--gpus", "8", "--updates", "4", "--staleness", "0",
                   "--partial", "off")
    assert "built-in default" not in out, "a key set to its default value is set all the same"


def test_splits_option_narrows_the_trainer_sizes(capsys):
    rc, out = _cli(capsys, SIM, "--gpus", "8", "--splits", "2,5", "--staleness", "0.5", "--partial", "off",
                   "--updates", "6")
    assert rc == 0
    assert {r[0] for r in _rows(out)} - {"coloc(8)", "1:7"} == {"2:6", "5:3"}  # 1:7 the config's own: requested


def test_staleness_and_partial_options_choose_the_async_settings_and_the_configs_own_is_always_one(capsys):
    cfg = load_config(SIM, ["async_training.staleness_threshold=0.3", "async_training.partial_rollout=true"])
    cands = candidates(cfg, SweepSpec(gpus=4, staleness=(0.1,), partial=(False,)))
    assert {(c.knobs.staleness_threshold, c.knobs.partial_rollout) for c in cands} == {(0.1, False), (0.3, True)}
    rc, out = _cli(capsys, SIM, "async_training.staleness_threshold=0.3", "--gpus", "4", "--staleness", "0.1",
                   "--partial", "on", "--all", "--updates", "6")
    assert rc == 0 and {(r[1], r[2]) for r in _rows(out) if r[0] != "coloc(4)"} == {("0.1", "yes"), ("0.3", "no")}


def test_the_requested_configuration_is_printed_next_to_the_best(capsys):
    """The config's own resources and async settings get a row even when they are far from the best."""
    rc, out = _cli(capsys, SIM, "resources.rollout_jobs=1", "simulated.trainer_gpus=7", "--gpus", "8", "--top", "1",
                   "--updates", "6")
    assert rc == 0
    rows = _rows(out)
    assert rows[-2][0] == "7:1" and rows[-2][-1] == "requested" and rows[-1][-2:] == ["synchronous", "baseline"]
    assert "requested: the config's resources (trainer 7 GPUs, 1 rollout jobs of 1)" in out


def test_the_step_is_printed_per_update_and_per_sync_period(capsys):
    rc, out = _cli(capsys, SIM, "async_training.trigger_parameter_sync_step=3", "--gpus", "4", "--updates", "9",
                   "--splits", "2", "--staleness", "0.5", "--partial", "off")
    assert rc == 0
    for r in _rows(out):
        assert float(r[4]) == pytest.approx(3 * float(r[3]), abs=0.2)
    assert "s/sync: a parameter-sync period of K=3 updates" in out


def test_prompt_lengths_come_from_the_data_or_the_knob(capsys, tmp_path):
    rc, out = _cli(capsys, SIM, "--gpus", "3", "--updates", "4", "--splits", "1")
    assert rc == 0 and "prompts from data.source (512 rows, mean 2 tokens, longest 2)" in out
    rc, out = _cli(capsys, SIM, "--gpus", "3", "--updates", "4", "--splits", "1", "--prompt-tokens", "300")
    assert rc == 0 and "prompts 300 tokens (--prompt-tokens)" in out
    rc, out = _cli(capsys, SIM, "data.source=" + str(tmp_path / "none.parquet"), "--gpus", "3")
    assert rc == 2 and "pass --prompt-tokens N" in out


def test_longer_prompts_cost_prefill_in_the_prediction():
    sim = load_config(SIM).simulated
    k = Knobs(rollout_jobs=1, trainer_gpus=1, staleness_threshold=0.0, partial_rollout=False, response_length=1536)
    from hpcrl.plan.events import predict
    short = predict(sim, k, 6, draws=Draws(sim, 8, 1536, prompts=[2]))
    long = predict(sim, k, 6, draws=Draws(sim, 8, 1536, prompts=[2000, 3000]))
    assert long.step_s > short.step_s + 32 * 2000 * sim.prefill_per_token_s * 0.9


def test_the_search_finds_the_best_of_every_candidate():
    """Coarse to fine with the bound finds the exhaustive sweep's best within 1 % (28K proportions, 12 GPUs of one
    node: every trainer size a shape)."""
    cfg = load_config("configs/simulated-28k.yaml")
    spec = SweepSpec(gpus=12, updates=6, gpus_per_node=12)
    draws = Draws(cfg.simulated, cfg.rollout.n, cfg.rollout.response_length, cfg.data.seed, None, 2)
    every = search(cfg.simulated, candidates(cfg, spec), draws, 6, cfg.data.seed, 3, exhaustive=True).predicted
    found = search(cfg.simulated, candidates(cfg, spec), draws, 6, cfg.data.seed, 3)
    assert len(found.predicted) < len(every)
    assert found.predicted[0].prediction.tokens_per_s >= 0.99 * every[0].prediction.tokens_per_s
    for c in every:  # the bound is one
        assert c.prediction.tokens_per_s <= c.bound_tokens_per_s


def test_the_bound_is_the_trainer_or_the_fleet(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "staleness.jsonl").write_text(json.dumps({"n_tokens": 100}) + "\n")
    sim = SimulatedConfig(decode_base_s=0.02, decode_per_seq_s=0.001, update_base_s=2.0, update_per_token_s=0.001,
                          weight_load_s=1.0, publish_s=0.0, lengths=f"empirical:{tmp_path}")
    k = Knobs(rollout_jobs=1, trainer_gpus=1, staleness_threshold=1.0, partial_rollout=True)
    tokens = 4 * 8 * 100
    trainer = tokens / (2.0 + 0.001 * tokens)
    fleet = 32 / (0.02 + 0.001 * 32)  # B * n = 64 sequences may run, an engine holds 8 groups x 8 of them: 64
    fleet = 64 / (0.02 + 0.001 * 64)
    assert upper_bound(sim, k, 100) == pytest.approx(min(trainer, tokens / (tokens / fleet + 1.0)))


def test_the_synchronous_baseline_by_hand(tmp_path):
    """Colocated on 2 GPUs (2 engines): 4 groups of 8 spread 2 per engine, L steps of 16 sequences, then the update
    on both GPUs, then the switch."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "staleness.jsonl").write_text(json.dumps({"n_tokens": 100}) + "\n")
    sim = SimulatedConfig(decode_base_s=0.02, decode_per_seq_s=0.001, prefill_per_token_s=0.0, update_base_s=2.0,
                          update_per_token_s=0.001, weight_load_s=1.0, lengths=f"empirical:{tmp_path}")
    k = Knobs(rollout_jobs=1, trainer_gpus=1, staleness_threshold=0.0, partial_rollout=False, response_length=1000)
    from hpcrl.plan.probe import empirical_lengths
    p = sync_baseline(sim, k, 2, 1, Draws(sim, 8, 1000, empirical=empirical_lengths(sim.lengths)), 4)
    assert p.step_s == pytest.approx(100 * (0.02 + 0.001 * 16) + 2.0 + 0.001 * 3200 / 2 + 1.0)
    assert p.lag_max == 0


def test_plan_prints_the_synchronous_baseline_and_the_speedup_over_it():
    lines = plan_command(SIM, [], SweepSpec(gpus=4, updates=6), top=3)
    text = "\n".join(lines)
    rows = _rows(text)
    sync = [r for r in rows if r[-2:] == ["synchronous", "baseline"]][0]
    assert sync[0] == "coloc(4)" and sync[6] == "1.00x"
    best = rows[0]
    assert float(best[6].rstrip("x")) == pytest.approx(float(best[5]) / float(sync[5]), abs=0.01)
    assert "x synchronous)" in text


def test_a_sweep_of_a_thousand_gpus_simulates_a_few_dozen_candidates():
    """At 1,024 GPUs the search simulates a small share of the ~650 candidates (the bench times it)."""
    cfg = load_config("configs/simulated-28k.yaml")
    spec = SweepSpec(gpus=1024, updates=4, staleness=(0.5,), partial=(True,))
    cands = candidates(cfg, spec)
    draws = Draws(cfg.simulated, cfg.rollout.n, cfg.rollout.response_length, cfg.data.seed, None, 2)
    found = search(cfg.simulated, cands, draws, 4, cfg.data.seed, 3)
    assert len(cands) == 130 and len(found.predicted) <= 30


def test_candidate_overrides_name_the_resources():
    c = Candidate(Knobs(rollout_jobs=3, trainer_gpus=5, staleness_threshold=0.5, partial_rollout=True))
    o = c.overrides(2)
    assert "resources.rollout_jobs=3" in o and "resources.rollout.gpus_per_node=2" in o
    assert "staleness_threshold=0.5" in o
    assert "resources.trainer.nodes=1 resources.trainer.tasks_per_node=5 resources.trainer.gpus_per_node=5" in o
    o = Candidate(Knobs(rollout_jobs=96, trainer_gpus=32, staleness_threshold=1, partial_rollout=False)).overrides(1)
    assert "resources.trainer.nodes=4 resources.trainer.tasks_per_node=8 resources.trainer.gpus_per_node=8" in o


def test_bad_options_are_refused_together_before_anything_is_simulated(capsys):
    rc, out = _cli(capsys, SIM, "--gpus", "1", "--splits", "x", "--staleness", "-1", "--updates", "2")
    assert rc == 2
    for what in ("--splits x", "--staleness -1", "--gpus must be >= 2, got 1", "--updates must be >= 3, got 2"):
        assert what in out


def test_the_readmes_plan_command_works_on_the_shipped_gpu_configs(capsys):
    """``hpcrl plan CONFIG --gpus 64`` as the README wrote it failed on every shipped GPU config (their model.path
    is a placeholder, so the prompts cannot be read): the README's command must run on them as written."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    readme = " ".join((repo / "README.md").read_text().split())
    command = re.search(r"`hpcrl plan CONFIG ([^`]*)`", readme).group(1).split()
    for config in sorted(repo.glob("configs/gsm8k-*.yaml")) + [repo / "configs" / "plan-7b-math-28k.yaml"]:
        rc, out = _cli(capsys, str(config), *command, "--updates", "4")  # fewer updates: the same check, sooner
        assert rc == 0, (config.name, out)
