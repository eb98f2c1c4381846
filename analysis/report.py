"""Write the staleness report of one or more runs: the same as ``hpcrl report``.

    python analysis/report.py RUN_DIR [RUN_DIR ...] --out DIR
"""
import sys

from hpcrl.cli import main

if __name__ == "__main__":
    sys.exit(main(["report", *sys.argv[1:]]))
