"""One rank of test_groups' timeout check (``timeout_ranks.py OUT BACKEND``): rank 1 joins an all-reduce late;
rank 0's Work must fail first."""

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from hpcdl.distributed.group.lifecycle import init_distributed

out, backend = sys.argv[1], sys.argv[2]
ctx = init_distributed(backend, timeout=timedelta(seconds=2))
x = torch.ones(3)
if ctx.rank == 1:
    time.sleep(8)  # late: rank 0's collective outlives its 2 s timeout meanwhile
    dist.all_reduce(x)
    result = {"value": x.tolist()}
else:
    t0 = time.monotonic()
    try:
        dist.all_reduce(x)
        result = {"error": None}
    except RuntimeError as exc:
        result = {"error": str(exc), "after_s": time.monotonic() - t0}
with open(f"{out}/rank{ctx.rank}.json", "w") as f:
    json.dump(result, f)
if ctx.rank == 0:
    time.sleep(8)  # the library's call itself completes once rank 1 joins; then both can leave
dist.destroy_process_group()
