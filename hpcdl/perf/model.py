"""The communication terms of ``hpcdl plan``: alpha-beta costs of the all-reduce algorithms.

A message of ``n`` bytes between two ranks costs ``alpha + n * beta``: ``alpha`` the latency in seconds,
``beta`` the seconds per byte (1 / bandwidth). For an all-reduce of ``n`` bytes over ``p`` ranks
(Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH", 2005;
the reduction's arithmetic is left out: at CPU memory speed it is small next to the network's):

- ring: a reduce-scatter then an allgather, each ``p - 1`` steps of ``n / p`` bytes:
  ``2 (p - 1) alpha + 2 (p - 1) / p * n beta``;
- Rabenseifner: the reduce-scatter by recursive halving, the allgather by recursive doubling:
  ``2 log2(p) alpha + 2 (p - 1) / p * n beta`` for ``p`` a power of two. Otherwise the ``p - p'`` ranks
  above the largest power of two ``p'`` first hand their whole vector to a partner and get the result
  back at the end: ``+ 2 (alpha + n beta)``, and the rest runs on ``p'`` ranks;
- hierarchical (``sync.hook=hierarchical``): a reduce to one leader per node, an all-reduce across the
  ``nodes`` leaders (ring or Rabenseifner), and a broadcast back, the node steps over the node's own
  links (``intra``). The reduce and the broadcast are each one step per other local rank here (a
  linear fan-in/out, which is what a shared-memory node does): ``(r - 1) (alpha_i + n beta_i)`` each.

Each function returns a :class:`Cost` whose two terms stay apart, so that ``hpcdl plan`` can show which
one dominates.
"""

from __future__ import annotations

import dataclasses
import math

from hpcdl.errors import ConfigError

__all__ = ["ALGORITHMS", "Cost", "Link", "allreduce_cost", "hierarchical", "rabenseifner", "ring"]


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """An alpha-beta link: latency in seconds and bandwidth in bytes per second."""

    latency_s: float
    bandwidth_bytes_s: float

    @property
    def beta(self) -> float:
        return 1.0 / self.bandwidth_bytes_s


@dataclasses.dataclass(frozen=True, slots=True)
class Cost:
    latency_s: float  # the alpha terms
    bandwidth_s: float  # the beta terms

    @property
    def total_s(self) -> float:
        return self.latency_s + self.bandwidth_s

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.latency_s + other.latency_s, self.bandwidth_s + other.bandwidth_s)


def _check(n_bytes: float, p: int) -> None:
    if p < 1 or n_bytes < 0:
        raise ConfigError(f"all-reduce of {n_bytes} bytes over {p} ranks: need at least 1 rank and 0 bytes")


def ring(n_bytes: float, p: int, link: Link) -> Cost:
    _check(n_bytes, p)
    return Cost(2 * (p - 1) * link.latency_s, 2 * (p - 1) / p * n_bytes * link.beta)


def rabenseifner(n_bytes: float, p: int, link: Link) -> Cost:
    _check(n_bytes, p)
    core = 2 ** int(math.log2(p))  # the largest power of two <= p
    cost = Cost(2 * math.log2(core) * link.latency_s, 2 * (core - 1) / core * n_bytes * link.beta)
    if core != p:  # the ranks above it fold in first and get the result back at the end
        cost += Cost(2 * link.latency_s, 2 * n_bytes * link.beta)
    return cost


ALGORITHMS = {"ring": ring, "rabenseifner": rabenseifner}


def hierarchical(n_bytes: float, nodes: int, ranks_per_node: int, network: Link, intra: Link,
                 across: str = "ring") -> Cost:
    """Reduce in the node, all-reduce across the nodes' leaders with ``across``, broadcast in the node."""
    if ranks_per_node < 1:
        raise ConfigError(f"hierarchical all-reduce: {ranks_per_node} ranks per node; need at least 1")
    in_node = Cost((ranks_per_node - 1) * intra.latency_s, (ranks_per_node - 1) * n_bytes * intra.beta)
    return in_node + ALGORITHMS[across](n_bytes, nodes, network) + in_node


def allreduce_cost(algorithm: str, n_bytes: float, nodes: int, ranks_per_node: int, network: Link,
                   intra: Link | None = None) -> Cost:
    """The all-reduce of a job of ``nodes`` x ``ranks_per_node`` ranks: ``ring`` and ``rabenseifner`` over all
    ranks on the network (the slowest link sets the pace), ``hierarchical`` (ring across the nodes)."""
    if algorithm == "hierarchical":
        if intra is None:
            raise ConfigError("the hierarchical all-reduce needs the node's own link (intra)")
        return hierarchical(n_bytes, nodes, ranks_per_node, network, intra)
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"all-reduce algorithm {algorithm!r}; choose one of ring, rabenseifner, hierarchical")
    return ALGORITHMS[algorithm](n_bytes, nodes * ranks_per_node, network)
