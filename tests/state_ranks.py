"""One rank of test_checkpoint's large restart: rank 0 reads the newest checkpoint of FOLDER and the job's group
streams it to every rank (:func:`hpcdl.train.checkpoint.load_latest_shared`); each rank checks every tensor it got
and writes OUT/rankR.json with the state's bytes and its peak resident memory over the restart.

    state_ranks.py FOLDER OUT BACKEND   (under mpiexec, srun, or torch's env:// variables)

The checkpoint's tensor ``tNN`` holds the value NN everywhere (written by the test).
"""

import json
import re
import sys


from hpcdl.distributed.group.lifecycle import init_distributed, shutdown
from hpcdl.distributed.ranks.env import rank_and_world
from hpcdl.log import setup_logging
from hpcdl.train.checkpoint import CheckpointManager, load_latest_shared


def memory(field: str) -> int:
    """VmRSS or VmHWM (the peak since the last reset) of this process, bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


folder, out, backend = sys.argv[1:4]
setup_logging(rank_and_world()[0])
ctx = init_distributed(backend)
before = memory("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) from here on
manager = CheckpointManager(folder) if ctx.rank == 0 else None
path, state = load_latest_shared(manager, ctx.group)
peak = memory("VmHWM")
tensors = state["model"]
wrong = [k for k, t in tensors.items() if not bool((t == int(k[1:])).all())]
found = {"rank": ctx.rank, "path": path, "step": state["counters"]["step"], "wrong": wrong,
         "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
         "dtypes": sorted({str(t.dtype) for t in tensors.values()}), "peak_over_start": peak - before}
with open(f"{out}/rank{ctx.rank}.json", "w") as f:
    json.dump(found, f)
shutdown(ctx)
