"""Live plain-text view of a run: the same as ``hpcrl status``.

    python analysis/status.py RUN_DIR [--interval-s 5] [--once]
"""
import sys

from hpcrl.cli import main

if __name__ == "__main__":
    sys.exit(main(["status", *sys.argv[1:]]))
