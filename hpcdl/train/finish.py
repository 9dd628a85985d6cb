"""The run's start and end as the user reads them: the lines announced at the start, the replica check, the
end on a signal, a loss not finite or a failed read, and the summary (``summary.json`` and its text)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os

import torch
import torch.distributed as dist

from hpcdl.config import RunConfig
from hpcdl.distributed.affinity import allocator_in_use
from hpcdl.distributed.group.lifecycle import DistContext
from hpcdl.errors import StorageError, TrainingDiverged
from hpcdl.optim.shard import scatters
from hpcdl.runs.folder import RunFolder
from hpcdl.runs.outcome import EXIT_BAD_INPUT, Outcome, summary_text
from hpcdl.train.leaving import error_text
from hpcdl.train.metrics import phase_shares
from hpcdl.train.preempt import hand_to_submitit, requeue, submitit_handles
from hpcdl.train.state import Progress
from hpcdl.utils import atomic_write_text

__all__ = ["Facts", "announce", "check_replicas", "diverged", "on_signal", "on_storage_error", "write_summary"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Facts:
    """What the start-up decided, for the announcement."""

    run_dir: str
    resumed_from: str | None
    last_step: int
    model_defaults: str
    precision: str
    precision_why: str
    loader: str
    ipex_note: str
    compile_note: str
    channels_last: bool
    channels_last_why: str


def announce(cfg: RunConfig, ctx: DistContext, progress: Progress, facts: Facts) -> None:
    """Rank 0 logs the derived quantities once: the batch split, steps, model, backend, threads, precision and
    the gradient sync."""
    if ctx.rank != 0:
        return
    s, sync = cfg.schedule, cfg.sync
    resumed = (f", resuming from {facts.resumed_from} (step {progress.step}, epoch {progress.epoch})"
               if facts.resumed_from else ", from scratch")
    sparse = (f" (keep {sync.keep:g} of {sync.chunk}-element chunks{', fp16 on the wire' if sync.fp16 else ''} after "
              f"{sync.dense_warmup_epochs:g} dense epochs; each rank's residuals checkpointed with it)"
              if sync.hook == "chunk_sparse" else "")
    lines = [
        f"run {cfg.name} in {facts.run_dir}{resumed}",
        f"world size {ctx.world_size}; batch per rank {cfg.per_rank_batch} = {cfg.loop.accum_steps} x "
        f"{cfg.micro_batch}; global batch {cfg.global_batch}",
        f"{cfg.train_images} training images: {s.steps_per_epoch} steps per epoch, {s.warmup_steps} warmup steps, "
        f"{facts.last_step} steps to run of {s.total_steps}; peak lr {s.peak_lr:.5g}",
        f"model {cfg.model.name} at crop {cfg.crop}" + (f" ({facts.model_defaults})" if facts.model_defaults else ""),
        f"backend {ctx.backend.name}; {ctx.cpu.threads} threads per rank; allocator {allocator_in_use()}",
        facts.loader, f"cpu plan: {ctx.cpu.describe()}",
        f"precision {facts.precision} ({facts.precision_why}); "
        f"{'channels_last' if facts.channels_last else 'contiguous'} memory ({facts.channels_last_why})",
        facts.ipex_note, facts.compile_note,
        shard_sync(cfg, ctx) or f"gradient sync: DDP, buckets of {sync.bucket_cap_mb:g} MB"
        + (f" (the first {sync.first_bucket_mb:g} MB)" if sync.first_bucket_mb else "")
        + f", comm hook {sync.hook}{sparse}" + (", the optimizer sharded (an all-gather after the update, "
                                                f"{gathered(cfg)}; no reduce-scatter with this hook or backend)"
                                                if cfg.optimizer.shard and ctx.world_size > 1 else ""),
    ]
    for line in lines:
        log.info("%s", line)


def shard_sync(cfg: RunConfig, ctx: DistContext) -> str | None:
    """The gradient sync's line where ``optimizer.shard`` reduce-scatters the gradients (:mod:`hpcdl.optim.shard`)."""
    if not (cfg.optimizer.shard and ctx.world_size > 1 and scatters(cfg.sync.hook, ctx.group)):
        return None
    wire = "" if cfg.sync.hook == "none" else f" from {cfg.sync.hook}"
    return (f"gradient sync: optimizer.shard, reduce-scatters{wire} started by backward (segments of "
            f"{cfg.sync.bucket_cap_mb:g} MB) to each tensor's owner and an all-gather of the updated tensors, "
            f"{gathered(cfg)} (DDP exchanges none)")


def gathered(cfg: RunConfig) -> str:
    """How ``optimizer.shard``'s all-gather is waited for (:mod:`hpcdl.optim.shard_ahead`)."""
    if cfg.optimizer.gather_ahead and not cfg.loop.compile:
        return "in segments taken in by the next forward (optimizer.gather_ahead)"
    return "one per dtype at the step's end, in place in the weights"


def check_replicas(model: torch.nn.Module, ctx: DistContext, step: int, optimizer=None) -> str:
    """Collective: that every rank holds the same weights, bitwise (a sha256 of them, its first 8 bytes
    compared by an all-reduce of min and max). Replicas that drifted apart (a rank that skipped an update,
    a non-deterministic hook) end the run with the ranks that differ from rank 0 named. Buffers are left
    out: batch norm's running statistics follow each rank's last batch until DDP's next forward hands out
    rank 0's (``optimizer.gather_ahead``: the step's end), which are the ones a checkpoint keeps.
    ``optimizer``: its all-gather in flight settled first (``optimizer.gather_ahead``)."""
    getattr(optimizer, "settle", lambda: None)()
    digest = hashlib.sha256()
    for tensor in model.parameters():
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    mine = int.from_bytes(digest.digest()[:8], "little", signed=True)
    both = torch.tensor([mine, -mine], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=ctx.group)
    if both[0].item() == -both[1].item() == mine:
        verdict = f"identical on {ctx.world_size} ranks (sha256 of the weights)"
        if ctx.rank == 0:
            log.info("replicas: %s", verdict)
        return verdict
    every = [None] * ctx.world_size
    dist.all_gather_object(every, mine, group=ctx.group)
    differ = [r for r, h in enumerate(every) if h != every[0]]
    raise TrainingDiverged(f"the replicas differ after step {step}: ranks {differ} hold other weights than rank 0; "
                           "this is a bug in hpcdl or in a custom comm hook: report it with the run folder")


def on_signal(cfg: RunConfig, ctx: DistContext, stop, step: int, terminated: bool, checkpoints: str) -> Outcome:
    """How a run stopped by a signal ends, its checkpoint written: on SIGTERM, terminated; on the requeue signal,
    rank 0 hands the job to submitit or ``scontrol requeue`` (requeued), or cannot (stopped)."""
    if terminated:
        if ctx.world_size > 1:  # the others wait for rank 0's write, as below: their status 3 under srun
            dist.broadcast_object_list([None], src=0, group=ctx.group)  # --kill-on-bad-exit=1 would end it
        log.error("rank %d: stopped at step %d on SIGTERM (scancel, or a preemption or time limit without --signal); "
                  "checkpoint written in %s: submit the job again to resume", ctx.rank, step, checkpoints)
        return Outcome.TERMINATED
    log.warning("stopping at step %d on the requeue signal (%s); checkpoint written", step, cfg.checkpoint.signal)
    if submitit_handles(stop):  # submitit checkpoints the job object and requeues (then exits), on rank 0
        return Outcome.REQUEUED if ctx.rank == 0 and hand_to_submitit(stop) else Outcome.STOPPED
    outcome = Outcome.REQUEUED if ctx.rank == 0 and requeue(cfg.checkpoint.max_requeues) else Outcome.STOPPED
    if ctx.world_size > 1:  # the others wait for rank 0's write and requeue, and take its outcome: under srun
        # --kill-on-bad-exit=1 their status 3 ended the step, rank 0 in its write or before its scontrol requeue
        box = [outcome.value]
        dist.broadcast_object_list(box, src=0, group=ctx.group)
        outcome = Outcome(box[0])
    return outcome


def diverged(progress: Progress, newest: str | None) -> TrainingDiverged:
    """The error of a loss that is not finite, naming the checkpoint the run resumes from."""
    return TrainingDiverged(
        f"the loss is not finite at step {progress.step + 1} (epoch {progress.epoch}); stopped without updating the "
        f"weights or writing a checkpoint. Last good checkpoint: {newest or 'none'}. Lower schedule.base_lr, lengthen "
        "schedule.warmup_epochs, or check the data; the run resumes from that checkpoint")


def write_summary(cfg: RunConfig, ctx: DistContext, progress: Progress, *, outcome: Outcome, epochs: float,
                  run_dir: str, replicas: str) -> dict:
    """The run's summary (the same on every rank); rank 0 writes summary.json and logs its text."""
    elapsed = progress.elapsed()
    best = progress.best or {}
    jsonl = RunFolder(run_dir).steps_log
    s = {"outcome": outcome.value, "name": cfg.name, "steps": progress.step, "world_size": ctx.world_size,
         "epochs": epochs, "train_s": elapsed,
         "images_per_s": progress.step * cfg.global_batch / elapsed if elapsed else 0.0,
         "best_top1": best.get("top1"), "best_top5": best.get("top5"), "best_step": best.get("step"),
         "target_top1": cfg.loop.target_top1, "time_to_target_s": progress.time_to_target_s,
         "stopped_at_target": progress.stopped_at is not None, "run_dir": run_dir,
         "replicas": replicas, "phases": phase_shares(jsonl) if ctx.rank == 0 and os.path.exists(jsonl) else {}}
    if ctx.rank == 0:
        atomic_write_text(RunFolder(run_dir).summary, json.dumps(s, indent=1) + "\n")
        log.info("%s", summary_text(s))
    return s


@contextlib.contextmanager
def on_storage_error(rescue):
    """Training under it: a read the filesystem failed in this rank's loader (a shard's storage server down, the
    mount lost; :class:`~hpcdl.errors.StorageError`) raises before the step's update, so this rank holds the last
    completed step whole. With a just-in-time checkpoint (``rescue``), it writes that step as a survivor does (the
    other ranks, blocked in the next collective, join it from its report) and stops with status 2, which no
    supervisor restarts: the data must be readable first. Without one, the error goes on up."""
    try:
        yield
    except StorageError as exc:
        if rescue is None:
            raise
        rescue.run(error_text(exc), EXIT_BAD_INPUT, "its input failed")
