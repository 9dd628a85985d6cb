"""One rank of test_evaluate: evaluate a fixed model over packed shards; rank 0 writes the result."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from hpcdl.data.dataset import ShardDataset
from hpcdl.data.sampler import DistributedShardSampler
from hpcdl.data.transforms import EvalTransform, normalize_batch
from hpcdl.models.tiny import TinyCNN
from hpcdl.train.evaluate import evaluate

root, mode, out = sys.argv[1:4]
world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    dist.init_process_group("gloo")
rank = dist.get_rank() if world > 1 else 0
ds = ShardDataset(root, EvalTransform(resize=40, size=32))
sampler = DistributedShardSampler(ds.shard_sizes, num_replicas=world, rank=rank, mode=mode, shuffle=False)
torch.manual_seed(0)
model = TinyCNN(num_classes=len(ds.classes))
result = evaluate(model, DataLoader(ds, batch_size=4, sampler=sampler, num_workers=1), normalize_batch)
if rank == 0:
    with open(out, "w") as f:
        json.dump(result, f)
if world > 1:
    dist.destroy_process_group()
