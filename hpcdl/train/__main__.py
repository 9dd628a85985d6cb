"""``python -m hpcdl.train CONFIG [--set key=value ...]``: the same as ``hpcdl train``."""

import sys

from hpcdl.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
