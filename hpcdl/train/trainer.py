"""The trainer: wires data, model, optimizer, gradient sync, checkpoints and signals; owns none of them.

:func:`train` runs one config on the ranks of the job it is started in (srun, mpiexec, torchrun,
submitit or a single process: :mod:`hpcdl.distributed.env` tells them apart). It resumes from the newest
readable checkpoint in the run folder, so a requeued job simply runs again.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from hpcdl.config import RunConfig, dump_yaml
from hpcdl.data.dataset import InMemory, ShardDataset
from hpcdl.data.format import Manifest
from hpcdl.data.verify import check_dataset, load_manifest
from hpcdl.data.recipe import channel_stats, parse
from hpcdl.data.sampler import DistributedShardSampler
from hpcdl.data.transforms import Augment, BatchMix, EvalTransform, normalize_batch
from hpcdl.distributed.affinity import allocator_in_use, plan_cpus
from hpcdl.distributed.hooks import ChunkSparse
from hpcdl.distributed.process_group import (
    DistContext,
    apply_cpu_plan,
    fail_fast,
    init_distributed,
    new_subgroup,
    set_timeout,
    shutdown,
)
from hpcdl.distributed.sync import data_parallel
from hpcdl.errors import ConfigError, DataError, TrainingDiverged
from hpcdl.models import build_model, model_info, with_model_defaults
from hpcdl.models.finetune import load_weights, lr_scales, read_weights
from hpcdl.optim.factory import build_optimizer
from hpcdl.optim.schedule import LRSchedule
from hpcdl.schema import flatten, from_dict, to_dict
from hpcdl.train.accel import apply_ipex
from hpcdl.train.checkpoint import CheckpointManager, load_latest_shared, load_rank_state, save_rank_state
from hpcdl.train.evaluate import evaluate
from hpcdl.train.loader import loader_cost, make_loader, size_loader, step_rate
from hpcdl.train.metrics import RunLog, phase_shares
from hpcdl.train.outcome import Outcome, summary_text
from hpcdl.train.precision import choose_precision
from hpcdl.train.preempt import StopSignal, hand_to_submitit, requeue, requeue_target
from hpcdl.train.preflight import check_writable, preflight
from hpcdl.train.startup import StartupRecord
from hpcdl.train.state import FORMAT, Counters, RankRng, SamplerPosition, Stateful, upgrade
from hpcdl.train.step import Stepper, criterion, effects_undone
from hpcdl.train.timeline import Timeline
from hpcdl.utils import atomic_write_text

__all__ = ["Trainer", "preflight", "run_dir", "train"]

log = logging.getLogger(__name__)


def train(cfg: RunConfig) -> dict:
    """Train ``cfg`` on this job's ranks; returns the run's summary (the same on every rank)."""
    record = StartupRecord({"run folder": run_dir(cfg), "training data": os.path.expandvars(cfg.data.train),
                            "validation data": os.path.expandvars(cfg.data.val), "python": sys.prefix}) \
        if cfg.loop.record_startup else None
    stop = StopSignal(cfg.checkpoint.signal)  # before any worker forks: they inherit the handler
    startup = timedelta(seconds=cfg.loop.startup_timeout_s)
    ctx = init_distributed(cfg.loop.backend, ccl_lib=cfg.loop.ccl_lib or None, timeout=startup,
                           count_store=record is not None)
    if record:
        record.mark("rendezvous and backend")
    trainer = None
    with fail_fast(ctx, lambda: trainer and trainer.comm_failure()), _data_workers_named(ctx.rank):
        set_timeout(ctx, startup)  # the job's group; the step timeout follows the first completed step
        trainer = Trainer(cfg, ctx, stop, record)
        stop.arm()  # after every communicator exists (see StopSignal.arm)
        summary = trainer.fit()
    stop.close()
    shutdown(ctx)
    return summary


@contextlib.contextmanager
def _data_workers_named(rank: int):
    """A DataLoader worker that dies (the OOM killer, most often) surfaces as a RuntimeError from the loader
    or from torch's SIGCHLD handler, wherever the main thread is, or as a ConnectionError when it dies
    handing a batch over: name it as the data's, with the fix."""
    try:
        yield
        return
    except (RuntimeError, ConnectionError, EOFError) as exc:
        error = exc
    for _ in range(3):  # torch's SIGCHLD handler can raise again while this runs: take its error instead
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            named = _worker_death(error, rank)
            break
        except RuntimeError as again:
            error = again
    else:
        named = None
    if named is None:
        raise error
    raise named from None


def _worker_death(exc: BaseException, rank: int) -> DataError | None:
    frames = traceback.extract_tb(exc.__traceback__)
    if "DataLoader worker" not in str(exc) and not any("torch/utils/data/" in f.filename for f in frames):
        return None
    first = (str(exc).strip().splitlines() or [""])[0]
    what = first if "DataLoader worker" in first else \
        f"a DataLoader worker died while handing over a batch ({type(exc).__name__}: {first})"
    return DataError(f"rank {rank}: {what}; the OOM killer is the usual cause (the node's dmesg says): lower "
                     "data.workers or the per-rank batch, or ask Slurm for more memory per task")


def run_dir(cfg: RunConfig) -> str:
    return os.path.expandvars(cfg.run_dir.format(name=cfg.name, job=requeue_target() or "local"))


class Trainer:
    def __init__(self, cfg: RunConfig, ctx: DistContext, stop: StopSignal, record: StartupRecord | None = None):
        self.ctx, self.stop, self.record = ctx, stop, record
        check_writable(cfg)  # the refusal the login node gives, before the folder is made
        self.dir = run_dir(cfg)
        try:
            os.makedirs(os.path.join(self.dir, "checkpoints"), exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"run_dir {self.dir}: cannot create it ({exc.strerror or exc}); --set run_dir to a "
                              "folder this job can write") from None
        self.ckpt = CheckpointManager(os.path.join(self.dir, "checkpoints"), cfg.checkpoint.keep) \
            if ctx.rank == 0 else None
        self.restore = load_latest_shared(self.ckpt, ctx.group)  # read once, by rank 0; before the batch split
        self._mark("checkpoint read")
        self.manifests = self._read_manifests(cfg)  # before preflight, which needs data.train's
        cfg, self.model_defaults = with_model_defaults(cfg)  # crop: 0, the model's
        self.cfg = cfg = preflight(self._fit_to_ranks(cfg), ctx.world_size, self.manifests[0])
        if ctx.rank == 0:
            atomic_write_text(os.path.join(self.dir, "config.yaml"), dump_yaml(cfg))
        self.precision, self.precision_why = choose_precision(cfg.loop.precision)
        self.step = self.epoch = self.consumed = 0
        self.started = False  # whether this process completed a step (start-up timeout until then)
        self.elapsed, self.best, self.time_to_target = 0.0, None, None
        self.last_save_step, self.last_save_time = -1, time.monotonic()
        self._build_model()
        self._mark("model")
        self._build_data()
        self._mark("data open")
        self._size_loader()
        self._mark("loader probe")
        self._hook_state = None  # this rank's comm hook state from the checkpoint resumed from
        self.comm = None  # the comm hook's timer (hpcdl.distributed.sync.CommTimer), once DDP wraps the model
        self.resumed_from = self._resume()
        self._mark("checkpoint restore")
        self._wrap()
        self._mark("DDP")
        self.last_step = min(cfg.schedule.total_steps, cfg.loop.max_steps or cfg.schedule.total_steps)

    # -- set-up ---------------------------------------------------------------------------------------
    def _mark(self, phase: str) -> None:
        if self.record is not None:
            self.record.mark(phase)

    def _build_model(self) -> None:
        cfg, tuned = self.cfg, self.cfg.model
        torch.manual_seed(cfg.loop.seed)
        model = build_model(tuned.name, cfg.num_classes, in_channels=cfg.data.channels)
        scales, body = {}, None
        if tuned.weights:
            if self.restore is None:  # a checkpoint of the run itself holds the weights it got to
                self._start_weights(model)
            scales, body = lr_scales(model, cfg.num_classes, tuned.body_lr_scale, tuned.layer_decay)
        if cfg.loop.channels_last:
            model = model.to(memory_format=torch.channels_last)
        optimizer = build_optimizer(model, cfg.optimizer, scales, body)
        self.model, self.optimizer, self.ipex_note = apply_ipex(model, optimizer, precision=self.precision,
                                                                mode=cfg.loop.ipex)
        freeze = round(tuned.freeze_body_epochs * cfg.schedule.steps_per_epoch)
        self.schedule = LRSchedule(self.optimizer, cfg.schedule, freeze_steps=freeze)
        self.criterion = criterion(cfg.label_smoothing)

    def _start_weights(self, model: torch.nn.Module) -> None:
        """model.weights into rank 0's model, read by rank 0 alone: DDP gives the other ranks rank 0's weights
        when it wraps the model. Rank 0's error stops every rank."""
        cfg, ctx = self.cfg, self.ctx
        found: list = [None, None]  # what was replaced or adapted, rank 0's error
        if ctx.rank == 0:
            try:
                weights = read_weights(cfg.model.weights, cfg.model.name)
                found[0] = load_weights(model, weights, cfg.num_classes, cfg.model.weights)
            except ConfigError as exc:
                found[1] = f"{exc}"
        dist.broadcast_object_list(found, src=0, group=ctx.group)
        if found[1] is not None:
            raise ConfigError(found[1] if ctx.rank == 0 else f"rank 0 could not load model.weights: {found[1]}")
        if ctx.rank == 0:
            m = cfg.model
            log.info("fine-tuning from %s: %s; body lr x%g, frozen for %g epochs, layer decay %g", m.weights,
                     "; ".join(found[0]) or "every tensor loaded", m.body_lr_scale, m.freeze_body_epochs,
                     m.layer_decay)

    def _build_data(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        micro = cfg.per_rank_batch // cfg.loop.accum_steps
        steps = parse(cfg.data.augment)
        augment = Augment(steps, cfg.crop, decoder=cfg.data.decoder, channels=cfg.data.channels)
        train = self._dataset(os.path.expandvars(cfg.data.train), self.manifests[0], augment, seed=cfg.data.seed)
        info = model_info(cfg.model.name)
        self.mean, self.std, why = channel_stats(cfg.data, train.manifest.stats, train.root,
                                                 stated=(info.mean, info.std, info.description),
                                                 finetuning=bool(cfg.model.weights))
        self.mix = BatchMix(steps, cfg.num_classes)
        names = [c["name"] or c["wnid"] for c in train.manifest.classes]  # for the confusion matrix
        self.classes = names if len(names) == cfg.num_classes else [str(i) for i in range(cfg.num_classes)]
        if ctx.rank == 0:
            log.info("data: %s; normalized with mean %s, std %s (%s)", ", ".join(cfg.data.augment),
                     [round(v, 4) for v in self.mean], [round(v, 4) for v in self.std], why)
        self.sampler = DistributedShardSampler(train.shard_sizes, ctx.world_size, ctx.rank, cfg.data.sampler,
                                               shuffle=True, seed=cfg.data.seed)
        if cfg.data.in_memory:
            train = InMemory(train, cfg.data.in_memory)
        self.train_loader = make_loader(train, self.sampler, micro, cfg.data.workers)
        self.val_loader = None
        if cfg.data.val:
            val = self._dataset(os.path.expandvars(cfg.data.val), self.manifests[1],
                                EvalTransform(cfg.data.eval_resize, cfg.crop, decoder=cfg.data.decoder,
                                              channels=cfg.data.channels))
            sampler = DistributedShardSampler(val.shard_sizes, ctx.world_size, ctx.rank, "global", shuffle=False)
            self.val_loader = make_loader(val, sampler, micro, cfg.data.workers)

    def _read_manifests(self, cfg: RunConfig) -> tuple[Manifest, Manifest | None]:
        """data.train's and data.val's manifests on every rank, read once: rank 0 reads them and the job's group
        broadcasts them (or rank 0's error, which every rank then raises)."""
        ctx = self.ctx
        found: list = [None, None, None]  # train's, val's, rank 0's error
        if ctx.rank == 0:
            try:
                found[0] = load_manifest(os.path.expandvars(cfg.data.train)) if cfg.data.train else None
                found[1] = load_manifest(os.path.expandvars(cfg.data.val)) if cfg.data.val else None
            except (DataError, OSError) as exc:
                found[2] = f"{exc}"
        dist.broadcast_object_list(found, src=0, group=ctx.group)
        if found[2] is not None:
            raise DataError(found[2] if ctx.rank == 0 else f"rank 0 could not read a manifest: {found[2]}")
        return found[0], found[1]

    def _dataset(self, root: str, manifest: Manifest, transform, seed: int | None = None) -> ShardDataset:
        """The packed dataset at ``root`` as every rank needs it, without every rank reading the same files:
        ``manifest`` is rank 0's (:meth:`_read_manifests`); the shards' check (``data.verify``) is split over the
        ranks, and when any rank found a problem every rank stops (each naming what it found)."""
        ctx = self.ctx
        problems = [] if self.cfg.data.verify == "none" else check_dataset(
            root, manifest, full=self.cfg.data.verify == "full", rank=ctx.rank, world=ctx.world_size, split=True)
        bad = torch.tensor([len(problems)], dtype=torch.int64)
        dist.all_reduce(bad, group=ctx.group)
        if bad.item():
            mine = ("; here:\n  " + "\n  ".join(problems)) if problems else " (the ranks that checked them name them)"
            raise DataError(f"{root}: {bad.item()} damaged or missing shards{mine}\nrun 'hpcdl verify --full {root}', "
                            "then repack or restore them")
        return ShardDataset(root, transform, verify="none", seed=seed, manifest=manifest)

    def _size_loader(self) -> None:
        """Keep whole cores from compute for the loader only where its measured need fills them (see
        :mod:`hpcdl.train.loader`), and re-plan the rank's threads around them."""
        cfg, ctx = self.cfg, self.ctx

        def measure() -> tuple[float, float]:
            x, y = self._blank_batch()
            autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if self.precision == "bf16" \
                else contextlib.nullcontext
            return loader_cost(self.train_loader.dataset), step_rate(self.model, self.criterion, x, y, autocast)

        self.loader_sizing = size_loader(cfg.data.reserve_cores, cfg.data.workers, measure)
        if self.loader_sizing.reserved != len(ctx.cpu.data_cpus):
            ctx.cpu = plan_cpus(local_rank=ctx.env.local_rank, local_size=ctx.env.local_size,
                                comm_threads=len(ctx.cpu.comm_cpus), data_cores=self.loader_sizing.reserved,
                                task_cpus=set(ctx.cpu.task_cpus))
            apply_cpu_plan(ctx.cpu)

    def _wrap(self) -> None:
        sync = self.cfg.sync
        sparse = ChunkSparse(keep=sync.keep, chunk=sync.chunk, fp16=sync.fp16, step=self.step,
                             dense_steps=round(sync.dense_warmup_epochs * self.cfg.schedule.steps_per_epoch)) \
            if sync.hook == "chunk_sparse" else None
        if sparse is not None:
            sparse.hold_back(self.optimizer)
            if self._hook_state is not None:
                sparse.load_state_dict(self._hook_state)
        self.sparse = sparse
        net, comm = data_parallel(self.model, self.ctx.env, self.ctx.group, hook=sync.hook, backend=self.ctx.backend.name,
                                  bucket_cap_mb=sync.bucket_cap_mb, first_bucket_mb=sync.first_bucket_mb,
                                  gradient_as_bucket_view=sync.gradient_as_bucket_view, sparse=sparse,
                                  new_group=functools.partial(new_subgroup, self.ctx))
        self.compile_note = "compile: off"
        if self.cfg.loop.compile:
            net, self.compile_note = torch.compile(net), "compile: torch.compile (the first steps compile)"
        self.net = net
        self.timeline = Timeline(self.dir, self.ctx.rank) if self.cfg.loop.timeline else None
        self.replicas = "not checked (the run ended early)"  # _check_replicas at the end
        self.samples = None
        if self.cfg.loop.record_samples:
            os.makedirs(os.path.join(self.dir, "samples"), exist_ok=True)
            self.samples = open(os.path.join(self.dir, "samples", f"rank{self.ctx.rank:05d}.txt"), "a")
        self.comm = comm
        self.stepper = Stepper(net, self.criterion, self.optimizer, self.schedule, precision=self.precision,
                               comm=comm, group=self.ctx.group, distributed=self.ctx.world_size > 1,
                               timeline=self.timeline)
        if sparse is not None and sparse.bucketed and self.ctx.world_size > 1:
            self._rehearse(sparse)

    def comm_failure(self):
        """The gradient bucket collective that failed, typed (DDP re-raises it as text), or None."""
        return self.comm.failure if self.comm is not None else None

    def _rehearse(self, sparse: ChunkSparse) -> None:
        """One forward and backward whose effects are all undone, so that the resumed run's next step uses
        the bucket layout the uninterrupted run used there. DDP builds its buckets in parameter order,
        records the order gradients become ready in its first backward and rebuilds them from it; the
        chunk_sparse hook chunks and picks per bucket, and its residuals are kept per bucket."""
        x, y = self._blank_batch()
        sparse.dry = True
        try:
            with effects_undone(self.model), self.stepper.autocast():
                self.criterion(self.net(x), y).backward()
        finally:
            sparse.dry = False

    def _prepare(self, images: torch.Tensor) -> torch.Tensor:
        return normalize_batch(images, self.mean, self.std, channels_last=self.cfg.loop.channels_last)

    def _blank_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch of black images, class 0: for the probes that only time or order a step."""
        cfg = self.cfg
        micro = cfg.per_rank_batch // cfg.loop.accum_steps
        return (self._prepare(torch.zeros(micro, cfg.crop, cfg.crop, cfg.data.channels, dtype=torch.uint8)),
                torch.zeros(micro, dtype=torch.long))

    # -- checkpoints ----------------------------------------------------------------------------------
    def _parts(self) -> dict[str, Stateful]:
        """What a checkpoint holds beside its format, world size and config: one entry per stateful part.
        The comm hook's state (chunk_sparse's residuals) is each rank's own and goes to per-rank files."""
        return {"model": self.model, "optimizer": self.optimizer, "schedule": self.schedule,
                "sampler": SamplerPosition(self), "rng": RankRng(self.ctx, self.cfg.loop.seed), "counters": Counters(self)}

    def _state(self) -> dict:
        return {"format": FORMAT, "world_size": self.ctx.world_size, "config": to_dict(self.cfg),
                "accum_remapped": self.accum_remapped,
                **{name: part.state_dict() for name, part in self._parts().items()}}

    def _save(self, why: str) -> None:
        """Collective: every rank gives its RNG state; rank 0 writes."""
        if self.last_save_step == self.step:
            return
        if self.sparse is not None:  # every rank's own part first; the gather in _state() waits for all
            save_rank_state(os.path.join(self.dir, "checkpoints"), self.step, self.ctx.rank, self.sparse.state_dict())
        state = self._state()
        state["rank_states"] = self.sparse is not None
        if self.ckpt is not None:
            path = self.ckpt.save(self.step, state)
            log.info("checkpoint (%s): %s", why, path)
        self.last_save_step, self.last_save_time = self.step, time.monotonic()

    def _fit_to_ranks(self, cfg: RunConfig) -> RunConfig:
        """``cfg`` for resuming a checkpoint of another number of ranks: refused under
        ``checkpoint.resume_ranks=same``; else the same global batch, with the gradient accumulation that
        keeps the saved run's micro-batch where the new batch per rank allows it. A run whose accumulation was
        set so keeps it on a resume on its own number of ranks too."""
        self.accum_remapped = False  # whether loop.accum_steps was set here: checkpoints say so
        if self.restore is None:
            return cfg
        path, state = self.restore
        saved, now = state["world_size"], self.ctx.world_size
        if saved == now and not state.get("accum_remapped"):
            return cfg
        if saved != now and cfg.checkpoint.resume_ranks == "same":
            raise ConfigError(f"{path} was written by {saved} ranks, this job has {now} and checkpoint.resume_ranks="
                              f"same; run on {saved} ranks, --set checkpoint.resume_ranks=any, or set run_dir to a "
                              "new folder")
        then = state["config"]
        micro = then["global_batch"] // saved // then["loop"]["accum_steps"]
        per_rank = cfg.global_batch // now if cfg.global_batch % now == 0 else 0
        if per_rank and per_rank % micro == 0:
            self.accum_remapped = per_rank // micro != cfg.loop.accum_steps or bool(state.get("accum_remapped"))
            if per_rank // micro != cfg.loop.accum_steps:
                if self.ctx.rank == 0:
                    log.info("resuming on %d ranks (saved: %d): loop.accum_steps %d -> %d keeps the micro-batch of "
                             "%d images", now, saved, cfg.loop.accum_steps, per_rank // micro, micro)
                cfg = dataclasses.replace(cfg, loop=dataclasses.replace(cfg.loop, accum_steps=per_rank // micro))
        return cfg

    def _resume(self) -> str | None:
        if self.restore is None:
            return None
        path, state = self.restore
        self._warn_changed(path, state["config"])
        state = upgrade(state)
        saved = state["world_size"]
        for name, part in self._parts().items():
            part.load_state_dict(state[name])
        if state.get("rank_states"):
            self._hook_state = self._rank_state(path, saved)
        elif self.cfg.sync.hook == "chunk_sparse" and self.step > 0:
            log.warning("%s holds no chunk_sparse residuals (written by an older hpcdl or another hook): they "
                        "start from zero, so this run is not the one that was interrupted", path)
        if saved != self.ctx.world_size and self.ctx.rank == 0:
            self._announce_remap(path, state)
        self.last_save_step = self.step
        self.restore = None  # the state's memory goes back
        return path

    def _rank_state(self, path: str, saved: int) -> dict:
        """This rank's comm hook state. From a run of another number of ranks: old rank r's residuals go to
        rank r mod (ranks now), scaled by now/saved, so that the update still owed (their mean over the
        ranks) is the same; each file is read by one rank."""
        now, rank = self.ctx.world_size, self.ctx.rank
        if saved == now:
            return load_rank_state(path, rank)
        mine = [load_rank_state(path, r) for r in range(rank, saved, now)]
        if not mine:  # more ranks than before: this one owes nothing
            first = load_rank_state(path, 0)
            return {**first, "residuals": {k: torch.zeros_like(v) for k, v in first["residuals"].items()}}
        residuals = {k: sum(m["residuals"][k] for m in mine) * (now / saved) for k in mine[0]["residuals"]}
        return {**mine[0], "residuals": residuals}

    def _announce_remap(self, path: str, state: dict) -> None:
        saved, now = state["world_size"], self.ctx.world_size
        then = state["config"]
        left = len(self.sampler) * now
        per_rank = "its own" if now <= saved else f"their own on ranks 0-{saved - 1}, seeded afresh on the others"
        residuals = (f"; chunk_sparse residuals: old rank r's to rank r mod {now}, scaled by {now}/{saved}"
                     if state.get("rank_states") else "")
        log.warning("resuming %s, written by %d ranks, on %d: global batch %d = %d x %d per rank (was %d x %d); the "
                    "epoch goes on with the %d samples not yet trained, each with its augmentation (seeded by "
                    "sample); RNG streams: each rank takes %s%s. What differs from an uninterrupted run: batch "
                    "norm's statistics come from each rank's micro-batch, and the all-reduce adds in another "
                    "order (float rounding)", path, saved, now, self.cfg.global_batch, now, self.cfg.per_rank_batch,
                    saved, then["global_batch"] // saved, left, per_rank, residuals)

    def _warn_changed(self, path: str, saved: dict) -> None:
        try:  # in today's shape: an older hpcdl's config (model: NAME) gets the keys added since, at their defaults
            saved = to_dict(from_dict(RunConfig, saved))
        except ConfigError:
            pass  # one this hpcdl cannot read: compared as it is
        now, then = flatten(to_dict(self.cfg)), flatten(saved)
        changed = sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))
        if changed and self.ctx.rank == 0:
            log.warning("resuming %s with a changed config: %s", path,
                        ", ".join(f"{k} {then.get(k)!r} -> {now.get(k)!r}" for k in changed))

    # -- the loop -------------------------------------------------------------------------------------
    def fit(self) -> dict:
        self._announce()
        self.t0 = time.monotonic()
        self.runlog = RunLog(self.dir, rank=self.ctx.rank, total_steps=self.last_step, start_step=self.step,
                             log_every=self.cfg.loop.log_every)
        try:
            outcome = self._loop()
            if outcome == "stop":
                return self._preempted()
            if outcome == "terminate":
                log.error("rank %d: stopped at step %d on SIGTERM (scancel, or a preemption or time limit without "
                          "--signal); checkpoint written in %s: submit the job again to resume", self.ctx.rank,
                          self.step, os.path.join(self.dir, "checkpoints"))
                return self._summary(Outcome.TERMINATED)
            self._finish()
            return self._summary(Outcome.FINISHED)
        finally:
            self.runlog.close()
            if self.timeline is not None:
                self.timeline.close()
            if self.samples is not None:
                self.samples.close()

    def _loop(self) -> str:
        while self.step < self.last_step:
            outcome = self._train_epoch()
            if outcome != "epoch":
                return outcome
            self.epoch, self.consumed = self.epoch + 1, 0
            every = self.cfg.loop.eval_every
            if every and self.epoch % every == 0 and self.step < self.last_step:
                self._evaluate()
        return "done"

    def _train_epoch(self) -> str:
        self.sampler.set_epoch(self.epoch)
        if self.samples is not None:
            self.sampler.handed = collections.deque()  # what the loader read ahead of a finished epoch goes
        batches = self._batches()
        while self.step < self.last_step:
            result = self.stepper.step(batches, self.cfg.loop.accum_steps, self._wishes)
            if result is None:
                return "epoch"
            if not result.finite:
                self._diverged()
            self.step += 1
            if not self.started:  # start-up is over: from here on a collective gets the step timeout
                self.started = True
                set_timeout(self.ctx, timedelta(seconds=self.cfg.loop.timeout_s))
                if self.record is not None:
                    self._mark("first step")
                    self.record.write(self.dir, self.ctx.rank, self.ctx.world_size, self.ctx.store_use.as_dict())
            self.runlog.step(self.step, self._epochs(), self.schedule.current_lr(), result)
            every = self.cfg.checkpoint.every_steps
            if result.save or result.stop or (every and self.step % every == 0):
                self._save("signal" if result.stop else "periodic")
            if result.stop:
                return "terminate" if result.stop == 2 else "stop"
        return "done"

    def _batches(self):
        for images, labels in self.train_loader:
            self.consumed += len(labels)
            if self.samples is not None:  # the loader returns batches in the order the sampler handed them out
                handed = self.sampler.handed
                self.samples.write("".join(f"{s.epoch} {int(s)}\n" for s in (handed.popleft() for _ in labels)))
                self.samples.flush()
            images = self._prepare(images)
            yield self.mix(images, labels) if self.mix else (images, labels)

    def _wishes(self) -> tuple[bool, bool]:
        """Rank 0's (stop, checkpoint now); the step's control all-reduce hands them to every rank."""
        minutes = self.cfg.checkpoint.every_minutes
        due = bool(minutes) and time.monotonic() - self.last_save_time >= 60 * minutes
        return self.stop.wish, due

    def _diverged(self) -> None:
        last = self.ckpt.checkpoints()[0] if self.ckpt is not None and self.ckpt.checkpoints() else None
        raise TrainingDiverged(
            f"the loss is not finite at step {self.step + 1} (epoch {self.epoch}); stopped without updating the "
            f"weights or writing a checkpoint. Last good checkpoint: {last or 'none'}. Lower schedule.base_lr, "
            "lengthen schedule.warmup_epochs, or check the data; the run resumes from that checkpoint")

    def _evaluate(self) -> None:
        if self.val_loader is None:
            return
        metrics = evaluate(self.net, self.val_loader, self._prepare, group=self.ctx.group,
                           num_classes=self.cfg.num_classes)
        self.runlog.evaluation(self.step, self._epochs(), metrics, self.classes)
        metrics.pop("confusion", None)
        if self.best is None or metrics["top1"] > self.best["top1"]:
            self.best = {"step": self.step, **metrics}
        target = self.cfg.loop.target_top1
        if target and self.time_to_target is None and metrics["top1"] >= target:
            self.time_to_target = self._elapsed()

    def _finish(self) -> None:
        if self.best is None or self.best["step"] != self.step:
            self._evaluate()
        self._check_replicas()
        self._save("end")

    def _check_replicas(self) -> None:
        """Collective: that every rank holds the same weights, bitwise (a sha256 of them, its first 8 bytes
        compared by an all-reduce of min and max). Replicas that drifted apart (a rank that skipped an update,
        a non-deterministic hook) end the run with the ranks that differ from rank 0 named. Buffers are left
        out: batch norm's running statistics follow each rank's last batch until DDP's next forward hands out
        rank 0's, which are the ones a checkpoint keeps."""
        digest = hashlib.sha256()
        for tensor in self.model.parameters():
            digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        mine = int.from_bytes(digest.digest()[:8], "little", signed=True)
        both = torch.tensor([mine, -mine], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.ctx.group)
        if both[0].item() == -both[1].item() == mine:
            self.replicas = f"identical on {self.ctx.world_size} ranks (sha256 of the weights)"
            if self.ctx.rank == 0:
                log.info("replicas: %s", self.replicas)
            return
        every = [None] * self.ctx.world_size
        dist.all_gather_object(every, mine, group=self.ctx.group)
        differ = [r for r, h in enumerate(every) if h != every[0]]
        raise TrainingDiverged(f"the replicas differ after step {self.step}: ranks {differ} hold other weights than "
                               "rank 0; this is a bug in hpcdl or in a custom comm hook: report it with the run "
                               "folder")

    def _preempted(self) -> dict:
        log.warning("stopping at step %d on the requeue signal (%s); checkpoint written", self.step,
                    self.cfg.checkpoint.signal)
        outcome = Outcome.STOPPED
        if self.ctx.rank == 0:
            # submitit checkpoints the job object and requeues (then exits); else scontrol requeue
            if hand_to_submitit(self.stop) or requeue(self.cfg.checkpoint.max_requeues):
                outcome = Outcome.REQUEUED
        return self._summary(outcome)

    def _epochs(self) -> float:
        """Epochs done, fractional: this rank's share of the current epoch that it has trained on."""
        return self.epoch + self.sampler.fraction_done(self.consumed)

    def _elapsed(self) -> float:
        return self.elapsed + time.monotonic() - self.t0 if hasattr(self, "t0") else self.elapsed

    def _summary(self, outcome: Outcome) -> dict:
        cfg, elapsed = self.cfg, self._elapsed()
        if self.record is not None:
            self.record.finish(self.ctx.store_use.as_dict())
        jsonl = os.path.join(self.dir, "train.jsonl")
        s = {"outcome": outcome.value, "name": cfg.name, "steps": self.step, "world_size": self.ctx.world_size,
             "epochs": self._epochs(), "train_s": elapsed,
             "images_per_s": self.step * cfg.global_batch / elapsed if elapsed else 0.0,
             "best_top1": self.best and self.best["top1"], "best_top5": self.best and self.best["top5"],
             "best_step": self.best and self.best["step"], "target_top1": cfg.loop.target_top1,
             "time_to_target_s": self.time_to_target, "run_dir": self.dir, "replicas": self.replicas,
             "phases": phase_shares(jsonl) if self.ctx.rank == 0 and os.path.exists(jsonl) else {}}
        if self.ctx.rank == 0:
            atomic_write_text(os.path.join(self.dir, "summary.json"), json.dumps(s, indent=1) + "\n")
            log.info("%s", summary_text(s))
        return s

    def _announce(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        if ctx.rank != 0:
            return
        s = cfg.schedule
        lines = [
            f"run {cfg.name} in {self.dir}" + (f", resuming from {self.resumed_from} (step {self.step}, "
                                               f"epoch {self.epoch})" if self.resumed_from else ", from scratch"),
            f"world size {ctx.world_size}; batch per rank {cfg.per_rank_batch} = {cfg.loop.accum_steps} x "
            f"{cfg.per_rank_batch // cfg.loop.accum_steps}; global batch {cfg.global_batch}",
            f"{cfg.train_images} training images: {s.steps_per_epoch} steps per epoch, {s.warmup_steps} warmup steps, "
            f"{self.last_step} steps to run of {s.total_steps}; peak lr {s.peak_lr:.5g}",
            f"model {cfg.model.name} at crop {cfg.crop}" + (f" ({self.model_defaults})" if self.model_defaults else ""),
            f"backend {ctx.backend.name}; {ctx.cpu.threads} threads per rank; allocator {allocator_in_use()}",
            self.loader_sizing.describe(), f"cpu plan: {ctx.cpu.describe()}",
            f"precision {self.precision} ({self.precision_why}); channels_last {cfg.loop.channels_last}",
            self.ipex_note, self.compile_note, f"gradient sync: DDP, buckets of {cfg.sync.bucket_cap_mb:g} MB"
            + (f" (the first {cfg.sync.first_bucket_mb:g} MB)" if cfg.sync.first_bucket_mb else "")
            + f", comm hook {cfg.sync.hook}"
            + (f" (keep {cfg.sync.keep:g} of {cfg.sync.chunk}-element chunks{', fp16 on the wire' if cfg.sync.fp16 else ''} "
               f"after {cfg.sync.dense_warmup_epochs:g} dense epochs; each rank's residuals checkpointed with it)"
               if cfg.sync.hook == "chunk_sparse" else ""),
        ]
        for line in lines:
            log.info("%s", line)
