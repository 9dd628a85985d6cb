"""Which node owns each sample: the node whose ranks read it in one epoch of the sampler's order.

Every node computes the same array from the same inputs (the sampler's seed, mode and shards, the epoch, the
ranks' nodes), so no node asks another where a sample lives. A sample padding gave to a second rank keeps its
first reader as its owner.
"""

from __future__ import annotations

import numpy as np

from hpcdl.data.sampler import DistributedShardSampler


def sample_owners(sampler: DistributedShardSampler, epoch: int, node_of_rank: list[int]) -> np.ndarray:
    """The owning node of every sample (int32, one entry per sample of the dataset) in ``epoch``'s whole order at
    the sampler's number of ranks, before any cut."""
    world = sampler.num_replicas
    if len(node_of_rank) != world:
        raise ValueError(f"node_of_rank names {len(node_of_rank)} ranks, the sampler has {world}")
    rank_of = np.full(sampler.total, -1, dtype=np.int64)
    saved = sampler.epoch
    sampler.epoch = epoch  # _global and _deal read it; no other state is touched
    try:
        if sampler.mode == "global":
            # the permutation's position p goes to rank p % world (padding wraps to the first positions)
            order = np.asarray([i for i, _ in sampler._global(0, 1)], dtype=np.int64)[:sampler.total]
            rank_of[order] = np.arange(sampler.total) % world
        else:
            for rank, shards in enumerate(sampler._deal(world)):
                for s in shards:
                    rank_of[sampler.starts[s]:sampler.starts[s + 1]] = rank
    finally:
        sampler.epoch = saved
    return np.asarray(node_of_rank, dtype=np.int32)[rank_of]
