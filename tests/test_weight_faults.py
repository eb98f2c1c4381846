"""Damaged weight versions with real jobs: a torn file, flipped header bytes or flipped tensor
bytes never stop the run and are never used (issue #14), and the same for delta versions and their base
(issue 33). The rollout job names the version, marks it bad and falls back to the newest intact one; the
trainer publishes its current weights as a new version; every committed group is still consumed exactly once."""
import json
import shutil
import signal
import time

import pytest

from conftest import check_exactly_once, start_rollout, start_trainer, wait_until
from hpcrl.control.records import read_heartbeats
from hpcrl.rundir.fsio import read_jsonl
from hpcrl.logs.run_logs import read_staleness
from test_weight_deltas import damage_delta
from test_weights import damage_weights


def n_updates(rd) -> int:
    return sum(1 for _ in read_jsonl(rd.metrics))


def newest_published(rd) -> int:
    return max((v for p in rd.weights.iterdir() if (v := rd.parse_weight_version(p.name)) is not None
                and rd.weight_manifest(v).is_file()), default=-1)


def finish_and_check(rd, trainer, rollout, bad_version: int) -> None:
    """The run completes, the damaged version is marked and named, the trainer republished."""
    cfg = rd.load_config()
    assert trainer.wait(300) == 0, trainer.tail()
    assert rollout.wait(120) == 0, rollout.tail()
    assert n_updates(rd) == cfg.total_updates
    check_exactly_once(rd, cfg.rollout.max_concurrent_groups)
    # (the bad.json marker went with the version when retention deleted it: the logs tell)
    rollout_log = rollout.log_path.read_text()
    assert f"weight version {bad_version} in {rd.weight_version_dir(bad_version)} is damaged" in rollout_log
    assert "AttributeError" not in rollout_log
    assert f"publishing the current weights as version {bad_version + 1}" in trainer.log_path.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "header", "data"])
def test_damaged_first_version_is_skipped_and_republished(tiny_run, how):
    """v0 damaged before any rollout job read it: the rollout has nothing intact to fall back
    to, waits, and loads v1, which the trainer publishes when it sees the marker."""
    rd = tiny_run("rollout.total_rollout_steps=24", "timeouts.wait_samples_s=60")
    trainer = start_trainer(rd)
    wait_until(lambda: rd.weight_manifest(0).is_file(), 120, "weight version 0", jobs=(trainer,))
    damage_weights(rd, 0, how)
    rollout = start_rollout(rd)
    finish_and_check(rd, trainer, rollout, bad_version=0)
    st = read_staleness(rd)
    assert 0 not in set(st.version_start), "groups were generated with the damaged version 0"


@pytest.mark.slow
def test_damaged_newest_version_mid_run_falls_back_to_the_previous_one(tiny_run):
    """Flipped tensor bytes in the newest version (safetensors loads them without a word):
    a restarted rollout job must refuse it and fall back to the previous version, whose
    admission budget is spent (s=0), so the run goes on only with the weights the trainer
    re-publishes as a new version."""
    rd = tiny_run("rollout.total_rollout_steps=80", "timeouts.wait_samples_s=60")
    trainer, rollout = start_trainer(rd), start_rollout(rd)
    wait_until(lambda: n_updates(rd) >= 5, 120, "5 trainer updates", jobs=(trainer, rollout))
    rollout.kill(signal.SIGKILL)

    # the trainer uses up the committed groups, then waits: its newest version stops changing
    def quiet():
        v = newest_published(rd)
        time.sleep(3)
        hb = read_heartbeats(rd).get("trainer")
        return v >= 1 and v == newest_published(rd) and hb is not None and hb.state == "waiting_samples" and v
    bad = wait_until(quiet, 60, "the trainer waiting for samples", jobs=(trainer,))
    shards_before = {line["shard"] for line in read_jsonl(rd.shard_manifest("w000"))}
    damage_weights(rd, bad, "data")
    rollout2 = start_rollout(rd)
    finish_and_check(rd, trainer, rollout2, bad_version=bad)
    st = read_staleness(rd)
    new = st[~st.shard.isin(shards_before)]
    assert len(new) > 0 and bad not in set(new.version_start), "the restarted rollout generated with the damaged version"
    assert f"weight version {bad - 1}" in rollout2.log_path.read_text(), "it fell back to the previous version"


@pytest.mark.slow
def test_rollout_failing_before_any_weights_reports_the_real_error(tiny_run):
    """No trainer, so no weights: the rollout job gives up with a TimeoutError naming what it
    waited for, and its shutdown does not bury that under an AttributeError."""
    rd = tiny_run("timeouts.wait_weights_s=3")
    rollout = start_rollout(rd)
    assert rollout.wait(120) != 0
    text = rollout.log_path.read_text()
    assert "TimeoutError" in text and "weight version 0" in text
    assert "AttributeError" not in text, text[-2000:]


@pytest.mark.slow
def test_delta_versions_survive_a_trainer_killed_mid_delta_damaged_deltas_and_a_deleted_base(tiny_run):
    """Delta versions (``weights.delta``; the tiny fp32 model's deltas are ~85 % of its size, so
    ``delta_max_ratio=1`` makes every version after a full one a delta). The trainer is SIGKILLed while writing
    its second delta: no version is visible half-written, and its successor starts again from a full version.
    Then, with the rollout job down, the newest delta is truncated, the one before bit-flipped, and their base
    deleted: the restarted rollout job (which holds no base) names each of the three versions in one line, marks
    them bad and waits; the trainer writes its weights as a full version, from which the rollout job goes on.
    Every committed group is consumed exactly once."""
    rd = tiny_run("rollout.total_rollout_steps=88", "timeouts.wait_samples_s=60", "weights.delta_max_ratio=1.0",
                  "weights.full_every=100", "trainer.checkpoint_every_updates=2")
    trainer = start_trainer(rd, env={"HPCRL_FAULT_POINT": "delta_write:2:kill"})
    rollout = start_rollout(rd)
    assert trainer.wait(180) == -signal.SIGKILL, trainer.tail()
    killed_at = newest_published(rd) + 1
    assert rd.staging(rd.weight_version_dir(killed_at)).is_dir(), "killed mid-delta: the folder is under .tmp"
    assert not rd.weight_version_dir(killed_at).exists() and not rd.weight_manifest(killed_at).exists()
    trainer = start_trainer(rd)
    wait_until(lambda: n_updates(rd) >= 10, 180, "10 trainer updates", jobs=(trainer, rollout))
    rollout.kill(signal.SIGKILL)

    def quiet():  # the trainer used up the committed groups and waits: its newest version stops changing
        v = newest_published(rd)
        time.sleep(3)
        hb = read_heartbeats(rd).get("trainer")
        return v >= 3 and v == newest_published(rd) and hb is not None and hb.state == "waiting_samples" and v
    newest = wait_until(quiet, 60, "the trainer waiting for samples", jobs=(trainer,))
    manifests = {v: json.loads(rd.weight_manifest(v).read_text()) for v in (newest, newest - 1, newest - 2)}
    bases = {m["base"]["version"] for m in manifests.values() if m["base"]}
    assert len(bases) == 1 and len(manifests) == 3, f"three deltas on one base expected: {manifests}"
    base = bases.pop()
    damage_delta(rd, newest, "truncated")
    damage_delta(rd, newest - 1, "data")
    shutil.rmtree(rd.weight_version_dir(base))
    rollout2 = start_rollout(rd)
    assert trainer.wait(300) == 0, trainer.tail()
    assert rollout2.wait(120) == 0, rollout2.tail()
    assert n_updates(rd) == rd.load_config().total_updates
    check_exactly_once(rd, rd.load_config().rollout.max_concurrent_groups)
    log = rollout2.log_path.read_text()
    for line in (f"weight version {newest} in {rd.weight_version_dir(newest)} is damaged: model.delta",
                 f"weight version {newest - 1} in {rd.weight_version_dir(newest - 1)} is damaged: model.delta",
                 f"weight version {newest - 2} (a delta) cannot be rebuilt: its base, full version {base} in "
                 f"{rd.weight_version_dir(base)}, is gone"):
        assert line in log, line
    assert "Traceback" not in log
    tlog = trainer.log_path.read_text()
    assert f"weight version {newest + 1} is written full: the newest version {newest} was found damaged" in tlog
    assert f"loaded weight version {newest + 1} " in log, "it went on from the new full version"
