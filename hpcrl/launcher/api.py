"""Launch and follow a run from a login-node Python session.

    import hpcrl
    run = hpcrl.launch("configs/tiny.yaml", run_dir="/scratch/me/run1", executor="slurm",
                       overrides=["async_training.staleness_threshold=0.5"])
    run.status()            # {"finished": False, "jobs": {"trainer": {...}, "rollout-w000": {...}}, ...}
    run.scale(4)            # four rollout jobs from now on (new ones join; the newest drain when shrinking)
    run.wait(timeout_s=3600)  # True when the trainer finished; resubmits dead jobs meanwhile
    run.stop(wait_s=300)      # the trainer checkpoints, the rollout jobs seal; resume with --resume
    run.cancel()              # SIGTERM / scancel now (the trainer resumes from its last checkpoint)

Everything is checked before anything is submitted (ConfigError otherwise).
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from hpcrl.config import ConfigError, RunConfig, given_keys, load_config
from hpcrl.config.checks import collecting, report
from hpcrl.control.fatal import read_fatal_record
from hpcrl.control.fleet_log import FleetLog
from hpcrl.control.records import read_heartbeats, read_trainer_done, request_stop
from hpcrl.launcher.autoscale import Autoscaler
from hpcrl.launcher.fleet import Fleet
from hpcrl.launcher.follow import RunFollower
from hpcrl.launcher.inputs import check_inputs, derive_total_steps
from hpcrl.launcher.prepare import check_run_dir, occupied_message, prepare_run_dir
from hpcrl.launcher.progress import Console
from hpcrl.launcher.resume_changes import change_lines, check_changes, finished_message
from hpcrl.launcher.submit import LauncherJobs, PlannedJob, missing_slurm_commands, plan_jobs, resolve_executor
from hpcrl.rundir.paths import FLEET_LAUNCHER, RunDir

log = logging.getLogger(__name__)


@dataclass
class RunPlan:
    """A run checked and planned, before anything is created or submitted: the config is
    validated once here, the jobs are planned once, and both are passed down from here."""

    cfg: RunConfig
    rd: RunDir
    kind: str
    """Executor: ``local`` or ``slurm``."""
    jobs: list[PlannedJob]
    notes: list[str] = field(default_factory=list)
    """How verl's keys were read, what the input checks found (prompt counts, the reward), for the user to read."""
    changes: list[str] = field(default_factory=list)
    """``--resume``: the keys it changes (``reward.path: 'a.py' -> 'b.py'``), for the frozen config's history."""
    finished: Optional[str] = None
    """``--resume`` of a finished run: the line saying so (nothing is submitted)."""


def _load(config, rd: RunDir, overrides: Sequence[str], resume: bool, notes: list[str]) -> tuple[RunConfig, set[str]]:
    """The config to run and the keys given explicitly (with ``resume`` and no CONFIG: the frozen config plus
    the overrides, which alone count as given)."""
    if isinstance(config, RunConfig):
        return config.validate(), set()
    if config is None and resume:
        return load_config(rd.config_path, list(overrides), notes), given_keys(None, list(overrides))
    if config is None and not overrides:
        raise ConfigError("no CONFIG given: pass a config file (e.g. configs/tiny.yaml) before --run-dir, "
                          "or --resume to continue the run in --run-dir")
    return load_config(config, list(overrides), notes), given_keys(config, list(overrides))


def plan_run(config: Optional[os.PathLike | str | RunConfig], run_dir: os.PathLike | str, executor: str = "auto",
             overrides: Sequence[str] = (), resume: bool = False, dry_run: bool = False) -> RunPlan:
    """Check the config (a file + overrides, a RunConfig, or with ``resume`` and no config the frozen one
    plus the overrides) and plan the jobs; check the model, data, reward and GPUs (:mod:`hpcrl.launcher.inputs`,
    every problem at once), that the run directory can be written and is free (or, with ``resume``, holds a run)
    and, with ``resume``, that only what may change on a live run changes (:mod:`hpcrl.launcher.resume_changes`). Raises
    ConfigError / ValueError; creates nothing. ``--dry-run`` (``dry_run``: Slurm's commands need not be here, a
    note says so) and the real run both come through here."""
    rd = RunDir(run_dir)
    if resume and not rd.config_path.exists():
        raise ConfigError(f"--resume: {rd.root} holds no run (no config.yaml)")
    notes: list[str] = []
    with collecting():  # the config's problems, the executor's and the inputs' in one pass (one line each)
        cfg, given = _load(config, rd, overrides, resume, notes)
        if resume and cfg.model.base_hash is None:  # written at launch (a LoRA run); checked again by prepare_run_dir
            cfg.model.base_hash = rd.load_config().model.base_hash
        try:
            check_run_dir(rd)
        except ConfigError as e:
            report(e)
        if rd.config_path.exists() and not resume:
            report(ConfigError(occupied_message(rd, cfg)))
        try:
            kind = resolve_executor(executor)
        except ValueError as e:
            kind = executor
            if dry_run and executor == "slurm":
                notes.append(f"Slurm's {', '.join(missing_slurm_commands())} are not on PATH here (not a Slurm login "
                             "node, or its module is not loaded): a real run needs them; shown is what it would submit")
            else:
                report(ConfigError(str(e)))
        if resume:
            finished = finished_message(read_trainer_done(rd), cfg, str(rd.root))
            if finished is not None and not overrides and config is None:
                return RunPlan(cfg, rd, kind, [], notes, finished=finished)
        found = check_inputs(cfg, kind)
    if not resume or "data.epochs" in given:
        derived = derive_total_steps(cfg, found.prompts, "rollout.total_rollout_steps" in given)
        found.lines += [derived] if derived else []
    changes: list[str] = []
    if resume:
        fatal = read_fatal_record(rd)
        changes = change_lines(check_changes(rd.load_config(), cfg, fatal), fatal)
        finished = finished_message(read_trainer_done(rd), cfg, str(rd.root))
        if finished is not None:
            return RunPlan(cfg, rd, kind, [], notes + found.lines, finished=finished)
    return RunPlan(cfg, rd, kind, plan_jobs(cfg, rd), notes + found.lines, changes)


class RunHandle:
    """A submitted run: its jobs (``launcher/submit.py``), its rollout fleet (``launcher/fleet.py``), the console
    and the follower that resubmits dead jobs; each is built here and handed to those that use it, none calls
    this back."""

    def __init__(self, plan: RunPlan, emit: Callable[[str], None], resume: bool = False, bar: bool = False):
        self.cfg, self.rd, self.kind = plan.cfg, plan.rd, plan.kind
        self.console = Console(plan.rd, plan.cfg, emit, resume, bar)
        say = self.console.say
        self.launched = LauncherJobs(plan.cfg, plan.rd, plan.kind)
        """Every job followed, with its plan (a resubmission submits it again) and restarts."""
        self.fleet = Fleet(plan.rd, plan.cfg, FleetLog(plan.rd, FLEET_LAUNCHER), say, self.launched)
        """The rollout fleet: ``Run.scale``, ``hpcrl scale`` and autoscale resize it through here."""
        if resume:
            keep = [p.args[1] for p in plan.jobs if RunDir.writer_of_job(p.name) is not None]
            for w in self.fleet.retire(keep, "hpcrl run --resume with a smaller fleet"):
                say(f"{w} is not in the resumed fleet of {len(keep)}: drained, its prompt claims handed back")
        self.launched.submit_all(plan.jobs, self.fleet.log, "hpcrl run --resume" if resume else "hpcrl run")
        scaling = plan.cfg.resources.rollout_autoscale
        autoscaler = Autoscaler(self.fleet, scaling) if scaling.enabled else None
        self.follower = RunFollower(plan.rd, plan.cfg, self.launched, self.fleet, self.console, say, resume,
                                    autoscaler)

    def scale(self, rollout_jobs: int, by: str = "Run.scale") -> list[str]:
        """Grow the fleet to ``rollout_jobs`` rollout jobs (new writers, which take the newest weights and claim
        prompts like the others) or shrink it (the newest drain); the frozen config follows (``launcher/fleet.py``,
        the path ``hpcrl scale`` and autoscale take). Returns the names of the jobs submitted or asked to drain."""
        return self.fleet.resize(rollout_jobs, by)

    @property
    def jobs(self) -> dict:
        """The jobs followed now, by name (``JobHandle``)."""
        return self.launched.handles

    def status(self) -> dict:
        """Each job's scheduler state and heartbeat, and whether the trainer finished."""
        now = time.time()
        beats = read_heartbeats(self.rd)
        jobs = {}
        for name, handle in self.jobs.items():
            beat = beats.get(name)
            jobs[name] = {"job_id": handle.job_id, "state": handle.state(),
                          "heartbeat_age_s": beat.age_s(now) if beat else None,
                          "job_state": beat.state if beat else None,
                          "param_version": beat.param_version if beat else None,
                          "stats": beat.stats.to_json() if beat else {},
                          "restarts": self.launched.restarts.get(name, 0)}
        return {"run_dir": str(self.rd.root), "finished": read_trainer_done(self.rd) is not None, "jobs": jobs}

    def wait(self, timeout_s: float, poll_s: float = 1.0) -> bool:
        """Follow until the trainer finishes (True) or a job fails for good / the timeout passes (False;
        the jobs are then cancelled)."""
        return self.follower.follow(timeout_s, poll_s) == 0

    def stop(self, wait_s: float, by: str = "hpcrl run: Ctrl-C") -> bool:
        """Ask every job to stop at its next safe point (``control/stop.json``): the trainer finishes its update and
        checkpoints it, a rollout job seals its complete groups, so a resume redoes nothing. A job still queued
        or starting has nothing to save and is cancelled at once; after ``wait_s`` whatever is left is cancelled
        and waited for (``LauncherJobs.end_all``). True when every job stopped by itself."""
        request_stop(self.rd, by)
        clean = self.launched.end_all(wait_s, self.console.say)
        self.console.close()
        return clean

    def cancel(self, wait_s: float = 0.0) -> bool:
        """Cancel every job of the run that is still queued or running; wait up to ``wait_s``
        for them to end. True when every job has ended."""
        self.launched.cancel_all()
        end = time.monotonic() + wait_s
        while not all(j.done() for j in self.jobs.values()):
            if time.monotonic() > end:
                return False
            time.sleep(0.5)
        return True


def launch(config: Optional[os.PathLike | str | RunConfig | RunPlan], run_dir: Optional[os.PathLike | str] = None,
           executor: str = "auto", overrides: Sequence[str] = (), resume: bool = False,
           emit: Optional[Callable[[str], None]] = None, bar: bool = False) -> RunHandle:
    """Check the config, prepare the run directory, submit the trainer, the rollout jobs and (``eval.every_versions``
    > 0) the evaluation job.

    ``config`` may also be a :class:`RunPlan` from :func:`plan_run` (the CLI checks first,
    then launches what it checked); then ``run_dir``, ``executor`` and ``overrides`` are its own.
    """
    plan = config if isinstance(config, RunPlan) else plan_run(config, run_dir, executor, overrides, resume)
    if plan.finished is not None:
        raise ConfigError(plan.finished)
    fresh = not plan.rd.root.exists()
    prepare_run_dir(plan.cfg, plan.rd.root, resume, inputs_checked=True, changes=tuple(plan.changes))
    try:
        return RunHandle(plan, emit or (lambda line: log.info("%s", line)), resume, bar)
    except BaseException:
        if fresh:  # nothing was submitted: leave nothing behind, so the same command can be retried
            shutil.rmtree(plan.rd.root, ignore_errors=True)
        raise
