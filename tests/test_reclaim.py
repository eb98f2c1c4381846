"""Claims of a rollout writer whose job is gone, reclaimed by the writers still running (``control/reclaim.py``):
the rule (stale heartbeat and ended job, given what Slurm said; ``squeue`` itself is asked on the real private
cluster in test_slurm_preempt.py), the release under the admission lock, a writer that comes back, and a real run with a
SIGKILLed rollout job and no launcher (a background run, ``conftest.BackgroundRuns``: this file is its command)."""
from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import PATIENT, BackgroundCommand, check_exactly_once, make_run, start_rollout, start_trainer, wait_until
from hpcrl.analysis.status import status_main
from hpcrl.control import admission as admission_mod
from hpcrl.control.admission import Admission, read_claims
from hpcrl.control.claims import ClaimLost
from hpcrl.control.reclaim import judge, same_beat, slurm_state
from hpcrl.control.records import Heartbeat, read_heartbeats, slurm_job_of
from hpcrl.rundir.fsio import read_jsonl, write_json_atomic
from hpcrl.rollout.in_flight import InFlightStates, SavedGroup, SavedGroups, SCHEMA
from hpcrl.rollout.trajectory import TrajectoryState
from hpcrl.rundir.paths import RunDir
from hpcrl.samples.skips import SkipLog
from hpcrl.samples.writer import ShardWriter
from test_samples import make_group

HOST = socket.gethostname()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # reaped: the pid names no process now
    return p.pid


def _beat(age_s: float, slurm_job: str = "", host: str = HOST, pid: int = 0, job: str = "rollout-w001") -> Heartbeat:
    return Heartbeat(job=job, role="rollout", host=host, pid=pid or _dead_pid(), time_s=time.time() - age_s,
                     state="generating", slurm_job=slurm_job)


def test_the_heartbeat_names_the_slurm_job_and_an_older_beat_without_it_still_reads():
    assert slurm_job_of({"SLURM_JOB_ID": "123"}) == "123"
    assert slurm_job_of({"SLURM_JOB_ID": "125", "SLURM_ARRAY_JOB_ID": "120", "SLURM_ARRAY_TASK_ID": "3"}) == "120_3"
    assert slurm_job_of({}) == ""
    old = {"job": "rollout-w000", "role": "rollout", "host": "n1", "pid": 7, "time_s": 1.0, "state": "generating"}
    assert Heartbeat.from_json(old).slurm_job == ""


@pytest.mark.parametrize("said,gone,says", [
    (("COMPLETED", ""), True, "Slurm job 123 ended (COMPLETED)"),
    (("NODE_FAIL", ""), True, "ended (NODE_FAIL)"),
    ((None, ""), True, "ended (absent)"),
    (("RUNNING", ""), False, "is RUNNING: not reclaimed"),
    (("PENDING", ""), False, "is PENDING"),
    (("REQUEUED", ""), False, "is REQUEUED"),
    ((None, "squeue exited 1: slurm_load_jobs error: Unable to contact slurm controller"), False,
     "Slurm could not say whether job 123 ended (squeue exited 1: slurm_load_jobs error: Unable to contact"),
])
def test_a_stale_writer_under_slurm_is_gone_only_when_slurm_says_its_job_ended(said, gone, says):
    """The rule, given what Slurm said (slurm_state itself asks the real private cluster in test_slurm_preempt)."""
    asked = []
    v = judge(_beat(20, slurm_job="123"), time.time(), 10.0, HOST, lambda job: asked.append(job) or said)
    assert (v.gone, v.asked_slurm) == (gone, True) and says in v.why and v.why.startswith("heartbeat stale 20 s")
    assert asked == ["123"]


def test_a_fresh_writer_is_not_gone_and_slurm_is_not_asked():
    asked = []
    v = judge(_beat(3, slurm_job="123"), time.time(), 10.0, HOST, lambda job: asked.append(job) or ("COMPLETED", ""))
    assert not v.gone and v.reason == "" and asked == []


def test_without_squeue_slurm_cannot_say_and_nothing_is_reclaimed(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    state, error = slurm_state("123")
    assert state is None and "squeue could not run" in error
    assert not judge(_beat(20, slurm_job="123"), time.time(), 10.0, HOST).gone


def test_outside_slurm_only_a_gone_process_on_this_host_is_gone():
    now = time.time()
    gone = judge(_beat(20), now, 10.0, HOST)
    assert gone.gone and "is gone" in gone.why
    assert not judge(_beat(20, pid=os.getpid()), now, 10.0, HOST).gone, "its process still runs"
    other = judge(_beat(20, host="elsewhere"), now, 10.0, HOST)
    assert not other.gone and "never reclaimed by a heartbeat's age alone" in other.why
    assert not judge(_beat(5), now, 10.0, HOST).gone


def _join(rd: RunDir, writer: str, reclaim_after_s=None):
    adm = Admission(rd, writer, 8, reclaim_after_s=reclaim_after_s)
    w = ShardWriter(rd, writer, 2, 60, skips=SkipLog(rd), commit_guard=adm.committing)
    return adm, w, adm.join(w.committed_groups, w.committed_prompt_indices, w.skipped_at_start)


def _write_beat(rd: RunDir, beat: Heartbeat) -> None:
    rd.heartbeats.mkdir(parents=True, exist_ok=True)
    write_json_atomic(rd.heartbeat(beat.job), beat.to_json())


def test_a_gone_writer_is_reclaimed_under_the_lock_and_one_that_comes_back_holds_nothing(tmp_path, caplog):
    caplog.set_level("INFO")
    rd = RunDir(tmp_path).create()
    a, _, _ = _join(rd, "w000", reclaim_after_s=10.0)
    b, wb, _ = _join(rd, "w001")
    for _ in range(3):  # w001 claims 0, 1, 2 and commits 0, 1; then w000 claims 3
        wb.add(make_group(b.try_start(0), writer="w001"))
        if wb.seal_due():
            wb.seal()
    _write_beat(rd, _beat(5))  # w001 is killed now: its beat is fresh for a while
    assert a.try_start(0) == 3 and a.reclaim_gone_writers() == [], "fresh, and not due again yet"
    a.gone._next_s = 0.0  # (the few seconds between looks, skipped)
    assert a.reclaim_gone_writers() == []
    stale = _beat(30)
    _write_beat(rd, stale)
    a.gone._next_s = 0.0
    assert a.reclaim_gone_writers() == ["w001"]
    book = read_claims(rd)
    why = book.left["w001"].why
    assert why.startswith("reclaimed by w000: heartbeat stale 30 s and its process") and why.endswith("is gone")
    assert book.free == [2] and book.left["w001"].released == 1
    assert json.loads(rd.admission.read_text())["started"]["w001"] == 2, "its budget count drops to what it committed"
    assert "writer w001 left (reclaimed by w000" in caplog.text
    assert a.try_start(0) == 2, "the reclaimed prompt is taken first"
    with pytest.raises(ClaimLost, match="reclaimed by w000"):
        wb.seal()  # prompt 2, buffered when w001 was "killed": a zombie of the gone writer commits nothing

    path = rd.in_flight_states("w001")  # w001 comes back: its predecessor had saved prompt 2 in flight
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, SavedGroups(SCHEMA, [SavedGroup(2, "single_turn", [TrajectoryState()])]).to_json())
    _write_beat(rd, _beat(0, pid=os.getpid()))  # the new job beats before it joins
    c, wc, held = _join(rd, "w001")
    assert held == [] and "w001" not in read_claims(rd).left
    wc.add(make_group(c.try_start(0), writer="w001"))  # it takes a new prompt and commits it: no ClaimLost again
    assert wc.seal().prompt_indices == [4]
    assert InFlightStates(path, enabled=True, held=[2]).saved_count() == 1, "a prompt still held keeps its state"
    states = InFlightStates(path, enabled=True, held=held)
    assert states.saved_count() == 0 and "dropped 1 groups in flight" in caplog.text


def test_each_writer_watches_the_next_three_in_a_ring_and_reads_only_their_heartbeats(tmp_path, monkeypatch):
    """Every writer reading every heartbeat is quadratic in the fleet (768 x 768 reads every 5 s at 1,024 GPUs):
    each watches the next WATCHED writers of the claim book instead, and the ring closes on the first ones."""
    from hpcrl.control import reclaim
    from hpcrl.control.claims import ClaimBook, WriterClaims
    book = ClaimBook(claims={f"w{i:03d}": WriterClaims(lease="l") for i in range(10)})
    rd = RunDir(tmp_path).create()
    assert reclaim.GoneWriters(rd, "w003", 60).watched(book) == ["w004", "w005", "w006"]
    assert reclaim.GoneWriters(rd, "w008", 60).watched(book) == ["w009", "w000", "w001"]
    assert sorted(w for me in book.claims for w in reclaim.GoneWriters(rd, me, 60).watched(book)) == \
        sorted(list(book.claims) * 3), "every writer is watched by three others"
    dead = _dead_pid()
    for w in book.claims:
        _write_beat(rd, _beat(30, job=f"rollout-{w}", pid=dead))
    read = []
    real = reclaim.read_json
    monkeypatch.setattr(reclaim, "read_json", lambda p: read.append(p.name) or real(p))
    gone = reclaim.GoneWriters(rd, "w003", 10).find(book)
    assert sorted(read) == ["rollout-w004.json", "rollout-w005.json", "rollout-w006.json"]
    assert [w for w, _, _ in gone] == ["w004", "w005", "w006"]


def test_a_writer_that_beat_again_after_it_was_judged_keeps_its_claims(tmp_path):
    rd = RunDir(tmp_path).create()
    a, _, _ = _join(rd, "w000", reclaim_after_s=10.0)
    b, _, _ = _join(rd, "w001")
    b.try_start(0)
    stale = _beat(30)
    _write_beat(rd, stale)
    [(writer, beat, why)] = a.gone.find(read_claims(rd))
    _write_beat(rd, _beat(0, pid=os.getpid()))  # a new job of w001 started meanwhile (it beats, then joins)
    assert not same_beat(rd, "w001", beat)
    assert admission_mod._release(rd, writer, why, still=lambda: same_beat(rd, writer, beat)) is None
    assert read_claims(rd).claims["w001"].prompts == [0]


SIMULATED = ["rollout.engine=simulated", "trainer.simulated=true", "eval.every_versions=0",
             "simulated.time_scale=50", "simulated.lengths=geometric", "simulated.length_mean=30",
             "simulated.update_base_s=2.0", "simulated.weight_load_s=1.0", "rollout.response_length=96",
             "rollout.total_rollout_steps=24", "rollout.max_concurrent_groups=2", "rollout.n=2",
             "async_training.staleness_threshold=0.0", "async_training.partial_rollout=false",
             "trainer.checkpoint_every_updates=1000", "resources.rollout_jobs=2", *PATIENT,
             "timeouts.heartbeat_interval_s=1.0", "timeouts.heartbeat_stale_s=3.0"]
"""Two writers, on-policy (B = K * R = 4): the groups a dead writer holds keep the survivor from starting a whole
batch, so the run cannot finish before they are reclaimed. Patient waits (a background run may get no CPU for
minutes), but a short stale time: a starved survivor is never taken for gone (its process runs), and on-policy the
trainer cannot publish past a version the survivor is loading (weight retention's pins read the stale time too)."""


def _committed(rd: RunDir, writer: str) -> set[int]:
    return {p for line in read_jsonl(rd.shard_manifest(writer)) for p in line["prompt_indices"]}


def sigkill_scenario(rd: RunDir) -> None:
    """The background command (``python tests/test_reclaim.py RUN``): a trainer and rollout job w001 outside Slurm,
    w001 SIGKILLed while it holds claims it has not committed, no launcher; then w000 starts and must reclaim them
    (on-policy, the run cannot finish otherwise). w000 starts only then: started together, a starved w001 was
    once still loading when w000 had finished the whole run. The claims w001 held go to ``RUN/killed_w001.json``.
    Its jobs end with it (SIGTERM: the session's end)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # outside Slurm: the pid is asked
    jobs = [start_trainer(rd, base_env=env, killed_after_the_test=False)]
    try:
        jobs.append(start_rollout(rd, 1, base_env=env, killed_after_the_test=False))
        trainer, w1 = jobs

        def kill_w1_holding_claims() -> set[int]:
            """SIGSTOP w001 where it is; SIGKILL it if it holds claims it has not committed (else let it go on)."""
            os.kill(w1.proc.pid, signal.SIGSTOP)
            book = read_claims(rd)
            mine = book.claims.get("w001") if book else None
            open_ = set(mine.prompts if mine else ()) - _committed(rd, "w001")  # killed mid-commit: the line counts
            if open_ and _committed(rd, "w001"):
                w1.kill()  # SIGKILL: nothing released, nothing saved
                return open_
            os.kill(w1.proc.pid, signal.SIGCONT)
            return set()
        held = wait_until(kill_w1_holding_claims, 1800, "w001 holding open claims after its first commit",
                          poll_s=0.05, jobs=jobs)
        (rd.root / "killed_w001.json").write_text(json.dumps(sorted(held)))
        w0 = start_rollout(rd, 0, base_env=env, killed_after_the_test=False)
        jobs.append(w0)
        assert trainer.wait(1800) == 0, trainer.tail()
        assert w0.wait(600) == 0, w0.tail()
    finally:
        for job in jobs:
            job.kill()


BACKGROUND_RUNS = {"reclaim:sigkill": BackgroundCommand(
    lambda folder: [sys.executable, __file__, str(make_run(folder, *SIMULATED).root)])}


def background_keys(item) -> tuple[str, ...]:
    """The background run the slow test reads."""
    return ("reclaim:sigkill",) if item.originalname.startswith("test_a_sigkilled_writer") else ()


@pytest.mark.slow
def test_a_sigkilled_writer_without_a_launcher_is_reclaimed_and_the_run_is_exactly_once(background_runs):
    proc = background_runs.launched("reclaim:sigkill", timeout_s=1800)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rd = RunDir(proc.args[-1])
    held = set(json.loads((rd.root / "killed_w001.json").read_text()))

    check_exactly_once(rd, max_in_flight=2)
    left = read_claims(rd).left["w001"]
    assert left.why.startswith("reclaimed by w000: heartbeat stale") and "is gone" in left.why
    assert left.released == len(held)
    assert held <= _committed(rd, "w000"), "the survivor committed the reclaimed prompts"
    assert "writer w001 left (reclaimed by w000" in rd.job_log(RunDir.rollout_job("w000")).read_text()
    assert not read_heartbeats(rd)["rollout-w001"].ended, "killed: it never wrote an ended state"
    out = io.StringIO()
    status_main(rd.root, once=True, out=out)
    fleet = next(x for x in out.getvalue().splitlines() if x.startswith("fleet:"))
    assert f"left: w001 ({left.why}, {len(held)} prompts handed back)" in fleet


if __name__ == "__main__":
    sigkill_scenario(RunDir(sys.argv[1]))
