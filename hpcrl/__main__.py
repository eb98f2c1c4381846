"""``python -m hpcrl``: the ``hpcrl`` command (:mod:`hpcrl.cli`)."""
import sys

from hpcrl.cli import entry

sys.exit(entry())
