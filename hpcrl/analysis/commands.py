"""The ``report`` and ``status`` subcommands of ``hpcrl`` (wired in :mod:`hpcrl.cli`).

Kept apart from the implementation so that building the parser imports nothing
heavy (pandas and matplotlib load only when ``report`` runs).
"""
from __future__ import annotations

import argparse
import logging
import sys


def add_analysis_commands(sub) -> None:
    rp = sub.add_parser("report", help="offline staleness report of one or more runs (Markdown + HTML + PNG)",
                        description="Read run directories (only) and write DIR/report.md, DIR/report.html and PNG "
                                    "plots; several runs get a side-by-side table and overlaid curves.")
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (--run-dir of `hpcrl run`)")
    rp.add_argument("--out", required=True, metavar="DIR", help="folder for report.md, report.html and the plots")
    st = sub.add_parser("status", help="live plain-text view of a run (login node, ssh)",
                        description="Refresh a plain-text view of the run's jobs until the trainer finishes. "
                                    "Exit 0 finished (or running, with --once), 1 stopped unfinished, 2 not a run.")
    st.add_argument("run_dir", metavar="RUN_DIR")
    st.add_argument("--interval-s", type=float, default=5.0, help="seconds between views (default 5)")
    st.add_argument("--once", action="store_true", help="print one view and exit")


def run_analysis_command(a: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if a.cmd == "status":
        from hpcrl.analysis.status import status_main

        if a.interval_s <= 0:
            print(f"hpcrl status: error: --interval-s must be > 0, got {a.interval_s}", file=sys.stderr)
            return 2
        try:
            return status_main(a.run_dir, a.interval_s, a.once)
        except KeyboardInterrupt:
            return 130
    from hpcrl.analysis.load import RunFormatError
    from hpcrl.analysis.recommend import recommend_run
    from hpcrl.analysis.report import build_report

    try:
        rep = build_report(a.run_dirs, a.out)
    except RunFormatError as e:
        print(f"hpcrl report: error: {e}", file=sys.stderr)
        return 2
    for d in rep.runs:
        print(f"{d.name}: {recommend_run(d).line}")
        for note in d.notes:
            print(f"{d.name}: note: {note}")
    print(f"report: {rep.markdown} and {rep.html} ({len(rep.plots)} plots)")
    for failure in rep.failed_plots:
        print(f"hpcrl report: plot failed: {failure}", file=sys.stderr)
    return 1 if rep.failed_plots else 0
