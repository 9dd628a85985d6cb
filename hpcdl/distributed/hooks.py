"""DDP communication hooks, chosen by name in the config (``sync.hook``), on every backend.

- ``none``: DDP's own bucket all-reduce.
- ``fp16`` / ``bf16``: each bucket is all-reduced in half precision (half the bytes) and written back
  in fp32; torch's compression hooks. bf16 keeps fp32's range, fp16 its precision.
- ``hierarchical``: reduce to one leader rank per node, all-reduce across the leaders, broadcast within
  the node. The three steps run in order on a thread of this module, so backward keeps going while a
  bucket is reduced; every rank submits buckets in the same order, so the collectives match.
- ``chunk_sparse``: GradientFlow's coarse-grained sparse communication. Each bucket (plus what was left
  of it last step) is cut into chunks; the chunks' L1 norms are all-reduced (a small message), every
  rank picks the same top ``keep`` fraction, and only those are packed, all-reduced (in fp16 with
  ``fp16``) and scattered back. The rest stays in a local residual that the next step adds (error
  feedback), so no gradient is lost, only delayed. Dense for the first ``dense_warmup_epochs``.
  :meth:`ChunkSparse.hold_back` makes the optimizer step leave the held-back positions alone (weights
  and optimizer state), so that they move when their gradient is sent, not before.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from hpcdl.distributed.env import RankEnv
from hpcdl.names import HOOKS, check

__all__ = ["HOOKS", "ChunkSparse", "Hierarchy", "make_hook", "node_groups", "sparse_allreduce"]



@dataclasses.dataclass(slots=True)
class Hierarchy:
    """The groups of a two-level all-reduce, built once (``dist.new_group`` is collective)."""

    node_group: dist.ProcessGroup
    leader: int  # global rank of this node's leader
    leaders: dist.ProcessGroup | None  # None on ranks that lead no node
    world_size: int
    nodes: int
    pool: concurrent.futures.ThreadPoolExecutor


def node_groups(env: RankEnv, backend: str | None = None, new_group=None) -> Hierarchy:
    """One group per node and one of the nodes' first ranks (collective), each made by ``new_group(ranks)``
    (default: ``dist.new_group`` on ``backend``; the trainer's keeps them under the job's timeouts).

    Nodes are the launcher's (``SLURM_NODEID`` under srun; block placement under mpiexec, see
    :mod:`hpcdl.distributed.env`), so several slurmd on one host count as the nodes Slurm says they are.
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


def _unwrapped(future: torch.futures.Future) -> torch.Tensor:
    """A future set from Python carries an error as a Python object that DDP's C++ reducer cannot read
    ("Unable to cast ... to Tensor"); raising it in a ``then`` callback makes it the chained future's error,
    which DDP raises from backward like a C++ collective's."""
    return future.value()


def _hierarchical(state: Hierarchy, bucket: dist.GradBucket) -> torch.futures.Future:
    tensor = bucket.buffer()
    future: torch.futures.Future = torch.futures.Future()

    def run():
        try:
            dist.reduce(tensor, dst=state.leader, group=state.node_group)
            if state.leaders is not None:
                dist.all_reduce(tensor, group=state.leaders)
            dist.broadcast(tensor, src=state.leader, group=state.node_group)
            future.set_result(tensor.div_(state.world_size))
        except Exception as exc:
            future.set_exception(exc)

    state.pool.submit(run)
    return future.then(_unwrapped)


@dataclasses.dataclass(slots=True, kw_only=True)
class ChunkSparse:
    """State of the ``chunk_sparse`` hook: its settings, residuals per bucket, and what it sent."""

    keep: float = 0.1
    chunk: int = 32768
    dense_steps: int = 0  # steps all-reduced densely first
    fp16: bool = False
    group: dist.ProcessGroup | None = None
    step: int = 0  # counted at each step's last bucket
    residuals: dict = dataclasses.field(default_factory=dict)
    sent_elements: int = 0  # this step so far: gradient elements sent (dense or selected chunks)
    total_elements: int = 0  # this step so far: gradient elements in the buckets
    last_step_sent: tuple[int, int] = (0, 0)  # (sent, total) of the last complete step
    sent: dict = dataclasses.field(default_factory=dict)  # parameter -> bool mask of what this step sent
    bucketed: bool = False  # DDP's first step is over: it rebuilds its buckets after it, so that one is dense
    dry: bool = False  # a rehearsal (the trainer's, after a resume): buckets go back untouched, nothing changes
    pool: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hpcdl-sparse"))


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
    world = dist.get_world_size(state.group)
    state.total_elements += grad.numel()
    if dense or state.step < state.dense_steps:
        dist.all_reduce(grad, group=state.group)
        state.sent_elements += grad.numel()
        return grad.div_(world), None
    acc = grad + state.residuals[key] if key in state.residuals else grad.clone()
    n, c = acc.numel(), state.chunk
    chunks = torch.nn.functional.pad(acc, (0, (-n) % c)).view(-1, c)
    norms = chunks.abs().sum(1)
    dist.all_reduce(norms, group=state.group)  # every rank now ranks the chunks alike
    picked = norms.topk(max(1, round(state.keep * len(norms)))).indices.sort().values
    packed = chunks[picked]
    wire = packed.half() if state.fp16 else packed
    dist.all_reduce(wire, group=state.group)
    state.sent_elements += wire.numel() + norms.numel()
    chunks[picked] = 0  # what was not sent stays here for the next step
    state.residuals[key] = chunks.view(-1)[:n].clone()
    out = torch.zeros_like(chunks)
    out[picked] = wire.float() / world
    sent = torch.zeros(len(chunks), dtype=torch.bool)
    sent[picked] = True
    return grad.copy_(out.view(-1)[:n]), sent.repeat_interleave(c)[:n]


def _chunk_sparse(state: ChunkSparse, bucket: dist.GradBucket) -> torch.futures.Future:
    tensor, key, last = bucket.buffer(), bucket.index(), bucket.is_last()
    params = bucket.parameters()
    future: torch.futures.Future = torch.futures.Future()

    def run():
        if state.dry:
            future.set_result(tensor)
            return
        try:
            # Residuals belong to a bucket layout, and DDP's first step has another (after a resume, the
            # trainer rehearses that step first: see Trainer._rehearse).
            grad, sent = sparse_allreduce(state, key, tensor, dense=not state.bucketed)
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

    state.pool.submit(run)
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
    return group, {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
                   "bf16": default_hooks.bf16_compress_hook}[name]
