"""DDP communication hooks, chosen by name in the config (``sync.hook``), on every backend.

- ``none``: DDP's bucket all-reduce, averaged. :func:`hpcdl.distributed.gradients.ddp.data_parallel` registers no hook
  for it (DDP's reducer divides as it fills the buckets); this one serves only ``loop.timeline``'s per-bucket
  spans.
- ``fp16`` / ``bf16``: each bucket is all-reduced in half precision (half the bytes) and written back
  in fp32, as torch's compression hooks do. bf16 keeps fp32's range, fp16 its precision.

  Unlike torch's own hooks (``default_hooks``), these chain no Python callback to the collective:
  its future is set on a thread of the hook.

- ``hierarchical``: reduce to one leader rank per node, all-reduce across the leaders, broadcast within
  the node. The steps run on a thread of this module, so backward keeps going while a bucket is reduced,
  one bucket behind: a bucket is reduced within the node while the one before it crosses the network.
  Every rank submits buckets in the same order, so the collectives match.
- ``chunk_sparse``: GradientFlow's coarse-grained sparse communication. Each bucket (plus what was left
  of it last step) is cut into chunks; the chunks' L1 norms are all-reduced (a small message), every
  rank picks the same top ``keep`` fraction, and only those are packed, all-reduced (in fp16 with
  ``fp16``) and scattered back. The rest stays in a local residual that the next step adds (error
  feedback), so no gradient is lost, only delayed. Dense for the first ``dense_warmup_epochs``.
  :meth:`ChunkSparse.hold_back` makes the optimizer step leave the held-back positions alone (weights
  and optimizer state), so that they move when their gradient is sent, not before.

Every collective a hook issues is issued with ``async_op=True`` from a thread of the hook and waited for
there with ``Work.wait()``, which raises the collective's error; nothing waits for the backend to let go of
the tensor as well (measured unnecessary on torch 2.14.1: docs/communication.md has the runs and command).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging

import torch
import torch.distributed as dist

from hpcdl.distributed.group.python_backend import unwrapped as _unwrapped
from hpcdl.distributed.ranks.env import RankEnv
from hpcdl.names import HOOKS, check

__all__ = ["HOOKS", "ChunkSparse", "Hierarchy", "Plain", "make_hook", "node_groups", "sparse_allreduce"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class Plain:
    """State of the ``none``, ``fp16`` and ``bf16`` hooks: the group, the dtype on the wire, each bucket's
    copy in that dtype, and the hook's two threads."""

    group: dist.ProcessGroup | None
    wire: torch.dtype | None  # None: the bucket's own dtype
    buffers: dict = dataclasses.field(default_factory=dict)  # bucket index -> its copy in ``wire``, reused
    issuer: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hpcdl-allreduce"))
    finisher: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hpcdl-allreduce-done"))


def _plain(state: Plain, bucket: dist.GradBucket) -> torch.futures.Future:
    """The bucket averaged over the group, in ``state.wire`` on the wire. One thread starts the buckets'
    all-reduces in DDP's order (so every rank's match), another waits for each and sets its future."""
    buffer = bucket.buffer()
    wire = buffer
    if state.wire is not None:
        wire = state.buffers.get(bucket.index())
        if wire is None or wire.numel() != buffer.numel():  # DDP rebuilds its buckets after the first step
            wire = state.buffers[bucket.index()] = torch.empty(buffer.numel(), dtype=state.wire)
        wire.copy_(buffer)
    wire.div_(dist.get_world_size(state.group))
    future: torch.futures.Future = torch.futures.Future()

    def start():
        try:
            held = dist.all_reduce(wire, group=state.group, async_op=True)
        except Exception as exc:
            future.set_exception(exc)
            return
        state.finisher.submit(finish, held)

    def finish(held):
        try:
            held.wait()
        except Exception as exc:
            future.set_exception(exc)
            return
        if wire is not buffer:
            buffer.copy_(wire)
        future.set_result(buffer)

    state.issuer.submit(start)
    return future.then(_unwrapped)


@dataclasses.dataclass(slots=True)
class Hierarchy:
    """The groups of a two-level all-reduce, built once (``dist.new_group`` is collective)."""

    node_group: dist.ProcessGroup
    leader: int  # global rank of this node's leader
    leaders: dist.ProcessGroup | None  # None on ranks that lead no node
    world_size: int
    nodes: int
    pool: concurrent.futures.ThreadPoolExecutor
    pending: tuple | None = None  # (tensor, leaders' all-reduce, future) of the bucket still to broadcast


def node_groups(env: RankEnv, backend: str | None = None, new_group=None) -> Hierarchy:
    """One group per node and one of the nodes' first ranks (collective), each made by ``new_group(ranks)``
    (default: ``dist.new_group`` on ``backend``; the trainer's keeps them under the job's timeouts).

    Nodes are the launcher's (``SLURM_NODEID`` under srun; block placement under mpiexec, see
    :mod:`hpcdl.distributed.ranks.env`), so several slurmd on one host count as the nodes Slurm says they are.
    """
    placed = [None] * env.world_size
    dist.all_gather_object(placed, env.node_rank)
    nodes = list(dict.fromkeys(placed))  # first-seen order
    members = {n: [r for r, x in enumerate(placed) if x == n] for n in nodes}
    new_group = new_group or functools.partial(dist.new_group, backend=backend)
    node_group = None
    for node in nodes:  # every rank creates every group, in the same order
        group = new_group(members[node])
        if node == env.node_rank:
            node_group = group
    leader_ranks = [members[n][0] for n in nodes]
    leaders = new_group(leader_ranks)
    return Hierarchy(node_group=node_group, leader=members[env.node_rank][0], nodes=len(nodes),
                     leaders=leaders if env.rank in leader_ranks else None, world_size=env.world_size,
                     pool=concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hpcdl-hier"))


def _hierarchical(state: Hierarchy, bucket: dist.GradBucket) -> torch.futures.Future:
    """One bucket behind: bucket k's reduce to the leader runs while bucket k-1's all-reduce across the leaders
    is on the wire, then k-1 is broadcast. Every rank of a node issues its node group's collectives in the
    same order (reduce 0, reduce 1, broadcast 0, reduce 2, broadcast 1 ... broadcast last), whatever the
    wire does; DDP hands buckets over in index order, the last one flagged."""
    tensor, last = bucket.buffer(), bucket.is_last()
    future: torch.futures.Future = torch.futures.Future()

    def run():
        pending, state.pending = state.pending, None
        try:
            dist.reduce(tensor, dst=state.leader, group=state.node_group, async_op=True).wait()
            if pending:
                _hierarchical_finish(state, *pending)
                pending = None
            held = dist.all_reduce(tensor, group=state.leaders, async_op=True) if state.leaders is not None else None
            if last:
                _hierarchical_finish(state, tensor, held, future)
            else:
                state.pending = (tensor, held, future)
        except Exception as exc:
            for f in (future, pending[2] if pending else None):
                if f is not None and not f.done():
                    f.set_exception(exc)

    state.pool.submit(run)
    return future.then(_unwrapped)


def _hierarchical_finish(state: Hierarchy, tensor: torch.Tensor, held: dist.Work | None,
                         future: torch.futures.Future) -> None:
    if held is not None:
        held.wait()
    dist.broadcast(tensor, src=state.leader, group=state.node_group, async_op=True).wait()
    future.set_result(tensor.div_(state.world_size))


@dataclasses.dataclass(slots=True, kw_only=True)
class ChunkSparse:
    """State of the ``chunk_sparse`` hook: its settings, residuals per bucket, and what it sent."""

    keep: float = 0.1
    chunk: int = 32768
    dense_steps: int = 0  # steps all-reduced densely first
    fp16: bool = False
    group: dist.ProcessGroup | None = None
    step: int = 0  # counted at each step's last bucket
    residuals: dict = dataclasses.field(default_factory=dict)  # bucket -> what it has not sent yet
    buffers: dict = dataclasses.field(default_factory=dict)  # bucket -> its residual padded to whole chunks
    sent_elements: int = 0  # this step so far: gradient elements sent (dense or selected chunks)
    total_elements: int = 0  # this step so far: gradient elements in the buckets
    last_step_sent: tuple[int, int] = (0, 0)  # (sent, total) of the last complete step
    sent: dict = dataclasses.field(default_factory=dict)  # parameter -> bool mask of what this step sent
    bucketed: bool = False  # DDP's first step is over: it rebuilds its buckets after it, so that one is dense
    dry: bool = False  # a rehearsal (the trainer's, after a resume): buckets go back untouched, nothing changes
    pool: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hpcdl-sparse"))
    finisher: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hpcdl-sparse-finish"))


    def state_dict(self) -> dict:
        """What a resumed run needs to continue as the uninterrupted one: this rank's residuals (keyed by
        bucket, in DDP's rebuilt layout) and the counters."""
        return {"residuals": dict(self.residuals), "step": self.step, "bucketed": self.bucketed,
                "last_step_sent": list(self.last_step_sent)}

    def load_state_dict(self, state: dict) -> None:
        self.residuals = dict(state["residuals"])
        self.step, self.bucketed = int(state["step"]), bool(state["bucketed"])
        self.last_step_sent = tuple(state["last_step_sent"])

    def hold_back(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` keep the weights and per-element state (momentum, moments) of every
        position whose gradient this step held back in the residual.

        Without it, an optimizer that decays weights or normalizes per layer (LARS: a layer whose
        gradient was all held back gets its whole trust-ratio step from weight decay alone) shrinks what
        it has not been told about; the held positions move when their gradient is sent.
        """
        saved: dict = {}

        def before(opt, args, kwargs):
            saved.clear()
            for p, sent in self.sent.items():
                state = {k: v.clone() for k, v in opt.state.get(p, {}).items()
                         if torch.is_tensor(v) and v.shape == p.shape}
                saved[p] = (sent, p.detach().clone(), state)

        def after(opt, args, kwargs):
            with torch.no_grad():
                for p, (sent, weights, state) in saved.items():
                    p.copy_(torch.where(sent, p, weights))
                    for k, v in state.items():
                        opt.state[p][k].copy_(torch.where(sent, opt.state[p][k], v))
            saved.clear()

        optimizer.register_step_pre_hook(before)
        optimizer.register_step_post_hook(after)


def sparse_allreduce(state: ChunkSparse, key, grad: torch.Tensor,
                     dense: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the averaged gradient ``chunk_sparse`` applies for one flat fp32 bucket ``grad``, in place; the
    bool mask of the elements sent, None when all were, as during ``dense_steps`` or when ``dense``)."""
    return sparse_start(state, key, grad, dense)()


def sparse_start(state: ChunkSparse, key, grad: torch.Tensor, dense: bool = False):
    """The first part of :func:`sparse_allreduce`: pick and pack the chunks and start their all-reduce.
    Returns ``finish()``, which waits for it and gives what :func:`sparse_allreduce` gives. The hook starts
    the next bucket while this one is on the wire.

    No full-size tensor is allocated per step: the residual lives in a buffer padded to whole chunks and
    is accumulated in place, and only the picked chunks are copied (a fresh tensor of a bucket's size
    costs about five times its arithmetic in page faults)."""
    world = dist.get_world_size(state.group)
    state.total_elements += grad.numel()
    if dense or state.step < state.dense_steps:
        held = dist.all_reduce(grad, group=state.group, async_op=True)
        state.sent_elements += grad.numel()
        return lambda: (held.wait(), grad.div_(world), None)[1:]
    n, c = grad.numel(), state.chunk
    chunks = _residual_chunks(state, key, n)
    chunks.view(-1)[:n].add_(grad)  # the residual plus this step's gradient
    norms = chunks.abs().sum(1)
    dist.all_reduce(norms, group=state.group, async_op=True).wait()  # every rank now ranks the chunks alike
    picked = norms.topk(max(1, round(state.keep * len(norms)))).indices.sort().values
    packed = chunks.index_select(0, picked)
    wire = packed.half() if state.fp16 else packed
    held = dist.all_reduce(wire, group=state.group, async_op=True)
    state.sent_elements += wire.numel() + norms.numel()
    chunks.index_fill_(0, picked, 0)  # what was not sent stays for the next step

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        held.wait()
        full = n // c  # chunks wholly inside the bucket; the last may reach into the padding
        grad.zero_()
        body = picked[picked < full]
        grad[:full * c].view(-1, c).index_copy_(0, body, wire[:len(body)].float().div_(world))
        if len(body) < len(picked):
            grad[full * c:].copy_(wire[-1, :n - full * c].float().div_(world))
        sent = torch.zeros(len(chunks), dtype=torch.bool)
        sent[picked] = True
        return grad, sent.repeat_interleave(c)[:n]

    return finish


def _residual_chunks(state: ChunkSparse, key, n: int) -> torch.Tensor:
    """Bucket ``key``'s residual as whole chunks (a view of a padded buffer kept for it); ``state.residuals[key]``
    is its first ``n`` elements, so a checkpoint holds the residual itself."""
    c = state.chunk
    padded = -(-n // c) * c
    res = state.residuals.get(key)
    buf = state.buffers.get(key)
    if buf is None or res is None or res.data_ptr() != buf.data_ptr() or buf.numel() != padded:
        buf = torch.zeros(padded)
        if res is not None:  # loaded from a checkpoint, or the first step after DDP's rebuild
            buf[:n].copy_(res.view(-1)[:n])
        state.buffers[key] = buf
        state.residuals[key] = buf[:n]
    return buf.view(-1, c)


def _chunk_sparse(state: ChunkSparse, bucket: dist.GradBucket) -> torch.futures.Future:
    """Two threads: ``pool`` picks, packs and starts each bucket's all-reduce in DDP's order (so every rank
    issues the same collectives in the same order), ``finisher`` waits for it and unpacks. A bucket is
    packed while the one before it is on the wire."""
    tensor, key, last = bucket.buffer(), bucket.index(), bucket.is_last()
    params = bucket.parameters()
    future: torch.futures.Future = torch.futures.Future()

    def finish(done):
        try:
            grad, sent = done()
            if sent is None:
                for p in params:
                    state.sent.pop(p, None)
            else:
                for p, part in zip(params, sent.split([p.numel() for p in params])):
                    state.sent[p] = part.view(p.shape)
            if last:  # before the result: once it is set, backward ends and a checkpoint may read the state
                state.last_step_sent = (state.sent_elements, state.total_elements)
                state.sent_elements = state.total_elements = 0
                state.step += 1
                state.bucketed = True
            future.set_result(grad)
        except Exception as exc:
            future.set_exception(exc)

    def start():
        if state.dry:
            future.set_result(tensor)
            return
        try:
            # Residuals belong to a bucket layout, and DDP's first step has another (after a resume, the
            # trainer rehearses that step first: see Trainer._rehearse).
            done = sparse_start(state, key, tensor, dense=not state.bucketed)
        except Exception as exc:
            future.set_exception(exc)
            return
        state.finisher.submit(finish, done)

    state.pool.submit(start)
    return future.then(_unwrapped)


def make_hook(name: str, env: RankEnv, group=None, backend: str | None = None, sparse: ChunkSparse | None = None,
              new_group=None):
    """(state, hook function) for DDP's ``register_comm_hook``; ``none`` is DDP's plain all-reduce.
    ``new_group``: what makes the hierarchical hook's groups (see :func:`node_groups`)."""
    check("sync.hook", name, HOOKS)
    if name == "hierarchical":
        return node_groups(env, backend, new_group), _hierarchical
    if name == "chunk_sparse":
        state = sparse or ChunkSparse()
        state.group = group
        return state, _chunk_sparse
    return Plain(group, {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[name]), _plain
