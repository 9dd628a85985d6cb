"""The optimizer step once per job: each parameter tensor's update, and its state, on one rank (``optimizer.shard``).

The gradients reach the owners by one reduce-scatter per dtype (:meth:`ShardedOptimizer.reduce`, in the layout of
the all-gather: each rank's tensors side by side, padded to the largest share), after backward: DDP exchanges
nothing (:func:`hpcdl.distributed.gradients.ddp.data_parallel` with ``exchange=False``). The reduce-scatter and
the all-gather carry the bytes of the one all-reduce they replace (ZeRO stage 1's and Megatron's distributed
optimizer's exchange), so sharding adds nothing to the wire but the padding (and, under the ``fp16`` and ``bf16``
hooks, the all-gather's fp32 weights against their 16-bit gradients). The owner computes the update every rank
computed before from the same averaged gradient: on 2 ranks (a sum of two is the same in either order) the weights
are the replicated run's bit for bit; on more, within fp32's rounding of another summation order. Unlike DDP's
all-reduce, the reduce-scatter does not overlap backward.

Where a reduce-scatter would not pay (:func:`scatters`: the ``hierarchical`` and ``chunk_sparse`` hooks do more than
average a bucket; gloo's reduce-scatter is an all-reduce), DDP all-reduces the gradients through the hook as
replicated and each owner updates from its copy (``scatter=False``): the all-gather is then added to the step's
communication.

The tensors are dealt out whole, never split, so LARS, LARC and LAMB keep their per-tensor trust ratios and Muon
orthogonalizes each matrix on one rank; they are dealt by their counted cost (:func:`update_cost`: Muon's
Newton-Schulz on a matrix costs far more than an element-wise update of the same size), the costliest first, each to
the rank with the least so far (longest processing time first).

The anchors: ZeRO stage 1 (Rajbhandari et al. 2020) and torch's ``ZeroRedundancyOptimizer`` shard the state by
parameter; Moonlight's distributed Muon (Liu et al. 2025) deals each matrix's Newton-Schulz to one rank.

The state is the inner optimizer's for the tensors this rank owns. :meth:`ShardedOptimizer.state_dict` is
collective (every rank calls it, as for the RNG streams' part): each rank's share is streamed to rank 0, which
returns the whole optimizer state in the replicated layout, so a checkpoint loads on any rank count, sharded or
not. :meth:`ShardedOptimizer.load_state_dict` takes a whole state and keeps this rank's share.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors

from hpcdl.distributed.group.python_backend import library_group
from hpcdl.distributed.group.share import broadcast_state
from hpcdl.errors import ConfigError

__all__ = ["SCATTER_WIRE", "ShardedOptimizer", "deal", "scatters", "state_bytes", "update_cost"]

# torch 2.14 renamed all_gather_into_tensor and reduce_scatter_tensor (and warns on the old names); earlier releases
# have only those
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# the comm hooks (sync.hook) whose exchange a reduce-scatter does, and its dtype on the wire (None: the gradients')
SCATTER_WIRE = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def scatters(hook: str, group=None) -> bool:
    """Whether a sharded step reduce-scatters the gradients: under a hook that only averages (``SCATTER_WIRE``), on a
    group whose reduce-scatter is one (the MPI and oneCCL groups'). torch's gloo makes its reduce-scatter an
    all-reduce of the whole buffer and a copy of this rank's part (torch 2.14.1, ``reduce_scatter_single``: twice an
    all-reduce's time on 2 ranks here, docs/performance.md), so on gloo DDP all-reduces the gradients, overlapped with
    backward, and each owner updates from its copy."""
    return hook in SCATTER_WIRE and library_group(group) is not None


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


class ShardedOptimizer:
    """``optimizer`` with each tensor's update on its owner (:func:`deal`), the updated tensors all-gathered over
    ``group``; with ``scatter``, the gradients reduce-scattered to their owners first (:meth:`reduce`, in ``wire``
    on the wire), else they arrive all-reduced. The schedule sets the lr on :attr:`param_groups`, which are the
    inner optimizer's."""

    collective = True  # state_dict() gathers the shares: every rank calls it (hpcdl.train.checkpoint)

    def __init__(self, optimizer: torch.optim.Optimizer, group=None, *, scatter: bool = False,
                 wire: torch.dtype | None = None):
        self.optimizer, self.group, self.scatter, self.wire = optimizer, group, scatter, wire
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.costs = [update_cost(p, g, optimizer) for g in optimizer.param_groups for p in g["params"]]
        elements = getattr(optimizer, "state_elements", lambda p, g: p.numel())  # where the state is not one shape
        self.owner = deal(self.costs, self.size, [float(elements(p, g)) for g in optimizer.param_groups
                                                  for p in g["params"]])
        self.mine = {id(p) for p, o in zip(self.params, self.owner) if o == self.rank}
        dtypes = sorted({p.dtype for p in self.params}, key=str)
        self._layout = []  # per dtype: each rank's tensors, their elements, the largest share's (the padded width)
        for dt in dtypes:
            shares = [[p for p, o in zip(self.params, self.owner) if o == r and p.dtype == dt] for r in range(self.size)]
            sizes = [sum(p.numel() for p in share) for share in shares]
            self._layout.append((shares, sizes, max(sizes)))
        self._kept: dict[tuple[torch.dtype, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def register_step_pre_hook(self, hook):  # chunk_sparse's hold_back: around the inner step, on the owned tensors
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):
        return self.optimizer.register_step_post_hook(hook)

    def step(self, closure=None):
        """:meth:`reduce`, :meth:`update`, then :meth:`gather` (the trainer runs them apart: hpcdl.train.step)."""
        self.reduce()
        self.update(closure)
        self.gather()

    def _buffers(self, dtype: torch.dtype, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(all ranks' shares, this rank's), made once per dtype and kept: memory fresh from the system each step
        costs its page faults (56 ms for 100 MB on this VM, more than the copy into it). The reduce-scatter and the
        all-gather of one layout share them (keyed by dtype and width: a wire dtype may be another layout's own).
        Their padding is never read: it is left as it is."""
        kept = self._kept.get((dtype, width))
        if kept is None:
            kept = self._kept[dtype, width] = (torch.empty(width * self.size, dtype=dtype),
                                               torch.empty(width, dtype=dtype))
        return kept

    @torch.no_grad()
    def reduce(self) -> None:
        """Collective, with ``scatter`` (else nothing): each tensor's gradient averaged over the ranks into its
        owner's ``grad``, one reduce-scatter per dtype in the layout of :meth:`gather`. The other tensors' gradients
        stay this rank's own, unaveraged: :meth:`update` hides them from the optimizer. As DDP's reduction and the
        ``fp16`` and ``bf16`` hooks do, each gradient is divided by the rank count before the sum (in ``wire``)."""
        if not self.scatter or self.size == 1:
            return
        for shares, sizes, width in self._layout:
            if not width:
                continue
            send, mine = self._buffers(self.wire or next(s[0].dtype for s in shares if s), width)
            for r, share in enumerate(shares):
                at = r * width
                for p in share:
                    if p.grad is not None:  # a tensor with no gradient (frozen) has none on any rank
                        part = send[at:at + p.numel()].view(p.shape)
                        if self.wire is None:  # as DDP's reduction: divided as copied
                            torch.div(p.grad, self.size, out=part)
                        else:  # as the fp16 and bf16 hooks: cast, then divided in the wire's dtype
                            part.copy_(p.grad).div_(self.size)
                    at += p.numel()
            REDUCE_SCATTER(mine, send, group=self.group)
            at = 0
            for p in shares[self.rank]:
                if p.grad is not None:
                    p.grad.copy_(mine[at:at + p.numel()].view(p.grad.shape))
                at += p.numel()

    @torch.no_grad()
    def update(self, closure=None) -> None:
        """The inner optimizer's step on this rank's tensors (the others' gradients hidden from it). A group none of
        whose tensors this rank owns still counts the step where the optimizer's step would count it (LAMB's
        ``step``, Muon's AdamW groups': its ``counts_step``), as on the tensors' owners."""
        if closure is not None:
            raise ConfigError("optimizer.shard=true: the sharded step takes no closure")
        hidden, counted = [], []
        counts = getattr(self.optimizer, "counts_step", lambda group: True)
        for g in self.optimizer.param_groups:
            had = any(p.grad is not None for p in g["params"])
            for p in g["params"]:
                if p.grad is not None and id(p) not in self.mine:
                    hidden.append((p, p.grad))
                    p.grad = None
            if had and "step" in g and counts(g) and not any(p.grad is not None for p in g["params"]):
                counted.append(g)
        try:
            self.optimizer.step()
        finally:
            for p, grad in hidden:
                p.grad = grad
        for g in counted:
            g["step"] += 1

    @torch.no_grad()
    def gather(self, guard=None) -> None:
        """Collective: each rank's tensors, as its owner holds them, on every rank (one all-gather per dtype). The
        copies into the model run under ``guard`` (the trainer's lock, which a rescue takes to read the weights;
        not the collective, which a lost rank would leave hanging with the lock held)."""
        if self.size == 1:  # this rank owns every tensor
            return
        for shares, sizes, width in self._layout:
            if not width:
                continue
            out, send = self._buffers(next(s[0].dtype for s in shares if s), width)
            at = 0
            for p in shares[self.rank]:
                send[at:at + p.numel()].view(p.shape).copy_(p)
                at += p.numel()
            ALL_GATHER(out, send, group=self.group)
            with guard or contextlib.nullcontext():
                for r, share in enumerate(shares):
                    if r != self.rank and share:
                        flat = out[r * width:r * width + sizes[r]]
                        for p, value in zip(share, _unflatten_dense_tensors(flat, share)):
                            p.copy_(value)

    def state_dict(self) -> dict | None:
        """Collective: the whole optimizer state, in the replicated layout, on rank 0 (None on the others)."""
        own = self.optimizer.state_dict()
        whole = own if self.rank == 0 else None
        for r in range(1, self.size):
            got = broadcast_state(own["state"] if self.rank == r else None, self.group, src=r)
            if self.rank == 0:
                whole["state"].update(got)
        return whole

    def load_state_dict(self, state: dict) -> None:
        """A whole optimizer state (a checkpoint's, written sharded or not, on any rank count): this rank keeps the
        state of the tensors it owns."""
        self.optimizer.load_state_dict(state)
        for p in self.params:
            if id(p) not in self.mine:
                self.optimizer.state.pop(p, None)

    def state_bytes(self) -> int:
        """The bytes of tensor state this rank holds."""
        return state_bytes(self.optimizer)


def state_bytes(optimizer) -> int:
    """The bytes of the tensors an optimizer's state holds (its moments and buffers, not the weights)."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
