"""Against a real private single-node Slurm cluster (sbatch/private-cluster.sh), started
once for this module: submitit and sbatch launches, a 2-rank trainer with 2 rollout
array tasks, preemption with requeue, a rollout job scancel'd and resubmitted
(a real preemption: tests/test_slurm_preempt.py), a policy trained on a learned reward served by a
Slurm job of its own (configs/tiny-rm.yaml).

The cluster needs root (it starts slurmd and munged) and Debian's Slurm packages,
which the script installs when missing; CI runs as root.
"""
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO, TINY, check_exactly_once, wait_until
from hpcrl.logs.eval_log import EVALUATED, read_eval_rows
from hpcrl.rundir.fsio import read_json, read_jsonl
from hpcrl.logs.run_logs import read_metrics, read_staleness
from hpcrl.rundir.paths import RunDir
from test_learning import fifths

pytestmark = pytest.mark.slow

CLUSTER = REPO / "sbatch" / "private-cluster.sh"


def private_cluster(tmp_path_factory, preempt: bool = False):
    """Start the private cluster (``preempt``: with the scavenger and owner partitions), yield its environment,
    stop it (a module fixture; one cluster at a time: they share the ports)."""
    if os.geteuid() != 0:
        pytest.fail("the Slurm tests start a private cluster and must run as root (CI does)")
    folder = tmp_path_factory.mktemp("slurm")
    subprocess.run(["bash", str(CLUSTER), "start", str(folder)], check=True, timeout=600,
                   env=dict(os.environ, HPCRL_PRIVATE_PREEMPT=str(int(preempt))))
    env = dict(os.environ, SLURM_CONF=str(folder / "slurm.conf"), HPCRL_PYTHON=sys.executable)
    old = os.environ.copy()
    os.environ.update(env)  # submitit and our squeue/scontrol calls in this process
    try:
        yield env
    finally:
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True)
        subprocess.run(["bash", str(CLUSTER), "stop", str(folder)], timeout=60)
        os.environ.clear()
        os.environ.update(old)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    yield from private_cluster(tmp_path_factory)


def n_updates(rd) -> int:
    return sum(1 for _ in read_jsonl(rd.metrics))


def squeue_ids(env) -> set:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=env)
    return set(out.stdout.split())


def jobs_state(slurm, rd) -> str:
    """What a failed wait on an sbatch run prints: the queue, then each job log's last lines."""
    queue = subprocess.run(["squeue", "-o", "%i %j %T %R %M"], capture_output=True, text=True, env=slurm).stdout
    def tail(p):  # a Slurm output holds a stuck rank's stacks (timeouts.stuck_update_s)
        return "".join(p.read_text(errors="replace").splitlines(True)[-(80 if "slurm" in p.name else 15):])

    logs = [f"--- {p.name}:\n{tail(p)}" for p in sorted(rd.job_logs.glob("*")) if p.is_file()] \
        if rd.job_logs.exists() else []
    return queue + "\n".join(logs)


def reward_rises(rd, margin=0.2):
    first, last = fifths(read_metrics(rd)["reward/mean"].to_numpy())
    assert last > first + margin, f"reward did not rise: first fifth {first:.3f}, last fifth {last:.3f}"
    return first, last


def submit_sbatch(slurm, run, *overrides) -> list[str]:
    """The job ids of trainer, rollout array and evaluation job (tiny.yaml validates)."""
    out = subprocess.run(["bash", str(REPO / "sbatch" / "submit.sh"), str(TINY), str(run), *overrides],
                         capture_output=True, text=True, env=slurm, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_sbatch_two_rank_trainer_and_two_rollout_tasks(slurm, tmp_path):
    run = tmp_path / "run"
    trainer_id, array_id, eval_id = submit_sbatch(slurm, run, "resources.rollout_jobs=2",
                                         "resources.trainer.tasks_per_node=2",
                                         "actor.zero_stage=3", "actor.ppo_micro_batch_size=2",
                                         "rollout.total_rollout_steps=400", "async_training.staleness_threshold=0.5",
                                         # value head + frozen reference across 2 ZeRO-3 ranks
                                         "algorithm.adv_estimator=gae", "actor.use_kl_loss=true",
                                         "timeouts.stuck_update_s=60")  # a rank stuck in a collective shows where
    rd = RunDir(run)
    wait_until(lambda: read_json(rd.trainer_done) or trainer_id not in squeue_ids(slurm), 400, "trainer_done.json",
               poll_s=1.0, describe=lambda: jobs_state(slurm, rd))
    assert read_json(rd.trainer_done), f"the trainer job left the queue without finishing:\n{jobs_state(slurm, rd)}"
    wait_until(lambda: not squeue_ids(slurm) & {trainer_id, f"{array_id}_0", f"{array_id}_1", eval_id}, 90,
               "jobs to leave")
    # the evaluation job (sbatch/eval.sbatch, tiny.yaml's eval section): v0, every 20th version and the last
    assert [r.version for r in read_eval_rows(rd.eval_log) if r.status == EVALUATED] == [0, 20, 40, 60, 80, 100]
    cfg = rd.load_config()
    st = read_staleness(rd)
    assert set(st.writer) == {"w000", "w001"}, "both array tasks wrote samples"
    assert st.lag.max() <= cfg.max_lag_bound, f"lag {st.lag.max()} above the bound {cfg.max_lag_bound}"
    assert (rd.job_logs / "trainer-rank1.log").exists(), "the trainer ran 2 ranks"
    # the shared budget: groups generated with weights of version <= v never exceed consumed(v) + B
    metrics = read_metrics(rd)
    consumed_at = {0: 0, **{int(r.param_version) + 1: int(r.consumed_groups) for r in metrics.itertuples()}}
    groups = st.drop_duplicates("group_id")
    for v, consumed in consumed_at.items():
        started = int((groups.version_start <= v).sum())
        assert started <= consumed + cfg.admission_budget, f"version {v}: {started} groups > {consumed} + B"
    reward_rises(rd, margin=0.1)
    check_exactly_once(rd, cfg.rollout.max_concurrent_groups)


def test_sbatch_trainer_preempted_with_usr2_requeues_and_resumes(slurm, tmp_path):
    """USR2 (what Slurm sends before a time limit or on preemption): the trainer checkpoints,
    requeues itself, resumes; nothing lost or doubled."""
    run = tmp_path / "run"
    trainer_id, array_id, _ = submit_sbatch(slurm, run, "rollout.total_rollout_steps=320",
                                         "timeouts.wait_weights_s=600", "timeouts.wait_samples_s=600")
    rd = RunDir(run)
    wait_until(lambda: n_updates(rd) >= 30, 180, "30 trainer updates")
    subprocess.run(["scancel", "--signal=USR2", trainer_id], check=True, env=slurm)
    wait_until(lambda: "Restarts=1" in subprocess.run(["scontrol", "show", "job", trainer_id], capture_output=True,
                                                      text=True, env=slurm).stdout, 60, "the trainer to be requeued")
    # Slurm holds a requeued job ~120 s (Reason=BeginTime): a cluster's policy, not ours; let it start now. Not
    # too soon: an update issued while the node still tears the old instance down has no effect, and one issued
    # right after the hold is set can start it before slurmd revoked the old credential, which kills it for good
    # ("Killing non-startable batch job: Job credential revoked", seen twice)
    wait_until(lambda: "JobState=PENDING Reason=BeginTime" in subprocess.run(
        ["scontrol", "show", "job", trainer_id], capture_output=True, text=True, env=slurm).stdout, 60,
        "the requeued trainer's hold")
    wait_until(lambda: (read_json(rd.heartbeat("trainer")) or {}).get("state") == "preempted", 60,
               "the first trainer's exit")
    time.sleep(3)
    subprocess.run(["scontrol", "update", f"JobId={trainer_id}", "StartTime=now"], check=True, env=slurm)
    wait_until(lambda: read_json(rd.trainer_done), 420, "the requeued trainer to finish")
    log_text = (rd.job_logs / "trainer.log").read_text()
    assert "received SIGUSR2" in log_text and f"requeueing Slurm job {trainer_id}" in log_text
    written = re.findall(r"checkpoint (step-\d+) ", log_text[:log_text.index("requeueing Slurm job")])
    assert written and f"resumed from {written[-1]}" in log_text, "resumed from the checkpoint written on USR2"
    steps = [r["step"] for r in read_jsonl(rd.metrics)]
    assert steps == list(range(1, rd.load_config().total_updates + 1))
    check_exactly_once(rd, rd.load_config().rollout.max_concurrent_groups)


def test_weight_broadcast_between_two_slurm_jobs(slurm, tmp_path):
    """weights.transport=broadcast with the trainer and the rollout job as two Slurm jobs: the
    rollout job joins the trainer's gloo group and takes versions by broadcast, exactly once."""
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "hpcrl", "run", str(TINY), "weights.transport=broadcast",
                          "rollout.total_rollout_steps=48", "--run-dir", str(run), "--executor", "slurm",
                          "--timeout-min", "5"], capture_output=True, text=True, cwd=REPO, env=slurm, timeout=420)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rd = RunDir(run)
    paths = [r["weights/path"] for r in read_jsonl(rd.rollout_metrics("w000"))]
    assert paths.count("broadcast") >= len(paths) - 2, paths
    assert "by broadcast" in (rd.job_logs / "rollout-w000.log").read_text()
    check_exactly_once(rd, rd.load_config().rollout.max_concurrent_groups)


def test_a_submitit_run_on_a_learned_reward_survives_a_scancelled_rollout_and_learns_the_rule(slurm, tmp_path):
    """docs/reward-models.md's run through Slurm: `hpcrl run configs/tiny-rm.yaml --executor slurm` (submitit), 240
    of its 300 updates (held-out rule scores at v200: 0.79-0.94 in four runs, 0.67-0.71 in two; 0.885 at v200 and
    0.901 at v300 in a whole run: 240 leaves a margin over 0.6 that 200 did not). A tiny sequence classifier trained
    at launch to predict the toy task's rule is the only reward, served by a Slurm job of its own. The rollout job is
    scancel'd at update 40: the trainer says what it waits for, the launcher resubmits the rollout job, which reaches
    the reward job again. The held-out prompts, scored by the rule the policy never trained on, go from ~0 to >= 0.6;
    the reward job scored every group and ended by itself; exactly once."""
    from hpcrl.control.records import read_heartbeats
    from hpcrl.logs.eval_log import JOB
    from hpcrl.rollout.parts import scoring_groups

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpcrl", "run", str(REPO / "configs" / "tiny-rm.yaml"),
           "rollout.total_rollout_steps=960", "timeouts.wait_log_interval_s=1", "--run-dir", str(run),
           "--executor", "slurm", "--timeout-min", "10"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=slurm)
    lines, rd = [], RunDir(run)
    try:
        while True:  # the launcher prints the job ids once all are submitted
            line = launcher.stdout.readline()
            assert line, "launcher exited before submitting:\n" + "".join(lines)
            lines.append(line)
            if "submitted (slurm): " in line:
                ids = dict(re.findall(r"([\w-]+)=(\d+)", line[line.index("submitted (slurm): "):]))
                break
        wait_until(lambda: n_updates(rd) >= 40, 240, "40 trainer updates", describe=lambda: jobs_state(slurm, rd))
        subprocess.run(["scancel", ids["rollout-w000"]], check=True, env=slurm)
        out, _ = launcher.communicate(timeout=600)
        lines.append(out)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = "".join(lines)
    assert launcher.returncode == 0, text[-3000:] + jobs_state(slurm, rd)
    assert "resubmitting" in text and "run finished" in text
    trainer_log = (rd.job_logs / "trainer.log").read_text()
    assert "waiting" in trainer_log and str(rd.samples) in trainer_log and "heartbeat" in trainer_log
    assert {"trainer", "rollout-w000", "eval", "reward-0"} <= set(ids) and len(set(ids.values())) == len(ids), ids
    shown = subprocess.run(["scontrol", "show", "job", ids["reward-0"]], capture_output=True, text=True,
                           env=slurm).stdout  # no accounting here (no sacct): finished jobs stay 10 minutes
    assert "JobName=reward-0" in shown and "JobState=COMPLETED" in shown, shown
    beats = read_heartbeats(rd)
    assert beats[RunDir.reward_job(0)].slurm_job == ids["reward-0"] and beats[RunDir.reward_job(0)].state == "done"
    resubmitted = beats[RunDir.rollout_job("w000")].slurm_job
    assert resubmitted not in set(ids.values()), f"the rollout job's last instance is the resubmitted one: {ids}"
    rows = [r for r in read_eval_rows(rd.eval_log) if r.source == JOB and r.status == EVALUATED]
    first, end = rows[0], (rows[-2].score + rows[-1].score) / 2  # one evaluation of 24 prompts wobbles by ~0.15
    print(f"held-out rule score v{first.version} {first.score:.3f} -> v{rows[-2].version}-v{rows[-1].version} "
          f"{end:.3f}: {[(r.version, round(r.score, 3)) for r in rows]}")
    assert first.version == 0 and first.score <= 0.1 and end >= 0.6, [(r.version, r.score) for r in rows]
    cfg = rd.load_config()
    check_exactly_once(rd, cfg.rollout.max_concurrent_groups + scoring_groups(cfg))
    job_rows = list(read_jsonl(rd.reward_metrics(RunDir.reward_job(0))))
    assert job_rows[-1]["reward_job/items"] >= cfg.total_updates * cfg.groups_per_update * cfg.rollout.n
