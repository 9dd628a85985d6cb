"""One rank of test_sync's bucket check: DDP's buckets with and without ``first_bucket_mb``.

Writes rank 0's bucket sizes (bytes, in reduction order, after DDP rebuilt them) to OUT/buckets.json.
"""

import json
import sys

import torch

from hpcdl.distributed.gradients.ddp import data_parallel
from hpcdl.distributed.group.lifecycle import init_distributed, shutdown

out = sys.argv[1]
ctx = init_distributed("gloo")
found = {}
for first in (None, 0.005):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    net, _ = data_parallel(model, ctx.env, ctx.group, bucket_cap_mb=0.02, first_bucket_mb=first)
    for _ in range(10):  # DDP rebuilds its buckets after the first step and logs them at the 10th
        net(torch.randn(4, 64)).sum().backward()
    found[str(first)] = [int(b) for b in net._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", ")]
if ctx.rank == 0:
    with open(f"{out}/buckets.json", "w") as f:
        json.dump(found, f)
# DDP holds the group: free it while the interpreter is alive. A DDP object sits in reference cycles, so only a
# collection frees it; left to the finalizing interpreter's, the gloo group's run loop thread took the GIL
# there and was ended by pthread_exit inside a noexcept frame: 'terminate called without an active exception'
# (gdb, 2026-11-26: about 1 run in 5 of bucket_ranks.py on the 2-core EPYC).
del net
__import__("gc").collect()
shutdown(ctx)
