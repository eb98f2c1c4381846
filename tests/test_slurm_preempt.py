"""The rollout fleet on a real Slurm cluster with preemptible capacity (``HPCRL_PRIVATE_PREEMPT=1
sbatch/private-cluster.sh``: a ``scavenger`` partition whose jobs a job of the ``owner`` partition requeues when
it needs their cores; every partition gives whole cores, the node declares 8). Its own cluster: the other Slurm
tests need shared cores.

One run goes through every change of the fleet issue 23 names: launched with one rollout job, grown to three by
`hpcrl scale` (the Python session's launcher applies it through submitit), shrunk by `Run.scale` (the newest
drains), one preempted by a real owner job and requeued by Slurm, one SIGKILLed and resubmitted by the launcher;
and a tool agent preempted in the middle of a tool call continues its trajectories in its requeued job."""
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from conftest import REPO, TINY, check_exactly_once, start_trainer, wait_until
from hpcrl.analysis.fleet import fleet_history
from hpcrl.control.reclaim import judge, slurm_state
from hpcrl.control.records import Heartbeat, read_heartbeats
from hpcrl.rundir.fsio import read_json, read_jsonl
from hpcrl.launcher.autoscale import can_start_soon, sbatch_test_only
from hpcrl.launcher import sbatch_lines
from hpcrl.launcher.sbatch_lines import rollout_lines
from hpcrl.process import faults
from hpcrl.rollout.trajectory import PROCESSING_TOOLS
from hpcrl.rundir.paths import RunDir
from hpcrl.samples.reader import read_shard
from hpcrl.samples.schema import ShardManifestLine
from test_agent import AGENT
from test_elastic import SIMULATED, check_fleet_run
from test_slurm import private_cluster, squeue_ids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    yield from private_cluster(tmp_path_factory, preempt=True)


def _committed(rd: RunDir, writer: str) -> int:
    return sum(line["n_groups"] for line in read_jsonl(rd.shard_manifest(writer)))


def _state(rd: RunDir, writer: str) -> str:
    return getattr(read_heartbeats(rd).get(RunDir.rollout_job(writer)), "state", "")


def _slurm_job(slurm: dict, partition: str) -> str:
    out = subprocess.run(["squeue", "-h", "-p", partition, "-o", "%i"], capture_output=True, text=True, env=slurm)
    ids = out.stdout.split()
    assert len(ids) == 1, f"one job expected in {partition}: {ids}"
    return ids[0]


def _show(slurm: dict, job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, env=slurm).stdout


def _queue(slurm: dict) -> str:
    return subprocess.run(["squeue", "-o", "%i %P %j %T %C %R"], capture_output=True, text=True, env=slurm).stdout


def _why_not_preempted(slurm: dict, job_id: str, log: Path) -> Callable[[], str]:
    """What a failed wait for a preemption shows: the queue, the job, its log's and slurmctld's last lines."""
    ctld = Path(slurm["SLURM_CONF"]).parent / "log" / "slurmctld.log"

    def tail(path: Path, n: int) -> str:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else f"(no {path})"

    return lambda: (f"squeue:\n{_queue(slurm)}\nscontrol show job {job_id}:\n{_show(slurm, job_id)}\n"
                    f"{log}:\n{tail(log, 15)}\n{ctld}:\n{tail(ctld, 25)}")


def _owner_takes_one_core_more_than_is_free(slurm: dict, running: set) -> None:
    """Submit a job of the owner partition that fits only if one more core is freed: Slurm preempts (requeues) a
    scavenger job for it. Only once the queue holds just ``running``: a job of an earlier test still completing
    would free its cores itself, and the owner would start without preempting anything. --mem: a job asking for the
    whole node's memory (the default) is never started so."""
    wait_until(lambda: squeue_ids(slurm) == running, 60, f"the queue to hold only {sorted(running)}",
               describe=lambda: _queue(slurm))
    node = subprocess.run(["scontrol", "show", "node"], capture_output=True, text=True, env=slurm).stdout
    total, used = (int(re.search(rf"{k}=(\d+)", node).group(1)) for k in ("CPUTot", "CPUAlloc"))
    subprocess.run(["sbatch", "-p", "owner", f"--cpus-per-task={total - used + 1}", "--mem=100M",
                    "--output=/dev/null", "--wrap", "sleep 3"], check=True, env=slurm, capture_output=True)


def _requeued_job_starts_now(slurm: dict, job_id: str, others: set) -> None:
    """After the owner job: a requeued job waits for its BeginTime; let it start at once."""
    wait_until(lambda: not squeue_ids(slurm) - others - {job_id} or
               not any("owner" in _show(slurm, j) for j in squeue_ids(slurm) - others - {job_id}), 60,
               "the owner job to end")
    time.sleep(3)  # not before the old credential went (test_sbatch_trainer_preempted_with_usr2_requeues_and_resumes)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, env=slurm)


def test_a_fleet_grown_drained_preempted_and_killed_on_slurm_trains_on_every_prompt_once(slurm, tmp_path):
    import hpcrl

    lines: list[str] = []
    run = hpcrl.launch(TINY, run_dir=tmp_path / "run", executor="slurm", emit=lines.append,
                       overrides=[*SIMULATED, "rollout.total_rollout_steps=80", "simulated.decode_base_s=1.0",
                                  "resources.rollout_preemptible.partition=scavenger", "resources.max_restarts=2"])
    rd, cfg = run.rd, run.cfg
    result: dict = {}
    follower = threading.Thread(target=lambda: result.setdefault("ok", run.wait(timeout_s=500, poll_s=0.5)),
                                daemon=True)
    follower.start()
    try:
        wait_until(lambda: _committed(rd, "w000") >= 2, 180, "w000's first groups (trainer and w000 on debug)")
        scale = subprocess.run([sys.executable, "-m", "hpcrl", "scale", str(rd.root), "--rollout-jobs", "3"],
                               capture_output=True, text=True, cwd=REPO, env=slurm, timeout=120)
        assert scale.returncode == 0 and "the launcher following the run applied it" in scale.stdout, scale.stdout
        wait_until(lambda: {"w001", "w002"} <= set(rd.writers()) and min(_committed(rd, w) for w in
                   ("w001", "w002")) >= 1, 180, "the two new writers' first groups, on the scavenger partition")
        assert run.scale(2) == [RunDir.rollout_job("w002")]  # the newest drains
        wait_until(lambda: _state(rd, "w002") == "drained", 120, "w002 drained")
        wait_until(lambda: "rollout-w002" not in subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True,
                   text=True, env=slurm).stdout, 60, "w002's job to end")
        w001 = _slurm_job(slurm, "scavenger")
        others = squeue_ids(slurm) - {w001}
        _owner_takes_one_core_more_than_is_free(slurm, others | {w001})
        wait_until(lambda: "Restarts=1" in _show(slurm, w001), 90, "w001 preempted and requeued by Slurm",
                   describe=_why_not_preempted(slurm, w001, rd.job_log(RunDir.rollout_job("w001"))))
        assert _state(rd, "w001") == "preempted", "SIGTERM of the preemption: sealed and saved, then requeued"
        os.kill(read_heartbeats(rd)[RunDir.rollout_job("w000")].pid, signal.SIGKILL)  # the launcher resubmits it
        _requeued_job_starts_now(slurm, w001, others)
        follower.join(520)
    finally:
        if follower.is_alive():  # a step above failed: stop the run rather than leave it to the next test
            run.stop(wait_s=30)
    assert result.get("ok") is True, "\n".join(lines[-40:])

    check_fleet_run(rd, cfg, lines, "slurm fleet", ("job rollout-w000",))
    lives = {w: [x.how for x in fleet_history(rd).lives if x.writer == w] for w in ("w000", "w001", "w002")}
    print(f"slurm fleet lives (logs/fleet/): {lives}")
    assert lives == {"w000": ["killed and resubmitted", "done"], "w001": ["preempted and requeued", "done"],
                     "w002": ["drained"]}, "every join and leave is in logs/fleet/, the preemption saved in full"
    w1 = rd.job_log(RunDir.rollout_job("w001")).read_text()
    assert w1.count("joined the fleet") == 2, "the requeued job is the same writer"
    assert "SIGTERM of a Slurm preemption" in w1 and "requeueing Slurm job" in w1
    w0 = rd.job_log(RunDir.rollout_job("w000")).read_text()
    assert w0.count("joined the fleet") == 2 and "recovered" in w0
    assert "partition=scavenger" in _show(slurm, w001).replace("Partition=", "partition=")


def test_slurm_answers_the_reclaim_and_autoscale_questions(slurm, tiny_run):
    """What the rollout writers ask before reclaiming a writer's claims (``squeue``: ended or not) and what the
    autoscaler asks before adding a job (``sbatch --test-only``: when would it start), asked of the real cluster."""
    rd = tiny_run("resources.rollout_preemptible.partition=scavenger")
    test = sbatch_test_only(sbatch_lines.test_only_argv(rd.load_config(), rd, sys.executable, 1))
    assert not isinstance(test, str), test
    assert test.partition == "scavenger" and abs(test.start_s - time.time()) < 60, test  # an idle cluster: now
    ok, why, _ = can_start_soon([], sbatch_lines.test_only_argv(rd.load_config(), rd, sys.executable, 1), 300)
    assert ok and "partition scavenger" in why, why
    job = subprocess.run(["sbatch", "--parsable", "-p", "debug", "--output=/dev/null", "--wrap", "sleep 2"],
                         capture_output=True, text=True, check=True, env=slurm).stdout.strip()
    wait_until(lambda: slurm_state(job) == ("RUNNING", ""), 30, "the job to run")
    stale = Heartbeat(job="rollout-w001", role="rollout", host="elsewhere", pid=1, time_s=time.time() - 600,
                      slurm_job=job)
    assert not judge(stale, time.time(), 60, "here").gone, "a running job is not gone, however stale its beat"
    wait_until(lambda: slurm_state(job)[0] in (None, "COMPLETED"), 30, "the job to end")
    assert judge(stale, time.time(), 60, "here").gone, "ended: its claims are reclaimed"
    assert slurm_state("999999") == (None, ""), "a job Slurm does not know has ended"


def test_a_tool_agent_preempted_in_the_middle_of_a_tool_call_continues_its_trajectories_when_requeued(
        slurm, tiny_run, monkeypatch):
    """The only rollout job is writer 1 of a tool-agent run, on the scavenger partition (writers from
    ``rollout_preemptible.floor`` = 1 on). Its 2nd tool call stalls (HPCRL_FAULT_POINT=tool_call:2:sleep=300: a slow
    tool, longer than any wait below: the call is still running whenever Slurm gets to the preemption); an owner
    job preempts it meanwhile: on SIGTERM it saves the trajectory with its call pending, Slurm
    requeues it, and the requeued job calls the tool again and continues the trajectory where it stopped."""
    rd = tiny_run(*AGENT, "resources.rollout_preemptible.partition=scavenger", "rollout.total_rollout_steps=48",
                  "async_training.staleness_threshold=1.0", "async_training.partial_rollout=true",
                  "trainer.keep_consumed_shards=-1")  # the test reads every shard w001 committed
    trainer = start_trainer(rd)
    monkeypatch.setenv(faults.ENV, "tool_call:2:sleep=300")  # the rollout job's environment, not the trainer's
    monkeypatch.setenv(faults.ONCE_ENV, str(rd.root / "tool-call-stalled"))  # not again in the requeued job
    (line,) = rollout_lines(rd.load_config(), rd, REPO / "sbatch", sys.executable, [1])
    subprocess.run(shlex.split(line), check=True, env=os.environ, capture_output=True)
    log = rd.job_log(RunDir.rollout_job("w001"))
    wait_until(lambda: log.exists() and "sleep=300 at tool_call #2" in log.read_text(), 180,
               "the rollout job's 2nd tool call (stalled by the fault point)", jobs=(trainer,))
    job_id = _slurm_job(slurm, "scavenger")  # 1_1 once running (1_[1] while pending)
    _owner_takes_one_core_more_than_is_free(slurm, {job_id})
    wait_until(lambda: _state(rd, "w001") == "preempted" and "JobState=PENDING" in _show(slurm, job_id), 90,
               "the rollout job preempted and requeued by Slurm", describe=_why_not_preempted(slurm, job_id, log))
    saved = [(g["prompt_index"], t) for g in read_json(rd.in_flight_states("w001"))["groups"]
             for t in g["trajectories"] if t["pending_calls"]]
    assert saved, "the trajectory whose call was running is saved with the call pending"
    assert all(t["state"] == PROCESSING_TOOLS for _, t in saved)
    _requeued_job_starts_now(slurm, job_id, set())
    assert trainer.wait(300) == 0, trainer.tail()
    wait_until(lambda: not squeue_ids(slurm), 60, "the rollout job to end")

    text = log.read_text()
    assert text.count("joined the fleet") == 2 and "SIGTERM of a Slurm preemption" in text
    assert text.count("sleep=300 at tool_call") == 1, "HPCRL_FAULT_ONCE: the requeued job's calls are not stalled"
    lines = [ShardManifestLine.from_json(x) for x in read_jsonl(rd.shard_manifest("w001"))]
    committed = {g.prompt_index: g for m in lines for g in read_shard(rd.writer_dir("w001") / m.shard, m, "w001")}
    for prompt, traj in saved:
        assert f"prompt {prompt} continues from its saved state" in text
        n = len(traj["tokens"])
        assert any(list(t.response_ids[:n]) == traj["tokens"] and list(t.token_versions[:n]) == traj["versions"]
                   for t in committed[prompt].trajectories), f"prompt {prompt}: the saved trajectory was not continued"
    print(f"preempted mid tool call: {len(saved)} trajectories with a call pending, continued by the requeued job")
    check_exactly_once(rd, rd.load_config().rollout.max_concurrent_groups)
