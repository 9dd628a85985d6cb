"""What a rank's start-up costs, for ``loop.record_startup``: the time of each phase from the process's start
to its first step, the files it opened under the roots that live on a shared filesystem (the run folder, the
data, the Python environment) with their bytes, and its use of rank 0's rendezvous store.

The files are counted by an audit hook (:func:`sys.addaudithook`, event ``open``: every ``open()``,
``io.open_code`` and so every import; ``os.open`` is not audited); a file opened for reading counts its size
at that moment, so for a file read whole, such as a checkpoint, the bytes are the bytes read. The hook counts
from the moment it is installed: ``python -m hpcdl`` installs it before its first import when
``HPCDL_RECORD_STARTUP=1`` is in the environment (``hpcdl bench startup`` sets it), so that the interpreter's
own imports of torch and hpcdl are counted; otherwise :class:`StartupRecord` installs it when training starts.
An audit hook cannot be removed: :meth:`FileReads.close` stops it counting. Each rank writes
``RUN_DIR/startup/rankRRRRR.json`` at its first step; ``hpcdl bench startup`` gathers them.

Torch-free: ``python -m hpcdl`` imports it before anything else.
"""

from __future__ import annotations

import json
import os
import sys
import time

from hpcdl.utils import atomic_write_text

__all__ = ["EARLY_ENV", "FileReads", "StartupRecord", "begin", "process_start_time"]

EARLY_ENV = "HPCDL_RECORD_STARTUP"
_WRITING = frozenset("wax+")


class FileReads:
    """Every file opened for reading from its creation on: (real path, bytes) in order, classified later."""

    def __init__(self):
        self.opened: list[tuple[str, int]] = []
        self.active = True
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if not self.active or event != "open":
            return
        path, mode = args[0], args[1]
        if not isinstance(path, (str, bytes)) or (mode is not None and not _WRITING.isdisjoint(str(mode))):
            return
        try:
            real = os.path.realpath(os.fsdecode(path))
            self.opened.append((real, os.stat(real).st_size))
        except (OSError, ValueError):
            return

    def close(self, roots: dict[str, str]) -> dict[str, dict[str, int]]:
        """Files and bytes under each of ``roots`` (name -> folder; the first that holds a file counts it)."""
        self.active = False
        prefixes = {name: os.path.realpath(path) + os.sep for name, path in roots.items() if path}
        counts = {name: {"files": 0, "bytes": 0} for name in prefixes}
        for real, size in self.opened:
            for name, prefix in prefixes.items():
                if real.startswith(prefix):
                    counts[name]["files"] += 1
                    counts[name]["bytes"] += size
                    break
        return counts


_early: FileReads | None = None


def begin() -> None:
    """Count files from now on, for the record a later :class:`StartupRecord` writes (``python -m hpcdl``)."""
    global _early
    if _early is None:
        _early = FileReads()


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
    start, beside the file counts under ``roots`` and the rendezvous store's use."""

    def __init__(self, roots: dict[str, str]):
        self.start = process_start_time()
        self.marks: dict[str, float] = {"interpreter and imports": time.time()}  # train() runs once they are in
        self.roots = roots
        self.from_start = _early is not None
        self.reads = _early or FileReads()
        self.record: dict | None = None
        self.path: str | None = None

    def mark(self, phase: str) -> None:
        self.marks[phase] = time.time()

    def write(self, run_dir: str, rank: int, world_size: int, store: dict | None = None) -> str:
        phases, last = {}, self.start
        for phase, at in self.marks.items():
            phases[phase] = at - last
            last = at
        self.record = record = {"rank": rank, "world_size": world_size, "host": os.uname().nodename, "phases_s": phases,
                  "total_s": last - self.start, "reads": self.reads.close(self.roots),
                  "reads_counted_from": "process start" if self.from_start else "train()", "store": store or {}}
        self.path = path = os.path.join(run_dir, "startup", f"rank{rank:05d}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write_text(path, json.dumps(record, indent=1) + "\n")
        return path

    def finish(self, store: dict) -> None:
        """Add the store's use at the run's end (what the steps sent after start-up) to the written record."""
        if self.record is not None:
            self.record["store_at_end"] = store
            atomic_write_text(self.path, json.dumps(self.record, indent=1) + "\n")
