import sys

from hpcrl.cli import entry

sys.exit(entry())
