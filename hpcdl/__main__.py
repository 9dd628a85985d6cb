import os

if os.environ.get("HPCDL_RECORD_STARTUP") == "1":  # count the files of every import that follows (loop.record_startup)
    from hpcdl.train.startup_record import begin

    begin()

from hpcdl.cli import console  # noqa: E402

console()
