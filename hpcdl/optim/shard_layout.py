"""How ``optimizer.shard`` deals the tensors out (:func:`deal`, by :func:`update_cost`) and lays them in its
buffers (:func:`laid`), and the collectives it calls (:mod:`hpcdl.optim.shard`, :mod:`hpcdl.optim.shard_ahead`)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["ALL_GATHER", "ELEMENTWISE", "REDUCE_SCATTER", "bind", "deal", "dense", "laid", "rebind", "update_cost"]

# torch 2.14 renamed all_gather_into_tensor and reduce_scatter_tensor (and warns on the old names); earlier releases
# have only those
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def laid(flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``flat`` (``p.numel()`` elements of a buffer) as a tensor of ``p``'s shape laid out in memory as ``p`` is (its
    strides, where it is dense: channels_last), so that a copy between them is one of memory, not a transposition
    (26 against 45 ms for ResNet-50's channels_last weights on one thread here). Every rank lays a tensor out alike."""
    return torch.as_strided(flat, p.shape, p.stride()) if dense(p) else flat.view(p.shape)


def dense(p: torch.Tensor) -> bool:
    """Whether ``p``'s elements fill its memory in one of torch's layouts (contiguous or channels_last)."""
    return p.is_contiguous() or (p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last)) \
        or (p.dim() == 5 and p.is_contiguous(memory_format=torch.channels_last_3d))


@torch.no_grad()
def bind(layout: list, size: int) -> dict[int, torch.Tensor]:
    """Each tensor of ``layout`` (:meth:`hpcdl.optim.shard.ShardedOptimizer._lay_out`) made a view of its place in
    its owner's block, every rank's block side by side in one buffer per dtype (Megatron-LM's parameter buffer),
    with its value: the buffers, by the layout's index. The sharded step's all-gather then lands in the weights,
    this rank's block its input in place, and nothing is copied into a block or out of the gathered one (two
    passes over the weights that replicated does not make: 4.6 and 4.3 ms over ResNet-50's on one thread of the
    EPYC Zen 4). The tensors keep their layout in memory (channels_last: :func:`laid`)."""
    weights = {li: torch.empty(width * size, dtype=next(s[0] for s in shares if s).dtype)
               for li, (shares, _, width, _) in enumerate(layout) if width}
    rebind(weights, layout, rank=None)
    return weights


@torch.no_grad()
def rebind(weights: dict[int, torch.Tensor], layout: list, rank: int | None) -> None:
    """A tensor given other memory since :func:`bind` (``p.data = ...``, a module's ``to()``) made a view of its
    place again, ``rank``'s own with its value (every rank's with ``None``: :func:`bind`'s new buffers): else the
    all-gather would land beside it."""
    for li, flat in weights.items():
        shares, _, width, _ = layout[li]
        for r, share in enumerate(shares):
            at = r * width
            for p in share:
                if p.data_ptr() != flat[at:].data_ptr():
                    view = laid(flat[at:at + p.numel()], p)
                    if rank is None or r == rank:
                        view.copy_(p)
                    p.data = view
                at += p.numel()


ELEMENTWISE = 10  # an element-wise update's cost per element, in the units of a matrix product's multiply-adds


def update_cost(p: torch.Tensor, group: dict, optimizer: torch.optim.Optimizer) -> float:
    """The counted cost of ``p``'s update: ``ELEMENTWISE`` per element, plus, where the optimizer orthogonalizes
    it (Muon's adapted matrices), the Newton-Schulz iteration's multiply-adds on its ``out x rest`` view."""
    cost = ELEMENTWISE * p.numel()
    steps = getattr(optimizer, "orthogonalize_steps", 0)
    if steps and group.get("adapt") and p.ndim >= 2:
        m, n = sorted((p.shape[0], math.prod(p.shape[1:])))  # x is m x n, m <= n
        cost += steps * (2 * m * m * n + m ** 3)  # x x^T, gram @ gram, (..) @ x
    return float(cost)


def deal(costs: list[float], ranks: int, sizes: list[float] | None = None) -> list[int]:
    """Each tensor's owner, the same on every rank: the costliest first, each to the rank whose larger share (of the
    cost dealt so far, and of the ``sizes``, the state's bytes, when given) stays smallest with it (ties: the lower
    rank, then the tensor's place). Where the cost follows the size (an element-wise update) this is longest
    processing time first; where it does not (Muon's matrices), neither the time nor the memory of a rank runs far
    past its 1/N."""
    sizes = sizes or costs
    total_cost, total_size = sum(costs) or 1.0, sum(sizes) or 1.0
    cost, size, owner = [0.0] * ranks, [0.0] * ranks, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (max((cost[r] + costs[i]) / total_cost, (size[r] + sizes[i]) / total_size),
                                             cost[r], r))
        owner[i], cost[r], size[r] = r, cost[r] + costs[i], size[r] + sizes[i]
    return owner
