"""Per-rank timelines in Chrome's trace-event format, and ``hpcdl timeline merge`` for all ranks.

With ``loop.timeline`` on, each rank appends complete events (``"ph": "X"``, microseconds) to
``RUN_DIR/timeline/rankR.jsonl``: the step's phases on thread ``step`` and each gradient bucket's
communication, from its hand-over to the completion of its all-reduce, on thread ``comm``. Where
``comm`` spans start before the ``backward`` span ends, communication overlapped computation.
``hpcdl timeline merge RUN_DIR`` writes ``RUN_DIR/timeline.json``, which chrome://tracing and
ui.perfetto.dev open, one process per rank (as Horovod's timeline shows them).
"""

from __future__ import annotations

import glob
import json
import os
import threading
import time

from hpcdl.errors import DataError
from hpcdl.utils import atomic_write_text

_EPOCH = time.time() - time.perf_counter()  # perf_counter -> wall clock, so ranks line up


class Timeline:
    def __init__(self, run_dir: str, rank: int):
        folder = os.path.join(run_dir, "timeline")
        os.makedirs(folder, exist_ok=True)
        self.rank = rank
        self._file = open(os.path.join(folder, f"rank{rank}.jsonl"), "a", buffering=1 << 16)
        self._lock = threading.Lock()  # comm spans are recorded from the collectives' threads

    def span(self, name: str, start: float, end: float, thread: str = "step", **args) -> None:
        """A span between two ``time.perf_counter()`` readings."""
        event = {"name": name, "ph": "X", "pid": self.rank, "tid": thread, "ts": round((_EPOCH + start) * 1e6, 1),
                 "dur": round((end - start) * 1e6, 1), **({"args": args} if args else {})}
        with self._lock:
            self._file.write(json.dumps(event) + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


def merge(run_dir: str) -> str:
    """All ranks' events as one trace file; returns its path."""
    paths = sorted(glob.glob(os.path.join(glob.escape(run_dir), "timeline", "rank*.jsonl")))
    if not paths:
        raise DataError(f"{run_dir}/timeline holds no rank*.jsonl; train with --set loop.timeline=true first")
    events = []
    for path in paths:
        with open(path) as f:
            events += [json.loads(line) for line in f if line.strip()]
    ranks = sorted({e["pid"] for e in events})
    meta = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in ranks]
    out = os.path.join(run_dir, "timeline.json")
    atomic_write_text(out, json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"}) + "\n")
    return out
