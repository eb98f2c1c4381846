"""The evaluation job with real jobs: killed and stopped mid-version, a version it holds kept from retention, a
damaged version recorded and not evaluated; ``hpcrl eval`` on the same run. (The tiny default with its
evaluation job, through the launcher, is ``tests/test_learning.py``.)"""
from __future__ import annotations

import contextlib
import io
import os
import signal
import time
from collections import Counter

import pytest

from conftest import Job, start_rollout, start_trainer, wait_until
from hpcrl.cli import main as cli_main
from hpcrl.control.records import read_heartbeats
from hpcrl.logs.eval_log import DAMAGED, EVALUATED, JOB, OFFLINE, read_eval_rows, read_eval_samples
from hpcrl.rundir.paths import EVAL_JOB, WEIGHT_TENSORS, RunDir

pytestmark = pytest.mark.slow
PROMPTS = 24
"""builtin:toy_heldout's prompts."""


def start_eval(rd, env=None, name="eval") -> Job:
    return Job(["eval-job", str(rd.root)], rd.root / f"{name}.out", env=env)


def newest(rd) -> int:
    versions = [v for p in rd.weights.iterdir() if (v := rd.parse_weight_version(p.name)) is not None
                and rd.weight_manifest(v).exists()] if rd.weights.is_dir() else []
    return max(versions, default=-1)


def eval_beat(rd):
    return read_heartbeats(rd).get(EVAL_JOB)


def freeze_trainer(rd, rollout: Job, trainer: Job) -> int:
    """SIGSTOP the rollout job, then wait until the trainer has published what it could: no new version for 3 s."""
    os.kill(rollout.proc.pid, signal.SIGSTOP)
    last, since = newest(rd), time.monotonic()
    while time.monotonic() - since < 3:
        assert trainer.proc.poll() is None, trainer.tail()
        if newest(rd) != last:
            last, since = newest(rd), time.monotonic()
        time.sleep(0.1)
    return last


def job_rows(rd):
    return read_eval_rows(rd.eval_log, source=JOB)


def test_eval_job_stopped_and_killed_mid_version_evaluates_every_due_version_once(tiny_run):
    """Due versions 0, 20, 40, 60, 80 (80 updates). The job is held mid-v20 (fault point), which retention
    (``keep_versions=2``) would delete but for its pin; then SIGTERM (it abandons v20 cleanly), a restart SIGKILLed
    at its 6th prompt (mid-v20 again), a second restart. Every due version is evaluated exactly once, with its 24
    samples once."""
    rd = tiny_run("rollout.total_rollout_steps=320", "weights.keep_versions=2")
    trainer, rollout = start_trainer(rd), start_rollout(rd)
    first = start_eval(rd, env={"HPCRL_FAULT_POINT": "eval_prompt:30:sleep=300"}, name="eval1")  # v20's 6th prompt
    jobs = (trainer, rollout, first)
    wait_until(lambda: (b := eval_beat(rd)) and b.stats.evaluating == 20 and newest(rd) >= 23, 300,
               "the evaluation job held in v20 while the trainer publishes v23", jobs=jobs)
    assert rd.weight_manifest(20).exists(), "pinned by the live evaluation job: retention must keep it"
    wait_until(lambda: not rd.weight_manifest(21).exists(), 60, "retention (keep_versions=2) to delete v21",
               jobs=jobs)  # the trainer retains right after it publishes v23: not yet, on a loaded machine
    frozen = freeze_trainer(rd, rollout, trainer)
    assert frozen < 40, f"the trainer must not pass the next due version while the test holds it ({frozen})"

    first.kill(signal.SIGTERM)
    assert first.proc.returncode != 0 and eval_beat(rd).state == "stopped", first.tail()
    assert [r.version for r in job_rows(rd)] == [0], "v20 abandoned: no row"
    assert len(read_eval_samples(rd.eval_samples)) == PROMPTS

    second = start_eval(rd, env={"HPCRL_FAULT_POINT": "eval_prompt:6:kill"}, name="eval2")
    assert second.wait(300) == -signal.SIGKILL, second.tail()
    assert [r.version for r in job_rows(rd)] == [0]

    third = start_eval(rd, name="eval3")
    wait_until(lambda: [r.version for r in job_rows(rd)] == [0, 20], 300, "v20 evaluated after two interruptions",
               jobs=(trainer, third))
    os.kill(rollout.proc.pid, signal.SIGCONT)
    assert trainer.wait(300) == 0, trainer.tail()
    assert rollout.wait(120) == 0, rollout.tail()
    assert third.wait(120) == 0, third.tail()

    rows = job_rows(rd)
    assert [(r.version, r.status) for r in rows] == [(v, EVALUATED) for v in (0, 20, 40, 60, 80)]
    assert Counter(s.version for s in read_eval_samples(rd.eval_samples)) == {v: PROMPTS for v in (0, 20, 40, 60, 80)}
    assert not rd.weight_manifest(20).exists(), "released: retention deleted it"
    assert rows[-1].trainer_step == 80 and eval_beat(rd).state == "done"


def _cli(*args: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(list(args))
    return rc, out.getvalue() + err.getvalue()


def test_a_damaged_version_is_recorded_not_evaluated_and_hpcrl_eval_reads_the_same_run(tiny_run, tmp_path):
    """v20's tensors are damaged before the job reads it: a ``damaged`` row and a log line, v20 marked bad, the run
    goes on (v40 and the final v50 evaluated). Then ``hpcrl eval`` on v0 and the last version, and on a model
    folder, writes the same records and scores (greedy: v50 scores what the job found)."""
    rd = tiny_run("rollout.total_rollout_steps=200", "weights.keep_versions=100", "eval.before_training=false")
    trainer, rollout = start_trainer(rd), start_rollout(rd)
    wait_until(lambda: newest(rd) >= 21, 300, "weight version 21", jobs=(trainer, rollout))
    assert freeze_trainer(rd, rollout, trainer) < 40
    path = rd.weight_file(20, WEIGHT_TENSORS)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    ev = start_eval(rd)
    wait_until(lambda: job_rows(rd), 300, "the evaluation job's first row", jobs=(trainer, ev))
    (row,) = job_rows(rd)
    assert (row.version, row.status) == (20, DAMAGED) and "damaged" in row.reason, row
    assert rd.weight_bad_marker(20).exists()
    os.kill(rollout.proc.pid, signal.SIGCONT)
    assert trainer.wait(300) == 0, trainer.tail()
    assert rollout.wait(120) == 0, rollout.tail()
    assert ev.wait(120) == 0, ev.tail()
    rows = job_rows(rd)
    assert [(r.version, r.status) for r in rows] == [(20, DAMAGED), (40, EVALUATED), (50, EVALUATED)]
    assert "weight version 20 damaged, not evaluated" in rd.job_log(EVAL_JOB).read_text()
    assert Counter(s.version for s in read_eval_samples(rd.eval_samples)) == {40: PROMPTS, 50: PROMPTS}

    out = tmp_path / "offline"
    rc, text = _cli("eval", str(rd.root), "--versions", "0,last", "--out", str(out))
    assert rc == 0, text
    offline = read_eval_rows(RunDir(out).eval_log)
    assert [(r.version, r.source) for r in offline] == [(0, OFFLINE), (50, OFFLINE)], text
    assert offline[1].score == rows[-1].score and offline[1].metrics == rows[-1].metrics, "same code, greedy"
    assert "v50 (step 50): val-core/builtin:toy_heldout/reward/mean@1" in text
    rc, text = _cli("eval", str(rd.root), "--versions", "20", "--out", str(out))
    assert rc == 1 and "v20: not evaluated" in text, text
    rc, text = _cli("eval", "--model", str(rd.weight_version_dir(50)), "--tokenizer", str(rd.base_model),
                    "--data", "builtin:toy_heldout", "--out", str(tmp_path / "model"))
    assert rc == 0, text
    (model_row,) = read_eval_rows(RunDir(tmp_path / "model").eval_log)
    assert model_row.version == -1 and model_row.score == rows[-1].score
    rc, text = _cli("eval", str(rd.root), "--versions", "last", "--n", "4", "--out", str(tmp_path / "n4"))
    assert rc == 0 and "mean@4" in text, text
    assert "val-core/builtin:toy_heldout/reward/best@4/mean" in read_eval_rows(RunDir(tmp_path / "n4").eval_log)[0].metrics
