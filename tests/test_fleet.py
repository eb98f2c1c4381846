"""The fleet's writer numbers, drain records and ``hpcrl scale`` without a launcher (``launcher/fleet.py``,
``control/fleet.py``, ``launcher/scale_cmd.py``): fast, no job started."""
import json
import time

from conftest import make_run
from hpcrl.control.admission import Admission, read_claims
from hpcrl.control.fleet import drain_requested, read_scale_request, request_drain, request_scale
from hpcrl.control.records import Heartbeat
from hpcrl.fsio import write_json_atomic
from hpcrl.launcher.fleet import fleet_ids, retire_writers
from hpcrl.launcher.sbatch_lines import rollout_lines, sbatch_lines
from hpcrl.launcher.scale_cmd import scale_command
from hpcrl.launcher.submit import plan_jobs
from hpcrl.run_dir import RunDir


def _beat(rd: RunDir, writer: str, state: str = "generating") -> None:
    job = RunDir.rollout_job(writer)
    write_json_atomic(rd.heartbeat(job), Heartbeat(job, "rollout", "h", 1, time.time(), state=state).to_json())


def test_a_fresh_run_has_the_writers_it_always_had_and_a_grown_one_never_reuses_a_number(tmp_path):
    rd = make_run(tmp_path, "resources.rollout_jobs=3")
    assert [p.name for p in plan_jobs(rd.load_config(), rd)][1:4] == ["rollout-w000", "rollout-w001", "rollout-w002"]
    assert "--array=0-2" in sbatch_lines(rd.load_config(), rd, tmp_path, "python")[1]
    for w in ("w000", "w001", "w002"):
        rd.writer_dir(w).mkdir(parents=True)
    request_drain(rd, "w001", "test")
    assert fleet_ids(rd, 2) == [0, 2] and fleet_ids(rd, 4) == [0, 2, 3, 4], "w001 drained: never run again"
    assert "--array=3,5" in rollout_lines(rd.load_config(), rd, tmp_path, "python", [3, 5])[0]


def test_a_resume_with_a_smaller_fleet_retires_the_newest_writers_and_hands_back_their_prompts(tmp_path):
    rd = make_run(tmp_path, "resources.rollout_jobs=2")
    for w in ("w000", "w001"):
        adm = Admission(rd, w, 100)
        adm.join(0, set())
        adm.try_start(0)
    assert retire_writers(rd, [0], "test") == ["w001"]
    book = read_claims(rd)
    assert drain_requested(rd, "w001") and book.free == [1] and set(book.claims) == {"w000"}


def test_scale_without_a_launcher_drains_the_newest_by_records(tmp_path, capsys):
    rd = make_run(tmp_path, "resources.rollout_jobs=3")
    for w in ("w000", "w001", "w002"):
        _beat(rd, w)
    _beat(rd, "w003", state="failed")  # an ended job is not in the fleet
    assert scale_command(str(rd.root), 1, wait_s=0.2, scripts=None) == 0
    assert [drain_requested(rd, w) for w in ("w000", "w001", "w002")] == [False, True, True]
    assert rd.load_config().resources.rollout_jobs == 1
    assert "resources.rollout_jobs: 3 -> 1 (hpcrl scale --rollout-jobs 1)" in rd.config_history()
    req = read_scale_request(rd)
    assert req.rollout_jobs == 1 and req.applied_s == 0.0, "no launcher acknowledged it"
    assert scale_command(str(rd.root), 0, wait_s=0, scripts=None) == 2
    assert "must be >= 1, got 0" in capsys.readouterr().err


def test_a_scale_request_is_a_record(tmp_path):
    rd = make_run(tmp_path)
    request_scale(rd, 4, "me")
    assert json.loads(rd.scale_request.read_text())["rollout_jobs"] == 4
    rd.scale_request.write_text("{torn")
    assert read_scale_request(rd) is None


def test_rollout_jobs_beyond_the_floor_go_to_the_preemptible_partition(tmp_path):
    rd = make_run(tmp_path, "resources.rollout_jobs=3", "resources.rollout_preemptible.partition=scavenger",
                  "resources.rollout_preemptible.floor=1", "resources.rollout.partition=debug")
    cfg = rd.load_config()
    lines = sbatch_lines(cfg, rd, tmp_path, "python")
    assert "--array=0-0" in lines[1] and "--partition=debug" in lines[1] and "--requeue" in lines[1]
    assert "--array=1-2" in lines[2] and "--partition=scavenger" in lines[2] and "--requeue" in lines[2]
    jobs = {p.name: p.resources.partition for p in plan_jobs(cfg, rd)}
    assert [jobs[f"rollout-w00{i}"] for i in range(3)] == ["debug", "scavenger", "scavenger"]
    cfg.resources.rollout_preemptible.requeue = False
    assert "--no-requeue" in rollout_lines(cfg, rd, tmp_path, "python", [5])[0]
    assert "--requeue " not in rollout_lines(cfg, rd, tmp_path, "python", [5])[0]


def test_status_lists_the_writers_that_joined_are_draining_and_left(tmp_path):
    import io

    from hpcrl.analysis.status import status_main

    rd = make_run(tmp_path, "resources.rollout_jobs=3")
    for w in ("w000", "w001", "w002"):
        Admission(rd, w, 100).join(0, set())
    request_drain(rd, "w001", "test")
    request_drain(rd, "w002", "test")
    Admission(rd, "w002", 100).release("drained")
    _beat(rd, "w000")
    out = io.StringIO()
    status_main(rd.root, once=True, out=out)
    line = next(x for x in out.getvalue().splitlines() if x.startswith("fleet:"))
    assert line == "fleet: 2 writer(s) joined (w000 w001); draining: w001; left: w002 (drained, 0 prompts handed back)"


def test_autoscale_adds_a_job_while_the_trainer_waits_and_drains_one_while_the_fleet_waits():
    from hpcrl.config.resources import RolloutAutoscale
    from hpcrl.launcher.autoscale import decide

    cfg = RolloutAutoscale(min_jobs=1, max_jobs=3, idle_ratio=0.3, versions=3)
    waiting = [{"param_version": v, "trainer/idle_ratio": 0.6} for v in range(6)]
    d = decide(cfg, 2, waiting, {}, last_decision_version=-100)
    assert d.rollout_jobs == 3 and d.version == 5 and "trainer idle 0.60-0.60 > 0.3" in d.why
    assert decide(cfg, 2, waiting, {}, last_decision_version=4) is None, "waits `versions` after a decision"
    assert decide(cfg, 3, waiting, {}, last_decision_version=-100) is None, "max_jobs"
    assert decide(cfg, 2, waiting[:2], {}, last_decision_version=-100) is None, "too few versions yet"
    busy = [{"param_version": v, "trainer/idle_ratio": 0.05} for v in range(6)]
    idle = {w: [{"param_version": v, "rollouter/idle_ratio": 0.5} for v in range(6)] for w in ("w000", "w001")}
    d = decide(cfg, 2, busy, idle, last_decision_version=-100)
    assert d.rollout_jobs == 1 and "w000 0.50, w001 0.50" in d.why
    assert decide(cfg, 1, busy, {"w000": idle["w000"]}, last_decision_version=-100) is None, "min_jobs"
    one_busy = dict(idle, w001=[{"param_version": v, "rollouter/idle_ratio": 0.1} for v in range(6)])
    assert decide(cfg, 2, busy, one_busy, last_decision_version=-100) is None


def test_autoscale_bounds_are_checked_before_submission(tmp_path):
    import pytest

    from hpcrl.config import ConfigError

    with pytest.raises(ConfigError, match="max_jobs.*>= resources.rollout_autoscale.min_jobs = 2"):
        make_run(tmp_path, "resources.rollout_autoscale.min_jobs=2", "resources.rollout_autoscale.max_jobs=1")
    with pytest.raises(ConfigError, match="idle_ratio"):
        make_run(tmp_path, "resources.rollout_autoscale.max_jobs=2", "resources.rollout_autoscale.idle_ratio=1.5")
