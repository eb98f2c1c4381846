"""Script entry points over :mod:`hpcrl.analysis` (the implementation, installed with hpcrl).

    python analysis/report.py RUN_DIR [RUN_DIR ...] --out DIR   # = hpcrl report
    python analysis/status.py RUN_DIR [--once]                  # = hpcrl status
    python analysis/summary.py RUN_DIR                          # per-version table in the terminal

From Python: ``from analysis import build_report, load_run``.
"""
from hpcrl.analysis.load import RunData, RunFormatError, load_run
from hpcrl.analysis.recommend import recommend_run
from hpcrl.analysis.report import build_report

__all__ = ["RunData", "RunFormatError", "build_report", "load_run", "recommend_run"]
