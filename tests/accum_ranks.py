"""One rank of test_accum: epochs whose last optimizer step has fewer micro-batches than loop.accum_steps, on
real gloo ranks, through hpcdl's DDP (:func:`hpcdl.distributed.gradients.ddp.data_parallel`), the sampler and the stepper
as the trainer calls it.

    accum_ranks.py MODE OUT   (torch's env:// variables)

39 samples (divides nothing), micro-batches of 3, loop.accum_steps=4: 20 samples per rank on 2 ranks, a step of
4 micro-batches, then one of 3, 3 and 2 images. After every step each rank gathers every rank's weights
(replicas: all bitwise rank 0's?) and checks the step against a reference: plain SGD on the mean loss over the
images every rank trained in it, from the weights before it (the gradient divided by what was done). Writes
OUT/rankR.json: per step, the micro-batches' sizes, whether the replicas agree, the largest difference from the
reference.
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from hpcdl.data.sampler import DistributedShardSampler
from hpcdl.distributed.gradients.ddp import data_parallel
from hpcdl.distributed.group.lifecycle import init_distributed, shutdown
from hpcdl.train.step import Stepper, criterion

MICRO, ACCUM, LR, SHARDS = 3, 4, 0.5, [10, 13, 9, 7]

mode, out = sys.argv[1:3]
ctx = init_distributed("gloo")
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(sum(SHARDS), 8, generator=g), torch.randint(0, 4, (sum(SHARDS),), generator=g))
torch.manual_seed(1)  # the same initial weights on every rank (DDP would broadcast rank 0's anyway)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
net, comm = data_parallel(model, ctx.env, ctx.group)
optimizer = torch.optim.SGD(model.parameters(), lr=LR)
schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
stepper = Stepper(net, criterion(), optimizer, schedule, comm=comm, group=ctx.group)
sampler = DistributedShardSampler(SHARDS, ctx.world_size, ctx.rank, mode=mode, seed=3)
loader = DataLoader(data, batch_size=MICRO, sampler=sampler)
taken = []


def batches():
    """As the trainer's: the sampler advances by each batch the step takes."""
    for x, y in loader:
        sampler.advance(len(y))
        taken.append((x, y))
        yield x, y


def flat(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


steps = []
for epoch in range(2):
    sampler.set_epoch(epoch)
    epoch_batches = batches()
    while True:
        before, left = copy.deepcopy(model), len(sampler)
        taken.clear()
        if stepper.step(epoch_batches, ACCUM, left=left) is None:
            break
        trained = [None] * ctx.world_size
        dist.all_gather_object(trained, [(x, y) for x, y in taken])
        xs = torch.cat([x for rank in trained for x, _ in rank])
        ys = torch.cat([y for rank in trained for _, y in rank])
        torch.nn.functional.cross_entropy(before(xs), ys).backward()
        with torch.no_grad():
            for p in before.parameters():
                p -= LR * p.grad
        weights = [torch.empty_like(flat(model)) for _ in range(ctx.world_size)]
        dist.all_gather(weights, flat(model))
        steps.append({"epoch": epoch, "left": left, "micro": [len(y) for _, y in taken],
                      "replicas_equal": all(torch.equal(w, weights[0]) for w in weights),
                      "from_reference": float((flat(model) - flat(before)).abs().max())})
with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as f:
    json.dump({"steps": steps, "per_rank": sampler.num_samples}, f)
del net  # DDP holds the group: free it while the interpreter is alive (see bucket_ranks.py)
__import__("gc").collect()
shutdown(ctx)
