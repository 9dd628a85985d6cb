"""``optimizer.gather_ahead``: the sharded step's all-gather overlapping the next forward, as Megatron-LM's
distributed optimizer does with ``overlap_param_gather`` (its parameter all-gathers started after the step and
waited for by forward pre-hooks, bucket by bucket, in forward order).

At the step's end (:meth:`GatherAhead.start`) each rank copies its updated tensors into its block, in the
reduce-scatters' layout (:meth:`hpcdl.optim.shard.ShardedOptimizer._lay_out`: each rank's tensors in backward's
order, cut in segments), and starts one all-gather per segment, the last first: the last segments hold the
tensors backward makes last, which the next forward needs first. Each segment lands where its reduce-scatter
read it, so a tensor's pieces are found as its gradient's were. A forward pre-hook on every module that holds
tensors itself waits for the segments of the other ranks' tensors in its subtree (a module may use its children's
directly: torch's ``MultiheadAttention`` passes ``out_proj``'s weight to a function) and copies them into the model,
under the trainer's lock (the one a rescue takes to read the weights), before the module runs; the rest of the
forward goes on while later segments are on the wire. A tensor that a module without tensors of its own reaches into
in a child is read before it arrives: such a model needs ``gather_ahead=false``.

The model's buffers (batch norm's running statistics) go from rank 0 to the others here, before the segments: DDP's
own broadcast at the start of each forward is off (:func:`hpcdl.distributed.gradients.ddp.data_parallel`): it queued
behind every segment on the MPI and oneCCL groups (their communication thread runs the collectives in order), so
that a model with buffers waited for the whole all-gather before its first module ran. The forward reads no running
statistic in training and nothing changes the buffers between the step's end and the next forward, so every rank
enters the forward with rank 0's, as under DDP's broadcast; after the step all ranks hold rank 0's (under DDP's, the
others held their own last update). A step skipped for a non-finite loss starts no all-gather and broadcasts
nothing: the next finite one does. Off by default (``hpcdl.optim.config``; docs/performance.md).

Whatever reads the weights between steps settles first (:meth:`GatherAhead.settle`: every segment waited for,
every tensor copied): the next step's reduce-scatters (they reuse the buffers), a checkpoint
(``Checkpointer.save``), an evaluation (``ModelWeights.evaluating``), the replicas' check, ``state_dict`` and
``load_state_dict``. A just-in-time checkpoint does not: it reads what arrived. A lost rank's tensors there are
those of the last all-gather this rank completed, tensor by tensor (:mod:`hpcdl.train.rescue_shard`: the
survivors' own come from their shares). Not under ``torch.compile`` (``hpcdl.train.build``): its graph would break
at the hooks' waits.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch
import torch.distributed as dist

from hpcdl.optim.shard_layout import ALL_GATHER, dense, laid

__all__ = ["GatherAhead"]

BUFFER_BUCKET_BYTES = 250 * 2**20  # DDP's broadcast_bucket_size


class GatherAhead:
    """The all-gather of :class:`~hpcdl.optim.shard.ShardedOptimizer` ``sharded`` started at the step's end and
    taken in by ``model``'s forward pre-hooks."""

    def __init__(self, sharded, model: torch.nn.Module):
        self.sharded = sharded
        others = {id(p) for p in sharded.params if id(p) not in sharded.mine}
        self._tracked = [p for p in sharded.params if id(p) in others]
        self._handles = []
        for module in model.modules():  # one that holds tensors itself may use its children's directly (torch's
            if next(module.parameters(recurse=False), None) is not None:  # MultiheadAttention: out_proj's weight)
                held = [p for p in module.parameters() if id(p) in others]  # so it takes in its whole subtree
                if held:
                    self._handles.append(module.register_forward_pre_hook(functools.partial(self._before, held)))
        self._model = model  # its buffers: DDP's broadcast before each forward, done by start()
        self._works: dict[tuple[int, int], object] = {}
        self._pending: dict[int, torch.Tensor] = {}
        self.guard = contextlib.nullcontext()
        self.taken_s = 0.0  # in the hooks since the last read: waiting and copying (the trainer's comm_wait)

    @torch.no_grad()
    def start(self, guard=None) -> None:
        """Collective: rank 0's buffers broadcast (waited for: they precede the segments on the wire), this
        rank's tensors copied into its block, one all-gather started per segment, the last first. Not waited for
        here."""
        self.settle()
        s = self.sharded
        buffers = list(self._model.buffers())  # read each time, as DDP's _sync_buffers does: one may be replaced
        if buffers:  # from rank 0 of the group, as DDP's
            dist._broadcast_coalesced(s.group if s.group is not None else dist.group.WORLD, buffers,
                                      BUFFER_BUCKET_BYTES, 0)
        self.guard = guard or contextlib.nullcontext()
        for li, every, block in s._own_into_blocks():
            _, _, width, segment = s._layout[li]
            across = s.size * segment
            for k in reversed(range(width // segment)):
                self._works[li, k] = ALL_GATHER(every[k * across:(k + 1) * across],
                                                  block[k * segment:(k + 1) * segment], group=s.group, async_op=True)
        self._pending = {id(p): p for p in self._tracked}

    def _before(self, held: list[torch.Tensor], module, args) -> None:
        if self._pending:
            for p in held:
                if id(p) in self._pending:
                    self._take(p)

    @torch.no_grad()
    def _take(self, p: torch.Tensor) -> None:
        """``p``'s segments waited for, its pieces copied into it (in its memory order, as its gradient's were)."""
        t = time.perf_counter()
        li, pieces = self.sharded._pieces[id(p)]
        every, _ = self.sharded._buffers(li, p.dtype)
        for k, *_ in pieces:
            work = self._works.get((li, k))
            if work is not None:
                work.wait()
                del self._works[li, k]  # only once waited for: a wait that raised leaves it to wait on
        with self.guard:
            if len(pieces) == 1:
                _, lo, hi, into = pieces[0]
                p.copy_(laid(every[into:into + hi - lo], p))
            else:
                flat = torch.as_strided(p, (p.numel(),), (1,)) if dense(p) else torch.empty(p.numel(),
                                                                                                  dtype=p.dtype)
                for _, lo, hi, into in pieces:
                    flat[lo:hi].copy_(every[into:into + hi - lo])
                if not dense(p):
                    p.copy_(flat.view(p.shape))
            del self._pending[id(p)]
        self.taken_s += time.perf_counter() - t

    def settle(self) -> None:
        """Every segment waited for and every tensor in the model: before anything reads the weights or reuses
        the buffers."""
        for p in list(self._pending.values()):
            self._take(p)
        works, self._works = list(self._works.values()), {}
        for work in works:  # segments of this rank's tensors and padding only
            work.wait()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self.settle()
        for handle in self._handles:
            handle.remove()
        self._handles = []
