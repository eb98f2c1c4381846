"""``hpcrl scale RUN --rollout-jobs N [--reward-jobs M]``: change the rollout fleet (and the reward jobs,
``reward_scale.py``) of a live run.

The command writes ``control/scale.json``; the launcher following the run (``hpcrl run``, or a Python session's
``Run``) acts on it within a poll and acknowledges it. When no launcher acknowledges within ``--wait-s`` (the run
was launched with ``sbatch/submit.sh``, or ``hpcrl run`` has exited), the command resizes the fleet itself, by
the same path (``launcher/fleet.py``: the same writers in the fleet, the same numbers for new ones, the same
writers drained): it drains by writing drain records (the jobs drain by themselves), and grows by submitting the
rollout job arrays of the new writer numbers with sbatch (:class:`SbatchArrays`, ``sbatch/rollout.sbatch``), or
prints those lines when sbatch is not on PATH.
"""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Iterator

from hpcrl.config import RunConfig
from hpcrl.control.fleet import read_scale_request, request_scale
from hpcrl.control.fleet_log import SCALE_REQUESTED, FleetLog
from hpcrl.control.records import read_trainer_done
from hpcrl.launcher.fleet import Fleet, StartError, Submitted, active_writers, submit_array
from hpcrl.launcher.reward_scale import resize_reward_jobs, sbatch_start
from hpcrl.launcher.sbatch_lines import SCRIPTS, rollout_arrays, rollout_lines
from hpcrl.launcher.submit import job_python
from hpcrl.rundir.paths import FLEET_SCALE, RunDir

"""Deadline of one ``sbatch`` submission."""


class SbatchArrays:
    """How ``hpcrl scale`` starts writers when no launcher follows the run: one rollout job array per kind of
    capacity (``launcher/sbatch_lines.py``), the array task id being the writer number. It cannot cancel a job: a
    drained one that has not started drains at once when it does."""

    kind = "sbatch"
    handles = None
    note = "no launcher follows the run"

    def __init__(self, cfg: RunConfig, rd: RunDir, scripts: Path):
        self.cfg, self.rd, self.scripts = cfg, rd, scripts

    def start(self, writer_ids: list[int]) -> Iterator[Submitted]:
        """Submit the arrays of ``writer_ids``; StartError (with the lines to submit by hand) without sbatch."""
        lines = rollout_lines(self.cfg, self.rd, self.scripts, job_python(), writer_ids)
        if shutil.which("sbatch") is None:
            raise StartError("sbatch is not on PATH: submit the new rollout jobs with\n" + "\n".join(lines))
        for ids, line in zip(rollout_arrays(self.cfg, writer_ids), lines):
            array = submit_array(line)
            for i in ids:
                yield Submitted(RunDir.writer_name(i), f"{array}_{i}", f"rollout job array {array}: {line}")

    def cancel(self, job: str) -> bool:
        """Not without a launcher (module docstring)."""
        return False

    def forget(self, job: str) -> None:
        """Nothing is followed here."""


def scale_command(run_dir: str, n: int | None, wait_s: float, scripts: str | None, reward_jobs: int | None = None
                  ) -> int:
    """The command (module docstring; ``reward_jobs``: ``launcher/reward_scale.py``); exit status 0 when the fleet
    was changed (or asked to change)."""
    rd = RunDir(run_dir)
    if n is None and reward_jobs is None:
        print("hpcrl scale: error: give --rollout-jobs N, --reward-jobs N or both", file=sys.stderr)
        return 2
    if reward_jobs is not None and reward_jobs < 1:
        print(f"hpcrl scale: error: --reward-jobs must be >= 1, got {reward_jobs}", file=sys.stderr)
        return 2
    if n is not None and n < 1:
        print(f"hpcrl scale: error: --rollout-jobs must be >= 1, got {n}; to stop the run press Ctrl-C in `hpcrl "
              "run`, or scancel its jobs", file=sys.stderr)
        return 2
    if read_trainer_done(rd) is not None:
        print(f"hpcrl scale: error: the run in {rd.root} has finished; nothing to scale", file=sys.stderr)
        return 2
    by = "hpcrl scale" + (f" --rollout-jobs {n}" if n is not None else "") + (
        f" --reward-jobs {reward_jobs}" if reward_jobs is not None else "")
    before = len(active_writers(rd, rd.load_config()))  # counted first: a launcher may apply the request at once
    req = request_scale(rd, n, by, reward_jobs)
    log = FleetLog(rd, FLEET_SCALE)
    if n is not None:
        log.record(SCALE_REQUESTED, by=by, from_jobs=before, to_jobs=n)
    deadline = time.monotonic() + wait_s
    what = " and ".join(x for x in (f"{n} rollout job(s)" if n is not None else "",
                                    f"{reward_jobs} reward job(s)" if reward_jobs is not None else "") if x)
    print(f"asked for {what} ({rd.scale_request}); waiting up to {wait_s:.0f}s for the launcher")
    while time.monotonic() < deadline:
        now = read_scale_request(rd)
        if now is not None and now.requested_s == req.requested_s and now.applied_s:
            print(f"the launcher following the run applied it: {what}")
            return 0
        time.sleep(0.5)
    print(f"no launcher acknowledged in {wait_s:.0f}s (the run was launched with sbatch/submit.sh, or `hpcrl run` "
          "has exited): acting here")
    cfg = rd.load_config()  # as the launcher may have left it
    folder = Path(scripts) if scripts else SCRIPTS
    try:
        if n is not None:
            Fleet(rd, cfg, log, print, SbatchArrays(cfg, rd, folder)).resize(n, by)
        if reward_jobs is not None:
            resize_reward_jobs(cfg, rd, reward_jobs, by, sbatch_start(cfg, rd, folder, job_python()), print)
    except (StartError, ValueError) as e:
        print(f"hpcrl scale: error: {e}", file=sys.stderr)
        return 1
    return 0
