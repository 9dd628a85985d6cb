"""``hpcdl`` with Python's audit hook watching the files this rank opens: each open of a path that contains
HPCDL_TEST_WATCH is written to stderr as ``opened: PATH``. For tests of what only rank 0 reads.

    HPCDL_TEST_WATCH=w.pt python audit_ranks.py train ...
"""

import os
import sys

from hpcdl.cli import console

watch = os.environ["HPCDL_TEST_WATCH"]


def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) and watch in os.fsdecode(args[0]):
        print(f"opened: {os.fsdecode(args[0])}", file=sys.stderr, flush=True)


sys.addaudithook(hook)
console(sys.argv[1:])
