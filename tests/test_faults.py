"""Kill either job with SIGKILL mid-run and start it again: the run completes, and every
committed group is consumed exactly once (manifests vs staleness log)."""
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import check_exactly_once, start_rollout, start_trainer, wait_until
from hpcrl.process import termination
from hpcrl.rundir.fsio import read_json, read_jsonl, wait_for
from hpcrl.logs.run_logs import read_staleness
from hpcrl.rundir.paths import RunDir


def n_updates(rd) -> int:
    return sum(1 for _ in read_jsonl(rd.metrics))


@pytest.mark.slow
def test_rollout_sigkill_then_restart(tiny_run):
    rd = tiny_run("rollout.total_rollout_steps=320", "async_training.staleness_threshold=0.5",
                  "rollout.max_concurrent_groups=3")
    cfg = rd.load_config()
    trainer, rollout = start_trainer(rd), start_rollout(rd)
    wait_until(lambda: n_updates(rd) >= 25, 120, "25 trainer updates", jobs=(trainer, rollout))
    rollout.kill(signal.SIGKILL)  # mid-run: groups in flight and maybe a shard half-written
    done_before = n_updates(rd)
    rollout2 = start_rollout(rd)
    assert trainer.wait(300) == 0, trainer.tail()
    assert rollout2.wait(120) == 0, rollout2.tail()
    assert "recovered" in rollout2.log_path.read_text(), "the restarted writer must recover from its manifest"
    assert n_updates(rd) == cfg.total_updates > done_before
    result = check_exactly_once(rd, cfg.rollout.max_concurrent_groups)
    assert result["consumed_groups"] == cfg.total_updates * cfg.groups_per_update


@pytest.mark.slow
def test_an_engine_that_fails_to_load_a_version_stays_on_its_own_and_retries(tiny_run):
    """The engine refuses version 2 once (an injected error as the verified weights reach it): the
    job says so, keeps generating with version 1 (re-applied), loads version 2 on the retry, and
    the run ends with every group trained on once."""
    rd = tiny_run("rollout.total_rollout_steps=64", "timeouts.retry_failed_load_s=1.0")
    cfg = rd.load_config()
    trainer = start_trainer(rd)
    rollout = start_rollout(rd, env={"HPCRL_FAULT_POINT": "engine_load:3:fail"})  # loads 1, 2: v0, v1; 3: v2
    assert trainer.wait(300) == 0, trainer.tail()
    assert rollout.wait(120) == 0, rollout.tail()
    log = rd.job_log(RunDir.rollout_job("w000")).read_text()
    assert "could not load weight version 2 (InjectedFault" in log and "staying on version 1" in log
    assert "loaded weight version 2" in log, "the retry loads it"
    rows = [r["param_version"] for r in read_jsonl(rd.rollout_metrics("w000"))]
    assert rows[:3] == [0, 1, 2] and rows.count(1) == 1, "version 2 is reported only once it is loaded"
    assert n_updates(rd) == cfg.total_updates
    check_exactly_once(rd, cfg.rollout.max_concurrent_groups)


@pytest.mark.parametrize("zero_stage, extra", [
    (2, ()),
    # the value head and the adaptive KL controller are trainer state too: both must survive
    (3, ("algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive")),
], ids=["zero2", "zero3-gae-adaptive-kl"])
@pytest.mark.slow
def test_trainer_sigkill_after_checkpoint_then_resume(tiny_run, zero_stage, extra):
    rd = tiny_run("rollout.total_rollout_steps=220", "trainer.checkpoint_every_updates=10",
                  f"actor.zero_stage={zero_stage}", *extra)
    cfg = rd.load_config()
    trainer, rollout = start_trainer(rd), start_rollout(rd)
    wait_until(lambda: (read_json(rd.latest_checkpoint) or {}).get("step", 0) >= 30, 180, "a checkpoint at step 30",
               jobs=(trainer, rollout))
    wait_until(lambda: n_updates(rd) >= 35, 60, "5 updates past the checkpoint", jobs=(trainer, rollout))
    trainer.kill(signal.SIGKILL)
    ckpt_step = read_json(rd.latest_checkpoint)["step"]
    rows_at_kill = n_updates(rd)
    assert rows_at_kill > ckpt_step, "the kill must fall after the checkpoint, with work to roll back"
    trainer2 = start_trainer(rd)
    assert trainer2.wait(300) == 0, trainer2.tail()
    assert rollout.wait(120) == 0, rollout.tail()
    assert f"resumed from step-{ckpt_step:08d}" in trainer2.log_path.read_text()
    steps = [r["step"] for r in read_jsonl(rd.metrics)]
    assert steps == list(range(1, cfg.total_updates + 1)), "metrics rolled back to the checkpoint, no step twice"
    st = read_staleness(rd)
    assert len(st) == cfg.total_updates * cfg.groups_per_update * cfg.rollout.n
    check_exactly_once(rd, cfg.rollout.max_concurrent_groups)
    if cfg.algorithm.kl_ctrl.type == "adaptive":
        rows = list(read_jsonl(rd.metrics))
        before, after = rows[ckpt_step - 1], rows[ckpt_step]  # last update saved, first one resumed
        ctrl = cfg.algorithm.kl_ctrl
        err = max(-0.2, min(0.2, before["actor/reward_kl_penalty"] / ctrl.target_kl - 1))
        n_seqs = cfg.groups_per_update * cfg.rollout.n
        want = before["actor/reward_kl_penalty_coeff"] * (1 + err * n_seqs / ctrl.horizon)
        assert abs(after["actor/reward_kl_penalty_coeff"] - want) < 1e-12, "beta continues from the checkpoint"
        assert after["actor/reward_kl_penalty_coeff"] != ctrl.kl_coef


@pytest.mark.slow
def test_trainer_waits_with_a_message_naming_what_it_waits_for(tiny_run):
    rd = tiny_run("rollout.total_rollout_steps=40", "timeouts.wait_samples_s=4")
    trainer = start_trainer(rd)  # no rollout job at all
    assert trainer.wait(120) != 0
    out = trainer.log_path.read_text()
    assert "waited" in out and str(rd.samples) in out and "committed groups" in out
    assert json.loads(rd.heartbeat("trainer").read_text())["state"] == "failed"


@pytest.mark.slow
def test_damaged_shard_is_skipped_by_a_running_trainer(tiny_run):
    """Kill the trainer, damage the first shard it has not read yet, resume: the shard is
    reported and counted, its prompts generated again, the run completes, every prompt is
    trained on exactly once."""
    rd = tiny_run("rollout.total_rollout_steps=160", "trainer.checkpoint_every_updates=5",
                  "async_training.staleness_threshold=1.0")
    cfg = rd.load_config()
    trainer, rollout = start_trainer(rd), start_rollout(rd)
    wait_until(lambda: (read_json(rd.latest_checkpoint) or {}).get("step", 0) >= 10, 120, "a checkpoint at step 10",
               jobs=(trainer, rollout))
    trainer.kill(signal.SIGKILL)
    from hpcrl.trainer.safe_checkpoint import load_tree

    tag = read_json(rd.latest_checkpoint)["tag"]
    state = load_tree(str(rd.checkpoints / tag / "mp_rank_00_model_states.pt"))["hpcrl"]
    pos = state["cursor"]["w000"]
    # the rollout keeps committing within its budget (B = 8 groups past the trainer): wait for
    # a whole shard after the cursor's, which the resumed trainer has not read
    lines = wait_until(lambda: (ls := list(read_jsonl(rd.shard_manifest("w000")))) and len(ls) > pos["line"] + 1 and ls,
                       60, "a shard after the checkpoint's cursor", jobs=(rollout,))
    victim = lines[pos["line"] + 1]
    path = rd.writer_dir("w000") / victim["shard"]
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    trainer2 = start_trainer(rd)
    assert trainer2.wait(300) == 0, trainer2.tail()
    assert rollout.wait(120) == 0, rollout.tail()
    log_text = trainer2.log_path.read_text()
    assert "SKIPPING shard" in log_text and str(path) in log_text and "truncated" in log_text
    last = list(read_jsonl(rd.metrics))[-1]
    assert last["fully_async/count/corrupt_groups_skipped"] == victim["n_groups"]
    st = read_staleness(rd)
    assert not st.sample_id.duplicated().any()
    regenerated = {f"w000/{p}" for p in victim["prompt_indices"]}
    assert regenerated <= set(st.group_id), "a skipped shard's prompts are generated again and trained on"
    assert not (st.shard == victim["shard"]).any(), "nothing from the damaged shard is trained on"
    assert st.group_id.nunique() == cfg.total_updates * cfg.groups_per_update
    check_exactly_once(rd, cfg.rollout.max_concurrent_groups)


@pytest.mark.slow
def test_usr2_while_waiting_keeps_the_groups_already_taken(tiny_run):
    """USR2 reaches the trainer after it took 2 of the 4 groups of its next update: the
    checkpoint must not count them, and the resumed trainer trains on them exactly once."""
    from test_samples import make_group

    from hpcrl.samples.writer import ShardWriter

    # staleness 1: a writer may commit 8 groups under version 0 (lag bound 1), as this one does before the trainer
    # starts; with 0 the trainer would rightly drop groups 4-7 for their lag.
    rd = tiny_run("rollout.total_rollout_steps=8", "rollout.n=3", "timeouts.wait_log_interval_s=0.5",
                  "async_training.staleness_threshold=1")
    writer = ShardWriter(rd, "w000", seal_groups=1, seal_interval_s=60)
    for i in range(6):  # one full update (4 groups) + 2 of the next
        writer.add(make_group(i))
        writer.seal()
    trainer = start_trainer(rd)
    wait_until(lambda: n_updates(rd) >= 1, 120, "the first update", jobs=(trainer,))
    wait_until(lambda: "committed groups (2/4)" in (rd.job_logs / "trainer.log").read_text(), 30,
               "the trainer to wait with 2 of 4 groups", jobs=(trainer,))
    trainer.kill(signal.SIGUSR2)
    assert trainer.wait(60) == 0, trainer.tail()
    log_text = (rd.job_logs / "trainer.log").read_text()
    assert "received SIGUSR2" in log_text and "preempted outside Slurm" in log_text
    for i in range(6, 8):
        writer.add(make_group(i))
        writer.seal()
    writer.close()
    trainer2 = start_trainer(rd)
    assert trainer2.wait(120) == 0, trainer2.tail()
    st = read_staleness(rd)
    assert sorted(st.group_id.unique()) == sorted(f"w000/{i}" for i in range(8))
    assert not st.sample_id.duplicated().any()


@pytest.mark.slow
def test_rollout_usr2_seals_and_its_successor_continues(tiny_run):
    rd = tiny_run("rollout.total_rollout_steps=160")
    trainer, rollout = start_trainer(rd), start_rollout(rd)
    wait_until(lambda: n_updates(rd) >= 10, 120, "10 updates", jobs=(trainer, rollout))
    rollout.kill(signal.SIGUSR2)
    assert rollout.wait(60) == 0, rollout.tail()
    rollout_log = (rd.job_logs / "rollout-w000.log").read_text()
    assert "USR2: sealing complete groups" in rollout_log
    assert "preempted outside Slurm" in rollout_log, "the job must ask to be requeued (outside Slurm: says so)"
    assert json.loads(rd.heartbeat("rollout-w000").read_text())["state"] == "preempted"
    rollout2 = start_rollout(rd)
    assert trainer.wait(300) == 0, trainer.tail()
    assert rollout2.wait(120) == 0, rollout2.tail()
    check_exactly_once(rd, rd.load_config().rollout.max_concurrent_groups)


def test_sigterm_swallowed_by_a_finalizer_still_stops_the_job(monkeypatch):
    """Python drops an exception raised while a finalizer runs ("Exception ignored in ...").
    A SIGTERM whose handler runs there must still stop the job at its next step: seen in CI,
    a scancel'd rollout job went on producing groups until Slurm's SIGKILL."""
    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", swallowed.append)
    previous = signal.getsignal(signal.SIGTERM)
    termination.install()
    try:
        class Finalized:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside the finalizer

        Finalized()
        assert [u.exc_type for u in swallowed] == [SystemExit], "the handler's own raise was swallowed"
        with pytest.raises(SystemExit, match="SIGTERM"):  # ... and the next poll of any wait raises again
            wait_for("groups that never come", lambda: False, timeout_s=30, poll_s=0.01, log=logging.getLogger(),
                     stop=termination.check)
    finally:
        signal.signal(signal.SIGTERM, previous)
        termination._received = None


# ---- issue #14 (1): SIGTERM at the instant a shard is committed

SEAL_UNDER_SIGTERM = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import fault_wrapper  # SIGTERM right after the manifest append #TEST_TERM_AFTER_MANIFEST_APPEND returns
    from test_samples import make_group
    from hpcrl.process import termination
    from hpcrl.rundir.paths import RunDir
    from hpcrl.samples.writer import ShardWriter
    termination.install()
    w = ShardWriter(RunDir({root!r}), "w000", seal_groups=2, seal_interval_s=60)
    i = 0
    try:
        while True:
            w.add(make_group(i))
            i += 1
            if w.seal_due():
                w.seal()
    finally:  # what the rollout job's shutdown does: keep a group that finished meanwhile, seal, close
        w.add(make_group(i))
        w.close()
""")


def test_sigterm_right_after_a_manifest_line_is_durable_commits_each_prompt_once(tmp_path):
    """The handler's SystemExit landed in seal() after the manifest line, before the buffer was
    cleared; close() then sealed the same groups again under the same shard index (seen: the same
    prompt committed and trained twice, the committed shard overwritten and then skipped)."""
    from hpcrl.rundir.paths import RunDir
    from hpcrl.samples.reader import SampleReader
    from test_samples import drain

    rd = RunDir(tmp_path).create()
    script = SEAL_UNDER_SIGTERM.format(tests=os.path.dirname(__file__), root=str(rd.root))
    env = dict(os.environ, TEST_TERM_AFTER_MANIFEST_APPEND="2")
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=60)
    assert b"SIGTERM" in p.stderr, p.stderr.decode()[-2000:]
    listed = [i for line in read_jsonl(rd.shard_manifest("w000")) for i in line["prompt_indices"]]
    assert sorted(listed) == sorted(set(listed)), f"a prompt was committed twice: {listed}"
    assert listed == [0, 1, 2, 3, 4]
    r = SampleReader(rd, verify_retries=0)
    assert [g.prompt_index for g in drain(r)] == [0, 1, 2, 3, 4] and not r.skipped, r.skipped


@pytest.mark.slow
def test_rollout_sigterm_at_a_shard_commit_then_restart(tiny_run):
    """The same, in a real rollout job with a slow (NFS-like) manifest fsync: restarted, the run
    completes with no shard skipped and every prompt trained on exactly once."""
    rd = tiny_run("rollout.total_rollout_steps=64", "rollout.seal_groups=2", "timeouts.wait_samples_s=60")
    cfg = rd.load_config()
    trainer = start_trainer(rd)
    rollout = start_rollout(rd, wrapped=True, env={"TEST_TERM_AFTER_MANIFEST_APPEND": "5",
                                                   "TEST_SLOW_MANIFEST_FSYNC_S": "0.02"})
    assert rollout.wait(120) != 0, "the rollout job must stop on the SIGTERM"
    assert "received SIGTERM" in rollout.tail(200)
    rollout2 = start_rollout(rd)
    assert trainer.wait(300) == 0, trainer.tail()
    assert rollout2.wait(120) == 0, rollout2.tail()
    assert "SKIPPING" not in trainer.log_path.read_text()
    check_exactly_once(rd, cfg.rollout.max_concurrent_groups)


# ---- issue #14 (2): a skipped shard must not deadlock a run at s=0

@pytest.mark.slow
def test_skipped_shard_gives_its_budget_back_and_its_prompts_are_regenerated(tiny_run):
    """s=0, the rollout has started every group the version allows, and the next shard the
    trainer reads is damaged: before, the trainer waited for its 4th group forever. Now the
    skip is recorded, the budget returned, the prompt regenerated and trained on once."""
    from hpcrl.trainer.safe_checkpoint import load_tree

    rd = tiny_run("rollout.total_rollout_steps=48", "rollout.seal_groups=1", "trainer.checkpoint_every_updates=1",
                  "timeouts.wait_samples_s=40")
    cfg = rd.load_config()
    trainer, rollout = start_trainer(rd), start_rollout(rd)
    wait_until(lambda: n_updates(rd) >= 3, 120, "3 updates", jobs=(trainer, rollout))
    trainer.kill(signal.SIGUSR2)  # checkpoint at the trainer's frontier, then exit
    assert trainer.wait(60) == 0, trainer.tail()
    tag = read_json(rd.latest_checkpoint)["tag"]
    state = load_tree(str(rd.checkpoints / tag / "mp_rank_00_model_states.pt"))["hpcrl"]
    consumed, pos = state["consumed_groups"], state["cursor"]["w000"]
    committed = lambda: sum(line["n_groups"] for line in read_jsonl(rd.shard_manifest("w000")))  # noqa: E731
    # the rollout fills the version's budget (B groups past what the trainer consumed), then waits
    wait_until(lambda: committed() >= consumed + cfg.admission_budget, 60, "the version's budget committed",
               jobs=(rollout,))
    rollout.kill(signal.SIGKILL)
    assert committed() == consumed + cfg.admission_budget and pos["row"] == 0
    victim = list(read_jsonl(rd.shard_manifest("w000")))[pos["line"]]  # the next shard the trainer reads
    path = rd.writer_dir("w000") / victim["shard"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    trainer2, rollout2 = start_trainer(rd), start_rollout(rd)
    assert trainer2.wait(300) == 0, trainer2.tail()
    assert rollout2.wait(120) == 0, rollout2.tail()
    log_text = trainer2.log_path.read_text()
    assert "SKIPPING shard" in log_text and str(path) in log_text
    assert list(read_jsonl(rd.metrics))[-1]["fully_async/count/corrupt_groups_skipped"] == victim["n_groups"]
    st = read_staleness(rd)
    for p in victim["prompt_indices"]:  # regenerated, and trained on exactly once
        assert (st.drop_duplicates("group_id").group_id == f"w000/{p}").sum() == 1
        assert not (st.shard[st.group_id == f"w000/{p}"] == victim["shard"]).any()
    check_exactly_once(rd, cfg.rollout.max_concurrent_groups)


@pytest.mark.slow
def test_an_update_that_outlasts_stuck_update_s_shows_every_threads_stack_and_goes_on(tiny_run):
    """A publish held 3 s (as a rank would be by a collective the other rank never joins) with
    ``timeouts.stuck_update_s=1``: the trainer's output holds each thread's stack, the held call in it, once; the run
    then finishes as usual."""
    rd = tiny_run("rollout.total_rollout_steps=12", "timeouts.stuck_update_s=1")
    trainer = start_trainer(rd, env={"HPCRL_FAULT_POINT": "publish:2:sleep=3"})
    rollout = start_rollout(rd)
    assert trainer.wait(120) == 0, trainer.tail()
    assert rollout.wait(60) == 0, rollout.tail()
    out = trainer.log_path.read_text()
    assert out.count("Timeout (0:00:01)!") == 1, out[-3000:]
    assert "most recent call first" in out and "in _publish" in out, out[-3000:]
