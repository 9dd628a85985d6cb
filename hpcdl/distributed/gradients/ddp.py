"""Gradient synchronization for the trainer: DDP over the job's process group, timed.

DDP all-reduces gradient buckets while backward still runs and waits for the last of them before
backward returns. A communication hook notes when each bucket is handed over; the last hand-over is
the end of the gradient computation, so what backward spends after it is communication that
computation did not hide (``exposed``).
"""

from __future__ import annotations

import contextlib
import inspect
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hpcdl.distributed.gradients.hooks import make_hook
from hpcdl.distributed.ranks.env import RankEnv

__all__ = ["BucketCollectiveError", "CommTimer", "bucket_caps", "data_parallel"]


class BucketCollectiveError(dist.DistError):
    """A gradient bucket's collective failed inside the comm hook. DDP's reducer re-raises it from backward
    as a plain RuntimeError carrying only its text ("Got the following error when running the callback");
    the hook-timing wrapper keeps it, typed, as :attr:`CommTimer.failure` for ``fail_fast``."""


class CommTimer:
    """When the last gradient of the current backward was handed over for its exchange: to the communication
    hook, bucket by bucket; or, with no hook (``none``: DDP's own all-reduce), to its bucket, gradient by
    gradient (:meth:`watch`), a bucket's all-reduce starting with its last gradient."""

    def __init__(self, hook_state, hook):
        self.hook_state, self.hook = hook_state, hook
        self.last_handover = 0.0
        self.buckets = 0  # hand-overs in this backward: buckets through a hook, gradients without one
        self.on_done = None  # (bucket index, handed over at, done at) -> None: the timeline's comm spans (a hook only)
        self.failure: BucketCollectiveError | None = None  # the first bucket collective that failed (a hook only)

    def reset(self) -> None:
        self.last_handover, self.buckets = 0.0, 0

    def watch(self, model: torch.nn.Module) -> None:
        """Note each parameter's gradient as it is accumulated (DDP's builtin reduction has no hook to time)."""
        def handed(_):
            self.last_handover = time.perf_counter()
            self.buckets += 1

        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(handed)


def _timed(timer: CommTimer, bucket):
    timer.last_handover = start = time.perf_counter()
    timer.buckets += 1
    future = timer.hook(timer.hook_state, bucket)
    index, record = bucket.index(), timer.on_done

    def done(f):
        try:
            value = f.value()
        except Exception as exc:
            failure = BucketCollectiveError(f"gradient bucket {index}'s collective failed: {exc}")
            timer.failure = timer.failure or failure
            raise failure from exc
        if record is not None:
            record(index, start, time.perf_counter())
        return value

    return future.then(done)


def _kept(_, bucket) -> torch.futures.Future:
    """A comm hook that exchanges nothing: the bucket stays this rank's sum (``optimizer.shard``'s reduce-scatter
    averages the gradients after backward, :meth:`hpcdl.optim.shard.ShardedOptimizer.reduce`)."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def data_parallel(model: torch.nn.Module, env: RankEnv, group=None, *, hook: str = "none", backend: str | None = None,
                  bucket_cap_mb: float = 25.0, first_bucket_mb: float | None = None,
                  gradient_as_bucket_view: bool = True, sparse=None, new_group=None,
                  bucket_spans: bool = False, exchange: bool = True,
                  broadcast_buffers: bool = True) -> tuple[torch.nn.Module, CommTimer | None]:
    """``model`` wrapped in DDP over ``group``, its buckets reduced by ``hook`` (:mod:`hpcdl.distributed.gradients.hooks`)
    and timed; on one rank, ``model`` itself.

    ``none`` registers no hook: DDP's own reduction divides each gradient by the size as it copies it into
    its bucket and hands the bucket to the group's all-reduce from C++, where a Python hook costs a pass
    over the gradients for the division and two threads' hand-offs per bucket (``hpcdl bench sync``;
    docs/performance.md). ``bucket_spans`` (the timeline's per-bucket spans) keeps the timed Python hook for
    ``none`` too. ``first_bucket_mb`` caps the first bucket (the last layers' gradients, ready first) below
    ``bucket_cap_mb`` so that communication starts sooner; ``None``: the same cap as the others. ``exchange=False``
    (``optimizer.shard``'s reduce-scatter does it): DDP exchanges no gradient and ``hook`` is not used; DDP still
    broadcasts the weights and the buffers (batch-norm statistics) at the start and, with ``broadcast_buffers``, the
    buffers from rank 0 before each forward; without it, the caller does (``optimizer.gather_ahead``:
    :mod:`hpcdl.optim.shard_ahead`, at the step's end).
    """
    if env.world_size == 1:
        return model, None
    with bucket_caps(bucket_cap_mb, first_bucket_mb) as caps:
        ddp = DistributedDataParallel(model, process_group=group, gradient_as_bucket_view=gradient_as_bucket_view,
                                      **caps, **({} if broadcast_buffers else _no_forward_buffer_sync()))
    if not broadcast_buffers and "forward_sync_buffers" not in _DDP_ARGS and any(True for _ in model.buffers()):
        # broadcast_buffers=False also skipped DDP's broadcast at construction (rank 0's pretrained statistics)
        dist._broadcast_coalesced(ddp.process_group, list(model.buffers()), ddp.broadcast_bucket_size, 0)
    if not exchange:
        timer = CommTimer(None, _kept)
        ddp.register_comm_hook(timer, _timed)
        return ddp, timer
    if hook == "none" and not bucket_spans:
        timer = CommTimer(None, None)
        timer.watch(model)
        return ddp, timer
    timer = CommTimer(*make_hook(hook, env, group, backend, sparse, new_group))
    ddp.register_comm_hook(timer, _timed)
    return ddp, timer


_DDP_ARGS = inspect.signature(DistributedDataParallel).parameters


def _no_forward_buffer_sync() -> dict:
    """DDP's arguments for no buffer broadcast before each forward, the buffers still broadcast at construction:
    ``forward_sync_buffers`` where torch has it (2.14.1 here: its ``broadcast_buffers=False`` is deprecated and
    also skips the broadcast at construction), ``broadcast_buffers`` on the releases before it (whose construction
    broadcast :func:`data_parallel` then makes itself)."""
    if "forward_sync_buffers" in _DDP_ARGS:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


@contextlib.contextmanager
def bucket_caps(cap_mb: float, first_mb: float | None):
    """DDP's bucket-size arguments. torch >= 2.10 takes per-bucket caps (the last repeats) and gives the
    first bucket ``bucket_cap_mb`` when that is set; earlier releases read the first bucket's cap from
    ``dist._DEFAULT_FIRST_BUCKET_BYTES`` when DDP is built."""
    first_mb = cap_mb if first_mb is None else min(first_mb, cap_mb)
    if "bucket_cap_mb_list" in _DDP_ARGS:
        yield {"bucket_cap_mb_list": [first_mb, cap_mb]} if first_mb < cap_mb else {"bucket_cap_mb": cap_mb}
        return
    default = dist._DEFAULT_FIRST_BUCKET_BYTES
    dist._DEFAULT_FIRST_BUCKET_BYTES = int(first_mb * 2 ** 20)
    try:
        yield {"bucket_cap_mb": cap_mb}
    finally:
        dist._DEFAULT_FIRST_BUCKET_BYTES = default
