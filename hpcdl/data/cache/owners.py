"""Which node owns each sample: the node its shard is dealt to. The shards go to the job's nodes by their sample
counts, the largest first, each to the node that holds the fewest samples so far.

A node opens only the shards it owns, so each shard is opened once per job rather than once per node: every
open is a request to the filesystem's metadata server, and its client reads ahead at an open (MooseFS's about
1.5 MB of an 8 MB shard on the local cluster; Lustre's readahead reaches megabytes too), bytes wasted unless
the node then reads the rest of the shard, which the owner does. The owner serves the shard's samples to the
other nodes. Every node computes the same array from the shard sizes and the node count alone, so no node asks
another where a sample lives, whatever the sampler, the epoch, the rank count or the point a run resumed at.
"""

from __future__ import annotations

import heapq

import numpy as np


def shard_owners(shard_sizes: list[int], nodes: int) -> np.ndarray:
    """The owning node of every shard (int32): the largest shards first, each to the least loaded node (ties: the
    lower shard index, the lower node)."""
    if nodes < 1:
        raise ValueError(f"{nodes} nodes: a job has at least one")
    owners = np.zeros(len(shard_sizes), dtype=np.int32)
    load = [(0, n) for n in range(nodes)]
    for s in sorted(range(len(shard_sizes)), key=lambda s: (-shard_sizes[s], s)):
        held, node = heapq.heappop(load)
        owners[s] = node
        heapq.heappush(load, (held + shard_sizes[s], node))
    return owners


def sample_owners(shard_sizes: list[int], nodes: int) -> np.ndarray:
    """The owning node of every sample of the dataset (int32), its shard's."""
    return np.repeat(shard_owners(shard_sizes, nodes), np.asarray(shard_sizes, dtype=np.int64))
