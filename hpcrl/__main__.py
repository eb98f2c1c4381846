import sys

from hpcrl.cli import main

sys.exit(main())
