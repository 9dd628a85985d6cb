"""One rank of test_mpi: hpcdl's process group on the mpi4py backend, checked collective by collective.

Run under mpiexec or srun; writes rank R's findings to OUT/rankR.json.
"""

import hashlib
import json
import sys

import torch
import torch.distributed as dist

from hpcdl.dist.env import rank_and_world
from hpcdl.dist.process_group import init_distributed, shutdown
from hpcdl.log import setup_logging

out = sys.argv[1]
setup_logging(rank_and_world()[0])
ctx = init_distributed("mpi")
rank, world = ctx.rank, ctx.world_size
found = {"backend": dist.get_backend(), "rank": rank}
for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64):
    t = torch.arange(6, dtype=dtype) + rank
    dist.all_reduce(t)
    found[f"sum {dtype}"] = t.tolist()
t = torch.tensor([float(rank)])
dist.all_reduce(t, op=dist.ReduceOp.MAX)
found["max"] = t.item()
t = torch.tensor([2.0 * (rank + 1)])
dist.all_reduce(t, op=dist.ReduceOp.AVG)
found["avg"] = t.item()
b = torch.full((3,), float(rank), dtype=torch.bfloat16)
dist.broadcast(b, src=world - 1)
found["broadcast bf16"] = b.tolist()
parts = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
dist.all_gather(parts, torch.full((2,), rank, dtype=torch.int64))
found["allgather"] = [p.tolist() for p in parts]
rs = torch.empty(2)
getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(rs, torch.arange(2.0 * world) * (rank + 1))
found["reduce_scatter"] = rs.tolist()
objects = [None] * world
dist.all_gather_object(objects, {"rank": rank})
found["objects"] = objects
dist.barrier()
# Each rank decides alone where a small collective runs: here rank 0 queues it behind a large all-reduce
# still in flight while rank 1, which waited for that one, runs it on its own thread. They must still meet.
mixed = []
for small in ("all_reduce", "broadcast", "barrier"):
    big = torch.ones(1 << 20)  # 4 MB: above the inline limit
    work = dist.all_reduce(big, async_op=True)
    if rank == 1:
        work.wait()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t) if small == "all_reduce" else dist.broadcast(t, src=0) if small == "broadcast" else dist.barrier()
    work.wait()
    mixed.append([big[0].item()] + ([t.item()] if small != "barrier" else []))
found["mixed paths"] = mixed
# DDP: 20 steps on different data per rank; the replicas must stay bitwise identical.
torch.manual_seed(rank)  # different initial weights: DDP's broadcast must make them equal
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)  # several buckets
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for step in range(20):
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    opt.zero_grad()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
found["weights sha256"] = digest
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(found, f)
shutdown(ctx)
