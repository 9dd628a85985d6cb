"""One rank of test_data_ranks: read an epoch through a DataLoader, allreduce once per batch like DDP."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from hpcdl.data.dataset import ShardDataset
from hpcdl.data.sampler import DistributedShardSampler
from hpcdl.data.transforms import Augment

root, mode, out = sys.argv[1:4]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
ds = ShardDataset(root, Augment("imagenet", 32))
sampler = DistributedShardSampler(ds.shard_sizes, num_replicas=world, rank=rank, mode=mode, seed=7)
loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2)
epochs = []
for epoch in range(2):
    sampler.set_epoch(epoch)
    seen, steps = [i for i, _ in sampler.indices()], 0
    for images, labels in loader:
        dist.all_reduce(torch.ones(1))  # a rank with fewer batches would leave the other waiting here
        steps += 1
    epochs.append({"indices": [int(i) for i in seen], "steps": steps})
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(epochs, f)
dist.destroy_process_group()
