"""DDP communication hooks, chosen by name in the config (``loop.comm_hook``), on every backend.

- ``none``: DDP's own bucket all-reduce.
- ``fp16`` / ``bf16``: each bucket is all-reduced in half precision (half the bytes) and written back
  in fp32; torch's compression hooks. bf16 keeps fp32's range, fp16 its precision.
- ``hierarchical``: reduce to one leader rank per node, all-reduce across the leaders, broadcast within
  the node. The three steps run in order on a thread of this module, so backward keeps going while a
  bucket is reduced; every rank submits buckets in the same order, so the collectives match.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from hpcdl.dist.env import RankEnv
from hpcdl.errors import ConfigError

__all__ = ["HOOKS", "Hierarchy", "make_hook", "node_groups"]

HOOKS = ("none", "fp16", "bf16", "hierarchical")


@dataclasses.dataclass(slots=True)
class Hierarchy:
    """The groups of a two-level all-reduce, built once (``dist.new_group`` is collective)."""

    node_group: dist.ProcessGroup
    leader: int  # global rank of this node's leader
    leaders: dist.ProcessGroup | None  # None on ranks that lead no node
    world_size: int
    nodes: int
    pool: concurrent.futures.ThreadPoolExecutor


def node_groups(env: RankEnv, backend: str | None = None) -> Hierarchy:
    """One group per node and one of the nodes' first ranks (collective).

    Nodes are the launcher's (``SLURM_NODEID`` under srun; block placement under mpiexec, see
    :mod:`hpcdl.dist.env`), so several slurmd on one host count as the nodes Slurm says they are.
    """
    placed = [None] * env.world_size
    dist.all_gather_object(placed, env.node_rank)
    nodes = list(dict.fromkeys(placed))  # first-seen order
    members = {n: [r for r, x in enumerate(placed) if x == n] for n in nodes}
    node_group = None
    for node in nodes:  # every rank creates every group, in the same order
        group = dist.new_group(members[node], backend=backend)
        if node == env.node_rank:
            node_group = group
    leader_ranks = [members[n][0] for n in nodes]
    leaders = dist.new_group(leader_ranks, backend=backend)
    return Hierarchy(node_group=node_group, leader=members[env.node_rank][0], nodes=len(nodes),
                     leaders=leaders if env.rank in leader_ranks else None, world_size=env.world_size,
                     pool=concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hpcdl-hier"))


def _hierarchical(state: Hierarchy, bucket: dist.GradBucket) -> torch.futures.Future:
    tensor = bucket.buffer()
    future: torch.futures.Future = torch.futures.Future()

    def run():
        try:
            dist.reduce(tensor, dst=state.leader, group=state.node_group)
            if state.leaders is not None:
                dist.all_reduce(tensor, group=state.leaders)
            dist.broadcast(tensor, src=state.leader, group=state.node_group)
            future.set_result(tensor.div_(state.world_size))
        except Exception as exc:
            future.set_exception(exc)

    state.pool.submit(run)
    return future


def make_hook(name: str, env: RankEnv, group=None, backend: str | None = None):
    """(state, hook function) for DDP's ``register_comm_hook``; ``none`` is DDP's plain all-reduce."""
    if name not in HOOKS:
        raise ConfigError(f"loop.comm_hook={name!r}; choose one of {', '.join(HOOKS)}")
    if name == "hierarchical":
        return node_groups(env, backend), _hierarchical
    return group, {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
                   "bf16": default_hooks.bf16_compress_hook}[name]
