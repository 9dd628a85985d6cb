"""Gradient synchronization for the trainer: DDP over the job's process group, timed.

DDP all-reduces gradient buckets while backward still runs and waits for the last of them before
backward returns. A communication hook notes when each bucket is handed over; the last hand-over is
the end of the gradient computation, so what backward spends after it is communication that
computation did not hide (``exposed``).
"""

from __future__ import annotations

import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from hpcdl.dist.env import RankEnv
from hpcdl.dist.hooks import make_hook

__all__ = ["CommTimer", "data_parallel"]


class CommTimer:
    """When the last gradient bucket of the current backward was handed to the communication hook."""

    def __init__(self, hook_state=None, hook=default_hooks.allreduce_hook):
        self.hook_state, self.hook = hook_state, hook
        self.last_handover = 0.0
        self.buckets = 0
        self.on_done = None  # (bucket index, handed over at, done at) -> None: the timeline's comm spans

    def reset(self) -> None:
        self.last_handover, self.buckets = 0.0, 0


def _timed(timer: CommTimer, bucket):
    timer.last_handover = start = time.perf_counter()
    timer.buckets += 1
    future = timer.hook(timer.hook_state, bucket)
    if timer.on_done is None:
        return future
    index, record = bucket.index(), timer.on_done

    def done(f):
        record(index, start, time.perf_counter())
        return f.value()

    return future.then(done)


def data_parallel(model: torch.nn.Module, env: RankEnv, group=None, *, hook: str = "none", backend: str | None = None,
                  bucket_cap_mb: float = 25.0, sparse=None) -> tuple[torch.nn.Module, CommTimer | None]:
    """``model`` wrapped in DDP over ``group``, its buckets reduced by ``hook`` (:mod:`hpcdl.dist.hooks`)
    and timed; on one rank, ``model`` itself."""
    if env.world_size == 1:
        return model, None
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_cap_mb,
                                  gradient_as_bucket_view=True)
    timer = CommTimer(*make_hook(hook, env, group, backend, sparse))
    ddp.register_comm_hook(timer, _timed)
    return ddp, timer
