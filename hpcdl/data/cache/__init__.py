"""The node cache (``data.cache=node``): each byte of the training set read from the shared filesystem once per
job, not once per node or per epoch.

- :mod:`~hpcdl.data.cache.owners`: which node owns each sample: the node its shard is dealt to, from the shard
  sizes and the node count alone, so every node computes the same map without asking anyone. That node opens the
  shard (once per job), reads the sample from the shared filesystem, keeps it, and serves it to the others.
- :mod:`~hpcdl.data.cache.agent`: one process per node (started by the node's local rank 0), the only one of the
  node that opens the shards. It serves the node's ranks and their loader workers and the other nodes' agents over
  TCP, prefetches the node's samples in the order its ranks announced, and keeps its own samples in RAM within a
  byte budget.
- :mod:`~hpcdl.data.cache.client`: what a rank and each of its workers hold: a connection to the node's agent, the
  check of each record's CRC32, and the fall back to reading the shard itself when the agent is gone.
"""
