"""The ``hpcrl`` command.

    hpcrl run CONFIG [key=value ...] --run-dir DIR [--executor local|slurm|auto] [--dry-run] [--resume]
    hpcrl eval RUN_DIR [--versions 0,20,last] [--data FILE] [--n 8 ...] | hpcrl eval --model HF_FOLDER --data FILE
    hpcrl report RUN_DIR [RUN_DIR ...] [--out DIR] # offline report (default: RUN_DIR/report)
    hpcrl status RUN_DIR [--interval-s 5] [--once] # live view from the login node
    hpcrl summary RUN_DIR                          # per-version table of the staleness log
    hpcrl samples RUN_DIR [--version V] [--worst|--best] [-n K]   # prompts, responses, rewards, token versions
    hpcrl export RUN_DIR [--version last|N] --out DIR [--merge]   # a weight version as a Hugging Face folder
    hpcrl plan CONFIG [key=value ...] --gpus N [--splits ..] [--staleness ..]  # best split and async knobs
    hpcrl doctor [--dir D] [--require cuda,vllm] [--json F]         # what this node offers a run
    hpcrl scale RUN_DIR --rollout-jobs N [--reward-jobs M]        # grow or shrink a live run's rollout fleet

internal, listed last by ``hpcrl --help`` (the scripts and the jobs run them):

    hpcrl sbatch-lines CONFIG [key=value ...] --run-dir DIR       # prepare DIR, print the sbatch commands
    hpcrl build-ops [--timeout-s 1800]                            # build DeepSpeed's JIT ops for this node now
    hpcrl trainer RUN_DIR                                         # job entry points (hpcrl run, sbatch/ scripts)
    hpcrl rollout RUN_DIR --writer-rank W
    hpcrl eval-job RUN_DIR
    hpcrl reward-job RUN_DIR --index I

``hpcrl --help`` lists them and ``hpcrl COMMAND --help`` explains each option (tests/test_cli_help.py: every
command and option has help).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from pathlib import Path

from hpcrl import __version__
from hpcrl.analysis.commands import add_analysis_commands, run_analysis_command
from hpcrl.config import ConfigError, load_config
from hpcrl.launcher.run_cmd import RUN_DESCRIPTION, add_run_arguments, cmd_run, print_problems


def _cmd_plan(a) -> int:
    from hpcrl.plan.command import plan_command
    from hpcrl.plan.sweep import GPUS_PER_NODE, SweepSpec, parse_floats, parse_partial, parse_splits

    problems: list[str] = []

    def attempt(fn, *args):
        try:
            return fn(*args)
        except ValueError as e:
            problems.append(str(e))
            return None

    staleness = attempt(parse_floats, a.staleness, "--staleness")
    partial = attempt(parse_partial, a.partial)
    splits = attempt(parse_splits, a.splits) if a.splits else None
    for name, value, lo in (("--gpus", a.gpus, 2), ("--gpus-per-engine", a.gpus_per_engine, 1),
                            ("--gpus-per-node", a.gpus_per_node, 1),
                            ("--updates", a.updates, 3), ("--top", a.top, 1), ("--prompt-tokens", a.prompt_tokens, 1)):
        if value is not None and value < lo:
            problems.append(f"{name} must be >= {lo}, got {value}")
    try:
        if problems:
            raise ValueError("\n".join(problems))
        gpe, node = a.gpus_per_engine, a.gpus_per_node
        if gpe is None or node is None:
            r = load_config(a.config, a.overrides).resources
            gpe = gpe or max(1, r.rollout.nodes * r.rollout.gpus_per_node)
            node = node or max(r.trainer.gpus_per_node, r.rollout.gpus_per_node, r.eval.gpus_per_node) or GPUS_PER_NODE
        spec = SweepSpec(gpus=a.gpus, gpus_per_engine=gpe, updates=a.updates, staleness=staleness, partial=partial,
                         splits=splits, gpus_per_node=node)
        lines = plan_command(a.config, a.overrides, spec, a.probe, a.top, a.all, a.prompt_tokens, a.model_config)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        return print_problems("hpcrl plan", e)
    print("\n".join(lines))
    return 0


def _cmd_sbatch_lines(a) -> int:
    from hpcrl.launcher.prepare import prepare_run_dir
    from hpcrl.launcher.sbatch_lines import sbatch_lines, write_setup_files
    from hpcrl.launcher.submit import job_python
    from hpcrl.rundir.paths import RunDir

    try:  # stdout carries the sbatch lines only (submit.sh runs each): what the checks print goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            cfg = load_config(a.config, a.overrides)
            rd = RunDir(a.run_dir) if a.dry_run else prepare_run_dir(cfg, Path(a.run_dir), resume=False)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        return print_problems("hpcrl", e)
    if not a.dry_run:
        write_setup_files(cfg, rd)
    for line in sbatch_lines(cfg, rd, Path(a.scripts).resolve(), a.python or job_python()):
        print(line)
    return 0


def add_plan_command(sub) -> None:
    """``hpcrl plan`` (hpcrl/plan/command.py)."""
    pl = sub.add_parser("plan", help="predict step time, throughput, busy shares and lag for trainer:rollout splits "
                                      "and async settings of a GPU budget (an event simulation, seconds)",
                        description="Predict, without running anything, the best trainer:rollout splits and async "
                                    "settings of a GPU budget, in shapes whole nodes can give, next to the "
                                    "configuration the config asks for and the synchronous colocated baseline "
                                    "(docs/planner.md: 'Sizing a run with hpcrl plan'). The phase model is the "
                                    "config's simulated: section; a config without one is predicted with hpcrl's "
                                    "built-in numbers, and a note says so. The prompt lengths come from data.source "
                                    "through the model's tokenizer: where those cannot be read here (a placeholder "
                                    "model.path, as in the shipped GPU configs), pass --prompt-tokens.")
    pl.add_argument("config", help="YAML config whose simulated: section holds the phase model (modelled seconds)")
    pl.add_argument("overrides", nargs="*", help="dotted overrides of the config, e.g. simulated.decode_base_s=0.03")
    pl.add_argument("--gpus", type=int, required=True, help="GPU budget: trainer GPUs + rollout engines' GPUs")
    pl.add_argument("--gpus-per-engine", type=int, default=None,
                    help="GPUs of one rollout job's engine (default: the config's resources.rollout GPUs, else 1)")
    pl.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                    help="GPUs of one node: a trainer past one node is advised in whole nodes, an engine fits in one "
                         "(default: the largest resources.*.gpus_per_node of the config, else 8)")
    pl.add_argument("--splits", default=None, metavar="LIST|RANGE",
                    help="trainer GPU counts to try: 8,16,32 or 8:64 or 8:64:8 (default: every count up to 64 GPUs, "
                         "else 1, 2, 4 and whole nodes of 8)")
    pl.add_argument("--staleness", default="0,0.5,1", metavar="LIST",
                    help="staleness_threshold values to try, e.g. 0,0.1,0.3 (default 0,0.5,1; the config's own is "
                         "always tried)")
    pl.add_argument("--partial", default="both", choices=["both", "on", "off"],
                    help="partial_rollout settings to try (default both; the config's own is always tried)")
    pl.add_argument("--prompt-tokens", type=int, default=None, metavar="N",
                    help="every prompt N tokens (default: data.source through the model's tokenizer; needed where "
                         "the model or the data cannot be read here)")
    pl.add_argument("--updates", type=int, default=32, help="local updates simulated per candidate (default 32)")
    pl.add_argument("--probe", default=None, metavar="RUN", help="measure the update model, weight switch and "
                    "response lengths from this run directory's logs")
    pl.add_argument("--model-config", default=None, metavar="FILE",
                    help="a model's config.json for the trainer's memory prediction when model.path is not here "
                         "(default: model.path's; configs/shapes/ has some)")
    pl.add_argument("--top", type=int, default=10, help="rows shown, best first (default 10)")
    pl.add_argument("--all", action="store_true", help="simulate every candidate (no search, no bound) and show "
                                                       "them all")


JOB_RUN_DIR_HELP = "the run directory prepared by `hpcrl run` or `hpcrl sbatch-lines` (the sbatch scripts pass it)"


def _cmd_build_ops(timeout_s: float) -> int:
    from hpcrl.trainer.ops import extensions_dir, prepare_ops

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.monotonic()
    names = prepare_ops(timeout_s)
    print(f"DeepSpeed ops ready in {extensions_dir()}: {', '.join(names)} ({time.monotonic() - t0:.0f}s)" if names
          else "no DeepSpeed op to build on this node")
    return 0


INTERNAL = "internal ({}): "
"""How the help of a command users rarely type begins (the jobs' entry points, the scripts' helpers)."""


def _add_run_command(sub) -> None:
    add_run_arguments(sub.add_parser("run", help="launch a run (trainer + rollout jobs) and follow it",
                                     description=RUN_DESCRIPTION))
    sc = sub.add_parser("scale", help="grow or shrink the rollout fleet (and the reward jobs) of a live run (new jobs "
                        "join; the newest drain: finish their groups, seal, hand back their prompts, exit)")
    sc.add_argument("run_dir", metavar="RUN_DIR", help="the live run's directory (--run-dir of `hpcrl run`)")
    sc.add_argument("--rollout-jobs", type=int, default=None, help="the number of rollout jobs from now on")
    sc.add_argument("--reward-jobs", type=int, default=None, help="the number of reward jobs from now on "
                    "(reward_model.placement=job; the ones beyond it end, their clients go to the others)")
    sc.add_argument("--wait-s", type=float, default=30.0,
                    help="how long to wait for the launcher following the run before acting here (default 30)")
    sc.add_argument("--scripts", default=None, help="folder holding rollout.sbatch (runs launched with sbatch)")


def _add_internal_commands(sub) -> None:
    """The commands the scripts and the jobs run (listed last, each marked internal)."""
    sl = sub.add_parser("sbatch-lines", help=INTERNAL.format("sbatch/submit.sh runs it") + "prepare RUN_DIR and print "
                        "the sbatch commands")
    sl.add_argument("config", help="YAML config, e.g. configs/tiny.yaml")
    sl.add_argument("overrides", nargs="*", help="dotted overrides, e.g. async_training.staleness_threshold=0.5")
    sl.add_argument("--run-dir", required=True, help="run directory to prepare on the shared filesystem (a new one)")
    sl.add_argument("--scripts", default=str(Path(__file__).resolve().parents[1] / "sbatch"),
                    help="folder holding trainer.sbatch, rollout.sbatch and eval.sbatch (default: the repository's "
                         "sbatch/)")
    sl.add_argument("--python", default=None, help="python the jobs run (default: HPCRL_PYTHON, else this one)")
    sl.add_argument("--dry-run", action="store_true", help="print the lines; create and submit nothing")
    bo = sub.add_parser("build-ops", help=INTERNAL.format("install.sh runs it") + "build DeepSpeed's JIT ops for this "
                        "node now, so that no trainer's start waits for the compiler")
    bo.add_argument("--timeout-s", type=float, default=1800.0, help="give up building after this long (default 1800)")
    job = INTERNAL.format("a job's entry point, which hpcrl run and the sbatch scripts start")
    t = sub.add_parser("trainer", help=job + "run the trainer job in this process")
    t.add_argument("run_dir", metavar="RUN_DIR", help=JOB_RUN_DIR_HELP)
    ro = sub.add_parser("rollout", help=job + "run one rollout job in this process")
    ro.add_argument("run_dir", metavar="RUN_DIR", help=JOB_RUN_DIR_HELP)
    ro.add_argument("--writer-rank", type=int, default=0, help="this job's writer number (w000 is 0; default 0)")
    ej = sub.add_parser("eval-job", help=job + "run the evaluation job in this process")
    ej.add_argument("run_dir", metavar="RUN_DIR", help=JOB_RUN_DIR_HELP)
    rj = sub.add_parser("reward-job", help=job + "run one reward job (serves reward_model.*) in this process")
    rj.add_argument("run_dir", metavar="RUN_DIR", help=JOB_RUN_DIR_HELP)
    rj.add_argument("--index", type=int, default=0, help="this reward job's number (reward-0 is 0; default 0)")


def _parser() -> argparse.ArgumentParser:
    """Every command and its arguments: the user's first, the internal ones last."""
    p = argparse.ArgumentParser(prog="hpcrl", description="asynchronous RL post-training on Slurm")
    p.add_argument("--version", action="version", version=f"hpcrl {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND",
                           help="what to do; `hpcrl COMMAND --help` explains its options")
    _add_run_command(sub)
    from hpcrl.eval.offline import add_arguments as add_eval_arguments

    add_eval_arguments(sub.add_parser(
        "eval", help="evaluate a run's weight versions, or a model folder, on held-out prompts (verl's metrics)",
        description="Evaluate weight versions of RUN (or --model HF_FOLDER) on held-out prompts with the evaluation "
                    "job's code; rows go to RUN/logs/eval.jsonl (marked offline) or --out DIR."))
    add_plan_command(sub)
    from hpcrl.doctor.command import add_arguments as add_doctor_arguments

    add_doctor_arguments(sub.add_parser("doctor", help="check what this node offers a run (CUDA, vLLM, gloo, /dev/shm, "
                                                       "the shared filesystem); exit 1 if a required check fails"))
    add_analysis_commands(sub)
    _add_internal_commands(sub)
    for action in sub._choices_actions:  # `hpcrl X --help` opens with what X does, as `hpcrl --help` lists it
        parser = sub.choices[action.dest]
        parser.description = parser.description or action.help[0].upper() + action.help[1:] + "."
    return p


def main(argv=None) -> int:
    p = _parser()
    # overrides may also follow the options (`hpcrl run CONFIG --run-dir D k=v`)
    a, extra = p.parse_known_args(argv)
    if extra:
        if a.cmd not in ("run", "sbatch-lines", "eval", "plan") or any("=" not in x or x.startswith("-") for x in extra):
            p.error("unrecognized arguments: " + " ".join(extra))
        a.overrides = list(a.overrides) + extra
    if a.cmd in ("report", "status", "summary", "samples", "export"):
        return run_analysis_command(a)
    if a.cmd == "run":
        if a.config is not None and "=" in a.config:  # `hpcrl run key=value --resume`
            a.overrides.insert(0, a.config)
            a.config = None
        return cmd_run(a)
    if a.cmd == "sbatch-lines":
        return _cmd_sbatch_lines(a)

    if a.cmd == "plan":
        return _cmd_plan(a)
    if a.cmd == "doctor":
        from hpcrl.doctor.command import doctor_command

        return doctor_command(a)
    if a.cmd == "build-ops":
        return _cmd_build_ops(a.timeout_s)
    if a.cmd == "eval":
        from hpcrl.eval.offline import eval_command

        if a.run_dir is not None and "=" in a.run_dir:  # `hpcrl eval --model F key=value`
            a.overrides.insert(0, a.run_dir)
            a.run_dir = None
        return eval_command(a)
    from hpcrl.rundir.paths import RunDir

    if not RunDir(a.run_dir).config_path.is_file():
        print(f"hpcrl {a.cmd}: error: {a.run_dir} is not an hpcrl run directory (no frozen config); "
              "start a run with `hpcrl run CONFIG --run-dir DIR` (or prepare one with `hpcrl sbatch-lines`)",
              file=sys.stderr)
        return 2
    if a.cmd == "scale":
        from hpcrl.launcher.scale_cmd import scale_command

        return scale_command(a.run_dir, a.rollout_jobs, a.wait_s, a.scripts, a.reward_jobs)
    if a.cmd == "trainer":
        from hpcrl.trainer.main import trainer_main

        trainer_main(a.run_dir)
        return 0
    if a.cmd == "eval-job":
        from hpcrl.eval.job import eval_main

        eval_main(a.run_dir)
        return 0
    if a.cmd == "reward-job":
        from hpcrl.reward.job import reward_main

        reward_main(a.run_dir, a.index)
        return 0
    from hpcrl.rollout.main import rollout_main

    rollout_main(a.run_dir, a.writer_rank)
    return 0


def entry(argv=None) -> int:
    """``main`` for the console script and ``python -m hpcrl``: a closed pipe (``| head``) ends
    the command quietly, as it does for other Unix tools."""
    try:
        rc = main(argv)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(entry())
