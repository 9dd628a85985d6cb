"""One rank of test_groups: hpcdl's process group on BACKEND (mpi, ccl, or the one-file store backend), checked
collective by collective and dtype by dtype, then DDP keeping replicas identical.

Run as ``group_ranks.py OUT BACKEND`` under mpiexec, srun or with torch's env:// variables; writes rank R's
findings to OUT/rankR.json.
"""

import hashlib
import json
import sys

import torch
import torch.distributed as dist

from hpcdl.distributed.ranks.env import rank_and_world
from hpcdl.distributed.group.lifecycle import init_distributed, shutdown
from hpcdl.log import setup_logging

out, backend = sys.argv[1], sys.argv[2]
if backend == "store":
    import store_backend  # noqa: F401  (a backend of one file: adds its row to the table)
setup_logging(rank_and_world()[0])
ctx = init_distributed(backend)
rank, world = ctx.rank, ctx.world_size
found = {"backend": dist.get_backend(), "rank": rank}
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.int16)
for dtype in DTYPES:
    t = torch.arange(6, dtype=dtype) + rank
    dist.all_reduce(t)
    found[f"sum {dtype}"] = t.tolist()
for op in ("MAX", "MIN", "PRODUCT"):
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        t = torch.tensor([1, 2, 3], dtype=dtype) * (rank + 2)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        found[f"{op.lower()} {dtype}"] = t.tolist()
for dtype in (torch.float32, torch.float16, torch.float64):
    t = torch.tensor([2.0 * (rank + 1)], dtype=dtype)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    found[f"avg {dtype}"] = t.item()
strided = torch.arange(12.0).reshape(3, 4)[:, 1] + rank  # not contiguous
dist.all_reduce(strided)
found["sum strided"] = strided.tolist()
for dtype in (torch.bfloat16, torch.float16, torch.int64, torch.float32):
    b = torch.full((3,), rank + 1, dtype=dtype)
    dist.broadcast(b, src=world - 1)
    found[f"broadcast {dtype}"] = b.tolist()
r = torch.full((4,), float(rank + 1))
dist.reduce(r, dst=0)
found["reduce to 0"] = r.tolist() if rank == 0 else None
parts = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
dist.all_gather(parts, torch.full((2,), rank, dtype=torch.int64))
found["allgather"] = [p.tolist() for p in parts]
flat = torch.zeros(2 * world, dtype=torch.float16)
getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(flat, torch.full((2,), rank + 0.5, dtype=torch.float16))
found["allgather single fp16"] = flat.tolist()
for elements in (2, 2**20):  # in place (this rank's part of the output as its input: optimizer.shard's), small and 4 MB
    flat = torch.full((elements * world,), -1.0)
    flat[rank * elements:(rank + 1) * elements] = torch.arange(elements) + 0.25 + rank
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(flat, flat[rank * elements:(rank + 1) * elements])
    found[f"allgather in place {elements}"] = flat.view(world, elements)[:, :2].tolist() + [
        torch.equal(flat, torch.cat([torch.arange(elements) + 0.25 + r for r in range(world)]))]
rs = torch.empty(2)
getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(rs, torch.arange(2.0 * world) * (rank + 1))
found["reduce_scatter"] = rs.tolist()
rl = torch.empty(2)
dist.reduce_scatter(rl, [torch.full((2,), float(q + 10 * rank)) for q in range(world)])
found["reduce_scatter list"] = rl.tolist()
objects = [None] * world
dist.all_gather_object(objects, {"rank": rank})
found["objects"] = objects
dist.barrier()
# A subgroup of rank 1 alone, then of both: new communicators over their ranks (dist.new_group is collective).
alone = dist.new_group([world - 1])
if rank == world - 1:
    t = torch.tensor([5.0])
    dist.all_reduce(t, group=alone)
    found["subgroup alone"] = t.item()
both = dist.new_group(list(range(world)))
t = torch.tensor([float(rank)])
dist.all_reduce(t, group=both)
found["subgroup all"] = t.item()
# Each rank decides alone where a small collective runs (MPI: inline or on the thread): here rank 0 queues it
# behind a large all-reduce still in flight while rank 1, which waited for that one, issues it with nothing queued.
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
# Small and large all-reduces in flight at once: on oneCCL the small ones go to c_comm_thread's C thread while nothing
# is queued on the Python thread, which lets them finish before it starts the large ones; one Work read as a future.
pending = [torch.full((1 << 20,) if i % 3 == 1 else (3,), float(rank + i)) for i in range(6)]
if rank == 1:
    __import__("time").sleep(0.5)  # rank 0's first small one waits on its thread while rank 0 issues the rest
works = [dist.all_reduce(t, async_op=True) for t in pending]
future = works[0].get_future()
for work in works:
    work.wait()
found["interleaved"] = [t[0].item() for t in pending]
found["future"] = future.wait()[0].tolist()
from hpcdl.distributed.group.python_backend import library_group  # noqa: E402

thread = getattr(library_group(), "thread", None)
found["c_comm_thread calls"] = thread.fast.issued() if getattr(thread, "fast", None) is not None else None
if found["c_comm_thread calls"] is not None:  # a large all-reduce too is made on the C thread: oneCCL sees one thread
    dist.all_reduce(torch.ones(1 << 20))
    found["large ones there"] = thread.fast.issued() - found["c_comm_thread calls"]
found["group class"] = [c.__name__ for c in type(library_group()).__mro__]
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
found["env"] = {k: v for k, v in __import__("os").environ.items() if k.startswith(("CCL_", "FI_"))}
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(found, f)
# DDP holds the group: free it while the interpreter is alive. A DDP object sits in reference cycles, so only a
# collection frees it; left to the finalizing interpreter's, the gloo group's run loop thread took the GIL
# there and was ended by pthread_exit inside a noexcept frame: 'terminate called without an active exception'
# (gdb, 2026-11-26: about 1 run in 5 of bucket_ranks.py on the 2-core EPYC).
del ddp
__import__("gc").collect()
shutdown(ctx)
