"""Submit the trainer and rollout jobs of a run through submitit.

``executor``: ``local`` runs both jobs as local processes (submitit's
LocalExecutor), ``slurm`` submits them to Slurm, ``auto`` picks Slurm when
``srun`` is on PATH. The job functions receive only the run directory path;
everything else they read from the frozen config.

submitit pickles the submitted callables into its own folder. That folder is
kept *outside* the run directory, in a private (0700) folder of the submitting
user (``~/.hpcrl/submitit/<run name>``), so no job ever unpickles anything from the
shared run directory.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from hpcrl.config import JobResources, RunConfig
from hpcrl.launcher.jobs import JobHandle
from hpcrl.run_dir import RunDir


def resolve_executor(name: str) -> str:
    if name == "auto":
        return "slurm" if shutil.which("srun") else "local"
    if name not in ("local", "slurm"):
        raise ValueError(f"--executor {name!r}: allowed local, slurm, auto")
    return name


def submitit_folder(rd: RunDir) -> Path:
    digest = hashlib.sha256(str(rd.root).encode()).hexdigest()[:8]
    folder = Path(os.environ.get("HPCRL_SUBMITIT_DIR", Path.home() / ".hpcrl" / "submitit")) / f"{rd.root.name}-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


@dataclass
class PlannedJob:
    name: str
    function: str
    args: tuple
    resources: JobResources

    def describe(self) -> str:
        r = self.resources
        return (f"{self.name}: {self.function}{self.args} nodes={r.nodes} tasks_per_node={r.tasks_per_node} "
                f"cpus_per_task={r.cpus_per_task} gpus_per_node={r.gpus_per_node} mem_gb={r.mem_gb} "
                f"timeout_min={r.timeout_min}")


def plan_jobs(cfg: RunConfig, rd: RunDir) -> list[PlannedJob]:
    jobs = [PlannedJob(RunDir.trainer_job(), "hpcrl.trainer.main.trainer_main", (str(rd.root),),
                       cfg.resources.trainer)]
    for w in range(cfg.resources.rollout_jobs):
        jobs.append(PlannedJob(RunDir.rollout_job(RunDir.writer_name(w)), "hpcrl.rollout.main.rollout_main", (str(rd.root), w),
                               cfg.resources.rollout))
    return jobs


def slurm_parameters(job: PlannedJob) -> dict:
    """submitit's ``slurm_*`` parameters for one job (what ends up in its sbatch script)."""
    r = job.resources
    params: dict = {"slurm_job_name": job.name}
    for name in ("partition", "account", "qos", "constraint"):
        if getattr(r, name):
            params[f"slurm_{name}"] = getattr(r, name)
    if r.gpus_per_node:
        params["slurm_gpus_per_node"] = r.gpus_per_node
    extra = {k: (True if v == "" else v) for k, v in r.sbatch_extra.items()}  # True: a bare flag
    extra.setdefault("requeue", True)  # preempted or USR2'd jobs requeue themselves (scontrol requeue)
    params["slurm_additional_parameters"] = extra
    if r.setup:
        params["slurm_setup"] = list(r.setup)
    return params


def _executor(kind: str, folder: Path, job: PlannedJob):
    import submitit

    ex = submitit.AutoExecutor(folder=folder / job.name, cluster=kind)
    r = job.resources
    ex.update_parameters(name=job.name, timeout_min=r.timeout_min, nodes=r.nodes, tasks_per_node=r.tasks_per_node,
                         cpus_per_task=r.cpus_per_task, mem_gb=r.mem_gb)
    if kind == "slurm":
        ex.update_parameters(**slurm_parameters(job))
    return ex


def _function(name: str):
    from hpcrl.rollout.main import rollout_main
    from hpcrl.trainer.main import trainer_main

    return {"hpcrl.trainer.main.trainer_main": trainer_main, "hpcrl.rollout.main.rollout_main": rollout_main}[name]


def submit_one(cfg: RunConfig, rd: RunDir, kind: str, planned: PlannedJob) -> JobHandle:
    job = _executor(kind, submitit_folder(rd), planned).submit(_function(planned.function), *planned.args)
    return JobHandle(planned.name, job, kind)


def submit_jobs(cfg: RunConfig, rd: RunDir, kind: str) -> dict[str, JobHandle]:
    """Submit every planned job; return {name: JobHandle}."""
    return {p.name: submit_one(cfg, rd, kind, p) for p in plan_jobs(cfg, rd)}
