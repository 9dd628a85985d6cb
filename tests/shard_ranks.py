"""One rank of test_shard: each optimizer that can be sharded, replicated and sharded side by side over the same
gradients (every rank draws the same ones, as an all-reduce leaves them), three steps; rank r writes what it saw to
OUT/rank-r.json: whether the weights and (rank 0) the gathered state equal the replicated ones bit for bit, the
bytes of state it holds against the replicated optimizer's, and whether a whole state loaded back keeps only its
share and steps on alike. Then with the gradients reduce-scattered (``scatter=True``): each rank draws its own, the
replicated optimizer steps on their mean; the largest difference of a weight, and a digest of this rank's weights
(the replicas' must match), and per step the reduce-scatters backward started, of how many; once set directly, once made by a backward that starts the reduce-scatters itself."""

import copy
import hashlib
import io
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import hpcdl.distributed.gradients.ddp as ddp_module
from hpcdl import names
from hpcdl.distributed.ranks.env import discover
from hpcdl.errors import ConfigError
from hpcdl.optim.config import OptimConfig
from hpcdl.optim.factory import build_optimizer
from hpcdl.optim.modes import ModelWeights
from hpcdl.optim.shard import ShardedOptimizer, state_bytes

out, backend = sys.argv[1], sys.argv[2]
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()


def model() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 16, 3), nn.BatchNorm2d(16), nn.Conv2d(16, 16, 3),
                         nn.Flatten(), nn.Linear(16, 12), nn.Linear(12, 10))


def steps(net: nn.Module, optimizer, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in net.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def scattered_steps(cfg: OptimConfig, n: int, backward: bool = False, ahead: bool = True
                    ) -> tuple[float, str, list[int], int, dict]:
    """``n`` steps sharded with the gradients reduce-scattered, each rank's its own, against the replicated optimizer
    on their mean: the largest difference of a weight, and the digest of this rank's weights. With ``backward``, the
    gradients come from a backward armed as the trainer's last micro-batch's, its reduce-scatters started by it in
    segments of 1 KB (tensors split across them), the model channels_last, one tensor left without a gradient, and
    the all-gather taken in by the next forward (``ahead``): the weights after it, before backward, as replicated, and
    after each step every rank holds rank 0's buffers (the forward's input differs by rank). Without ``ahead`` (the
    default): the weights views of the all-gather's buffer, one of them given new memory before the second step (as
    ``p.data = ...`` or a module's ``to()`` would): it is bound again."""
    own, ref = model(), model()
    if backward:  # the conv weights channels_last, as the trainer lays them: copied as laid in memory
        own, ref = own.to(memory_format=torch.channels_last), ref.to(memory_format=torch.channels_last)
    sharded = ShardedOptimizer(build_optimizer(own, cfg), scatter=True, bucket_bytes=1024 if backward else 25 * 2**20,
                               order=list(own.parameters()) if backward else None,  # as the trainer's
                               ahead=own if backward and ahead else None)
    replicated = build_optimizer(ref, cfg)
    g, started, checks = torch.Generator().manual_seed(3), [], {"ahead": []}
    for step in range(n):
        if backward and ahead and step:  # the forward's hooks take the last all-gather in, each module's before it runs
            own(torch.randn(2, 3, 7, 7, generator=g) + rank)  # batch norm's statistics: each rank its own
            checks["ahead"].append((sharded.ahead.pending, max((p - q).abs().max().item()
                                                               for p, q in zip(own.parameters(), ref.parameters()))))
        loss = 0
        for i, (p, q) in enumerate(zip(own.parameters(), ref.parameters())):
            drawn = [torch.randn(p.shape, generator=g) for _ in range(world)]  # every rank's, alike on every rank
            if backward and i == 1:
                continue  # no gradient, on any rank
            if backward:
                loss = loss + (p * drawn[rank]).sum()
            else:
                p.grad = drawn[rank].clone()
            q.grad = sum(d / world for d in drawn)
        if backward:
            sharded.arm()
            loss.backward()
            started.append(sharded.started)
        if backward and ahead:  # the step's end broadcasts rank 0's buffers (DDP's before-forward broadcast, moved)
            checks.setdefault("own_buffers", []).append(buffer_digest(own))
        if backward and not ahead and step == 1:
            first = next(own.parameters())
            first.data = first.data.clone()
        sharded.step()
        if backward and ahead:
            checks.setdefault("buffers", []).append(buffer_digest(own))
        replicated.step()
        sharded.zero_grad(set_to_none=True)
        replicated.zero_grad(set_to_none=True)
    sharded.settle()
    diff = max((p - q).abs().max().item() for p, q in zip(own.parameters(), ref.parameters()))
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in own.parameters())).hexdigest()
    flats = {w.untyped_storage().data_ptr() for w in sharded._weights.values()}
    checks["views"] = [p.untyped_storage().data_ptr() in flats for p in own.parameters()]
    if backward and not ahead:  # a checkpoint holds the tensors, not the padded buffer they are views of (1.7x here)
        checks["saved"] = [saved_bytes(ModelWeights(own, sharded).state_dict()), saved_bytes(ref.state_dict())]
    if backward:  # a tensor frozen after the layout counted it is refused; close() leaves no hook behind
        first = next(own.parameters())
        first.requires_grad_(False)
        try:
            sharded.arm()
            checks["frozen"] = "not refused"
        except ConfigError as e:
            checks["frozen"] = str(e)
        first.requires_grad_(True)
        sharded.close()
        checks["hooks_left"] = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
                                   for p in own.parameters()) + sum(len(m._forward_pre_hooks) for m in own.modules())
    return diff, digest, started, len(sharded._sequence), checks


def saved_bytes(state: dict) -> int:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.tell()


def buffer_digest(net: nn.Module) -> str:
    return hashlib.sha256(b"".join(b.numpy().tobytes() for b in net.buffers())).hexdigest()


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(x, y) if torch.is_tensor(x) else same(x, y) if isinstance(x, dict) else x == y
               for x, y in ((a[k], b[k]) for k in a))


seen = {}
for name, row in names.OPTIMIZER_TABLE.items():
    if row.schedule_free:
        continue
    cfg = OptimConfig(name=name, lr=0.01, shard=True)
    plain, dealt = model(), model()
    replicated = build_optimizer(plain, cfg)
    sharded = ShardedOptimizer(build_optimizer(dealt, cfg))
    steps(plain, replicated, 3, seed=1)
    steps(dealt, sharded, 3, seed=1)
    whole = sharded.state_dict()  # collective
    weights = same(plain.state_dict(), dealt.state_dict())
    # each group's step counter on every rank, as replicated (LAMB's; Muon's AdamW groups', not its matrices')
    steps_alike = [g.get("step") for g in sharded.param_groups] == [g.get("step") for g in replicated.param_groups]
    state = same(whole, replicated.state_dict()) if rank == 0 else whole is None
    again = model()
    resumed = ShardedOptimizer(build_optimizer(again, cfg))
    again.load_state_dict(dealt.state_dict())
    resumed.load_state_dict(copy.deepcopy(replicated.state_dict()))  # as read from a file: no tensor shared
    steps(again, resumed, 2, seed=2)
    steps(plain, replicated, 2, seed=2)
    seen[name] = {
        "weights": weights, "state": state, "steps": steps_alike,
        "bytes": sharded.state_bytes(), "replicated_bytes": state_bytes(replicated),
        "resumed": all(torch.equal(p, q) for p, q in zip(plain.parameters(), again.parameters())),
        "resumed_bytes": resumed.state_bytes(), "owners": sorted(set(sharded.owner)),
    }
    seen[name]["scatter_diff"], seen[name]["scatter_digest"], _, _, _ = scattered_steps(cfg, 3)
    (seen[name]["overlap_diff"], seen[name]["overlap_digest"], seen[name]["started"],
     seen[name]["segments"], seen[name]["checks"]) = scattered_steps(cfg, 3, backward=True)
    (seen[name]["bound_diff"], seen[name]["bound_digest"], _, _,
     seen[name]["bound_checks"]) = scattered_steps(cfg, 3, backward=True, ahead=False)
# data_parallel without DDP's buffer broadcast before each forward (optimizer.gather_ahead), on a torch without
# forward_sync_buffers (a fake: its signature without the argument): rank 0's buffers still reach every rank at
# construction, as they do through forward_sync_buffers=False on this torch
for fake_old_torch in (False, True):
    net = model()
    with torch.no_grad():
        for b in net.buffers():
            b.add_(rank + 1)
    args = ddp_module._DDP_ARGS
    if fake_old_torch:
        ddp_module._DDP_ARGS = {k: v for k, v in args.items() if k != "forward_sync_buffers"}
    try:
        wrapped, _ = ddp_module.data_parallel(net, discover(), broadcast_buffers=False)
    finally:
        ddp_module._DDP_ARGS = args
    seen.setdefault("construction_buffers", []).append(
        [buffer_digest(net), wrapped.forward_sync_buffers])
with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
    json.dump(seen, f)
dist.destroy_process_group()
