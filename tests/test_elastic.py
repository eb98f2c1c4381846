"""A rollout fleet that changes during a run (``hpcrl scale``, ``launcher/fleet.py``, ``control/claims.py``):
launched with one rollout job, grown to three by a scale request the launcher follows, shrunk to two (the newest
drains: it finishes its groups, seals, hands back its prompts and exits 0, never resubmitted), one SIGKILLed and
resubmitted by the launcher, stopped and resumed with the fleet it had; the run completes, exactly once, within
the lag bound, every join and leave logged (in the launcher's lines, the jobs' logs and ``logs/fleet/``); and a
rollout-bound run whose fleet the autoscale rule grows from 1 to 3 jobs. The same fleet changes on a Slurm cluster
with preemption: test_slurm_preempt.py."""
from __future__ import annotations

import io
import os
import signal
import threading

import pytest

from conftest import REPO, TINY, BackgroundCommand, check_exactly_once, wait_until
from hpcrl.analysis.fleet import fleet_history
from hpcrl.control.admission import read_claims
from hpcrl.control.fleet_log import read_fleet_events
from hpcrl.control.records import read_heartbeats
from hpcrl.rundir.fsio import read_jsonl
from hpcrl.logs.run_logs import read_staleness
from hpcrl.rundir.paths import RunDir

SIMULATED = ["rollout.engine=simulated", "trainer.simulated=true", "eval.every_versions=0",
             "simulated.time_scale=20", "simulated.lengths=geometric", "simulated.length_mean=30",
             "simulated.update_base_s=4.0", "simulated.weight_load_s=1.0", "rollout.response_length=96",
             "rollout.total_rollout_steps=160", "rollout.max_concurrent_groups=2", "rollout.n=2",
             "async_training.staleness_threshold=1.0", "async_training.partial_rollout=true",
             "trainer.checkpoint_every_updates=1000", "timeouts.wait_samples_s=120", "timeouts.wait_weights_s=120"]

_BENCH_SETTING = ["rollout.max_concurrent_groups=2", "actor.ppo_mini_batch_size=4",
                  "async_training.partial_rollout=true", "trainer.checkpoint_every_updates=1000000"]


def _status(rd: RunDir) -> str:
    from hpcrl.analysis.status import status_main

    out = io.StringIO()
    status_main(rd.root, once=True, out=out)
    return out.getvalue()


def _committed(rd: RunDir, writer: str) -> int:
    return sum(line["n_groups"] for line in read_jsonl(rd.shard_manifest(writer)))


def check_fleet_run(rd: RunDir, cfg, lines: list[str], label: str, more: tuple[str, ...]) -> None:
    """After a run grown to 3 writers and shrunk to 2 (w002 drained), one writer killed and resubmitted: exactly
    once, every writer's groups trained on, the newest token's lag within the bound, w002 left drained, the frozen
    config follows the fleet, and the launcher said every change (``more``: this run's own lines)."""
    check_exactly_once(rd, cfg.rollout.max_concurrent_groups)
    st = read_staleness(rd)
    assert set(st.writer) == {"w000", "w001", "w002"}, "every writer's groups were trained on"
    lag_end = st.trainer_version - st.groupby("group_id").version_end.transform("max")  # the group's newest token
    print(f"{label}: lag of the newest token max {lag_end.max()} (bound {cfg.max_lag_bound}); groups per writer "
          f"{st.drop_duplicates('group_id').writer.value_counts().to_dict()}")
    assert lag_end.max() <= cfg.max_lag_bound
    book = read_claims(rd)
    assert set(book.left) == {"w002"} and book.left["w002"].why == "drained"
    assert rd.load_config().resources.rollout_jobs == 2, "the frozen config follows the fleet (a resume starts 2)"
    text = "\n".join(lines)
    for expected in ("scale: rollout-w001 submitted", "scale: rollout-w002 submitted", "asked to drain",
                     "job rollout-w002", "left the fleet", "resubmitting", *more):
        assert expected in text, f"{expected!r} not in the launcher's lines:\n{text[-3000:]}"


@pytest.mark.slow
def test_a_fleet_grown_shrunk_killed_and_resumed_trains_on_every_prompt_once(tmp_path):
    """Local executor: the fleet changes as in tests/test_slurm_preempt.py (grown by `hpcrl scale`, the newest
    drained, one SIGKILLed and resubmitted), then the run is stopped (Run.stop: Ctrl-C in `hpcrl run`) and
    resumed: the resumed run starts the fleet as it was (w000 and w001; w002 drained, never again) and completes."""
    import hpcrl
    from hpcrl.launcher.scale_cmd import scale_command

    lines: list[str] = []
    # long enough to be stopped by the test, not to finish: with 160 steps a whole-suite run here trained the last
    # 16 updates while the killed w001 was resubmitted (~6 s), which then found the trainer done, never generating
    run = hpcrl.launch(TINY, run_dir=tmp_path / "run", executor="local", emit=lines.append,
                       overrides=[*SIMULATED, "rollout.total_rollout_steps=800"])
    rd, cfg = run.rd, run.cfg
    result: dict = {}
    follower = threading.Thread(target=lambda: result.setdefault("ok", run.wait(timeout_s=400, poll_s=0.5)),
                                daemon=True)
    follower.start()
    wait_until(lambda: _committed(rd, "w000") >= 4, 120, "w000's first groups")
    assert scale_command(str(rd.root), 3, wait_s=30, scripts=None) == 0  # the follower applies it
    wait_until(lambda: min(_committed(rd, w) for w in ("w000", "w001", "w002")) >= 2 if
               {"w001", "w002"} <= set(rd.writers()) else False, 120, "the two new writers' first groups")
    assert scale_command(str(rd.root), 2, wait_s=30, scripts=None) == 0  # w002, the newest, drains
    wait_until(lambda: getattr(read_heartbeats(rd).get("rollout-w002"), "state", "") == "drained", 60, "w002 drained")
    w1_log = rd.job_log(RunDir.rollout_job("w001"))
    killed = read_heartbeats(rd)["rollout-w001"].pid
    os.kill(killed, signal.SIGKILL)  # claims open: the launcher resubmits it
    beat = lambda: read_heartbeats(rd)["rollout-w001"]  # noqa: E731
    wait_until(lambda: beat().pid != killed and beat().state == "generating", 60, "w001 resubmitted and generating")
    assert run.stop(wait_s=120), "\n".join(lines[-20:])  # every job stops at its next safe point
    follower.join(60)
    assert result.get("ok") is False and not follower.is_alive(), "Run.wait ends when the run is stopped"
    fleet = [x for x in _status(rd).splitlines() if x.startswith("fleet:")]
    assert fleet and "w002 (drained" in fleet[0], fleet  # hpcrl status names the writer that left and why

    # resumed for 10 updates past where the stop left it
    steps = cfg.groups_per_update * (len(list(read_jsonl(rd.metrics))) + 10)
    resumed = hpcrl.launch(None, run_dir=rd.root, executor="local", emit=lines.append, resume=True,
                           overrides=[f"rollout.total_rollout_steps={steps}"])
    assert sorted(resumed.jobs) == ["rollout-w000", "rollout-w001", "trainer"], "the fleet as it was, w002 not"
    assert resumed.wait(timeout_s=400, poll_s=0.5), "\n".join(lines[-30:])

    check_fleet_run(rd, cfg, lines, "elastic run", ("job rollout-w001", "run stopped on request"))
    assert not any("resubmitting" in x and "rollout-w002" in x for x in lines), "a drained job is never resubmitted"
    w1 = w1_log.read_text()
    assert w1.count("joined the fleet") == 3 and "recovered" in w1
    said = {(e.source, e.event, e.writer, e.from_jobs, e.to_jobs) for e in read_fleet_events(rd)}
    for expected in [("scale", "scale_requested", "", 1, 3), ("launcher", "submitted", "w001", -1, -1),
                     ("launcher", "scale_applied", "", 1, 3), ("launcher", "drain_requested", "w002", -1, -1),
                     ("launcher", "scale_applied", "", 3, 2), ("launcher", "left", "w002", -1, -1),
                     ("launcher", "resubmitted", "w001", -1, -1), ("w002", "ended", "w002", -1, -1)]:
        assert expected in said, f"{expected} not in logs/fleet/: {sorted(said)}"
    lives = {w: [x.how for x in fleet_history(rd).lives if x.writer == w] for w in ("w000", "w001", "w002")}
    assert lives == {"w000": ["stopped, then resumed", "done"], "w002": ["drained"],
                     "w001": ["killed and resubmitted", "stopped, then resumed", "done"]}, lives


AUTOSCALE_SETTING = [*_BENCH_SETTING, "async_training.staleness_threshold=1.0", "rollout.total_rollout_steps=160",
                     "resources.rollout_autoscale.max_jobs=3", "resources.rollout_autoscale.versions=3",
                     "timeouts.poll_max_s=0.05"]
"""bench/bench_elastic.py's rollout-bound setting (one job keeps the trainer ~2/3 idle, three ~1/3) with autoscale
on from 1 up to 3 rollout jobs, deciding every 3 versions: 40 updates. At time_scale 10 a version comes every
~0.5 s, as long as the poll back-off's longest wait; in one whole-suite run a background job missed v12 (group
w002/51: every token v11, trained at v13, lag 2 > 1). The commit now refuses such a group (tests/test_lag_bound.py);
the run still polls every 0.05 s, so that a job reacts to a version well within its period."""

BACKGROUND_RUNS = {"elastic:autoscale": BackgroundCommand.hpcrl_args(
    lambda folder: ["run", str(REPO / "configs" / "simulated.yaml"), *AUTOSCALE_SETTING, "--run-dir",
                    str(folder / "run"), "--executor", "local", "--timeout-min", "30"])}
"""A run whose fleet only the autoscale rule changes, launched like a user's in the background when the session
starts (conftest.BackgroundRuns): what it asserts holds however fast it went (the rule reads the idle ratios the
run measured, slow or not)."""


def background_keys(item) -> tuple[str, ...]:
    """The background runs a test item reads (none: it runs its own jobs)."""
    return ("elastic:autoscale",) if item.originalname.startswith("test_autoscale") else ()


@pytest.mark.slow
def test_autoscale_grows_a_rollout_bound_fleet_and_logs_every_decision_with_its_numbers(background_runs):
    """`hpcrl run configs/simulated.yaml` with ``resources.rollout_autoscale`` (max 3 jobs): the trainer waits on
    one rollout job, so the launcher adds a second, then a third; every decision is a launcher line and a
    ``logs/fleet/`` event whose numbers are the idle ratios of the metrics it read; the added writers train on
    their own prompts; exactly once and the lag bound hold whatever the fleet did."""
    out = background_runs.launched("elastic:autoscale", timeout_s=600)
    assert out.returncode == 0, out.stdout[-6000:]
    rd = RunDir(out.args[out.args.index("--run-dir") + 1])
    cfg = rd.load_config()
    decisions = [e for e in read_fleet_events(rd) if e.event == "autoscale"]
    print("autoscale decisions: " + "; ".join(f"{e.from_jobs}->{e.to_jobs} at v{e.numbers['version']} "
                                              f"({e.why})" for e in decisions))
    grown = [(e.from_jobs, e.to_jobs) for e in decisions if e.applied and e.to_jobs > e.from_jobs]
    assert grown[:2] == [(1, 2), (2, 3)], f"grown one job at a time to max_jobs: {grown}"
    trainer_idle = {int(r["param_version"]): r["trainer/idle_ratio"] for r in read_jsonl(rd.metrics)}
    for e in decisions:
        assert f"autoscale: {e.from_jobs} -> {e.to_jobs} rollout job(s) at version {e.numbers['version']}" \
               in out.stdout, "every decision is a launcher line"
        if e.to_jobs > e.from_jobs:  # the rule saw the trainer idle above the threshold in each of `versions` rows
            seen = [trainer_idle[v] for v in range(e.numbers["since_version"], e.numbers["version"] + 1)]
            assert len(seen) == cfg.resources.rollout_autoscale.versions
            assert min(seen) > cfg.resources.rollout_autoscale.idle_ratio
            assert abs(e.numbers["trainer_idle_min"] - min(seen)) < 1e-6, (e.numbers, seen)
    st = read_staleness(rd)
    assert {"w000", "w001", "w002"} <= set(st.writer), "the added writers' groups were trained on"
    check_exactly_once(rd, cfg.rollout.max_concurrent_groups)
    lag_end = st.trainer_version - st.groupby("group_id").version_end.transform("max")
    assert lag_end.max() <= cfg.max_lag_bound
