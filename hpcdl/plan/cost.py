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

:class:`StepModel` puts a step together: a node's compute time for its share of the batch (from a
measured throughput-against-batch curve), the all-reduce, the part of it hidden behind backward
(``overlap``), and the data loading, which runs beside the rest and limits only when it is slower. The
gradients go out in ``messages`` all-reduces (DDP's buckets), each paying the latency term once.

A comm hook changes two terms (:func:`hook_terms`): the bytes on the wire (``wire_fraction`` of the
gradient: half for fp16 and bf16, the kept chunks for chunk_sparse) and its own work per step
(``hook_s``: casting, or picking and packing chunks), measured by ``hpcdl bench sync``. The hierarchical
hook is the hierarchical algorithm.
"""

from __future__ import annotations

import dataclasses
import math

from hpcdl.errors import ConfigError
from hpcdl.launch.profiles import ClusterProfile

BACKWARD_SHARE = 2 / 3  # backward's part of a step's compute (about twice forward's), unless calibrated

__all__ = ["ALGORITHMS", "BatchCurve", "Cost", "Link", "StepModel", "allreduce_cost", "hierarchical",
           "hook_terms", "rabenseifner", "ring"]


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """An alpha-beta link: latency in seconds and bandwidth in bytes per second."""

    latency_s: float
    bandwidth_bytes_s: float

    @property
    def beta(self) -> float:
        return 1.0 / self.bandwidth_bytes_s

    @classmethod
    def of(cls, profile: ClusterProfile) -> Link:
        """A cluster profile's fabric."""
        if profile.network_latency_us is None or profile.network_gb_s is None:
            raise ConfigError(f"profile {profile.name} has no network latency and bandwidth; measure them with hpcdl "
                              f"bench allreduce (hpcdl plan --allreduce-json) or choose a profile that has them")
        return cls(latency_s=profile.network_latency_us * 1e-6, bandwidth_bytes_s=profile.network_gb_s * 1e9)


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


ALGORITHMS = {"ring": ring, "rabenseifner": rabenseifner}  # over all ranks
ALGORITHM_CHOICES = (*ALGORITHMS, "hierarchical")


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
        raise ConfigError(f"all-reduce algorithm {algorithm!r}; choose one of {', '.join(ALGORITHM_CHOICES)}")
    return ALGORITHMS[algorithm](n_bytes, nodes * ranks_per_node, network)


def hook_terms(hook: str, keep: float = 0.1, chunk: int = 32768) -> tuple[float, int]:
    """(bytes on the wire per gradient byte, all-reduces per bucket) of a comm hook: chunk_sparse sends the
    kept chunks and, before them, one L1 norm per chunk."""
    if hook in ("fp16", "bf16"):
        return 0.5, 1
    if hook == "chunk_sparse":
        return keep + 1 / chunk, 2
    return 1.0, 1


@dataclasses.dataclass(frozen=True, slots=True)
class BatchCurve:
    """A node's compute throughput (images/s) against its batch, from measured ``(batch, images/s)`` points.

    Between points it interpolates linearly in the batch; beyond them it holds the nearest point's
    throughput (a node does not get faster with a batch it was not measured at).
    """

    points: tuple[tuple[float, float], ...]

    def __post_init__(self):
        if not self.points or any(b <= 0 or v <= 0 for b, v in self.points):
            raise ConfigError(f"throughput curve {self.points}: give (batch, images/s) points, all > 0")
        object.__setattr__(self, "points", tuple(sorted(self.points)))

    def __call__(self, batch: float) -> float:
        pts = self.points
        if batch <= pts[0][0]:
            return pts[0][1]
        for (b0, v0), (b1, v1) in zip(pts, pts[1:]):
            if batch <= b1:
                return v0 + (v1 - v0) * (batch - b0) / (b1 - b0)
        return pts[-1][1]

    @classmethod
    def slowest(cls, curves: list[BatchCurve]) -> BatchCurve:
        """The nodes of one job step together, so the job's node is the slowest of them at every batch: at
        each batch any of them was measured at, the least throughput of all."""
        batches = sorted({b for c in curves for b, _ in c.points})
        return cls(tuple((b, min(c(b) for c in curves)) for b in batches))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepModel:
    """What a training step of one job costs, term by term (all times in seconds)."""

    gradient_bytes: float
    throughput: BatchCurve  # one node's compute, images/s against its batch
    network: Link
    ranks_per_node: int = 1
    algorithm: str = "ring"
    intra: Link | None = None  # the node's own link, for the hierarchical all-reduce
    messages: int = 1  # all-reduces per step (DDP's buckets): each pays the latency term, the bytes are split
    overlap: float = 0.0  # the fraction of backward that communication can hide behind (0: none, 1: all)
    backward_share: float = BACKWARD_SHARE
    data_images_s: float | None = None  # one node's loading capacity; None: not a limit
    wire_fraction: float = 1.0  # bytes on the wire per gradient byte (the comm hook's compression)
    hook_s: float = 0.0  # the comm hook's own work per step (bench sync), beside the wire

    def terms(self, nodes: int, global_batch: float) -> dict[str, float]:
        """compute, allreduce (its latency and bandwidth parts), hidden, exposed, data and step times, and
        the throughput and efficiency that follow; efficiency = compute / step, the same per-node batch
        with free communication."""
        if not 0 <= self.overlap <= 1:
            raise ConfigError(f"overlap={self.overlap}: a fraction of backward, between 0 and 1")
        batch = global_batch / nodes
        compute = batch / self.throughput(batch)
        multi = nodes * self.ranks_per_node > 1
        comm = allreduce_cost(self.algorithm, self.gradient_bytes * self.wire_fraction, nodes, self.ranks_per_node,
                              self.network, self.intra) if multi else Cost(0.0, 0.0)
        hook = self.hook_s if multi else 0.0
        comm = Cost(comm.latency_s * self.messages, comm.bandwidth_s + hook)
        hidden = min(comm.total_s, self.overlap * self.backward_share * compute)
        exposed = comm.total_s - hidden
        data = batch / self.data_images_s if self.data_images_s else 0.0
        step = max(compute + exposed, data)
        return {"batch_per_node": batch, "compute_s": compute, "allreduce_s": comm.total_s,
                "allreduce_latency_s": comm.latency_s, "allreduce_bandwidth_s": comm.bandwidth_s - hook, "hook_s": hook,
                "hidden_s": hidden, "exposed_s": exposed, "data_s": data, "step_s": step,
                "images_s": global_batch / step, "efficiency": compute / step}

    def time_to_train(self, nodes: int, global_batch: float, epochs: float, train_images: int) -> float:
        """Seconds for ``epochs`` passes over ``train_images`` at ``global_batch``, a step per full batch."""
        steps = math.ceil(train_images / global_batch)
        return epochs * steps * self.terms(nodes, global_batch)["step_s"]
