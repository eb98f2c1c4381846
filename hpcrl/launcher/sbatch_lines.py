"""Render the sbatch commands of a run for the scripts in ``sbatch/``.

One line for the trainer (``sbatch/trainer.sbatch``), one for the rollout
job array (``sbatch/rollout.sbatch``; two with ``resources.rollout_preemptible``: the floor and the
preemptible jobs) and, with ``eval.every_versions`` > 0, one
for the evaluation job (``sbatch/eval.sbatch``), with the sizes and Slurm options
of the config; ``sbatch/submit.sh`` runs them. Per-job ``setup`` lines go to
``RUN/sbatch/<role>.setup.sh``, which the scripts source.
"""
from __future__ import annotations

import shlex
from pathlib import Path

from hpcrl.config import JobResources, RunConfig
from hpcrl.rundir.fsio import write_bytes_atomic
from hpcrl.launcher.fleet import fleet_ids
from hpcrl.rundir.paths import RunDir

SCRIPTS = Path(__file__).resolve().parents[2] / "sbatch"
"""The repository's sbatch scripts (``trainer.sbatch``, ``rollout.sbatch``, ``eval.sbatch``, ``reward.sbatch``)."""


def slurm_options(r: JobResources) -> dict[str, object]:
    """The Slurm options a job's config adds to its size, as {option: value} (``""`` = a bare
    flag): GPUs, partition, account, qos, constraint, ``sbatch_extra``. Rendered here once for
    both ways in: the sbatch scripts (``--option=value``) and submitit (its additional parameters).
    """
    opts: dict[str, object] = {}
    if r.gpus_per_node:
        opts["gpus-per-node"] = r.gpus_per_node
    for name in ("partition", "account", "qos", "constraint"):
        if getattr(r, name):
            opts[name] = getattr(r, name)
    opts.update(r.sbatch_extra)
    if "no-requeue" not in opts:
        opts.setdefault("requeue", "")  # preempted or USR2'd jobs requeue themselves (scontrol requeue)
    return opts


def _options(role: str, r: JobResources, rd: RunDir, python: str) -> list[str]:
    opts = [f"--job-name=hpcrl-{role}", f"--nodes={r.nodes}", f"--ntasks-per-node={r.tasks_per_node}",
            f"--cpus-per-task={r.cpus_per_task}", f"--mem={r.mem_gb}G", f"--time={r.timeout_min}",
            f"--output={rd.slurm_log_pattern(role)}", f"--export=ALL,HPCRL_PYTHON={python}"]
    opts += [f"--{k}" if v == "" else f"--{k}={v}" for k, v in slurm_options(r).items()]
    return opts


def sbatch_lines(cfg: RunConfig, rd: RunDir, scripts: Path, python: str) -> list[str]:
    """The sbatch command lines of a run (trainer; rollout job array; the evaluation job if on)."""
    trainer = ["sbatch", "--parsable", *_options("trainer", cfg.resources.trainer, rd, python),
               str(scripts / "trainer.sbatch"), str(rd.root)]
    lines = [shlex.join(trainer), *rollout_lines(cfg, rd, scripts, python, fleet_ids(rd, cfg.resources.rollout_jobs))]
    if cfg.eval.enabled:
        lines.append(shlex.join(["sbatch", "--parsable", *_options("eval", cfg.resources.eval, rd, python),
                                 str(scripts / "eval.sbatch"), str(rd.root)]))
    if reward_jobs(cfg):
        lines.append(reward_line(cfg, rd, scripts, python, list(range(reward_jobs(cfg)))))
    return lines


def reward_line(cfg: RunConfig, rd: RunDir, scripts: Path, python: str, ids: list[int]) -> str:
    """The sbatch command of a reward job array of these indices (the array task id is the job's index)."""
    return shlex.join(["sbatch", "--parsable", f"--array={','.join(map(str, ids))}",
                       *_options("reward", cfg.resources.reward, rd, python), str(scripts / "reward.sbatch"),
                       str(rd.root)])


def reward_jobs(cfg: RunConfig) -> int:
    """How many reward jobs the run submits (``resources.reward_jobs`` with ``reward_model.placement: job``)."""
    rm = cfg.reward_model
    return cfg.resources.reward_jobs if rm.enable and rm.placement == "job" else 0


def rollout_arrays(cfg: RunConfig, writer_ids: list[int]) -> list[list[int]]:
    """``writer_ids`` split into one job array per kind of capacity (``resources.rollout``, and
    ``resources.rollout_preemptible`` from its floor on), in order."""
    kinds: dict[str, list[int]] = {}
    for i in writer_ids:
        kinds.setdefault(repr(cfg.resources.rollout_for(i)), []).append(i)
    return list(kinds.values())


def rollout_lines(cfg: RunConfig, rd: RunDir, scripts: Path, python: str, writer_ids: list[int]) -> list[str]:
    """The sbatch commands of the rollout job arrays for these writer numbers (the array task id is the writer
    number: ``0-3`` at launch, ``4,5`` when ``hpcrl scale`` grows the fleet), one per :func:`rollout_arrays`."""
    lines = []
    for ids in rollout_arrays(cfg, writer_ids):
        contiguous = ids == list(range(ids[0], ids[0] + len(ids)))
        array = f"{ids[0]}-{ids[-1]}" if contiguous else ",".join(map(str, ids))
        lines.append(shlex.join(["sbatch", "--parsable", f"--array={array}",
                                 *_options("rollout", cfg.resources.rollout_for(ids[0]), rd, python),
                                 str(scripts / "rollout.sbatch"), str(rd.root)]))
    return lines


def test_only_argv(cfg: RunConfig, rd: RunDir, python: str, writer_id: int) -> list[str]:
    """``sbatch --test-only`` with the options of rollout job ``writer_id``: Slurm's estimate of when it would
    start, nothing submitted (the autoscaler's queue check, ``launcher/autoscale.py``)."""
    argv = shlex.split(rollout_lines(cfg, rd, SCRIPTS, python, [writer_id])[0])
    argv[argv.index("--parsable")] = "--test-only"
    return argv


def write_setup_files(cfg: RunConfig, rd: RunDir) -> None:
    """``RUN/sbatch/<role>.setup.sh`` from ``resources.<role>.setup`` (sourced by the scripts)."""
    rd.sbatch_dir.mkdir(exist_ok=True)
    for role, r in (("trainer", cfg.resources.trainer), ("rollout", cfg.resources.rollout),
                    ("eval", cfg.resources.eval), ("reward", cfg.resources.reward)):
        body = "# written by hpcrl from resources.%s.setup\n%s\n" % (role, "\n".join(r.setup))
        write_bytes_atomic(rd.sbatch_setup(role), body.encode())
