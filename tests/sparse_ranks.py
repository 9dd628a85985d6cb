"""One rank of test_sync's conservation check: chunk_sparse over K steps on random gradients."""

import json
import sys

import torch
import torch.distributed as dist

from hpcdl.distributed.gradients.hooks import ChunkSparse, sparse_allreduce

out, fp16 = sys.argv[1], sys.argv[2] == "fp16"
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
state = ChunkSparse(keep=0.1, chunk=1000, dense_steps=1, fp16=fp16)
torch.manual_seed(rank)
grads_sum, applied_sum, sent = torch.zeros(100_500, dtype=torch.float64), torch.zeros(100_500, dtype=torch.float64), []
for step in range(6):
    g = torch.randn(100_500) * (1 + step)
    grads_sum += g.double()
    state.total_elements = state.sent_elements = 0
    applied_sum += sparse_allreduce(state, 0, g.clone())[0].double() * world  # the hook returns the average
    sent.append(state.sent_elements)
    state.step += 1
dist.all_reduce(grads_sum)
residual = state.residuals[0].double()
dist.all_reduce(residual)
error = ((applied_sum + residual - grads_sum).abs().max() / grads_sum.abs().max()).item()
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump({"error": error, "sent": sent}, f)
dist.destroy_process_group()
