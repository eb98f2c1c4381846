"""The evaluation's parts without jobs: its config (and verl's keys for it), which versions are due, the eval
log's crash safety, greedy decoding, the toy task's held-out split, the launcher's plan."""
from __future__ import annotations

import gzip
import json
import time

import pytest
import yaml
import torch

from conftest import REPO, TINY
from hpcrl.config import ConfigError, load_config
from hpcrl.eval.schedule import DuePolicy, all_handled, plan_next
from hpcrl.eval.writer import EvalLogWriter
from hpcrl.logs.eval_log import EVALUATED, SKIPPED, EvalRow, EvalSample, read_eval_rows, read_eval_samples
from hpcrl.launcher.sbatch_lines import sbatch_lines
from hpcrl.launcher.submit import plan_jobs
from hpcrl.rundir.paths import EVAL_JOB, RunDir

# ---- config ------------------------------------------------------------------------------------


def test_verls_validation_keys_are_accepted_and_mapped(tmp_path):
    """verl's ``data.val_files``, ``trainer.test_freq``, ``trainer.val_before_train`` and ``val_kwargs.*``, as
    overrides and in a YAML tree, resolve to the same config as hpcrl's names."""
    v = "actor_rollout_ref.rollout.val_kwargs."
    verl = load_config(TINY, ["trainer.test_freq=10", "trainer.val_before_train=false", "data.val_files=/d/test.parquet",
                              v + "n=4", v + "do_sample=true", v + "temperature=0.6", v + "top_p=0.9", v + "top_k=20"])
    ours = load_config(TINY, ["eval.every_versions=10", "eval.before_training=false", "data.val_files=[/d/test.parquet]",
                              "eval.n=4", "eval.do_sample=true", "eval.temperature=0.6", "eval.top_p=0.9",
                              "eval.top_k=20"])
    assert verl.to_dict() == ours.to_dict()
    assert verl.data.val_files == ["/d/test.parquet"], "verl's single file (a string) becomes a list"
    tree = {"data": {"val_files": ["a.jsonl", "b.parquet"]}, "trainer": {"test_freq": 5, "checkpoint_every_updates": 7},
            "actor_rollout_ref": {"rollout": {"val_kwargs": {"n": 1, "do_sample": False}}}}
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(tree))
    cfg = load_config(path)
    assert (cfg.eval.every_versions, cfg.eval.n, cfg.trainer.checkpoint_every_updates) == (5, 1, 7)
    assert load_config(TINY, ["trainer.test_freq=-1"]).eval.enabled is False, "verl's -1: no evaluation"
    assert load_config(TINY, ["trainer.test_freq=10"]).eval.every_versions == 10, "an override wins over the file"
    path.write_text(yaml.safe_dump({**tree, "trainer": {"test_freq": 10}, "eval": {"every_versions": 20}}))
    with pytest.raises(ConfigError, match="got (10|20), but (eval.every_versions|trainer.test_freq) already set "
                                          "eval.every_versions to (20|10); fix: keep one of them"):
        load_config(path)


@pytest.mark.parametrize("overrides, match", [
    (["eval.n=4"], "eval.n: got 4; allowed: 1 with greedy decoding.*fix: set eval.do_sample=true"),
    (["eval.do_sample=true", "eval.temperature=0"], "eval.temperature: got 0.*> 0 with eval.do_sample=true"),
    (["data.val_files=[]"], "data.val_files: got \\[\\]; allowed: held-out prompt files with eval.every_versions=20"),
    (["data.val_files=test.csv"], "data.val_files: got 'test.csv'"),
    (["eval.engine=sglang"], "eval.engine"),
    (["eval.top_k=-2"], "eval.top_k"),
    (["resources.eval.tasks_per_node=2"], "resources.eval.tasks_per_node: got 2"),
    (["rollout.device=cuda", "resources.rollout.gpus_per_node=1"], "resources.eval.gpus_per_node: got 0"),
])
def test_evaluation_config_errors_name_the_key_and_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(TINY, overrides)


def test_the_tiny_config_validates_every_20_versions_on_the_held_out_split():
    cfg = load_config(TINY)
    assert cfg.eval.enabled and cfg.eval.every_versions == 20 and cfg.eval.before_training
    assert cfg.data.val_files == ["builtin:toy_heldout"] and (cfg.eval.n, cfg.eval.do_sample) == (1, False)
    rd = RunDir("/tmp/run")
    assert [j.name for j in plan_jobs(cfg, rd)] == ["trainer", "rollout-w000", EVAL_JOB]
    assert [j.name for j in plan_jobs(load_config(TINY, ["eval.every_versions=0"]), rd)] == ["trainer", "rollout-w000"]
    lines = sbatch_lines(cfg, rd, REPO / "sbatch", "python")
    assert len(lines) == 3 and lines[2].endswith("sbatch/eval.sbatch /tmp/run") and "--job-name=hpcrl-eval" in lines[2]
    assert len(sbatch_lines(load_config(TINY, ["eval.every_versions=0"]), rd, REPO / "sbatch", "python")) == 2


def test_the_held_out_split_never_shows_a_training_prompt():
    from hpcrl.rollout.dataset import load_rows

    cfg = load_config(TINY)
    train = {r["prompt"] for r in load_rows(cfg.data, 8)}
    held = load_rows(load_config(TINY, ["data.source=builtin:toy_heldout"]).data, 8)
    assert len(held) == 24 and not train & {r["prompt"] for r in held}
    assert {r["answer"].split()[0] for r in held} == {p.split()[-1] for p in train}, "the same letters"
    assert all(r["data_source"] == "builtin:toy_heldout" for r in held)


# ---- which versions are due ---------------------------------------------------------------------

def test_due_versions_and_what_is_skipped_when_behind():
    p = DuePolicy(every_versions=20, before_training=True)
    assert [v for v in range(70) if p.is_due(v)] == [0, 20, 40, 60]
    assert plan_next(p, [0, 1, 2], set()).target == 0
    plan = plan_next(p, [38, 39, 40, 41], {0})
    assert (plan.target, plan.skipped) == (40, [20]), "behind: the newest due version, 20 is skipped"
    assert plan_next(p, [41, 42], {0, 20, 40}).target is None
    done = DuePolicy(20, False, final=57)
    assert done.due_up_to(57) == [20, 40, 57] and not done.is_due(0)
    assert plan_next(done, [55, 56, 57], {20, 40}).target == 57
    assert all_handled(done, {20, 40, 57}) and not all_handled(done, {20, 57})
    assert not all_handled(DuePolicy(20, True), {0, 20}), "never over before the trainer is done"


# ---- the eval log: the row is the commit point --------------------------------------------------

def _row(v: int, status: str = EVALUATED) -> EvalRow:
    return EvalRow(version=v, status=status, score=0.5 if status == EVALUATED else None)


def _samples(v: int, n: int = 3) -> list[EvalSample]:
    return [EvalSample(version=v, prompt_id=f"0:{i}", data_source="d", index=0, prompt="p", response="r",
                       ground_truth="g", reward=1.0) for i in range(n)]


@pytest.mark.parametrize("samples_name", ["eval_samples.jsonl.gz", "eval_samples.jsonl"])  # an older run's: plain
def test_a_restarted_writer_cuts_samples_without_a_row_and_a_torn_row(tmp_path, samples_name):
    rows, samples = tmp_path / "eval.jsonl", tmp_path / samples_name
    w = EvalLogWriter(rows, samples)
    w.commit(_row(0), _samples(0))
    w.commit(_row(20, SKIPPED))
    committed = samples.stat().st_size
    w.close()
    lost = "".join(json.dumps(s.to_json()) + "\n" for s in _samples(40)) + '{"version": 40, "pro'
    with open(samples, "ab") as f:  # killed between the samples of v40 and its row (the last member cut short) ...
        f.write(gzip.compress(lost.encode())[:-9] if samples_name.endswith(".gz") else lost.encode())
    with open(rows, "a") as f:  # ... or in the middle of the row
        f.write('{"version": 40, "status": "evalu')
    w = EvalLogWriter(rows, samples)
    assert [r.version for r in w.rows] == [0, 20] and samples.stat().st_size == committed
    w.commit(_row(40), _samples(40, 2))
    w.close()
    assert [(r.version, r.samples) for r in read_eval_rows(rows)] == [(0, 3), (20, 0), (40, 2)]
    assert [s.version for s in read_eval_samples(samples)] == [0, 0, 0, 40, 40]
    assert read_eval_rows(rows)[-1].samples_bytes == samples.stat().st_size


def test_a_row_that_is_not_a_record_is_skipped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "eval.jsonl"
    path.write_text('{"version": 1, "status": "evaluated"}\n{"version": "x"}\n[1, 2]\n{"version": 2, "status": "weird"}\n')
    assert [r.version for r in read_eval_rows(path)] == [1]
    assert "EvalRow.status 'weird'" in caplog.text and "EvalRow.version" in caplog.text


# ---- greedy decoding in the transformers engine --------------------------------------------------

def test_greedy_and_top_k_in_the_transformers_engine(tmp_path):
    from transformers import AutoModelForCausalLM

    from hpcrl.rollout.engine import EngineOptions
    from hpcrl.rollout.transformers_engine import TransformersEngine, apply_top_k
    from hpcrl.tiny.model import build_tiny_model

    folder = build_tiny_model(tmp_path / "m", seed=3)
    opts = EngineOptions(model_dir=folder, max_new_tokens=6, temperature=0.0, top_p=1.0, device="cpu",
                         dtype="float32")
    greedy = TransformersEngine(opts)
    prompt = [5, 7, 9]
    got = greedy.generate_sync(prompt, 2, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=1)
    assert got[0].response_ids.tolist() == want[0, 3:].tolist()[:len(got[0].response_ids)]
    assert got[0].response_ids.tolist() == got[1].response_ids.tolist(), "greedy: every response the same"
    top1 = TransformersEngine(EngineOptions(model_dir=folder, max_new_tokens=6, temperature=1.0, top_p=1.0,
                                            device="cpu", dtype="float32", top_k=1))
    assert top1.generate_sync(prompt, 1, seed=5)[0].response_ids.tolist() == got[0].response_ids.tolist()
    masked = apply_top_k(torch.tensor([[0.1, 3.0, 2.0, -1.0]]), 2)
    assert torch.isinf(masked).tolist() == [[True, False, False, True]]
    assert apply_top_k(torch.tensor([[1.0, 2.0]]), -1).tolist() == [[1.0, 2.0]]


def test_a_version_published_again_after_a_trainer_rollback_is_evaluated_again(tmp_path):
    """The trainer resumed from an earlier checkpoint and published v20 anew: another ``published_s``, a new version."""
    from types import SimpleNamespace

    from hpcrl.config import WeightsConfig
    from hpcrl.eval.job import EvalJob
    from hpcrl.weights import make_publisher, make_subscriber

    rd = RunDir(tmp_path).create()
    pub = make_publisher(WeightsConfig(keep_versions=10), rd)
    state = {"w": torch.zeros(2)}
    first = pub.publish(20, state, "{}", 20, 80).manifest.published_s
    job = SimpleNamespace(run_dir=rd, weights=make_subscriber(WeightsConfig(), rd, EVAL_JOB), handled={20: first},
                          _manifest_seen={})
    EvalJob._forget_if_republished(job, 20)
    assert job.handled == {20: first}, "the same version: still handled"
    pub.withdraw_after(19)
    time.sleep(0.01)
    pub.publish(20, {"w": torch.ones(2)}, "{}", 20, 80)
    EvalJob._forget_if_republished(job, 20)
    assert 20 not in job.handled, "published again: due again"


def test_the_evaluation_jobs_metrics_reach_tensorboard_in_a_run_of_their_own(tmp_path):
    """At the trainer step of the version, read back by TensorBoard's own event reader; the trainer's folder
    holds none of them (one writer per folder)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hpcrl.logs.trackers import open_trackers

    rd = RunDir(tmp_path).create()
    cfg = load_config(TINY, ["logging.backends=[jsonl,tensorboard]"])
    trackers = open_trackers(cfg, rd, role="eval")
    for step, value in ((0, 0.0), (20, 0.26), (40, 0.27)):
        trackers.log({"step": step, "val-core/builtin:toy_heldout/reward/mean@1": value})
    trackers.close()
    acc = EventAccumulator(str(rd.eval_tensorboard), size_guidance={"scalars": 0})
    acc.Reload()
    got = [(e.step, round(e.value, 4)) for e in acc.Scalars("val-core/builtin:toy_heldout/reward/mean@1")]
    assert got == [(0, 0.0), (20, 0.26), (40, 0.27)]
    assert not list(rd.tensorboard.glob("events.*")), "the trainer's folder is the trainer's"
