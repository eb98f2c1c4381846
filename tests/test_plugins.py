"""A backend is one module and one registry entry: an engine, an advantage estimator and a weight transport written
as a newcomer would (tests/fake_backends/), registered by one entry each and nothing else changed, pass the config's
and the launcher's checks, and every check reads what the entry declares, never a backend's name."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from conftest import REPO, TINY
from hpcrl.config import ConfigError, load_config, registries
from hpcrl.config.registries import EngineSpec, EstimatorSpec

UNIFORM = EngineSpec("fake_backends.uniform_engine:UniformEngine", doc="uniform sampling over the vocabulary")
VALUE_BASELINE = EstimatorSpec("fake_backends.value_baseline:estimate_score_minus_value", values=True,
                               doc="the score minus the critic's value")


@pytest.fixture
def uniform(monkeypatch):
    """The uniform engine, registered as ``uniform`` with ``spec`` (the test's variant of it)."""
    def register(**spec):
        monkeypatch.setitem(registries.ENGINES, "uniform", dataclasses.replace(UNIFORM, **spec))
    register()
    return register


def problem(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(TINY, list(overrides))
    return str(e.value)


# ---- engines


def test_a_new_engine_passes_the_launch_checks_and_generates(uniform, tmp_path):
    from hpcrl.launcher.inputs import check_inputs
    from hpcrl.rollout.engine import EngineOptions, EngineRunner
    from hpcrl.rollout.engines import make_engine
    from hpcrl.tiny.model import build_tiny_model

    cfg = load_config(TINY, ["rollout.engine=uniform"])
    assert check_inputs(cfg, "local").prompts > 0
    model = build_tiny_model(tmp_path / "m")
    runner = EngineRunner()
    try:
        engine = make_engine("uniform", EngineOptions(model, 8, 1.0, 1.0, "cpu", "float32"), cfg, runner, 30)
        samples = runner.call(lambda: engine.generate([3, 4], n=4, seed=1), 30, "generating")
    finally:
        runner.close()
    assert len(samples) == 4 and all(0 < len(s.response_ids) <= 8 for s in samples)


def test_the_parallel_sizes_follow_the_engines_spec(uniform):
    assert problem("rollout.engine=uniform", "rollout.tensor_parallel_size=2").startswith(
        "config rollout.tensor_parallel_size: got (2, 1); allowed: 1 and 1 with rollout.engine=uniform")
    uniform(parallel=True)
    load_config(TINY, ["rollout.engine=uniform", "rollout.tensor_parallel_size=2"])  # no GPUs asked: no count
    assert "resources.rollout.gpus_per_node (1)" in problem(
        "rollout.engine=uniform", "rollout.tensor_parallel_size=2", "resources.rollout.gpus_per_node=1")


def test_the_largest_lora_rank_and_the_verl_name_follow_the_engines_spec(uniform):
    load_config(TINY, ["rollout.engine=uniform", "actor.lora_rank=64"])
    uniform(max_lora_rank=16)
    assert problem("rollout.engine=uniform", "actor.lora_rank=64").startswith(
        "config actor.lora_rank: got 64; allowed: at most 16 with rollout.engine=uniform")
    uniform(verl_name="uni")
    assert load_config(TINY, ["actor_rollout_ref.rollout.name=uni"]).rollout.engine == "uniform"
    uniform(simulated=True)
    assert load_config(TINY, ["rollout.engine=uniform", "eval.every_versions=0"]).is_simulated


def test_the_launch_check_reads_the_package_and_the_cpu_head_dim_of_the_engines_spec(uniform):
    from hpcrl.launcher.inputs import check_engine

    cfg = load_config(TINY, ["rollout.engine=uniform"])
    check_engine(cfg)
    uniform(package="hpcrl_no_such_package", install="pip install hpcrl-no-such-package")
    with pytest.raises(ConfigError, match="hpcrl_no_such_package is not installed.*fix: pip install "
                                          "hpcrl-no-such-package, or rollout.engine=transformers"):
        check_engine(cfg)
    uniform(cpu_min_head_dim=64)
    with pytest.raises(ConfigError, match="config model.path: .*head dim is >= 64 .*this one's is 32.*fix: set "
                                          "model.path=builtin:tiny-h64"):
        check_engine(cfg)
    check_engine(load_config(TINY, ["rollout.engine=uniform", "model.path=builtin:tiny-h64"]))


def test_the_doctor_checks_every_engines_package():
    from hpcrl.doctor.command import OPTIONAL

    assert OPTIONAL == ("cuda", *dict.fromkeys(s.package for s in registries.ENGINES.values() if s.package))


# ---- advantage estimators


def test_a_new_estimator_declares_what_it_needs_and_the_checks_read_it(monkeypatch):
    from hpcrl.trainer.advantages import compute_advantages, place_scores

    monkeypatch.setitem(registries.ADV_ESTIMATORS, "score_minus_value", VALUE_BASELINE)
    cfg = load_config(TINY, ["algorithm.adv_estimator=score_minus_value", "rollout.n=1", "algorithm.use_pf_ppo=true"])
    assert registries.estimator_spec(cfg.algorithm.adv_estimator).values  # the trainer adds the value head for it
    mask, g = torch.tensor([[1.0, 1.0], [1.0, 0.0]]), torch.tensor([0, 1])
    adv, ret = compute_advantages("score_minus_value", place_scores(torch.tensor([1.0, 0.0]), mask), mask, g,
                                  values=torch.full((2, 2), 0.25))
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75], [-0.25, 0.0]]))
    with pytest.raises(ValueError, match="score_minus_value needs values from the critic"):
        compute_advantages("score_minus_value", place_scores(torch.tensor([1.0, 0.0]), mask), mask, g)
    monkeypatch.setitem(registries.ADV_ESTIMATORS, "score_minus_value", dataclasses.replace(VALUE_BASELINE,
                                                                                            values=False, group=True))
    assert "use_pf_ppo" in problem("algorithm.adv_estimator=score_minus_value", "algorithm.use_pf_ppo=true")
    assert problem("algorithm.adv_estimator=score_minus_value", "rollout.n=1").startswith(
        "config rollout.n: got 1; allowed: at least 2 with adv_estimator=score_minus_value")


def test_the_config_reference_lists_the_registries_names_with_what_each_is(monkeypatch):
    from hpcrl.config.reference import render

    monkeypatch.setitem(registries.ADV_ESTIMATORS, "score_minus_value", VALUE_BASELINE)
    monkeypatch.setitem(registries.ENGINES, "uniform", UNIFORM)
    page = render()
    assert "``score_minus_value``: the score minus the critic's value" in page
    assert "``uniform``: uniform sampling over the vocabulary" in page


# ---- no check names a backend


BACKEND_NAMES = re.compile(r'"vllm"|== "gae"|"remax"')
"""What the checks spelled before each backend declared itself (issue 49's acceptance)."""
BACKENDS = ("config/registries.py", "rollout/vllm_engine.py", "rollout/vllm_worker.py", "rollout/vllm_sockets.py",
            "trainer/estimators.py")
"""The registry and the backends themselves, which may name themselves."""


def test_no_module_outside_the_registry_and_the_backends_names_an_engine_or_an_estimator():
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in sorted((REPO / "hpcrl").rglob("*.py"))
             if not str(p.relative_to(REPO / "hpcrl")).endswith(BACKENDS)
             for i, line in enumerate(p.read_text().splitlines(), 1) if BACKEND_NAMES.search(line)]
    assert not found, "read the backend's spec in hpcrl/config/registries.py instead:\n" + "\n".join(found)
