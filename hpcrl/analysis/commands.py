"""The analysis commands of ``hpcrl`` (report, status, summary, samples, export): their arguments and how each runs.
Their output is the command's output; pandas and matplotlib load only when ``report`` runs."""
from __future__ import annotations

import argparse
import logging
import sys

RUN_DIR_HELP = "a run directory (--run-dir of `hpcrl run`)"


def add_analysis_commands(sub) -> None:
    """The parsers of ``report``, ``status``, ``summary``, ``samples`` and ``export``."""
    rp = sub.add_parser("report", help="offline staleness report of one or more runs (Markdown + HTML + PNG)",
                        description="Read run directories (only) and write DIR/report.md, DIR/report.html and PNG "
                                    "plots; several runs get a side-by-side table and overlaid curves.")
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (--run-dir of `hpcrl run`)")
    rp.add_argument("--out", default=None, metavar="DIR",
                    help="folder for report.md, report.html and the plots (default: RUN_DIR/report of the first run)")
    st = sub.add_parser("status", help="live plain-text view of a run (login node, ssh)",
                        description="Refresh a plain-text view of the run's jobs until the trainer finishes. "
                                    "Exit 0 finished (or running, with --once), 1 stopped unfinished, 2 not a run.")
    st.add_argument("run_dir", metavar="RUN_DIR", help=RUN_DIR_HELP)
    st.add_argument("--interval-s", type=float, default=5.0, help="seconds between views (default 5)")
    st.add_argument("--once", action="store_true", help="print one view and exit")
    sm = sub.add_parser("summary", help="per-version table of a run's staleness log in the terminal")
    sm.add_argument("run_dir", metavar="RUN_DIR", help=RUN_DIR_HELP)
    sa = sub.add_parser("samples", help="what the model writes: prompts, responses, rewards and per-token versions "
                                        "decoded from the shards",
                        description="Decode committed samples of one weight version (default: the newest) with the "
                                    "run's tokenizer. The trainer removes the shards behind its checkpoint but the "
                                    "newest trainer.keep_consumed_shards (8) per writer, so the samples of old "
                                    "versions go (set it to -1 to keep them); a note says how many shards are gone. "
                                    "Exit 0: shown; 1: no trajectory of that version; 2: not a run directory.")
    sa.add_argument("run_dir", metavar="RUN_DIR", help=RUN_DIR_HELP)
    sa.add_argument("--version", type=int, default=None, help="weight version that sampled them (default: newest)")
    order = sa.add_mutually_exclusive_group()
    order.add_argument("--worst", action="store_true", help="lowest reward first")
    order.add_argument("--best", action="store_true", help="highest reward first")
    sa.add_argument("-n", type=int, default=4, help="how many (default 4)")
    ex = sub.add_parser("export", help="write a published weight version as a Hugging Face folder (model, tokenizer, "
                                       "generation config) that transformers and vLLM load as is")
    ex.add_argument("run_dir", metavar="RUN_DIR", help=RUN_DIR_HELP)
    ex.add_argument("--version", default="last", help="weight version number, or last (default)")
    ex.add_argument("--out", required=True, metavar="DIR", help="a new folder")
    ex.add_argument("--merge", action="store_true", help="a LoRA run: the base model with the adapter merged into "
                                                        "its weights (default: the adapter folder)")


def _cmd_summary(run_dir: str) -> int:
    from hpcrl.analysis.tables import per_version_summary
    from hpcrl.logs.run_logs import read_staleness

    st = read_staleness(run_dir)
    table = per_version_summary(st)
    if table.empty:
        print("no consumed trajectories yet")
        return 0
    print(table.to_string(float_format=lambda x: f"{x:.3f}"))
    print(f"\n{len(st)} trajectories, lag histogram (trajectories): {st.lag.value_counts().sort_index().to_dict()}")
    return 0


def run_analysis_command(a: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if a.cmd == "summary":
        return _cmd_summary(a.run_dir)
    if a.cmd == "samples":
        from hpcrl.analysis.samples import samples_main

        return samples_main(a.run_dir, a.version, "worst" if a.worst else "best" if a.best else "newest", a.n)
    if a.cmd == "export":
        from hpcrl.analysis.export import export_main

        return export_main(a.run_dir, a.out, a.version, a.merge)
    if a.cmd == "status":
        from hpcrl.analysis.status import status_main

        if a.interval_s <= 0:
            print(f"hpcrl status: error: --interval-s must be > 0, got {a.interval_s}", file=sys.stderr)
            return 2
        try:
            return status_main(a.run_dir, a.interval_s, a.once)
        except KeyboardInterrupt:
            return 130
    from hpcrl.analysis.glance import glance
    from hpcrl.analysis.load import RunFormatError
    from hpcrl.analysis.report import build_report

    from hpcrl.rundir.paths import RunDir

    try:
        rep = build_report(a.run_dirs, a.out or RunDir(a.run_dirs[0]).report)
    except RunFormatError as e:
        print(f"hpcrl report: error: {e}", file=sys.stderr)
        return 2
    for d in rep.runs:
        for line in glance(d):
            print(f"{d.name}: {line}")
        for note in d.notes:
            print(f"{d.name}: note: {note}")
    print(f"report: {rep.markdown} and {rep.html} ({len(rep.plots)} plots; the numbers and the reasoning behind "
          "these lines are there)")
    for failure in rep.failed_plots:
        print(f"hpcrl report: plot failed: {failure}", file=sys.stderr)
    return 1 if rep.failed_plots else 0
