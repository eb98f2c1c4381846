"""A real preemption on the private Slurm cluster started with its preemptible capacity
(``HPCRL_PRIVATE_PREEMPT=1 sbatch/private-cluster.sh``: a ``scavenger`` partition whose jobs an ``owner`` job
requeues). Its own cluster: with preemption on, Slurm 22.05 no longer shares cores between jobs, which the
other Slurm tests need."""
import subprocess
import time

import pytest

from conftest import REPO, check_exactly_once, start_rollout, start_trainer, wait_until
from hpcrl.control.admission import read_claims
from hpcrl.fsio import read_json, read_jsonl
from hpcrl.launcher.scale_cmd import scale_command
from hpcrl.run_dir import RunDir
from test_elastic import SIMULATED
from test_slurm import n_updates, private_cluster, squeue_ids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    yield from private_cluster(tmp_path_factory, preempt=True)


def test_a_rollout_job_preempted_on_scavenger_capacity_comes_back_and_loses_nothing(slurm, tiny_run):
    """resources.rollout_preemptible.partition=scavenger (sbatch/private-cluster.sh: PreemptMode=REQUEUE below the
    owner partition). The trainer and the floor (w000) run outside Slurm; `hpcrl scale` with no launcher following
    submits w001 to the scavenger partition with sbatch; a job of the owner partition takes the node back, Slurm
    preempts w001 (SIGTERM: it seals and saves its groups in flight) and requeues it; when it runs again the same
    writer regenerates its uncommitted claims and continues its saved groups; exactly once."""
    # rollout-bound (a group decodes ~2 s, an update 0.2 s): w001 always has groups in flight to save
    rd = tiny_run(*SIMULATED, "rollout.total_rollout_steps=64", "simulated.decode_base_s=1.0",
                  "resources.rollout_preemptible.partition=scavenger", "resources.rollout.partition=debug")
    trainer, floor = start_trainer(rd), start_rollout(rd, 0)
    wait_until(lambda: n_updates(rd) >= 2, 120, "2 updates", jobs=(trainer, floor))
    assert scale_command(str(rd.root), 2, wait_s=0, scripts=str(REPO / "sbatch")) == 0
    w1 = RunDir.rollout_job("w001")
    committed = lambda: sum(x["n_groups"] for x in read_jsonl(rd.shard_manifest("w001")))  # noqa: E731
    wait_until(lambda: committed() >= 2 and read_claims(rd).claims["w001"].prompts, 120,
               "w001's first groups on the scavenger partition, and more in flight")
    job_id = subprocess.run(["squeue", "-h", "-p", "scavenger", "-o", "%i"], capture_output=True, text=True,
                            env=slurm).stdout.split()[0]
    subprocess.run(["sbatch", "-p", "owner", "--output=/dev/null", "--wrap", "sleep 2"], check=True, env=slurm,
                   capture_output=True)  # the owner takes the whole node back
    show = lambda: subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,  # noqa: E731
                                  env=slurm).stdout
    wait_until(lambda: "Restarts=1" in show() and "JobState=PENDING" in show(), 90, "w001 preempted and requeued")
    assert (read_json(rd.heartbeat(w1)) or {}).get("state") == "preempted", "SIGTERM: sealed and saved, requeued"
    wait_until(lambda: not squeue_ids(slurm) - {job_id}, 30, "the owner job to end")
    time.sleep(3)  # not before the old credential went (test_sbatch_trainer_preempted_with_usr2_requeues_and_resumes)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, env=slurm)
    assert trainer.wait(300) == 0, trainer.tail()
    assert floor.wait(60) == 0, floor.tail()
    wait_until(lambda: not squeue_ids(slurm), 60, "w001 to end")
    log_text = rd.job_log(w1).read_text()
    assert log_text.count("joined the fleet") == 2, "the requeued job is the same writer"
    assert "SIGTERM of a Slurm preemption" in log_text and "requeueing Slurm job" in log_text
    assert "continuing" in log_text and "saved by this writer's previous job" in log_text
    check_exactly_once(rd, rd.load_config().rollout.max_concurrent_groups)
