"""What a node's cache agent is given (:class:`AgentSpec`), what it holds of a sample (:class:`Record`) and what it
counts (:class:`Counters`): the facts shared by the agent (:mod:`hpcdl.data.cache.agent`), its process and the rank
that starts it (:mod:`hpcdl.data.cache.client`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["AgentSpec", "Counters", "Record"]


@dataclass
class AgentSpec:
    root: str
    paths: list[str]  # the shards, in the manifest's order
    counts: list[int]  # their images
    owners: np.ndarray  # the owning node of each sample (int32)
    node: int  # this node's number
    budget: int  # bytes of owned samples kept in RAM
    window: int  # samples prefetched ahead of the readers
    nodes: int = 1  # the job's nodes: with more than one, another node's sample waits for PEERS
    host: str = "0.0.0.0"  # the address to listen on: the one the job's nodes reach this node at
    fetchers: int = 4  # threads fetching ahead


@dataclass(slots=True)
class Record:
    data: bytes
    label: int
    crc: int
    version: int


@dataclass
class Counters:
    source_reads: int = 0  # samples read from the shared filesystem
    source_bytes: int = 0
    source_opens: int = 0  # shards opened
    source_again: int = 0  # samples read from the shared filesystem a second time or more (beyond the budget)
    peer_reads: int = 0  # samples fetched from other nodes' agents
    peer_bytes: int = 0
    peer_exchanges: int = 0  # round trips to other nodes' agents for them (a prefetched run of samples: one)
    served_to_peers: int = 0  # samples sent to other nodes' agents
    kept_hits: int = 0  # local reads answered from the samples kept here
    ahead_hits: int = 0  # local reads answered from the prefetch
    waited: int = 0  # local reads fetched while the reader waited
    prefetch_errors: int = 0
    peer_failures: int = 0  # samples a peer was slow on or failed: read from the shard instead
    kept_samples: int = 0
    kept_bytes: int = 0
    peers_lost: list = field(default_factory=list)
