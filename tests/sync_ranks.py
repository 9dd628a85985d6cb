"""One rank of test_sync: DDP through hpcdl's gradient sync with a backend and each of the comm hooks named.

For each hook in turn, in one process (a rank's start costs more than all four checks): a fresh model, one
step's averaged gradients checked against a plain all-reduce of the same local gradients, then 20 steps
trained and a digest of the weights. Writes OUT/HOOK/rankR.json.
"""

import copy
import gc
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

from hpcdl.distributed.gradients.ddp import data_parallel
from hpcdl.distributed.group.lifecycle import init_distributed, shutdown
from hpcdl.distributed.ranks.env import rank_and_world
from hpcdl.log import setup_logging

out, backend, hooks = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
setup_logging(rank_and_world()[0])
ctx = init_distributed(backend)
rank = ctx.rank


def check(hook: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    reference = copy.deepcopy(model)
    net, timer = data_parallel(model, ctx.env, ctx.group, hook=hook, backend=ctx.backend.name, bucket_cap_mb=0.02)
    nodes = getattr(timer.hook_state, "nodes", None)

    torch.manual_seed(100 + rank)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    torch.nn.functional.cross_entropy(net(x), y).backward()
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    errors = []
    for p, q in zip(model.parameters(), reference.parameters()):
        plain = q.grad.clone()
        dist.all_reduce(plain)
        plain /= ctx.world_size
        errors.append((p.grad - plain).abs().max().item() / max(plain.abs().max().item(), 1e-12))

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt.zero_grad()
    for step in range(20):
        x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    return {"rank": rank, "backend": dist.get_backend(), "hook": hook, "max_rel_error": max(errors),
            "weights": digest, "world": ctx.world_size, "nodes": nodes}


for hook in hooks:
    print(f"rank {rank}: hook {hook}", flush=True)  # a failure's traceback follows the hook it ran
    result = check(hook)
    os.makedirs(f"{out}/{hook}", exist_ok=True)
    with open(f"{out}/{hook}/rank{rank}.json", "w") as f:
        json.dump(result, f)
# The checks are written: leave without the interpreter's finalization, where a rank of the fp16 gloo case
# ended in 'terminate called without an active exception' in 2 of 4 clean-clone CI runs (never reproduced
# alone, nor with the CPUs loaded; issue 29's note). The group is shut down first, as a training job does.
gc.collect()  # the last hook's DDP goes before its group
shutdown(ctx)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
