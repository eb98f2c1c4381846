"""A backend is one module and one registry entry: an engine, an advantage estimator and a weight transport written
as a newcomer would (tests/fake_backends/), registered by one entry each and nothing else changed, pass the config's
and the launcher's checks, and every check reads what the entry declares, never a backend's name."""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import PATIENT, REPO, TINY, BackgroundCommand, check_exactly_once
from hpcrl.config import ConfigError, load_config, registries
from hpcrl.config.registries import EngineSpec, EstimatorSpec, TransportSpec

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


# ---- weight transports

COPY = TransportSpec("fake_backends.copy_transport:CopySender", "fake_backends.copy_transport:CopyReceiver",
                     doc="a copy in the node's temporary folder")


def test_a_new_transport_writes_only_transfer_code_and_inherits_the_store(monkeypatch, tmp_path):
    """Versions come by the new transport; retention, withdrawal, bad markers and the check that a copy belongs to
    the committed version are the store's."""
    from hpcrl.config import WeightsConfig
    from hpcrl.rundir.paths import RunDir
    from hpcrl.weights import make_publisher, make_subscriber

    monkeypatch.setitem(registries.WEIGHT_TRANSPORTS, "copy", COPY)
    load_config(TINY, ["weights.transport=copy"])
    rd = RunDir(tmp_path / "run").create()
    cfg = WeightsConfig(transport="copy", keep_versions=2, delta=False)
    pub, sub = make_publisher(cfg, rd), make_subscriber(cfg, rd, "w000")
    w = torch.arange(6.0).reshape(2, 3)
    for v in range(4):
        published = pub.publish(v, {"w": w + v, "tied": w + v}, "{}", v, 4 * v)
        assert published.path == "copy" and published.sent_bytes > 0
        with sub.take(v) as wv:
            assert wv.path == "copy" and torch.equal(wv.tensors["w"], w + v)
        pub.retain(heartbeat_stale_s=60)
    assert pub.published_versions() == [2, 3]  # the store's retention
    assert pub.withdraw_after(2) == [3]
    pub.publish(3, {"w": w * 10}, "{}", 3, 12)  # published again after a rollback: the old copy is not it
    from fake_backends.copy_transport import folder_of
    (folder_of(rd) / "v3.json").write_text('{"published_s": 1.0, "aliases": {}}')
    with sub.take(3) as wv:
        assert wv.path == "filesystem" and torch.equal(wv.tensors["w"], w * 10)
    shutil.rmtree(folder_of(rd))


def _plugged_in_copy(folder):
    """The package as a newcomer leaves it after adding the three fake backends: one module each beside the
    backends of its kind, one entry each in config/registries.py, and nothing else changed (checked here)."""
    import difflib

    src = folder / "src"
    shutil.copytree(REPO / "hpcrl", src / "hpcrl", ignore=shutil.ignore_patterns("__pycache__"))
    added = {"rollout/uniform_engine.py": "uniform_engine.py", "trainer/value_baseline.py": "value_baseline.py",
             "weights/copy_transport.py": "copy_transport.py"}
    for where, module in added.items():
        shutil.copy(REPO / "tests" / "fake_backends" / module, src / "hpcrl" / where)
    entries = {"ENGINES: dict[str, EngineSpec] = {\n":
               '    "uniform": EngineSpec("hpcrl.rollout.uniform_engine:UniformEngine", doc="uniform tokens"),\n',
               "ADV_ESTIMATORS: dict[str, EstimatorSpec] = {\n":
               '    "score_minus_value": EstimatorSpec("hpcrl.trainer.value_baseline:estimate_score_minus_value", '
               'values=True, doc="s - V"),\n',
               "WEIGHT_TRANSPORTS: dict[str, TransportSpec] = {\n":
               '    "copy": TransportSpec("hpcrl.weights.copy_transport:CopySender", '
               '"hpcrl.weights.copy_transport:CopyReceiver", doc="a copy in the node\'s temporary folder"),\n'}
    registry = src / "hpcrl" / "config" / "registries.py"
    text = registry.read_text()
    for head, entry in entries.items():
        assert head in text, head
        text = text.replace(head, head + entry)
    registry.write_text(text)
    changed = sorted(str(p.relative_to(src / "hpcrl")) for p in (src / "hpcrl").rglob("*.py")
                     if not (REPO / "hpcrl" / p.relative_to(src / "hpcrl")).exists()
                     or p.read_bytes() != (REPO / "hpcrl" / p.relative_to(src / "hpcrl")).read_bytes())
    assert changed == sorted([*added, "config/registries.py"]), changed
    diff = [line for line in difflib.unified_diff((REPO / "hpcrl/config/registries.py").read_text().splitlines(),
                                                  text.splitlines(), n=0, lineterm="")
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert sorted(diff) == sorted("+" + e.rstrip("\n") for e in entries.values()), diff
    return src


PLUGGED = ["rollout.engine=uniform", "algorithm.adv_estimator=score_minus_value", "weights.transport=copy",
           "rollout.total_rollout_steps=16", "eval.every_versions=0"]
"""A short run on the three new backends (4 updates of R=4 groups; the engine ignores the weights it gets)."""


def plugged_in_run(folder) -> list[str]:
    """``hpcrl run`` of the plugged-in copy (first on the path, started from a folder of its own so that no job
    finds this checkout's package first), with a starved background run's patience."""
    src = _plugged_in_copy(folder)
    return ["env", "-C", str(folder), f"PYTHONPATH={src}", sys.executable, "-m", "hpcrl", "run", str(TINY), *PLUGGED,
            "--run-dir", str(folder / "run"), "--executor", "local", *PATIENT]


BACKGROUND_RUNS = {"plugins:run": BackgroundCommand(plugged_in_run)}
"""In the background when the session starts (conftest.BackgroundRuns): its jobs start cold (their package is the
copy), its test only reads the finished run."""


def background_keys(item) -> tuple[str, ...]:
    """The background run a test item reads (none: it runs its own)."""
    return ("plugins:run",) if item.originalname == "test_a_run_on_backends_each_added_as_one_module_and_one_entry" \
        else ()


@pytest.mark.slow
def test_a_run_on_backends_each_added_as_one_module_and_one_entry(background_runs, monkeypatch):
    """An engine, an estimator and a transport, each one new module and one registry entry, nothing else changed:
    the launch checks pass and the run ends, every group trained exactly once, on the new engine's samples, the new
    estimator's value head trained, every version taken by the new transport."""
    from hpcrl.rundir.paths import RunDir

    out = background_runs.launched("plugins:run", timeout_s=900)
    assert out.returncode == 0 and "run finished" in out.stdout, out.stdout[-4000:]
    rd = RunDir(Path(out.args[out.args.index("--run-dir") + 1]))
    for registry, name, spec in ((registries.ENGINES, "uniform", UNIFORM), (registries.WEIGHT_TRANSPORTS, "copy", COPY),
                                 (registries.ADV_ESTIMATORS, "score_minus_value", VALUE_BASELINE)):
        monkeypatch.setitem(registry, name, spec)  # so that this process reads the run's frozen config too
    check_exactly_once(rd, rd.load_config().rollout.max_concurrent_groups)
    metrics = [json.loads(x) for x in rd.metrics.read_text().splitlines()]
    assert len(metrics) == 4 and all("critic/values/mean" in m and "critic/vf_loss" in m for m in metrics)
    rows = [json.loads(x) for x in rd.rollout_metrics("w000").read_text().splitlines()]
    assert {r["weights/path"] for r in rows} == {"copy"}, [r["weights/path"] for r in rows]
    assert {m["weights/path"] for m in metrics if "weights/path" in m} == {"copy"}
    from fake_backends.copy_transport import folder_of
    shutil.rmtree(folder_of(rd))
