import os
import sys

if os.environ.get("HPCDL_RECORD_STARTUP") == "1":  # count the files of every import that follows (loop.record_startup)
    from hpcdl.train.startup import begin

    begin()

from hpcdl.cli import main  # noqa: E402

sys.exit(main())
