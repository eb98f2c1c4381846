"""Reward jobs as real processes beside a trainer and a rollout job: SIGKILLed at random moments and started again,
the run finishes with every group scored exactly once by the model (each reward equal to an offline call of the
same model on that response); a model that cannot load stops the run with a fatal record, after the rollout job
said what it waits for and until when."""
from __future__ import annotations

import random
import signal
import time

import pytest
import torch

from conftest import Job, check_exactly_once, start_rollout, start_trainer, wait_until
from hpcrl.control.fatal import read_fatal_record
from hpcrl.control.records import read_heartbeats
from hpcrl.logs.eval_log import read_eval_samples
from hpcrl.rollout.parts import scoring_groups
from hpcrl.rundir.fsio import read_json, read_jsonl
from hpcrl.rundir.paths import RunDir
from hpcrl.samples.reader import read_shard
from hpcrl.samples.schema import ShardManifestLine
from hpcrl.tiny.model import build_tokenizer, quiet_progress_bars, tiny_config

pytestmark = pytest.mark.slow


def random_rm(folder) -> str:
    """A random tiny sequence classifier on the tiny tokenizer (the run only needs its scores, not good ones)."""
    from transformers import Qwen2ForSequenceClassification

    tok = build_tokenizer()
    config = tiny_config(32, tok)
    config.num_labels, config.architectures = 1, ["Qwen2ForSequenceClassification"]
    torch.manual_seed(11)
    with quiet_progress_bars():
        Qwen2ForSequenceClassification(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def start_reward(rd: RunDir, index: int = 0, attempt: int = 0) -> Job:
    return Job(["reward-job", str(rd.root), "--index", str(index)], rd.root / f"reward{index}-{attempt}.out")


def rescored(rd: RunDir, folder: str) -> tuple[list[float], list[float]]:
    """(the rewards the run committed, the same responses scored offline by transformers' own call)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    model.config.pad_token_id = None  # one sequence, scored at its last token even when that is a sampled <pad>
    got, want = [], []
    for line in read_jsonl(rd.shard_manifest("w000")):
        line = ShardManifestLine.from_json(line)
        for g in read_shard(rd.writer_dir("w000") / line.shard, line, "w000"):
            for t in g.trajectories:
                ids = torch.tensor([list(t.prompt_ids) + list(t.response_ids)])
                with torch.inference_mode():
                    want.append(model(input_ids=ids).logits[0, -1].item())
                got.append(float(t.reward))
    return got, want


def updates_done(rd: RunDir) -> int:
    return sum(1 for _ in read_jsonl(rd.metrics)) if rd.metrics.exists() else 0


def test_reward_job_sigkilled_three_times_at_random_moments(tiny_run, tmp_path):
    folder = random_rm(tmp_path / "rm")
    rd = tiny_run("reward.name=by_data_source", "reward_model.enable=true", f"reward_model.path={folder}",
                  "rollout.total_rollout_steps=48", "reward_model.wait_s=120", "reward_model.request_timeout_s=30",
                  "eval.every_versions=6", "trainer.keep_consumed_shards=-1")
    cfg = rd.load_config()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"kill moments drawn with seed {seed}")
    trainer, rollout = start_trainer(rd), start_rollout(rd)
    evaluation = Job(["eval-job", str(rd.root)], rd.root / "eval.out")  # it scores validation with the model too
    reward = start_reward(rd)
    # Moments tied to the trainer's progress, not the clock: a run whose reward job answers fast is over in seconds.
    # Updates drawn in the run's first half (two may coincide: a kill during the successor's start-up), each plus
    # a fraction of a second (mid-request, mid-batch); with no staleness the trainer can't outrun a dead reward job.
    kill_after = sorted(rng.randint(1, cfg.total_updates // 2) for _ in range(3))
    for attempt, updates in enumerate(kill_after, start=1):
        wait_until(lambda: updates_done(rd) >= updates, 120, f"update {updates}",
                   jobs=(trainer, rollout, reward, evaluation))
        time.sleep(rng.uniform(0.0, 0.5))
        reward.kill(signal.SIGKILL)
        assert trainer.proc.poll() is None, "the run must still be going when the reward job is killed"
        reward = start_reward(rd, attempt=attempt)
    assert trainer.wait(300) == 0, trainer.tail()
    assert rollout.wait(120) == 0, rollout.tail()
    assert evaluation.wait(120) == 0, evaluation.tail()
    assert reward.wait(60) == 0, reward.tail()  # it ends by itself: the trainer is done, the evaluation too
    samples = read_eval_samples(rd.eval_samples)
    assert {s.version for s in samples} >= {0, cfg.total_updates} and all(0.0 < abs(s.reward) for s in samples), \
        "validation is scored by the model (a random classifier's scores), not by a rule's 0 and 1"
    assert read_heartbeats(rd)[RunDir.reward_job(0)].state == "done"
    assert not rd.reward_service(RunDir.reward_job(0)).exists(), "a clean end withdraws the service record"
    log = rd.job_log(RunDir.rollout_job("w000")).read_text()
    assert "sending it again" in log or "waiting for a reward job" in log, "no request was in flight at any kill"
    result = check_exactly_once(rd, cfg.rollout.max_concurrent_groups + scoring_groups(cfg))
    assert result["consumed_groups"] == cfg.total_updates * cfg.groups_per_update
    got, want = rescored(rd, folder)
    assert len(got) >= cfg.total_updates * cfg.groups_per_update * cfg.rollout.n
    assert got == pytest.approx(want, abs=1e-4), "a committed reward differs from the model's score of its response"
    rows = [r for r in read_jsonl(rd.rollout_metrics("w000")) if "reward_model/groups" in r]
    assert sum(r["reward_model/groups"] for r in rows) >= result["consumed_groups"]
    assert all(r["reward_model/problems"] == 0 for r in rows)


def test_a_reward_model_that_cannot_load_stops_the_run_after_a_bounded_named_wait(tiny_run, tmp_path):
    """No reward job yet: the rollout job's groups wait, saying for whom and until when (here a hybrid function's own
    call of the model); then a reward job whose model's weights are damaged records the fatal input and every job
    stops (none fails, none is resubmitted), and no group is committed with a reward nobody computed."""
    folder = tmp_path / "rm"
    random_rm(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # checked at launch: config and tokenizer; loaded: the job
    (tmp_path / "hybrid.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, reward_model=None):\n"
        "    rule = float(solution_str.split()[:1] == ground_truth.split()[:1])\n"
        "    return 0.5 * rule + 0.5 * reward_model.score(solution_str)\n")
    rd = tiny_run(f"reward.path={tmp_path / 'hybrid.py'}", "reward_model.enable=true", f"reward_model.path={folder}",
                  "reward_model.wait_s=300", "timeouts.wait_log_interval_s=1", "eval.every_versions=0")
    trainer, rollout = start_trainer(rd), start_rollout(rd)
    wait_until(lambda: "waiting for a reward job to answer" in rollout.tail(200), 120,
               "the rollout job's line naming what it waits for", jobs=(trainer, rollout))
    line = next(x for x in rollout.tail(200).splitlines() if "waiting for a reward job to answer" in x)
    assert "failing after 300s" in line and "no reward job has written" in line and "own score call" in line, line
    reward = start_reward(rd)
    assert reward.wait(120) != 0, reward.tail()
    record = read_fatal_record(rd)
    assert record is not None and record.input == "reward_model" and record.job == RunDir.reward_job(0), record
    assert "loading the reward model" in record.message
    assert rollout.wait(120) == 0, rollout.tail()
    assert trainer.wait(120) == 0, trainer.tail()
    assert read_heartbeats(rd)[RunDir.rollout_job("w000")].state == "stopped"
    assert read_json(rd.fatal)["input"] == "reward_model"
    committed = list(read_jsonl(rd.shard_manifest("w000"))) if rd.shard_manifest("w000").exists() else []
    assert not committed, "no reward job ever answered: a group committed now would carry rewards nobody computed"


def test_reward_jobs_shrink_and_grow_with_hpcrl_scale(tiny_run, tmp_path, capsys):
    """Without a launcher: `hpcrl scale --reward-jobs 1` makes the frozen config say 1 and reward-1 ends by itself
    (drained, its record withdrawn) while reward-0 serves on; growing again submits reward.sbatch's array of the new
    index (its line, where sbatch is not on PATH)."""
    from hpcrl.launcher.scale_cmd import scale_command

    folder = random_rm(tmp_path / "rm")
    rd = tiny_run("reward.name=by_data_source", "reward_model.enable=true", f"reward_model.path={folder}",
                  "resources.reward_jobs=2", "eval.every_versions=0")
    jobs = [start_reward(rd, 0), start_reward(rd, 1)]
    wait_until(lambda: all(rd.reward_service(RunDir.reward_job(i)).exists() for i in (0, 1)), 120,
               "both reward jobs serving", jobs=tuple(jobs))
    assert scale_command(str(rd.root), None, 0.2, None, reward_jobs=1) == 0
    assert jobs[1].wait(60) == 0, jobs[1].tail()
    assert read_heartbeats(rd)[RunDir.reward_job(1)].state == "drained"
    assert not rd.reward_service(RunDir.reward_job(1)).exists() and rd.reward_service(RunDir.reward_job(0)).exists()
    assert jobs[0].proc.poll() is None, "reward-0 is within the new number and serves on"
    assert rd.load_config().resources.reward_jobs == 1
    assert any("resources.reward_jobs: 2 -> 1" in line for line in rd.config_history())
    capsys.readouterr()
    if __import__("shutil").which("sbatch") is None:
        assert scale_command(str(rd.root), None, 0.2, None, reward_jobs=2) == 1
        err = capsys.readouterr().err
        assert "--array=1" in err and "reward.sbatch" in err, err
    jobs[0].kill(signal.SIGTERM)

