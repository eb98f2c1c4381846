"""Submit the jobs of a run through submitit: the trainer, the rollout jobs, with ``eval.every_versions`` > 0 the
evaluation job, and with ``reward_model.placement: job`` the reward jobs.

``executor``: ``local`` runs both jobs as local processes (submitit's
LocalExecutor), ``slurm`` submits them to Slurm, ``auto`` picks Slurm when
``srun`` is on PATH. The job functions receive only the run directory path;
everything else they read from the frozen config.

submitit pickles the submitted callables into its own folder. That folder is
kept *outside* the run directory, in a private (0700) folder of the submitting
user (``~/.hpcrl/submitit/<run name>``), so no job ever unpickles anything from the
shared run directory.

:class:`LauncherJobs` holds the jobs a launcher follows (plans, handles, restarts) and is the way the launcher's
fleet starts and cancels rollout jobs (``launcher/fleet.py``).
"""
from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from hpcrl.config import JobResources, RunConfig
from hpcrl.control.fleet_log import SUBMITTED, FleetLog
from hpcrl.control.records import HeartbeatState, read_heartbeats
from hpcrl.launcher.fleet import StartError, Submitted, fleet_ids
from hpcrl.launcher.jobs import KILL_WAIT_S, JobHandle, SlurmQueue
from hpcrl.launcher.sbatch_lines import reward_jobs, slurm_options
from hpcrl.process.leftovers import MARK_ENV, job_mark
from hpcrl.rundir.paths import EVAL_JOB, RunDir


GONE_MARGIN_S = 30.0
"""Seconds past :data:`~hpcrl.launcher.jobs.KILL_WAIT_S` that :meth:`LauncherJobs.end_all` waits for a cancelled job
to be gone (a Slurm epilog, a slow ``squeue``) before it names the jobs still there and returns."""


SLURM_COMMANDS = ("sbatch", "squeue", "scancel")
"""What the launcher runs to submit and follow jobs on Slurm."""


def missing_slurm_commands() -> list[str]:
    """The Slurm commands the launcher needs that are not on PATH (all of them off a login node)."""
    return [c for c in SLURM_COMMANDS if shutil.which(c) is None]


def resolve_executor(name: str) -> str:
    """``local`` or ``slurm`` for ``--executor`` (``auto``: Slurm when ``srun`` is on PATH)."""
    if name == "auto":
        return "slurm" if shutil.which("srun") else "local"
    if name not in ("local", "slurm"):
        raise ValueError(f"--executor {name!r}: allowed local, slurm, auto")
    if name == "slurm":
        missing = missing_slurm_commands()
        if missing:
            raise ValueError(f"--executor slurm: {', '.join(missing)} not found on PATH (this is not a Slurm login "
                             "node, or Slurm's module is not loaded); use --executor local, or run on a login node "
                             "(--dry-run shows what would be submitted anywhere)")
    return name


JOB_PYTHON_ENV = "HPCRL_PYTHON"
"""When set, the Python every job runs (a path: another environment's interpreter, or a script that starts one in a
container), local or on Slurm; else the launcher's own. The sbatch scripts read the same variable."""


def job_python() -> str:
    """The Python the jobs run: ``HPCRL_PYTHON`` when set, else this one."""
    return os.environ.get(JOB_PYTHON_ENV) or sys.executable


def submitit_folder(rd: RunDir) -> Path:
    """submitit's private folder for this run, outside the run directory (its pickles stay there)."""
    digest = hashlib.sha256(str(rd.root).encode()).hexdigest()[:8]
    folder = Path(os.environ.get("HPCRL_SUBMITIT_DIR", Path.home() / ".hpcrl" / "submitit")) / f"{rd.root.name}-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


@dataclass
class PlannedJob:
    """One job of a run as planned before submission (the same plan is resubmitted on restart)."""

    name: str
    """Job name from RunDir (``trainer``, ``rollout-w000``)."""
    function: str
    """Dotted name of the job's entry function."""
    args: tuple
    """Its arguments: the run directory (and the writer rank)."""
    resources: JobResources

    def describe(self) -> str:
        r = self.resources
        return (f"{self.name}: {self.function}{self.args} nodes={r.nodes} tasks_per_node={r.tasks_per_node} "
                f"cpus_per_task={r.cpus_per_task} gpus_per_node={r.gpus_per_node} mem_gb={r.mem_gb} "
                f"timeout_min={r.timeout_min}")


def plan_rollout(cfg: RunConfig, rd: RunDir, writer_id: int) -> PlannedJob:
    """The rollout job of writer number ``writer_id``."""
    return PlannedJob(RunDir.rollout_job(RunDir.writer_name(writer_id)), "hpcrl.rollout.main.rollout_main",
                      (str(rd.root), writer_id), cfg.resources.rollout_for(writer_id))


def plan_jobs(cfg: RunConfig, rd: RunDir) -> list[PlannedJob]:
    """The trainer, one rollout job per writer of the fleet (``launcher/fleet.py``: ``0..rollout_jobs-1`` for a new
    run), the evaluation job (if on) and the reward jobs (``reward_model.placement: job``), with their resources."""
    jobs = [PlannedJob(RunDir.trainer_job(), "hpcrl.trainer.main.trainer_main", (str(rd.root),),
                       cfg.resources.trainer)]
    jobs += [plan_rollout(cfg, rd, w) for w in fleet_ids(rd, cfg.resources.rollout_jobs)]
    if cfg.eval.enabled:
        jobs.append(PlannedJob(EVAL_JOB, "hpcrl.eval.job.eval_main", (str(rd.root),), cfg.resources.eval))
    jobs += [plan_reward(cfg, rd, i) for i in range(reward_jobs(cfg))]
    return jobs


def plan_reward(cfg: RunConfig, rd: RunDir, index: int) -> PlannedJob:
    """Reward job ``index`` (``reward_model.placement: job``)."""
    return PlannedJob(RunDir.reward_job(index), "hpcrl.reward.job.reward_main", (str(rd.root), index),
                      cfg.resources.reward)


def slurm_parameters(job: PlannedJob) -> dict:
    """submitit's ``slurm_*`` parameters for one job: the same options the sbatch scripts get
    (:func:`hpcrl.launcher.sbatch_lines.slurm_options`), plus the job name, the setup lines, the job's mark
    (the next attempt on a node ends this one's leftovers by it: ``process/leftovers.py``) and
    ``srun --kill-on-bad-exit=1``: a rank that dies ends the others at once instead of leaving them in a
    collective until the time limit."""
    r = job.resources
    extra = {k: (True if v == "" else v) for k, v in slurm_options(r).items()}  # True: a bare flag
    mark = shlex.quote(job_mark(Path(job.args[0]), job.name))
    return {"slurm_job_name": job.name, "slurm_additional_parameters": extra,
            "slurm_setup": [*r.setup, f"export {MARK_ENV}={mark}"], "slurm_srun_args": ["--kill-on-bad-exit=1"]}


def _executor(kind: str, folder: Path, job: PlannedJob):
    import submitit

    ex = submitit.AutoExecutor(folder=folder / job.name, cluster=kind, **{f"{kind}_python": shlex.quote(job_python())})
    r = job.resources
    # gpus_per_node through submitit's generic parameter: Slurm gets --gpus-per-node, the local
    # executor sets CUDA_VISIBLE_DEVICES from it (without it a local job sees no GPU)
    ex.update_parameters(name=job.name, timeout_min=r.timeout_min, nodes=r.nodes, tasks_per_node=r.tasks_per_node,
                         cpus_per_task=r.cpus_per_task, mem_gb=r.mem_gb, gpus_per_node=r.gpus_per_node)
    if kind == "slurm":
        ex.update_parameters(**slurm_parameters(job))
    return ex


def _function(name: str):
    from hpcrl.eval.job import eval_main
    from hpcrl.reward.job import reward_main
    from hpcrl.rollout.main import rollout_main
    from hpcrl.trainer.main import trainer_main

    return {"hpcrl.trainer.main.trainer_main": trainer_main, "hpcrl.rollout.main.rollout_main": rollout_main,
            "hpcrl.eval.job.eval_main": eval_main, "hpcrl.reward.job.reward_main": reward_main}[name]


@contextmanager
def _sigint_ignored(kind: str) -> Iterator[None]:
    """Local jobs are children of the launcher, in its terminal's process group: Ctrl-C would
    reach them and submitit's controllers would print KeyboardInterrupt tracebacks. They are started
    with SIGINT blocked (the mask is inherited across fork and exec), so they leave Ctrl-C to the
    launcher, which stops them. A Ctrl-C meanwhile is recorded, not lost, and handed to the launcher's
    own handler once the job is started."""
    if kind != "local" or threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # one pending here is recorded now
        signal.signal(signal.SIGINT, old)
        if pressed:
            signal.raise_signal(signal.SIGINT)


def submit_one(rd: RunDir, kind: str, planned: PlannedJob) -> JobHandle:
    """Submit one planned job (first submission or a restart)."""
    with _sigint_ignored(kind):
        job = _executor(kind, submitit_folder(rd), planned).submit(_function(planned.function), *planned.args)
    return JobHandle(planned.name, job, kind)


class LauncherJobs:
    """The jobs a launcher follows, by name: each one's plan (what a resubmission submits again), its handle and its
    restarts; the :class:`~hpcrl.launcher.fleet.Starter` of the launcher's fleet (one submitit job per writer).
    ``submit`` submits one planned job (:func:`submit_one`; a test may start something lighter)."""

    note = ""

    def __init__(self, cfg: RunConfig, rd: RunDir, kind: str,
                 submit: Callable[[RunDir, str, PlannedJob], JobHandle] = submit_one):
        self.cfg, self.rd, self.kind = cfg, rd, kind
        self.planned: dict[str, PlannedJob] = {}
        self.handles: dict[str, JobHandle] = {}
        """The jobs followed now (a rollout job that left the fleet, an evaluation job given up: no more)."""
        self.restarts: dict[str, int] = {}
        self._submit = submit
        self.queue = SlurmQueue()
        """Every Slurm job of this launcher is asked about in one ``squeue`` (``launcher/jobs.py``)."""

    def submit_all(self, planned: list[PlannedJob], log: FleetLog, by: str) -> None:
        """Submit every planned job, each a ``submitted`` event in ``log``. If one submission fails, the jobs
        already submitted are cancelled before the error is raised (all or nothing)."""
        try:
            for p in planned:
                self.submit(p)
        except BaseException:
            self.cancel_all()
            raise
        for name, handle in self.handles.items():
            log.record(SUBMITTED, job=name, writer=RunDir.writer_of_job(name) or "", job_id=handle.job_id, by=by)

    def submit(self, planned: PlannedJob) -> JobHandle:
        """Submit one planned job and follow it."""
        self.planned[planned.name] = planned
        return self._follow(planned.name, self._submit(self.rd, self.kind, planned))

    def resubmit(self, name: str) -> JobHandle:
        """Submit job ``name`` again, as planned (a restart)."""
        self.restarts[name] = self.restarts.get(name, 0) + 1
        return self._follow(name, self._submit(self.rd, self.kind, self.planned[name]))

    def _follow(self, name: str, handle: JobHandle) -> JobHandle:
        """Follow ``handle`` as job ``name``, its state asked in this launcher's one ``squeue``."""
        handle.queue = self.queue
        if handle.kind == "slurm":
            self.queue.add(handle.job_id)
        self.handles[name] = handle
        return handle

    def start(self, writer_ids: list[int]) -> Iterator[Submitted]:
        """New writers' rollout jobs, one submitit job each (the fleet's ``Starter``); StartError when the
        executor refuses one."""
        for i in writer_ids:
            planned = plan_rollout(self.cfg, self.rd, i)
            try:
                handle = self.submit(planned)
            except Exception as e:  # submitit's FailedSubmissionError, sbatch's refusal, an OSError
                raise StartError(f"{planned.name} could not be submitted ({type(e).__name__}: {e})") from e
            yield Submitted(RunDir.writer_name(i), handle.job_id)

    def start_reward(self, indices: list[int]) -> list[str]:
        """Submit the reward jobs of these indices (``hpcrl scale --reward-jobs``), followed like the others; their
        job ids."""
        return [self.submit(plan_reward(self.cfg, self.rd, i)).job_id for i in indices]

    def cancel(self, job: str) -> bool:
        """Cancel ``job`` (SIGTERM / scancel); it is still followed until it ends."""
        self.handles[job].cancel()
        return True

    def forget(self, job: str) -> None:
        """Follow ``job`` no more."""
        del self.handles[job]

    def cancel_all(self) -> None:
        """Cancel every job still queued or running (``Run.cancel`` may call this while the follower runs)."""
        for handle in list(self.handles.values()):
            if not handle.done():
                handle.cancel()

    def end_all(self, grace_s: float, say: Callable[[str], None], names: Optional[Iterable[str]] = None) -> bool:
        """End the jobs ``names`` (default: every job followed) and wait until they are gone, so that none outlives
        the launcher that gives up on it. A job ends by itself at its next safe point once the run directory says
        so (a stop request, the trainer's end, a fatal record: ``control/job.py``); one with no heartbeat yet or
        still starting has nothing to save and is cancelled at once, the others get ``grace_s``. Whatever is left
        then is cancelled (SIGTERM / scancel) and waited for: a local job still running :data:`KILL_WAIT_S` later is
        SIGKILLed (``JobHandle.done``), Slurm does the same after its KillWait. The jobs still there
        :data:`GONE_MARGIN_S` after that are named, with their ids, and left. True when every job ended by
        itself."""
        jobs = {n: self.handles[n] for n in (list(self.handles) if names is None else names) if n in self.handles}
        cancelled: set[str] = set()
        if grace_s > 0:
            left = self._wait_gone(jobs, grace_s, say, cancelled)
            if left:
                say(f"{', '.join(left)} still running {grace_s:.0f}s after being asked to stop: cancelled")
        else:
            left = [n for n, job in jobs.items() if not job.done()]
        ended_alone = not left and not cancelled
        if left:
            for name in left:
                jobs[name].cancel()
            left = self._wait_gone({n: jobs[n] for n in left}, KILL_WAIT_S + GONE_MARGIN_S, say)
        if left:
            say(f"{', '.join(f'{n} ({jobs[n].job_id})' for n in left)} still not gone "
                f"{KILL_WAIT_S + GONE_MARGIN_S:.0f}s after the cancel; end them by hand "
                f"({'scancel JOB_ID' if self.kind == 'slurm' else 'kill -9 their processes'})")
        return ended_alone

    def _wait_gone(self, jobs: dict[str, JobHandle], wait_s: float, say: Callable[[str], None],
                   cancelled: Optional[set[str]] = None) -> list[str]:
        """Wait up to ``wait_s`` until every job in ``jobs`` is gone, saying once which it waits for; the jobs
        still there. With ``cancelled``: cancel each job with no heartbeat yet or still starting (nothing to save),
        said, and add it. A job found gone is not asked again (on Slurm each question is an ``squeue``)."""
        end = time.monotonic() + wait_s
        left = [n for n, job in jobs.items() if not job.done()]
        if left:
            say(f"waiting up to {wait_s:.0f}s for {', '.join(left)} to end")
        while left and time.monotonic() < end:
            if cancelled is not None:
                self._cancel_unstarted({n: jobs[n] for n in left}, cancelled, say)
            time.sleep(0.5 if self.kind == "local" else 2.0)
            left = [n for n in left if not jobs[n].done()]
        return left

    def _cancel_unstarted(self, jobs: dict[str, JobHandle], cancelled: set[str], say: Callable[[str], None]) -> None:
        """Cancel the jobs with no heartbeat yet or still starting, each said once; add them to ``cancelled``."""
        beats = read_heartbeats(self.rd)
        for name, job in jobs.items():
            beat = beats.get(name)
            if name in cancelled or (beat is not None and beat.state != HeartbeatState.STARTING):
                continue
            say(f"{name}: {'no heartbeat yet' if beat is None else 'starting: ' + beat.step}; nothing to save, "
                "cancelled")
            job.cancel()
            cancelled.add(name)
