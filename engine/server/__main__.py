"""`python -m pagekube.engine.server [MODEL] [--flags]` is `pagekube serve`."""

import sys

from pagekube.engine.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
