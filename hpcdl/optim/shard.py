"""The optimizer step once per job: each parameter tensor's update, and its state, on one rank (``optimizer.shard``).

The gradients reach the owners by reduce-scatters that backward starts (:meth:`ShardedOptimizer.arm`, then a
post-accumulate-grad hook on each tensor), overlapping it as DDP's bucket all-reduces do, and :meth:`reduce` waits
for: DDP exchanges nothing (:func:`hpcdl.distributed.gradients.ddp.data_parallel` with ``exchange=False``). Each
rank's tensors lie side by side in its block, in backward's order, padded to the largest share; a reduce-scatter
carries one segment of every block (``bucket_bytes`` in all, DDP's bucket cap), so the first carries the gradients
backward makes first (:meth:`ShardedOptimizer._lay_out`). The reduce-scatters and the all-gather carry the bytes of
the one all-reduce they replace (ZeRO stage 1's and Megatron's distributed optimizer's exchange), so sharding adds
nothing to the wire but the padding (and, under the ``fp16`` and ``bf16`` hooks, the all-gather's fp32 weights
against their 16-bit gradients). The owner computes the update every rank computed before from the same averaged
gradient: on 2 ranks (a sum of two is the same in either order) the weights are the replicated run's bit for bit;
on more, within fp32's rounding of another summation order. The all-gather of the updated tensors ends the step, in
place: the weights are views of its buffer (:func:`~hpcdl.optim.shard_layout.bind`), and the owners' averaged
gradients views of the reduce-scatters' output, the others' dropped as they are sent, so the layout copies nothing
that replicated does not. Or, given the model (``ahead``, ``optimizer.gather_ahead``, off by default), it is taken in
by the next forward (:mod:`hpcdl.optim.shard_ahead`), through copies; bench optim-shard's whole step measures both
(docs/performance.md).

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

import math

import torch
import torch.distributed as dist

from hpcdl import names
from hpcdl.distributed.group.python_backend import library_group
from hpcdl.distributed.group.share import broadcast_state
from hpcdl.errors import ConfigError
from hpcdl.optim.shard_ahead import GatherAhead
from hpcdl.optim.shard_layout import ALL_GATHER, ELEMENTWISE, REDUCE_SCATTER, bind, deal, rebind, update_cost
from hpcdl.optim.shard_layout import dense as _dense
from hpcdl.optim.shard_layout import laid as _laid

__all__ = ["ELEMENTWISE", "SCATTER_WIRE", "ShardedOptimizer", "deal", "scatters", "state_bytes", "update_cost"]

# the comm hooks (sync.hook) whose exchange a reduce-scatter does, and its dtype on the wire (None: the gradients')
SCATTER_WIRE = dict(zip(names.SCATTER_HOOKS, (None, torch.float16, torch.bfloat16), strict=True))


def scatters(hook: str, group=None) -> bool:
    """Whether a sharded step reduce-scatters the gradients: under a hook that only averages (``SCATTER_WIRE``), on a
    group whose reduce-scatter is one (the MPI and oneCCL groups'). torch's gloo makes its reduce-scatter an
    all-reduce of the whole buffer and a copy of this rank's part (torch 2.14.1, ``reduce_scatter_single``: twice an
    all-reduce's time on 2 ranks here, docs/performance.md), so on gloo DDP all-reduces the gradients, overlapped with
    backward, and each owner updates from its copy."""
    return hook in SCATTER_WIRE and library_group(group) is not None


class ShardedOptimizer:
    """``optimizer`` with each tensor's update on its owner (:func:`deal`), the updated tensors all-gathered over
    ``group``; with ``scatter``, the gradients reduce-scattered to their owners first (:meth:`reduce`, in ``wire``
    on the wire), else they arrive all-reduced. The schedule sets the lr on :attr:`param_groups`, which are the
    inner optimizer's."""

    collective = True  # state_dict() gathers the shares: every rank calls it (hpcdl.train.checkpoint)

    def __init__(self, optimizer: torch.optim.Optimizer, group=None, *, scatter: bool = False,
                 wire: torch.dtype | None = None, bucket_bytes: int = 25 * 2**20, overlap: bool = True,
                 order: list[torch.Tensor] | None = None, ahead: torch.nn.Module | None = None):
        """``order``: the model's parameters as it registers them (``model.parameters()``), whose reverse is about
        backward's order; the optimizer's groups may list them otherwise (mlperf semantics: the weights, then the
        batch-norm and bias tensors). Default: the groups' order. ``ahead``: the model, whose next forward takes
        in the all-gather (:mod:`hpcdl.optim.shard_ahead`); None: the all-gather ends the step."""
        self.optimizer, self.group, self.scatter, self.wire = optimizer, group, scatter, wire
        self.overlap = overlap  # the reduce-scatters started by backward (arm), else by reduce: bench optim-shard
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.costs = [update_cost(p, g, optimizer) for g in optimizer.param_groups for p in g["params"]]
        elements = getattr(optimizer, "state_elements", lambda p, g: p.numel())  # where the state is not one shape
        self.owner = deal(self.costs, self.size, [float(elements(p, g)) for g in optimizer.param_groups
                                                  for p in g["params"]])
        self.mine = {id(p) for p, o in zip(self.params, self.owner) if o == self.rank}
        self._layout = self._lay_out(max(1, bucket_bytes), order)
        self._kept: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self.armed, self.started, self._works = False, 0, []  # started: this step's reduce-scatters so far
        self._waiting, self._copied = list(self._counts), set()
        self._graded: set[int] = set()  # the tensors copied this step from a gradient of this rank's own
        hooked = [p for p in self.params if p.requires_grad] if scatter and self.size > 1 else []
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in hooked]
        self._hooked = {id(p) for p in hooked}
        self.ahead = GatherAhead(self, ahead) if ahead is not None and self.size > 1 \
            else None
        self._weights: dict[int, torch.Tensor] = {}  # per layout: every rank's block, the tensors views of it
        self.gathering = False  # an all-gather into the weights began and did not end (hpcdl.train.rescue_shard)
        self._lends = wire is None and self.ahead is None  # an owner's averaged gradient a view of the reduce-
        if self.ahead is None and self.size > 1:  # scatter's output (not the ahead all-gather's block)
            self._weights = bind(self._layout, self.size)

    def _lay_out(self, bucket_bytes: int, order: list[torch.Tensor] | None
                 ) -> list[tuple[list[list[torch.Tensor]], list[int], int, int]]:
        """Per dtype: each rank's tensors in backward's order (the reverse of the model's, about), their elements,
        the padded width of a rank's block (whole segments), a segment's elements. A reduce-scatter carries one
        segment of every block (``bucket_bytes`` in all, about), so the first segments hold the gradients backward
        makes first. Sets each tensor's pieces (:attr:`_pieces`: segment, its elements' range, where in the send
        buffer), the reduce-scatters' order (:attr:`_sequence`) and each one's count of tensors (:attr:`_counts`)."""
        where = {id(p): i for i, p in enumerate(self.params)}
        registered = [where[id(p)] for p in order or self.params if id(p) in where]
        backward = list(reversed(registered + sorted(set(range(len(self.params))) - set(registered))))
        layouts, self._pieces, self._sequence, self._counts = [], {}, [], []
        for dt in sorted({p.dtype for p in self.params}, key=str):
            shares = [[self.params[i] for i in backward if self.owner[i] == r and self.params[i].dtype == dt]
                      for r in range(self.size)]
            sizes = [sum(p.numel() for p in share) for share in shares]
            width = max(sizes)
            element = (self.wire or dt).itemsize
            segments = max(1, math.ceil(self.size * width * element / bucket_bytes)) if width else 0
            segment = math.ceil(width / segments) if segments else 0
            members: list[set[int]] = [set() for _ in range(segments)]
            for r, share in enumerate(shares):
                at = 0
                for p in share:
                    pieces, lo = [], 0
                    while lo < p.numel():
                        k, into = divmod(at + lo, segment)
                        hi = min(p.numel(), lo + segment - into)
                        pieces.append((k, lo, hi, (k * self.size + r) * segment + into))
                        members[k].add(where[id(p)] if p.requires_grad else -1)
                        lo = hi
                    self._pieces[id(p)] = (len(layouts), pieces)
                    at += p.numel()
            place = {i: at for at, i in enumerate(backward)}
            for k, m in enumerate(members):  # launched in the order backward completes them, on every rank alike
                m.discard(-1)
                self._sequence.append((max((place[i] for i in m), default=-1), len(layouts), k))
                self._counts.append(len(m))
            layouts.append((shares, sizes, segment * segments, segment))
        ranked = sorted(range(len(self._sequence)), key=lambda s: self._sequence[s])
        self._sequence = [self._sequence[s][1:] for s in ranked]
        self._counts = [self._counts[s] for s in ranked]
        self._slot = {(li, k): s for s, (li, k) in enumerate(self._sequence)}
        return layouts

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

    def _buffers(self, li: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(all ranks' blocks, this rank's) of layout ``li`` in ``dtype``, made once and kept: memory fresh from the
        system each step costs its page faults (56 ms for 100 MB on this VM, more than the copy into it). The
        reduce-scatters and ``ahead``'s all-gather of a layout share them where the wire is the tensors' dtype; each
        layout has its own (their reduce-scatters are all in flight before any is copied out). Their padding is never
        read: it is left as it is."""
        kept = self._kept.get((li, dtype))
        if kept is None:
            width = self._layout[li][2]
            kept = self._kept[li, dtype] = (torch.empty(width * self.size, dtype=dtype),
                                            torch.empty(width, dtype=dtype))
        return kept

    def arm(self) -> None:
        """The next backward is the step's last (the others accumulate): with ``scatter``, the reduce-scatters start
        in :attr:`_sequence`'s order, each once backward has made its gradients and started every earlier one
        (:meth:`_ready`), overlapping the rest of backward as DDP's bucket all-reduces do; :meth:`flush` starts the
        rest, :meth:`reduce` waits for them."""
        self.settle()  # the last all-gather in the model, its buffers free for backward's reduce-scatters
        if self._works:  # a step whose backward raised: its reduce-scatters may still read the buffers
            raise RuntimeError(f"optimizer.shard: {len(self._works)} reduce-scatter(s) of the last step were never "
                               "waited for (its backward raised?); the rank must leave, not step again")
        changed = [i for i, p in enumerate(self.params) if p.requires_grad != (id(p) in self._hooked)] \
            if self._hooks else []
        if changed:
            raise ConfigError(f"optimizer.shard: the requires_grad of parameter(s) {changed[:8]} (the optimizer's "
                              "order) changed after the optimizer was built; its reduce-scatters' layout counts the "
                              "tensors that have gradients. Freeze by lr (the trainer's way), or build the optimizer "
                              "after freezing")
        self.armed, self.started, self._works = bool(self._hooks) and self.overlap, 0, []
        self._waiting, self._copied, self._graded = list(self._counts), set(), set()

    def close(self) -> None:
        """Remove backward's hooks from the tensors (an optimizer built anew over the same model, as bench optim-shard
        does, must not leave this one's hooks behind)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._hooked = [], set()
        if self.ahead is not None:
            self.ahead.close()

    def settle(self) -> None:
        """With ``ahead``: the all-gather in flight waited for and in the model (before the weights are read)."""
        if self.ahead is not None:
            self.ahead.settle()

    @torch.no_grad()
    def flush(self) -> None:
        """Collective, with ``scatter``, after the step's last backward and before any other collective of the step:
        the gradients backward's hooks did not copy (those of earlier micro-batches only, or every one when not
        armed) copied now, a tensor with none as zeros, and every reduce-scatter not yet started started, so that
        every rank issues them all, in one order, before the step's control all-reduce."""
        if not self.scatter or self.size == 1 or self.started == len(self._sequence):
            return
        self.settle()
        self.armed = True
        for p in self.params:
            if id(p) not in self._copied:
                self._ready(p, fill=True)
        while self.started < len(self._sequence):
            self._start()

    @torch.no_grad()
    def _ready(self, p: torch.Tensor, fill: bool = False) -> None:
        """``p``'s gradient is final (a post-accumulate-grad hook): divided by the rank count as it is copied into the
        send buffer (in ``wire`` where set, as the ``fp16`` and ``bf16`` hooks cast before they divide; as DDP's
        reduction, before the sum), then every reduce-scatter whose tensors are all in is started, in
        :attr:`_sequence`'s order, the same on every rank. ``fill``: with no gradient, zeros (:meth:`flush`). Then
        the gradient is dropped unless this rank owns the tensor and cannot lend it the averaged one (:meth:`reduce`):
        nothing reads it again, and its memory serves the rest of backward (DDP, finding none, zeroes its bucket's
        slot, cheaper than its copy)."""
        if not self.armed or not p.requires_grad or (p.grad is None and not fill) or id(p) in self._copied:
            return  # a frozen tensor's slots are never read: its segments do not wait for it
        self._copied.add(id(p))
        if p.grad is not None:
            self._graded.add(id(p))
        li, pieces = self._pieces[id(p)]
        send, _ = self._buffers(li, self.wire or p.dtype)
        whole, grad = len(pieces) == 1, p.grad
        if grad is None:
            grad = torch.zeros(p.numel(), dtype=p.dtype) if not whole else torch.zeros_like(p)
        elif not whole:  # split over segments: flat, in p's memory order (a view where the gradient is laid as p)
            laid = grad.stride() == p.stride() and _dense(p)
            grad = torch.as_strided(grad, (p.numel(),), (1,)) if laid else \
                _laid(torch.empty(p.numel(), dtype=grad.dtype), p).copy_(grad).as_strided((p.numel(),), (1,))
        for k, lo, hi, into in pieces:
            part = send[into:into + hi - lo]
            part, value = (_laid(part, p), grad) if whole else (part, grad[lo:hi])
            if self.wire is None:
                torch.div(value, self.size, out=part)
            else:
                part.copy_(value).div_(self.size)
            self._waiting[self._slot[li, k]] -= 1
        if self._lends or id(p) not in self.mine:
            p.grad = None
        while self.started < len(self._sequence) and not self._waiting[self.started]:
            self._start()

    def _start(self) -> None:
        li, k = self._sequence[self.started]
        shares, _, width, segment = self._layout[li]
        send, mine = self._buffers(li, self.wire or next(s[0].dtype for s in shares if s))
        across = self.size * segment
        self._works.append(REDUCE_SCATTER(mine[k * segment:(k + 1) * segment], send[k * across:(k + 1) * across],
                                          group=self.group, async_op=True))
        self.started += 1

    @torch.no_grad()
    def reduce(self) -> None:
        """Collective, with ``scatter`` (else nothing): each tensor's gradient averaged over the ranks into its
        owner's ``grad`` by the reduce-scatters of :meth:`_lay_out`, started in backward after :meth:`arm` (else
        here), waited for here. The other tensors' gradients were dropped (:meth:`_ready`; DDP may point them at its
        bucket): :meth:`update` hides them from the optimizer. An owner with no gradient of its own gets none (as
        before the reduce-scatter)."""
        if not self.scatter or self.size == 1:
            return
        self.flush()  # where the trainer did not: every gradient not yet copied
        try:
            for work in self._works:
                work.wait()
        finally:
            self.armed, self.started, self._works = False, 0, []
            self._waiting, self._copied = list(self._counts), set()
        for li, (shares, _, width, _) in enumerate(self._layout):
            if not width:
                continue
            _, mine = self._buffers(li, self.wire or next(s[0].dtype for s in shares if s))
            at = 0
            for p in shares[self.rank]:
                if id(p) in self._graded:
                    averaged = _laid(mine[at:at + p.numel()], p)
                    if self._lends:  # where it landed, read before the next reduce-scatter writes there (zero_grad
                        p.grad = averaged  # drops it first)
                    else:
                        p.grad.copy_(averaged)
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
            had = any(p.grad is not None or id(p) in self._graded for p in g["params"])
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
            self._graded = set()
        for g in counted:
            g["step"] += 1

    @torch.no_grad()
    def gather(self, guard=None) -> None:
        """Collective: each rank's tensors, as its owner holds them, on every rank: one all-gather per dtype of the
        rank-major blocks the tensors are views of (:func:`bind`), in place (in segments, as the reduce-scatters,
        it took 1.2x as long on 2 ranks of oneCCL here). Not under ``guard`` (the trainer's lock, which a rescue
        takes to read the weights): a lost rank would leave the collective hanging with the lock held; a rescue
        that finds it cut (:attr:`gathering`) says so (:mod:`hpcdl.train.rescue_shard`). With ``ahead``: started
        here in segments, taken in by the next forward under ``guard``."""
        if self.size == 1:  # this rank owns every tensor
            return
        if self.ahead is not None:
            return self.ahead.start(guard)
        rebind(self._weights, self._layout, self.rank)
        self.gathering = True
        for li, flat in self._weights.items():
            width = self._layout[li][2]
            ALL_GATHER(flat, flat[self.rank * width:(self.rank + 1) * width], group=self.group)
        self.gathering = False

    def _own_into_blocks(self):
        """With ``ahead``: per layout with tensors, its index, the all-gather's output (every rank's block) and this
        rank's block, which this rank's tensors are copied into first (as laid in memory)."""
        for li, (shares, _, width, _) in enumerate(self._layout):
            if not width:
                continue
            every, block = self._buffers(li, next(s[0].dtype for s in shares if s))
            at = 0
            for p in shares[self.rank]:
                _laid(block[at:at + p.numel()], p).copy_(p)
                at += p.numel()
            yield li, every, block

    def state_dict(self) -> dict | None:
        """Collective: the whole optimizer state, in the replicated layout, on rank 0 (None on the others)."""
        self.settle()
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
        self.settle()
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
