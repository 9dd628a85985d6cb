"""What a rank's start-up costs, for ``loop.record_startup``: the time of each phase from the process's start
to its first step, and the files it opened under the roots that live on a shared filesystem (the run
folder, the data, the Python environment), with their bytes.

The files are counted by an audit hook (:func:`sys.addaudithook`, event ``open``: every ``open()``,
``io.open_code`` and so every import, ``os.open`` is not audited); a file opened for reading counts its size
at that moment, so for a file read whole, such as a checkpoint, the bytes are the bytes read. An audit hook
cannot be removed: :class:`FileReads` stops counting when closed. Each rank writes
``RUN_DIR/startup/rankRRRRR.json`` at its first step; ``hpcdl bench startup`` gathers them.
"""

from __future__ import annotations

import json
import os
import sys
import time

from hpcdl.utils import atomic_write_text

__all__ = ["FileReads", "StartupRecord", "process_start_time"]


class FileReads:
    """Files opened for reading under each of ``roots`` (name -> folder), and their bytes, while open."""

    def __init__(self, roots: dict[str, str]):
        self.roots = {name: os.path.realpath(path) + os.sep for name, path in roots.items() if path}
        self.counts = {name: {"files": 0, "bytes": 0} for name in self.roots}
        self.active = True
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if not self.active or event != "open":
            return
        path, mode = args[0], args[1]
        if not isinstance(path, (str, bytes)) or (mode is not None and any(c in str(mode) for c in "wax+")):
            return
        try:
            real = os.path.realpath(os.fsdecode(path))
            for name, root in self.roots.items():
                if real.startswith(root):
                    count = self.counts[name]
                    count["files"] += 1
                    count["bytes"] += os.stat(real).st_size
                    return
        except (OSError, ValueError):
            return

    def close(self) -> dict:
        self.active = False
        return self.counts


def process_start_time() -> float:
    """When this process started, on the clock of :func:`time.time` (from /proc/self/stat and the boot time)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return time.time()


class StartupRecord:
    """Phase ends on the wall clock, from the process's start; :meth:`write` puts them, in seconds from the
    start, beside the file counts."""

    def __init__(self, roots: dict[str, str]):
        self.start = process_start_time()
        self.marks: dict[str, float] = {"imports": time.time()}  # train() runs once hpcdl and torch are in
        self.reads = FileReads(roots)

    def mark(self, phase: str) -> None:
        self.marks[phase] = time.time()

    def write(self, run_dir: str, rank: int, world_size: int) -> str:
        phases, last = {}, self.start
        for phase, at in self.marks.items():
            phases[phase] = at - last
            last = at
        record = {"rank": rank, "world_size": world_size, "host": os.uname().nodename, "phases_s": phases,
                  "total_s": last - self.start, "reads": self.reads.close()}
        path = os.path.join(run_dir, "startup", f"rank{rank:05d}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write_text(path, json.dumps(record, indent=1) + "\n")
        return path
