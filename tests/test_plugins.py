"""A backend is one module and one registry entry: an engine, an advantage estimator and a weight transport written
as a newcomer would (tests/fake_backends/), registered by one entry each and nothing else changed, pass the config's
and the launcher's checks, and every check reads what the entry declares, never a backend's name."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import REPO, TINY
from hpcrl.config import ConfigError, load_config, registries
from hpcrl.config.registries import EngineSpec

UNIFORM = EngineSpec("fake_backends.uniform_engine:UniformEngine", doc="uniform sampling over the vocabulary")


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
