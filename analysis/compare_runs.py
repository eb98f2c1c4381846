"""Compare hpcrl runs side by side, from their run directories only.

    python analysis/compare_runs.py RUN1 RUN2 [RUN ...] [--out DIR]

Prints one row per run (step, generation, update, sync and total time, final reward, mean/max lag, idle
ratios, tokens/s, dropped groups; the columns are defined in hpcrl/analysis/tables.py) and writes the
overlaid curves (reward, lag, idle ratios, progress) as PNG files to DIR (default analysis/figures/compare).
For the full report: ``hpcrl report RUN1 RUN2 --out DIR``; to change a plot: analysis/runs.ipynb.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpcrl.analysis import compare, tables
from hpcrl.analysis.load import RunFormatError, load_run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default="analysis/figures/compare", metavar="DIR", help="folder for the PNG files")
    a = p.parse_args(argv)
    try:
        runs = [load_run(r) for r in a.run_dirs]
    except RunFormatError as e:
        print(f"compare_runs: error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print(tables.ablation_table(runs).to_string(float_format=lambda x: f"{x:.3f}"))
    for name, draw in compare.COMPARE_PLOTS.items():
        print(f"wrote {draw(runs, out / name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
