"""``hpcrl run CONFIG [key=value ...] --run-dir DIR``: check everything, launch (or resume) the run and follow it,
what it prints, and how Ctrl-C and SIGTERM stop it (the parser and the exit statuses: :data:`RUN_DESCRIPTION`).
The checks and the launch are :mod:`hpcrl.launcher.api`'s; the lines printed while the run goes are
:mod:`hpcrl.launcher.progress`'s."""
from __future__ import annotations

import signal
import sys
import threading

from hpcrl.config import ConfigError, dump_config

RUN_DESCRIPTION = (
    "Check everything before anything is created (the config, the model, data and reward, the GPUs, the run "
    "directory: every problem in one pass), prepare RUN_DIR, submit the trainer, the rollout jobs and the evaluation "
    "job, and follow them until the trainer finishes. Every config key, its default and meaning: "
    "docs/config-reference.md. Ctrl-C (or SIGTERM) asks the jobs to stop at their next safe point: the trainer "
    "checkpoints its last update, so `hpcrl run --resume --run-dir RUN_DIR` redoes nothing; a second Ctrl-C cancels "
    "at once. Exit 0: finished (or a dry run); 1: a job failed for good or --timeout-min passed; 2: bad input, "
    "nothing created or submitted; 130: stopped by Ctrl-C.")


def add_run_arguments(r) -> None:
    """The options of ``hpcrl run`` (an argparse parser)."""
    r.add_argument("config", nargs="?", help="YAML config, e.g. configs/tiny.yaml (omit with --resume)")
    r.add_argument("overrides", nargs="*", help="dotted overrides, e.g. async_training.staleness_threshold=0.5")
    r.add_argument("--run-dir", required=True, help="run directory on the shared filesystem")
    r.add_argument("--executor", default="auto", help="local (processes here), slurm (sbatch through submitit) or auto "
                                                      "(default: slurm when srun is on PATH, else local)")
    r.add_argument("--dry-run", action="store_true", help="check everything and print what would be submitted (with "
                                                          "--executor slurm also its sbatch lines, even where Slurm "
                                                          "is missing)")
    r.add_argument("--resume", action="store_true", help="continue the run already in --run-dir")
    r.add_argument("--timeout-min", type=float, default=None,
                   help="give up following after this long (default: resources.trainer.timeout_min)")


def cmd_run(a) -> int:
    """``hpcrl run``'s exit status (module docstring); prints as it goes."""
    from hpcrl.launcher.api import launch, plan_run
    from hpcrl.launcher.input_warnings import WARNING

    try:
        plan = plan_run(a.config, a.run_dir, a.executor, a.overrides, a.resume, dry_run=a.dry_run)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        return print_problems("hpcrl", e)
    cfg, kind = plan.cfg, plan.kind
    warnings = [n for n in plan.notes if n.startswith(WARNING)]
    plan.notes = [n for n in plan.notes if not n.startswith(WARNING)]
    if plan.finished is not None:
        print(plan.finished)
        return 0
    if a.dry_run:
        print(f"# executor: {kind}; run directory: {plan.rd.root}")
        print(f"# R={cfg.groups_per_update} groups per update, K={cfg.async_training.trigger_parameter_sync_step}, "
              f"budget B={cfg.admission_budget} groups per version, {cfg.total_updates} updates, "
              f"max lag bound {cfg.max_lag_bound}")
        for note in plan.notes:
            print(f"# {note}")
        for change in plan.changes:
            print(f"# --resume changes {change}")
        for job in plan.jobs:
            print("would submit " + job.describe())
        if kind == "slurm":
            _print_sbatch_lines(cfg, plan.rd)
        print("# resolved config:")
        print(dump_config(cfg), end="")
        print_warnings(warnings)
        return 0
    for note in plan.notes:
        print(note)
    print_warnings(warnings)
    for change in plan.changes:
        print(f"--resume changes {change} (recorded at the top of {plan.rd.config_path})")
    old_term = signal.signal(signal.SIGTERM, _interrupt) if threading.current_thread() is threading.main_thread() else None
    try:
        return _follow(a, plan, cfg, kind, launch)
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _print_sbatch_lines(cfg, rd) -> None:
    """The same jobs as plain sbatch commands (what ``sbatch/submit.sh CONFIG RUN_DIR`` submits once it has
    prepared RUN_DIR), for a dry run of ``--executor slurm``, with Slurm on PATH or not."""
    from hpcrl.launcher.sbatch_lines import SCRIPTS, sbatch_lines
    from hpcrl.launcher.submit import job_python

    print("# the same jobs with plain sbatch (sbatch/submit.sh CONFIG RUN_DIR prepares RUN_DIR, then runs these):")
    for line in sbatch_lines(cfg, rd, SCRIPTS, job_python()):
        print(line)


def print_problems(prog: str, e: BaseException) -> int:
    """Every problem of a check that found some (one line each, one pass: ``config/checks.py``), on stderr; 2."""
    problems = str(e).splitlines() or [type(e).__name__]
    for line in problems:
        print(f"{prog}: error: {line}", file=sys.stderr)
    if len(problems) > 1:
        print(f"{prog}: {len(problems)} problems, found in one pass; nothing was created or submitted", file=sys.stderr)
    return 2


def print_warnings(warnings: list[str]) -> None:
    """The input checks' warnings (hpcrl/launcher/input_warnings.py), last and on stderr, so that neither the
    resolved config nor the run's lines hide them."""
    for w in warnings:
        print(f"hpcrl: {w}", file=sys.stderr)
    if warnings:
        print(f"hpcrl: {len(warnings)} warning(s) above: the run may start, but check them first", file=sys.stderr)


def _interrupt(signum, frame) -> None:
    """SIGTERM to ``hpcrl run`` (a closed session, ``kill``) stops the run as Ctrl-C does."""
    raise KeyboardInterrupt


def _hold_sigint():
    """Record a Ctrl-C while the jobs are submitted instead of raising it there (half-submitted jobs would be
    left to themselves); :func:`_release_sigint` raises it once they are known, so that it stops them. The
    recorded presses, or None where this thread cannot (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    pressed: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    return pressed


def _release_sigint(held) -> None:
    """Ctrl-C raises KeyboardInterrupt again; one pressed while held is raised here."""
    if held is None:
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


def _follow(a, plan, cfg, kind, launch) -> int:
    held = _hold_sigint()
    try:
        run = launch(plan, resume=a.resume, emit=lambda line: print(line, flush=True), bar=sys.stdout.isatty())
    except (ConfigError, ValueError, OSError) as e:  # submission refused: nothing is left behind
        _release_sigint(held)
        print(f"hpcrl: error: {e}", file=sys.stderr)
        return 2
    except BaseException:
        _release_sigint(held)
        raise
    print(f"submitted ({kind}): " + ", ".join(f"{n}={j.job_id}" for n, j in run.jobs.items()) + f"; run dir {run.rd.root}",
          flush=True)
    if cfg.is_sizing_probe:
        print("SIZING PROBE: the simulated engine feeds the real trainer random responses of the model's vocabulary "
              f"at simulated.lengths ({cfg.simulated.lengths}); the trainer's memory (perf/*) and update seconds are "
              "real, nothing learns; then: hpcrl plan CONFIG --probe RUN", flush=True)
    elif cfg.is_simulated:
        print(f"SIMULATED run ({'engine and trainer' if cfg.trainer.simulated else 'engine'}): GPU time is modelled "
              f"and slept (simulated.time_scale {cfg.simulated.time_scale:g}); nothing real is generated or trained",
              flush=True)
    timeout_s = a.timeout_min * 60 if a.timeout_min else cfg.resources.trainer.timeout_min * 60
    try:
        _release_sigint(held)  # a Ctrl-C pressed while submitting stops the run from here
        return 0 if run.wait(timeout_s) else 1
    except KeyboardInterrupt:
        print(f"interrupted: asking the jobs to stop (the trainer checkpoints its last update; at most "
              f"{cfg.timeouts.stop_s:.0f}s, Ctrl-C again to cancel at once) ...", file=sys.stderr, flush=True)
        try:
            clean = run.stop(cfg.timeouts.stop_s)
        except KeyboardInterrupt:  # a second Ctrl-C: cancel now (the jobs get SIGTERM)
            run.cancel(wait_s=0)
            clean = False
        from hpcrl.control.records import read_latest_checkpoint

        ckpt = read_latest_checkpoint(run.rd)
        print(f"{'jobs stopped' if clean else 'jobs told to stop'}; trainer checkpoint at step "
              f"{ckpt.step if ckpt else 0}/{cfg.total_updates}; resume later with "
              f"`hpcrl run --resume --run-dir {run.rd.root}`", file=sys.stderr)
        return 130
