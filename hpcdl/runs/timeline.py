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
from hpcdl.plot import pyplot, save_png
from hpcdl.utils import atomic_write_text


class Timeline:
    def __init__(self, run_dir: str, rank: int):
        folder = os.path.join(run_dir, "timeline")
        os.makedirs(folder, exist_ok=True)
        self.rank = rank
        self._file = open(os.path.join(folder, f"rank{rank}.jsonl"), "a", buffering=1 << 16)
        self._lock = threading.Lock()  # comm spans are recorded from the collectives' threads
        self._epoch = time.time() - time.perf_counter()  # perf_counter -> wall clock, so ranks line up

    def span(self, name: str, start: float, end: float, thread: str = "step", **args) -> None:
        """A span between two ``time.perf_counter()`` readings."""
        event = {"name": name, "ph": "X", "pid": self.rank, "tid": thread, "ts": round((self._epoch + start) * 1e6, 1),
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


def render(trace: str, out: str, steps: int = 1, skip: int = 2) -> str:
    """A picture (PNG) of ``steps`` training steps of a merged trace, after the first ``skip``: one lane per
    rank and thread (``step``, ``comm``), a box per span. Needs matplotlib (``pip install 'hpcdl[plot]'``)."""
    plt = pyplot("hpcdl timeline render")
    from matplotlib.patches import Patch

    with open(trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    starts = sorted(e["ts"] for e in events if e["name"] == "forward" and e["pid"] == 0)
    if len(starts) < skip + steps:
        raise DataError(f"{trace}: rank 0 has {len(starts)} steps; render needs {skip + steps} (skip + steps)")
    t0 = starts[skip]
    t1 = starts[skip + steps] if len(starts) > skip + steps else max(e["ts"] + e["dur"] for e in events)
    shown = [e for e in events if e["ts"] < t1 and e["ts"] + e["dur"] > t0]
    lanes = sorted({(e["pid"], e["tid"]) for e in shown}, key=lambda k: (k[0], k[1] != "step"))
    colors = {"data": "#bbbbbb", "forward": "#4c72b0", "backward": "#dd8452", "control": "#8172b3",
              "optimizer": "#55a868", "comm": "#c44e52"}
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(lanes) + 1.2))
    for e in shown:
        y = lanes.index((e["pid"], e["tid"]))
        kind = "comm" if e["tid"] == "comm" else e["name"]
        ax.broken_barh([((e["ts"] - t0) / 1e3, e["dur"] / 1e3)], (y - 0.4, 0.8), facecolors=colors.get(kind, "#999999"),
                       edgecolor="white", linewidth=0.5)
    ax.set_yticks(range(len(lanes)), [f"rank {p} {t}" for p, t in lanes])
    ax.invert_yaxis()
    ax.set_xlim(0, (t1 - t0) / 1e3)
    ax.set_xlabel("ms from the start of the step's forward")
    ax.legend(handles=[Patch(color=c, label="bucket all-reduce" if k == "comm" else k)
                       for k, c in colors.items()], loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=6,
              frameon=False)
    fig.tight_layout()
    return save_png(fig, out)
