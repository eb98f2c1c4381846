"""The fleet's writer numbers, drain records, its one resize path with and without a launcher, and ``hpcrl scale``
(``launcher/fleet.py``, ``control/fleet.py``, ``launcher/scale_cmd.py``): fast, no rollout job started (where a
launcher submits one, a real local job that sleeps stands in for it)."""
import json
import os
import time
from pathlib import Path

import pytest

from conftest import make_run
from hpcrl.control.admission import Admission, read_claims
from hpcrl.control.fleet import acknowledge_scale, drain_requested, read_scale_request, request_drain, request_scale
from hpcrl.control.fleet_log import FleetLog, read_fleet_events
from hpcrl.control.records import Heartbeat
from hpcrl.rundir.fsio import write_json_atomic
from hpcrl.launcher.fleet import Fleet, active_writers, fleet_ids
from hpcrl.launcher.jobs import JobHandle
from hpcrl.launcher.sbatch_lines import rollout_lines, sbatch_lines
from hpcrl.launcher.scale_cmd import scale_command
from hpcrl.launcher.submit import LauncherJobs, plan_jobs
from hpcrl.process.pids import pid_running
from hpcrl.rundir.paths import FLEET_LAUNCHER, FLEET_SCALE, RunDir


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


def test_scale_logs_the_fleet_it_found_before_a_launcher_could_apply_the_request(tmp_path, monkeypatch):
    """A launcher may grow the fleet as soon as the request is written (the whole suite caught one within the
    command's own next line): ``scale_requested`` holds the size the command found, not one half applied."""
    import hpcrl.launcher.scale_cmd as scale_cmd

    rd = make_run(tmp_path, "resources.rollout_jobs=1")
    _beat(rd, "w000")
    written = scale_cmd.request_scale

    def applied_at_once(rd_, n, by, *reward_jobs):  # what a launcher's poll does between the request and the next line
        req = written(rd_, n, by, *reward_jobs)
        rd_.writer_dir("w001").mkdir(parents=True)
        _beat(rd_, "w001")
        acknowledge_scale(rd_, req)
        return req

    monkeypatch.setattr(scale_cmd, "request_scale", applied_at_once)
    assert scale_command(str(rd.root), 3, wait_s=5, scripts=None) == 0
    (ev,) = [e for e in read_fleet_events(rd) if e.event == "scale_requested"]
    assert (ev.from_jobs, ev.to_jobs) == (1, 3)


def test_a_resume_with_a_smaller_fleet_retires_the_newest_writers_and_hands_back_their_prompts(tmp_path):
    rd = make_run(tmp_path, "resources.rollout_jobs=2")
    for w in ("w000", "w001"):
        adm = Admission(rd, w, 100)
        adm.join(0, set())
        adm.try_start(0)
    cfg = rd.load_config()
    fleet = Fleet(rd, cfg, FleetLog(rd, FLEET_LAUNCHER), print, LauncherJobs(cfg, rd, "local"))
    assert fleet.retire([0], "test") == ["w001"]
    book = read_claims(rd)
    assert drain_requested(rd, "w001") and book.free == [1] and set(book.claims) == {"w000"}
    (ev,) = [e for e in read_fleet_events(rd) if e.source == FLEET_LAUNCHER]
    assert (ev.event, ev.writer, ev.by, ev.numbers) == ("drain_requested", "w001", "test", {"released_prompts": 1})


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
    said = [(e.event, e.writer, e.from_jobs, e.to_jobs) for e in read_fleet_events(rd)]
    assert said == [("scale_requested", "", 3, 1), ("drain_requested", "w002", -1, -1),
                    ("drain_requested", "w001", -1, -1), ("scale_applied", "", 3, 1)], "hpcrl scale logs what it did"
    assert rd.fleet_log(FLEET_SCALE).is_file()
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
    _beat(rd, "w000", state="preempted")  # Slurm requeues it: it beats again when it starts
    out = io.StringIO()
    status_main(rd.root, once=True, out=out)
    line = next(x for x in out.getvalue().splitlines() if x.startswith("fleet:"))
    assert "; preempted (waiting to be requeued): w000;" in line


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


def test_the_fleet_history_says_who_joined_and_left_when_and_why(tmp_path):
    """Real writers: admission joins and leaves, shard commits, the launcher's events; status shows them."""
    import io

    from hpcrl.analysis.fleet import fleet_history
    from hpcrl.analysis.status import status_main
    from hpcrl.control.fleet_log import RESUBMITTED, SCALE_APPLIED, SUBMITTED
    from hpcrl.samples.writer import ShardWriter
    from test_samples import make_group

    rd = make_run(tmp_path, "resources.rollout_jobs=2")
    launcher = FleetLog(rd, FLEET_LAUNCHER)
    launcher.record(SUBMITTED, job="rollout-w000", writer="w000", job_id="11", by="hpcrl run")
    prompts = iter(range(100))

    def life(writer: str, groups: int) -> Admission:
        """One job of ``writer``: join, commit ``groups`` groups (one shard each)."""
        adm = Admission(rd, writer, 10**9)
        w = ShardWriter(rd, writer, 1, 60, commit_guard=adm.committing)
        adm.join(w.committed_groups, w.committed_prompt_indices)
        for _ in range(groups):
            w.add(make_group(adm.try_start(0, own=next(prompts)), writer=writer))
            w.seal()
        return adm

    life("w000", 2)
    launcher.record(SCALE_APPLIED, by="hpcrl scale --rollout-jobs 2", from_jobs=1, to_jobs=2)
    life("w001", 1).leave("preempted")  # Slurm requeues it: the same writer joins again
    life("w001", 1)  # SIGKILLed: no final state; the launcher resubmits it
    launcher.record(RESUBMITTED, job="rollout-w001", writer="w001", job_id="13", why="ended early")
    request_drain(rd, "w001", "hpcrl scale --rollout-jobs 1")
    life("w001", 2).leave("drained")
    _beat(rd, "w000")
    h = fleet_history(rd)
    assert [(x.writer, x.how, x.groups) for x in h.lives] == [
        ("w000", "running", 2), ("w001", "preempted and requeued", 1), ("w001", "killed and resubmitted", 1),
        ("w001", "drained", 2)]
    assert h.changed and [e.event for e in h.decisions] == ["scale_applied"]
    windows = h.windows(4)
    assert abs(sum(x.total_per_s * (x.end_s - x.start_s) for x in windows) - 6) < 1e-6, "every group in a window"
    out = io.StringIO()
    status_main(rd.root, once=True, out=out)
    text = out.getvalue()
    assert "fleet over time (groups/s committed per writer, 6 windows of" in text
    w001 = next(x for x in text.splitlines() if x.startswith("  w001: "))
    assert w001.count("joined +") == 3 and "preempted and requeued at +" in w001 and "drained at +" in w001
    assert "killed and resubmitted at +" in w001 and w001.endswith("2 groups")
    assert "  w000: joined +0s (job " in text and ", running, 2 groups" in text
    assert "decisions: +0s scale 1 -> 2 (hpcrl scale --rollout-jobs 2)" in text
    from types import SimpleNamespace

    from hpcrl.analysis.fleet import fleet_plot, lives_table, windows_table

    lives = lives_table(h)  # the report's section: its tables and its plot
    assert list(lives["how"]) == ["running", "preempted and requeued", "killed and resubmitted", "drained"]
    assert list(lives["groups"]) == [2, 1, 1, 2] and lives["left (s)"].isna().tolist() == [True, False, False, False]
    ws = windows_table(h, 4)
    assert list(ws.columns) == ["from (s)", "to (s)", "writers", "groups/s", "w000 groups/s", "w001 groups/s"]
    png = fleet_plot(SimpleNamespace(root=rd.root), tmp_path / "fleet.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_run_of_one_writer_shows_no_fleet_view(tmp_path):
    import io

    from hpcrl.analysis.status import status_main

    rd = make_run(tmp_path)
    Admission(rd, "w000", 100).join(0, set())
    _beat(rd, "w000")
    out = io.StringIO()
    status_main(rd.root, once=True, out=out)
    assert "fleet" not in out.getvalue()


def test_sbatch_test_only_is_parsed_as_slurm_prints_it():
    from datetime import datetime

    from hpcrl.launcher.autoscale import parse_test_only

    # Slurm 22.05 (src/api/allocate.c, info() to stderr): with and without the partition (before 18.08)
    got = parse_test_only("sbatch: Job 123 to start at 2026-11-24T14:00:00 using 1 processors on nodes n1 in "
                          "partition debug\n")
    assert got.start_s == datetime(2026, 11, 24, 14, 0, 0).timestamp()
    assert (got.processors, got.nodes, got.partition) == (1, "n1", "debug")
    old = parse_test_only("sbatch: Job 7 to start at 2026-11-24T14:00:05 using 4 processors on n[1-2]\n"
                          "sbatch:   Preempts: 5,6\n")
    assert (old.processors, old.nodes, old.partition) == (4, "n[1-2]", "")
    assert parse_test_only("sbatch: error: Batch job submission failed: Requested node configuration is not "
                           "available") is None
    assert parse_test_only("sbatch: Job 1 to start at Tue 14:00 using 1 processors on n1") is None


def test_the_queue_check_adds_a_job_only_if_the_queue_can_start_one_soon():
    from hpcrl.launcher.autoscale import TestOnly, queue_verdict

    now = 1000.0
    ok, why, nums = queue_verdict([], None, now, 300)
    assert ok and "local executor" in why
    ok, why, nums = queue_verdict(["rollout-w003 (55_3)"], TestOnly(now, 1, "n1"), now, 300)
    assert not ok and "rollout-w003 (55_3) still pending" in why and nums == {"pending_jobs": 1}
    ok, why, nums = queue_verdict([], TestOnly(now + 60, 1, "n1", "debug"), now, 300)
    assert ok and "start in 60s on n1 in partition debug" in why and nums["start_in_s"] == 60
    ok, why, nums = queue_verdict([], TestOnly(now + 3600, 1, "n1"), now, 300)
    assert not ok and "only in 3600s" in why and "start_within_s=300" in why
    ok, why, _ = queue_verdict([], "exit 1: sbatch: error: invalid partition", now, 300)
    assert not ok and "invalid partition" in why


def test_sbatch_test_only_says_why_it_has_no_answer():
    """Without an estimate the reason is the command's (the real answer of a real cluster: test_slurm_preempt)."""
    from hpcrl.launcher.autoscale import sbatch_test_only

    assert sbatch_test_only(["false"]) == "exit 1: no output"
    assert "No such file" in sbatch_test_only(["/nonexistent/sbatch", "--test-only"])


def _sleeping_jobs(folder: Path):
    """A launcher's submit function whose jobs are real local processes (submitit's, as the launcher starts them)
    that become ``sleep 120`` instead of running the rollout job: the fleet's handles, states and cancels (SIGTERM)
    are real."""
    import submitit

    def submit(rd: RunDir, kind: str, planned) -> JobHandle:
        ex = submitit.LocalExecutor(folder=folder / planned.name)
        ex.update_parameters(timeout_min=2)
        return JobHandle(planned.name, ex.submit(os.execvp, "sleep", ["sleep", "120"]), "local")
    return submit


def _launch(fleet: Fleet) -> None:
    """Submit the rollout jobs of the launch plan, as ``hpcrl run`` does (the trainer is not needed here)."""
    rollouts = [p for p in plan_jobs(fleet.cfg, fleet.rd) if RunDir.writer_of_job(p.name) is not None]
    fleet.starter.submit_all(rollouts, fleet.log, "hpcrl run")


@pytest.fixture
def launcher(tmp_path):
    """``launcher(rd)``: the fleet of a launcher following ``rd`` whose jobs sleep (:func:`_sleeping_jobs`), its
    lines in ``.lines``; every job it started is cancelled after the test."""
    made = []

    def make(rd: RunDir) -> Fleet:
        cfg = rd.load_config()
        lines: list[str] = []
        fleet = Fleet(rd, cfg, FleetLog(rd, FLEET_LAUNCHER), lines.append,
                      LauncherJobs(cfg, rd, "local", submit=_sleeping_jobs(tmp_path / "submitit")))
        fleet.lines = lines
        made.append(fleet)
        return fleet
    yield make
    for fleet in made:
        for handle in fleet.starter.handles.values():
            _end(handle)


def _end(handle: JobHandle) -> None:
    """End a sleeping job (SIGTERM, as the launcher cancels) and wait for its end: a SIGTERM that reached submitit
    before the job could act on it is followed by SIGKILL ``kill_wait_s`` later, as Slurm's KillWait does."""
    handle.cancel()
    deadline = time.monotonic() + handle.kill_wait_s + 30
    while not handle.done():
        assert time.monotonic() < deadline, f"{handle.name} did not end {handle.kill_wait_s + 30:.0f} s after SIGTERM"
        time.sleep(0.05)


def test_a_local_job_that_ignores_sigterm_is_killed_with_what_it_started_after_the_kill_wait(tmp_path):
    """``cancel`` of a local job is scancel's: SIGTERM, then SIGKILL to the job and its children once it still runs
    ``kill_wait_s`` later. A job ignoring SIGTERM stands in for one whose SIGTERM came while submitit's wrapper
    ignored it (CI: a sleeping job cancelled a moment after its submission ran on past 30 s)."""
    import submitit

    pidfile = tmp_path / "child.pid"
    ex = submitit.LocalExecutor(folder=tmp_path / "submitit")
    ex.update_parameters(timeout_min=5)
    script = f"trap '' TERM; sleep 300 & echo $! > {pidfile}; wait"
    handle = JobHandle("stubborn", ex.submit(os.execvp, "bash", ["bash", "-c", script]), "local", kill_wait_s=3)
    deadline = time.monotonic() + 60
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline and not handle.done(), "the job never started its child"
        time.sleep(0.05)
    child = int(pidfile.read_text())
    t0 = time.monotonic()
    handle.cancel()
    time.sleep(1.5)
    assert not handle.done(), "SIGTERM is ignored: the job runs until the kill wait"
    while not handle.done():
        assert time.monotonic() - t0 < 3 + 30, "not killed after the kill wait"
        time.sleep(0.05)
    assert time.monotonic() - t0 >= 3
    assert not pid_running(child), "the job's child was killed with it"


def test_a_launcher_stopped_by_a_fatal_record_returns_only_when_every_job_is_gone(tmp_path):
    """A job's fatal record stops the run: the follower gives the jobs ``timeouts.stop_s`` to stop by themselves
    (the trainer here stops on seeing the record), cancels at once a job still starting (nothing to save), and
    returns only once every job is gone, SIGKILLing one that ignored its SIGTERM after the kill wait. CI once had an
    evaluation job, cancelled as it started, outlive ``hpcrl run`` for 600 s holding its output open."""
    import submitit

    from hpcrl.control.fatal import write_fatal
    from hpcrl.launcher.follow import RunFollower
    from hpcrl.launcher.progress import Console

    rd = make_run(tmp_path, "timeouts.stop_s=20")
    cfg = rd.load_config()
    pids = tmp_path / "pids"
    pids.mkdir()
    scripts = {  # what each job's process does instead of the job
        "trainer": f"echo $$ > {pids}/trainer; while [ ! -e {rd.fatal} ]; do sleep 0.1; done; touch {tmp_path}/saved",
        "rollout-w000": f"echo $$ > {pids}/rollout-w000; exit 1",  # the job that recorded the error
        "eval": f"trap '' TERM; echo $$ > {pids}/eval; sleep 300",  # its SIGTERM came before its handler
    }

    def submit(rd: RunDir, kind: str, planned) -> JobHandle:
        ex = submitit.LocalExecutor(folder=tmp_path / "submitit" / planned.name)
        ex.update_parameters(timeout_min=5)
        return JobHandle(planned.name, ex.submit(os.execvp, "bash", ["bash", "-c", scripts[planned.name]]), "local",
                         kill_wait_s=3)

    lines: list[str] = []
    jobs = LauncherJobs(cfg, rd, "local", submit=submit)
    fleet = Fleet(rd, cfg, FleetLog(rd, FLEET_LAUNCHER), lines.append, jobs)
    jobs.submit_all(plan_jobs(cfg, rd), fleet.log, "test")
    assert set(jobs.handles) == set(scripts)
    try:
        deadline = time.monotonic() + 60
        while len(list(pids.iterdir())) < 3:
            assert time.monotonic() < deadline, f"the jobs did not start: {list(pids.iterdir())}"
            time.sleep(0.05)
        write_json_atomic(rd.heartbeat("trainer"), Heartbeat("trainer", "trainer", "h", 1, time.time(),
                                                             state="waiting_samples").to_json())
        write_fatal(rd, "rollout-w000", "loading the model failed: ValueError: no model_type", "model")
        follower = RunFollower(rd, cfg, jobs, fleet, Console(rd, cfg, lines.append, False), lines.append)
        t0 = time.monotonic()
        assert follower.follow(timeout_s=120, poll_s=0.05) == 1
        took = time.monotonic() - t0
        said = "\n".join(lines)
        assert all(h.done() for h in jobs.handles.values()), said
        for name in scripts:
            assert not pid_running(int((pids / name).read_text())), f"{name} outlived the launcher:\n{said}"
        assert (tmp_path / "saved").exists(), "the trainer stopped by itself on the record"
        assert "run stopped: rollout-w000: loading the model failed" in said
        assert "eval: no heartbeat yet; nothing to save, cancelled" in said
        assert "trainer: no heartbeat" not in said and "still running" not in said, said
        assert 3 <= took < 20, f"the stubborn job is killed after the kill wait (3 s), not at stop_s: {took:.1f}s"
    finally:
        for handle in jobs.handles.values():
            _end(handle)


FAKE_SLURM = r"""#!{python}
import json, sys
from pathlib import Path
folder = Path({folder!r})
with open(folder / "calls", "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\n")
slurm = json.loads((folder / "slurm.json").read_text())
if Path(sys.argv[0]).name == "squeue":
    if slurm.get("down"):
        sys.exit("slurm_load_jobs error: Unable to contact slurm controller (connect failure)")
    ids = sys.argv[sys.argv.index("-j") + 1].split(",")
    print("\n".join(f"{{i}} {{slurm['queue'][i]}}" for i in ids if i in slurm["queue"]))
elif sys.argv[-1] in slurm["ended"]:
    print(f"JobId={{sys.argv[-1]}} JobName=x JobState={{slurm['ended'][sys.argv[-1]]}} Reason=None")
else:
    sys.exit("slurm_load_jobs error: Invalid job id specified")
"""


def test_a_launchers_slurm_jobs_are_asked_about_in_one_squeue_and_an_ended_one_never_again(tmp_path, monkeypatch):
    """A launcher following many Slurm jobs asks ``squeue`` once per refresh for all of them (it asked once per
    job per poll: 768 calls a second for a 1,024-GPU fleet), ``scontrol`` once for a job that left the queue, and
    never again about a job that ended; while the controller does not answer, no running job reads as ended."""
    import sys
    from types import SimpleNamespace

    from hpcrl.launcher.jobs import SlurmQueue

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("squeue", "scontrol"):
        (bin_dir / name).write_text(FAKE_SLURM.format(python=sys.executable, folder=str(tmp_path)))
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    ids = [str(i) for i in range(101, 106)]
    slurm = {"queue": {i: "RUNNING" for i in ids}, "ended": {}}
    (tmp_path / "slurm.json").write_text(json.dumps(slurm))

    def calls() -> list[str]:
        return (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []

    queue = SlurmQueue(refresh_s=3600)
    handles = []
    for i in ids:
        handle = JobHandle(f"rollout-w{i}", SimpleNamespace(job_id=i), "slurm")
        handle.queue = queue
        queue.add(i)
        handles.append(handle)
    assert not any(h.done() for h in handles) and not any(h.done() for h in handles)
    assert calls() == ["-h -j 101,102,103,104,105 -o %i %T"], "one squeue for all five, then its answer is reused"

    slurm["queue"].pop("103")
    slurm["ended"]["103"] = "CANCELLED"
    (tmp_path / "slurm.json").write_text(json.dumps(slurm))
    queue.refresh_s = 0.0
    assert [h.done() for h in handles] == [False, False, True, False, False]
    assert handles[2].state() == "CANCELLED"
    asked = calls()
    assert asked.count("show job 103") == 1, asked
    assert all("103" not in c for c in asked[asked.index("show job 103") + 1:]), "an ended job is not asked again"

    slurm["down"] = True
    (tmp_path / "slurm.json").write_text(json.dumps(slurm))
    assert [h.done() for h in handles] == [False, False, True, False, False], "no answer is not an end"
    assert handles[0].state() == "UNREACHABLE"


def test_an_autoscale_decision_is_logged_with_its_numbers_whether_or_not_the_queue_lets_it_through(tmp_path, launcher):
    from hpcrl.rundir.fsio import JsonlAppender
    from hpcrl.launcher.autoscale import Autoscaler

    rd = make_run(tmp_path, "resources.rollout_autoscale.max_jobs=3", "resources.rollout_autoscale.versions=2")
    fleet = launcher(rd)
    _launch(fleet)  # w000
    _beat(rd, "w000")
    rows = JsonlAppender(rd.metrics)
    rows.append_many([{"param_version": v, "step": v, "trainer/idle_ratio": 0.7} for v in range(3)])
    answers = iter([(False, "rollout-w001 (12) still pending in the queue", {"pending_jobs": 1}),
                    (True, "sbatch --test-only: it would start in 0s", {"start_in_s": 0.0})])
    scaler = Autoscaler(fleet, fleet.cfg.resources.rollout_autoscale, queue_check=lambda: next(answers))
    assert scaler.step().rollout_jobs == 2 and fleet.active() == ["w000"], "held: nothing submitted"
    assert "HELD" not in fleet.lines[-1] and "held until 2 more versions" in fleet.lines[-1]
    assert scaler.step() is None, "a held decision waits `versions` versions like any other"
    rows.append_many([{"param_version": v, "step": v, "trainer/idle_ratio": 0.7} for v in range(3, 5)])
    assert scaler.step().rollout_jobs == 2
    assert fleet.active() == ["w000", "w001"] and "scale: rollout-w001 submitted as " in "\n".join(fleet.lines)
    held, added = [e for e in read_fleet_events(rd) if e.event == "autoscale"]
    assert not held.applied and held.numbers["pending_jobs"] == 1 and held.numbers["trainer_idle_min"] == 0.7
    assert "still pending" in held.why and (held.from_jobs, held.to_jobs) == (1, 2)
    assert added.applied and added.numbers["start_in_s"] == 0.0 and added.numbers["version"] == 4
    (applied,) = [e for e in read_fleet_events(rd) if e.event == "scale_applied"]
    assert (applied.by, applied.from_jobs, applied.to_jobs, applied.numbers) == ("autoscale", 1, 2,
                                                                                 {"jobs": ["rollout-w001"]})
    assert rd.load_config().resources.rollout_jobs == 2, "the frozen config follows an autoscale decision too"


def _fake_sbatch(tmp_path: Path, monkeypatch, job_id: str = "4242") -> Path:
    """An ``sbatch`` on PATH that answers as ``sbatch --parsable`` does (no Slurm here: the real one is asked in
    test_slurm_preempt.py) and keeps each command line it got in the returned file."""
    folder = tmp_path / "bin"
    folder.mkdir()
    calls = tmp_path / "sbatch_calls"
    (folder / "sbatch").write_text(f'#!/bin/sh\necho "$*" >> {calls}\necho {job_id}\n')
    (folder / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_with_and_without_a_launcher_the_fleet_is_the_same_writers_after_a_drain_and_a_join(tmp_path, launcher,
                                                                                          monkeypatch):
    """The launcher's view (its job handles) and the run directory's (what ``hpcrl scale`` reads when no launcher
    follows) name the same writers at every step; a writer number is never given twice, whichever path grows."""
    rd = make_run(tmp_path, "resources.rollout_jobs=2")
    fleet = launcher(rd)
    records = lambda: active_writers(rd, rd.load_config())  # noqa: E731  (no launcher: the records alone)
    assert records() == ["w000", "w001"], "a run launched by sbatch/submit.sh whose jobs are still queued"
    _launch(fleet)
    assert fleet.active() == records() == ["w000", "w001"]
    _beat(rd, "w000")
    _beat(rd, "w001")

    assert fleet.resize(1, "Run.scale") == ["rollout-w001"]  # the newest drains
    assert drain_requested(rd, "w001") and fleet.active() == records() == ["w000"]
    assert "scale: rollout-w001 (" in fleet.lines[0] and "asked to drain" in fleet.lines[0]
    w001 = fleet.starter.handles["rollout-w001"]
    _end(w001)  # its job drains and ends
    _beat(rd, "w001", state="drained")
    assert w001.done() and fleet.reap("rollout-w001", w001) and "rollout-w001" not in fleet.starter.handles
    assert fleet.active() == records() == ["w000"]

    assert fleet.resize(2, "hpcrl scale --rollout-jobs 2") == ["rollout-w002"]  # a new number, never w001 again
    assert fleet.active() == records() == ["w000", "w002"], "submitted, not started yet: in the fleet"

    calls = _fake_sbatch(tmp_path, monkeypatch)  # the launcher has gone: `hpcrl scale` acts itself
    assert scale_command(str(rd.root), 3, wait_s=0, scripts=None) == 0
    assert records() == ["w000", "w002", "w003"] and calls.read_text().count("--array=3-3 ") == 1
    assert scale_command(str(rd.root), 3, wait_s=0, scripts=None) == 0
    assert calls.read_text().count("\n") == 1, "w002 and w003 are queued, not gone: nothing is submitted twice"
    assert scale_command(str(rd.root), 2, wait_s=0, scripts=None) == 0  # the newest, still queued, drains
    assert drain_requested(rd, "w003") and records() == ["w000", "w002"]
    assert rd.load_config().resources.rollout_jobs == 2
    said = [(e.source, e.event, e.writer, e.job_id, e.from_jobs, e.to_jobs) for e in read_fleet_events(rd)
            if e.event not in ("scale_requested", "cancelled", "left")]
    assert said == [("launcher", "submitted", "w000", said[0][3], -1, -1),
                    ("launcher", "submitted", "w001", said[1][3], -1, -1),
                    ("launcher", "drain_requested", "w001", said[1][3], -1, -1),
                    ("launcher", "scale_applied", "", "", 2, 1),
                    ("launcher", "submitted", "w002", said[4][3], -1, -1),
                    ("launcher", "scale_applied", "", "", 1, 2),
                    ("scale", "submitted", "w003", "4242_3", -1, -1), ("scale", "scale_applied", "", "", 2, 3),
                    ("scale", "scale_applied", "", "", 3, 3),
                    ("scale", "drain_requested", "w003", "", -1, -1), ("scale", "scale_applied", "", "", 3, 2)]


def test_without_a_launcher_a_preempted_writer_stays_and_an_ended_or_reclaimed_one_has_left(tmp_path):
    rd = make_run(tmp_path, "resources.rollout_jobs=5")
    for w, state in (("w000", "generating"), ("w001", "preempted"), ("w002", "failed"), ("w003", "stopped"),
                     ("w004", "generating")):
        Admission(rd, w, 100).join(0, set())
        _beat(rd, w, state)
    from hpcrl.control.admission import release_writer

    release_writer(rd, "w004", "reclaimed by w000: heartbeat stale 312 s and Slurm job 123 ended (COMPLETED)")
    assert active_writers(rd, rd.load_config()) == ["w000", "w001"], "Slurm requeues a preempted job"


def test_only_the_launcher_can_cancel_a_drained_job_that_has_not_started(tmp_path, launcher):
    rd = make_run(tmp_path, "resources.rollout_jobs=2")
    fleet = launcher(rd)
    _launch(fleet)
    _beat(rd, "w000")
    assert fleet.resize(1, "Run.scale") == ["rollout-w001"]
    assert "scale: rollout-w001 (" in fleet.lines[0] and "not started: nothing to save, cancelled" in fleet.lines[0]
    (cancelled,) = [e for e in read_fleet_events(rd) if e.event == "cancelled"]
    assert cancelled.writer == "w001" and "drained while queued" in cancelled.why
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        fleet.resize(0, "Run.scale")


def test_a_zombies_end_does_not_end_its_successor_and_a_run_without_fleet_logs_has_one_life_per_writer(tmp_path):
    from hpcrl.analysis.fleet import fleet_history
    from hpcrl.control.fleet_log import ENDED, JOINED
    from test_samples import write_groups

    rd = make_run(tmp_path)
    w = FleetLog(rd, "w000")
    w.record(JOINED, writer="w000", numbers={"lease": "a"})
    w.record(JOINED, writer="w000", numbers={"lease": "b"})  # a requeued job took over; the old one still runs
    w.record(ENDED, writer="w000", why="stopped", numbers={"lease": "a"})
    _beat(rd, "w000")
    assert [x.how for x in fleet_history(rd).lives] == ["killed and requeued", "running"]
    write_groups(rd, range(4), writer="w001")  # an hpcrl before the fleet logs: manifests only
    _beat(rd, "w001", state="done")
    (old,) = [x for x in fleet_history(rd).lives if x.writer == "w001"]
    assert (old.how, old.groups) == ("done", 4) and old.left_s is not None
