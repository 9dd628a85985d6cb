"""The model as the loop trains it: DDP with the comm hook (chunk_sparse's state restored), torch.compile when
asked, and the stepper that runs one optimizer step with its timeline."""

from __future__ import annotations

import dataclasses
import functools

import torch

from hpcdl.config import RunConfig
from hpcdl.distributed.gradients.ddp import CommTimer, data_parallel
from hpcdl.distributed.gradients.hooks import ChunkSparse
from hpcdl.distributed.group.lifecycle import DistContext, new_subgroup
from hpcdl.runs.timeline import Timeline
from hpcdl.train.build import DataParts, ModelParts
from hpcdl.train.step import Stepper, effects_undone

__all__ = ["Wrapped", "wrap"]


@dataclasses.dataclass(slots=True)
class Wrapped:
    net: torch.nn.Module
    stepper: Stepper
    comm: CommTimer | None  # the comm hook's timer; its ``failure`` names a bucket collective that failed
    sparse: ChunkSparse | None  # chunk_sparse's state, checkpointed per rank
    timeline: Timeline | None
    compile_note: str


def wrap(cfg: RunConfig, ctx: DistContext, parts: ModelParts, data: DataParts, *, precision: str, step: int,
         hook_state: dict | None, run_dir: str) -> Wrapped:
    sync = cfg.sync
    sparse = ChunkSparse(keep=sync.keep, chunk=sync.chunk, fp16=sync.fp16, step=step,
                         dense_steps=round(sync.dense_warmup_epochs * cfg.schedule.steps_per_epoch)) \
        if sync.hook == "chunk_sparse" else None
    if sparse is not None:
        sparse.hold_back(parts.optimizer)
        if hook_state is not None:
            sparse.load_state_dict(hook_state)
    net, comm = data_parallel(parts.model, ctx.env, ctx.group, hook=sync.hook, backend=ctx.backend.name,
                              bucket_cap_mb=sync.bucket_cap_mb, first_bucket_mb=sync.first_bucket_mb,
                              gradient_as_bucket_view=sync.gradient_as_bucket_view, sparse=sparse,
                              new_group=functools.partial(new_subgroup, ctx), bucket_spans=cfg.loop.timeline,
                              exchange=not getattr(parts.optimizer, "scatter", False),
                              broadcast_buffers=getattr(parts.optimizer, "ahead", None) is None)
    note = "compile: off"
    if cfg.loop.compile:
        net, note = torch.compile(net), "compile: torch.compile (the first steps compile)"
    timeline = Timeline(run_dir, ctx.rank) if cfg.loop.timeline else None
    stepper = Stepper(net, parts.criterion, parts.optimizer, parts.schedule, precision=precision, comm=comm,
                      group=ctx.group, distributed=ctx.world_size > 1, timeline=timeline)
    if sparse is not None and sparse.bucketed and ctx.world_size > 1:
        _rehearse(net, parts, stepper, sparse, data.blank_batch(cfg))
    return Wrapped(net, stepper, comm, sparse, timeline, note)


def _rehearse(net, parts: ModelParts, stepper: Stepper, sparse: ChunkSparse, batch) -> None:
    """One forward and backward whose effects are all undone, so that the resumed run's next step uses the
    bucket layout the uninterrupted run used there. DDP builds its buckets in parameter order, records the
    order gradients become ready in its first backward and rebuilds them from it; the chunk_sparse hook
    chunks and picks per bucket, and its residuals are kept per bucket."""
    x, y = batch
    sparse.dry = True
    try:
        with effects_undone(parts.model), stepper.autocast():
            parts.criterion(net(x), y).backward()
    finally:
        sparse.dry = False
