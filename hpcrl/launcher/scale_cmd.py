"""``hpcrl scale RUN --rollout-jobs N``: change the rollout fleet of a live run.

The command writes ``control/scale.json``; the launcher following the run (``hpcrl run``, or a Python session's
``Run``) acts on it within a poll (new jobs through its executor, drain records for the newest ones) and
acknowledges it. When no launcher acknowledges within ``--wait-s`` (the run was launched with
``sbatch/submit.sh``, or ``hpcrl run`` has exited), the command acts itself: it drains by writing drain records
(the jobs drain by themselves), and grows by submitting the rollout job array of the new writer numbers with
sbatch (``sbatch/rollout.sbatch``), or prints that line when sbatch is not on PATH.
"""
from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hpcrl.control.fleet import drained_writers, read_scale_request, request_drain, request_scale
from hpcrl.control.fleet_log import DRAIN_REQUESTED, SCALE_APPLIED, SCALE_REQUESTED, SUBMITTED, FleetLog
from hpcrl.control.records import read_heartbeats, read_trainer_done
from hpcrl.launcher.fleet import record_fleet_size, used_writer_ids
from hpcrl.launcher.sbatch_lines import SCRIPTS, rollout_lines
from hpcrl.run_dir import FLEET_SCALE, RunDir


def _active_writers(rd: RunDir) -> list[str]:
    """Writers whose job beats (not ended) and is not draining, sorted."""
    drained = drained_writers(rd)
    return sorted(w for job, beat in read_heartbeats(rd).items()
                  if (w := RunDir.writer_of_job(job)) is not None and not beat.ended and w not in drained)


def _act_without_launcher(rd: RunDir, n: int, scripts: Path, by: str, fleet: FleetLog) -> int:
    cfg = rd.load_config()
    active = _active_writers(rd)
    if n < len(active):
        for w in active[::-1][:len(active) - n]:
            request_drain(rd, w, by)
            fleet.record(DRAIN_REQUESTED, writer=w, job=RunDir.rollout_job(w), by=by, why="no launcher follows the run")
            print(f"{RunDir.rollout_job(w)} asked to drain ({rd.drain_request(w)})")
    elif n > len(active):
        start = max(used_writer_ids(rd), default=-1) + 1
        ids = list(range(start, start + n - len(active)))
        lines = rollout_lines(cfg, rd, scripts, sys.executable, ids)
        if shutil.which("sbatch") is None:
            print("sbatch is not on PATH: submit the new rollout jobs with\n" + "\n".join(lines))
            return 1
        for line in lines:
            out = subprocess.run(shlex.split(line), capture_output=True, text=True, timeout=60)
            if out.returncode != 0:
                print(f"hpcrl scale: error: `{line}` failed: {out.stderr.strip()}", file=sys.stderr)
                return 1
            print(f"submitted rollout job array {out.stdout.strip()}: {line}")
            fleet.record(SUBMITTED, job_id=out.stdout.strip(), by=by, why=f"rollout job array: {line}",
                         numbers={"writer_ids": ids})
        print(f"writers {ids[0]}..{ids[-1]} join the fleet")
    record_fleet_size(cfg, rd, n, by)
    fleet.record(SCALE_APPLIED, by=by, from_jobs=len(active), to_jobs=n, why="no launcher follows the run")
    return 0


def scale_command(run_dir: str, n: int, wait_s: float, scripts: str | None) -> int:
    """The command (module docstring); exit status 0 when the fleet was changed (or asked to change)."""
    rd = RunDir(run_dir)
    if n < 1:
        print(f"hpcrl scale: error: --rollout-jobs must be >= 1, got {n}; to stop the run press Ctrl-C in `hpcrl "
              "run`, or scancel its jobs", file=sys.stderr)
        return 2
    if read_trainer_done(rd) is not None:
        print(f"hpcrl scale: error: the run in {rd.root} has finished; nothing to scale", file=sys.stderr)
        return 2
    by = f"hpcrl scale --rollout-jobs {n}"
    req = request_scale(rd, n, by)
    fleet = FleetLog(rd, FLEET_SCALE)
    fleet.record(SCALE_REQUESTED, by=by, from_jobs=len(_active_writers(rd)), to_jobs=n)
    deadline = time.monotonic() + wait_s
    print(f"asked for {n} rollout job(s) ({rd.scale_request}); waiting up to {wait_s:.0f}s for the launcher")
    while time.monotonic() < deadline:
        now = read_scale_request(rd)
        if now is not None and now.requested_s == req.requested_s and now.applied_s:
            print(f"the launcher following the run applied it: {n} rollout job(s)")
            return 0
        time.sleep(0.5)
    print(f"no launcher acknowledged in {wait_s:.0f}s (the run was launched with sbatch/submit.sh, or `hpcrl run` "
          "has exited): acting here")
    return _act_without_launcher(rd, n, Path(scripts) if scripts else SCRIPTS, by, fleet)
