"""The trainer: wires data, model, optimizer, gradient sync, checkpoints and signals; owns none of them.

:func:`train` runs one config on the ranks of the job it is started in (srun, mpiexec, torchrun,
submitit or a single process: :mod:`hpcdl.distributed.ranks.env` tells them apart). It resumes from the newest
readable checkpoint in the run folder, so a requeued job simply runs again.

The parts follow their lifetime: :mod:`~hpcdl.train.build` (model, data), :mod:`~hpcdl.train.resume`,
:mod:`~hpcdl.train.wrap` (DDP, hook, stepper), the loop here, :mod:`~hpcdl.train.finish` (start, end, failures).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from datetime import timedelta

from hpcdl.config import RunConfig, dump_yaml
from hpcdl.data.loader import data_workers_named
from hpcdl.distributed.group.lifecycle import DistContext, init_distributed, set_timeout, shutdown
from hpcdl.distributed.group.liveness import fail_fast
from hpcdl.models import with_model_defaults
from hpcdl.optim.modes import ModelWeights, training_weights
from hpcdl.runs.folder import RunFolder
from hpcdl.runs.outcome import Outcome
from hpcdl.runs.preflight import make_run_dir, preflight, run_dir
from hpcdl.schema import to_dict
from hpcdl.train.build import build_data, build_model_parts, read_manifests, size_loader_for
from hpcdl.train.checkpoint import Checkpointer
from hpcdl.train.evaluate import evaluate
from hpcdl.train.finish import Facts, announce, check_replicas, diverged, on_signal, on_storage_error, write_summary
from hpcdl.train.leaving import leaving_together
from hpcdl.train.metrics import RunLog
from hpcdl.train.precision import choose_precision
from hpcdl.train.preempt import StopSignal
from hpcdl.train.rescue import Rescue
from hpcdl.train.resume import Saved, changed_config, fold_residuals, plan_resume
from hpcdl.train.startup_record import StartupRecord
from hpcdl.train.state import FORMAT, Progress, RankRng, SamplerPosition, upgrade
from hpcdl.train.wrap import wrap
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
    rescue = Rescue(ctx, run_dir(cfg)) if cfg.checkpoint.jit and ctx.world_size > 1 else None
    with fail_fast(ctx.heartbeat, lambda: trainer and trainer.wrapped.comm and trainer.wrapped.comm.failure,
                   on_lost=rescue.run if rescue else None), leaving_together(ctx, rescue), data_workers_named(ctx.rank):
        set_timeout(ctx, startup)  # the job's group; the step timeout follows the first completed step
        if rescue:
            rescue.start_watch()
        trainer = Trainer(cfg, ctx, stop, record, rescue)
        stop.arm()  # after every communicator exists (see StopSignal.arm)
        summary = trainer.fit()
    stop.close()
    shutdown(ctx)
    return summary


class Trainer:
    def __init__(self, cfg: RunConfig, ctx: DistContext, stop: StopSignal, record: StartupRecord | None = None,
                 rescue: Rescue | None = None):
        self.ctx, self.stop, self.record, self.rescue = ctx, stop, record, rescue
        self.dir = make_run_dir(cfg)
        self.folder = RunFolder(self.dir)
        self.ckpt = Checkpointer(self.folder, cfg.checkpoint.keep, ctx.rank, rescue.lock if rescue else None)
        restore = self.ckpt.load_latest_shared(ctx.group, cfg.loop.record_samples)  # by rank 0; before the split
        self._mark("checkpoint read")
        manifests = read_manifests(cfg, ctx)  # before preflight, which needs data.train's
        cfg, model_defaults = with_model_defaults(cfg)  # crop: 0, the model's
        self.plan = plan_resume(Saved.of(*restore), ctx.world_size, cfg) if restore else None
        if self.plan is not None:
            cfg = self.plan.applied(cfg)  # this job's ranks and the plan's accumulation, checked together
        self.cfg = cfg = preflight(cfg, ctx.world_size, manifests[0])
        if ctx.rank == 0:
            atomic_write_text(self.folder.config, dump_yaml(cfg))
        precision, precision_why = choose_precision(cfg.loop.precision)
        self.progress = Progress()
        self.parts = build_model_parts(cfg, ctx, precision, resuming=restore is not None)
        self._mark("model")
        self.data = build_data(cfg, ctx, manifests, self.parts.channels_last)
        self._mark("data open")
        sizing = size_loader_for(cfg, ctx, self.data, self.parts, precision)
        self._mark("loader probe")
        self.ckpt.attach(self._parts_of_state(), self.checkpoint_header)
        hook_state = self._resume(restore)
        del restore  # the state's memory goes back
        training_weights(self.parts.optimizer)  # Schedule-Free: train mode before the first step
        self._mark("checkpoint restore")
        self.wrapped = wrap(cfg, ctx, self.parts, self.data, precision=precision, step=self.progress.step,
                            hook_state=hook_state, run_dir=self.dir)
        self._mark("DDP")
        self.last_step = min(cfg.schedule.total_steps, cfg.loop.max_steps or cfg.schedule.total_steps)
        self.ckpt.last_step = self.progress.step if self.plan else -1
        self.saved_evaluations = 0  # the evaluations this process had made when it last saved
        self.started = False  # whether this process completed a step (start-up timeout until then)
        self.replicas = "not checked (the run ended early)"
        self.samples = self.folder.open_sample_record(ctx.rank) if cfg.loop.record_samples else None
        self.wrapped.stepper.commit, self.wrapped.stepper.guard = self._commit, self.ckpt.lock
        if rescue is not None:
            rescue.attach(self.ckpt, cfg.loop.record_samples, residuals_lost=cfg.sync.hook == "chunk_sparse")
            with self.ckpt.lock:
                rescue.take_boundary()
        self.facts = Facts(self.dir, self.plan.path if self.plan else None, self.last_step, model_defaults, precision,
                           precision_why, sizing.describe(), self.parts.ipex_note, self.wrapped.compile_note,
                           self.parts.channels_last, self.parts.channels_last_why)

    def _mark(self, phase: str) -> None:
        if self.record is not None:
            self.record.mark(phase)

    # -- checkpoints ----------------------------------------------------------------------------------
    def _parts_of_state(self) -> dict:
        """What a checkpoint holds beside its header (:meth:`checkpoint_header`): one entry per stateful part, handed
        to the Checkpointer. The comm hook's residuals are each rank's own and go to per-rank files."""
        ctx, p = self.ctx, self.parts
        return {"model": ModelWeights(p.model, p.optimizer, self.ckpt.lock), "optimizer": p.optimizer,
                "schedule": p.schedule, "sampler": SamplerPosition(self.data.sampler), "counters": self.progress,
                "rng": RankRng(ctx.group, ctx.rank, ctx.world_size, self.cfg.loop.seed,
                               self.plan.rng_from if self.plan else None)}

    def _resume(self, restore: tuple[str, dict] | None) -> dict | None:
        """Apply the resume plan: every part's state, the remapped sampler and RNG; this rank's hook state."""
        if restore is None:
            return None
        path, state = restore
        changed = changed_config(state["config"], self.cfg)
        if changed and self.ctx.rank == 0:
            log.warning("resuming %s with a changed config: %s", path, changed)
        state = upgrade(state)
        for name, part in self.ckpt.parts.items():
            part.load_state_dict(state[name])
        if self.ctx.rank == 0:
            for line in self.plan.lines:
                log.warning("%s", line)
            if self.plan.remapped:
                log.info("epoch %d goes on with the %d samples not yet trained, %d per rank", self.progress.epoch,
                         len(self.data.sampler) * self.ctx.world_size, len(self.data.sampler))
        if state.get("rank_states"):
            return fold_residuals(self.plan, path, self.ctx.rank, state.get("hook"))
        if self.cfg.sync.hook == "chunk_sparse" and self.progress.step > 0:
            log.warning("%s holds no chunk_sparse residuals (written by an older hpcdl or another hook): they "
                        "start from zero, so this run is not the one that was interrupted", path)
        return None

    def _save(self, why: str) -> None:
        """Collective: the checkpoint of this step (rank 0 writes). After the final or the requeue signal's gather no
        rank needs another: the others leave, so this rank's watch stops before its write, however long."""
        if (self.ckpt.last_step, self.saved_evaluations) == (self.progress.step, self.progress.evaluations):
            return  # the checkpoint of this step is written, and no evaluation came after it
        sparse = self.wrapped.sparse
        last = self.rescue.stop_watch if self.rescue and why in ("end", "signal") else None
        self.ckpt.save(self.progress.step, why, sparse.state_dict() if sparse is not None else None, gathered=last)
        self.saved_evaluations = self.progress.evaluations

    def checkpoint_header(self) -> dict:
        """What every checkpoint holds beside the parts' states."""
        return {"format": FORMAT, "world_size": self.ctx.world_size, "config": to_dict(self.cfg),
                "accum_remapped": bool(self.plan and self.plan.accum_remapped)}

    # -- the loop -------------------------------------------------------------------------------------
    def fit(self) -> dict:
        announce(self.cfg, self.ctx, self.progress, self.facts)
        self.progress.start_clock()
        runlog = RunLog(self.dir, rank=self.ctx.rank, total_steps=self.last_step, start_step=self.progress.step,
                        log_every=self.cfg.loop.log_every)
        try:
            with on_storage_error(self.rescue):  # the last evaluation reads the validation shards too
                outcome = self._loop(runlog)
                if outcome not in ("stop", "terminate") and self.progress.evaluated_step != self.progress.step:
                    self._evaluate(runlog, may_stop=self.progress.step == self.cfg.schedule.total_steps)  # once
            if outcome in ("stop", "terminate"):  # checkpointed; rank 0 requeues on the requeue signal
                return self._summary(on_signal(self.cfg, self.ctx, self.stop, self.progress.step,
                                               outcome == "terminate", self.folder.checkpoints))
            self.replicas = check_replicas(self.parts.model, self.ctx, self.progress.step, self.parts.optimizer)
            self._save("end")
            return self._summary(Outcome.FINISHED)
        finally:
            for closing in filter(None, (runlog, self.wrapped.timeline, self.samples)):
                closing.close()

    def _loop(self, runlog: RunLog) -> str:
        p, sampler = self.progress, self.data.sampler
        p.aim(self.cfg.loop.target_top1)
        if not self.cfg.loop.stop_at_target:
            p.stopped_at = None  # a run stopped at its target, resumed without the flag: it trains on
        while True:
            if p.evaluation_due(self.cfg.loop.eval_every, self.last_step):  # also first after a rescue before it
                self._evaluate(runlog)
            if p.step >= self.last_step or p.stopped_at is not None:
                return "done"
            sampler.set_epoch(p.epoch)
            outcome = self._train_epoch(runlog)
            if outcome != "epoch":
                return outcome
            with self.ckpt.lock:
                p.epoch += 1
                sampler.set_epoch(p.epoch)  # a checkpoint from here on names the next epoch's start
                if self.rescue:
                    self.rescue.take_boundary()

    def _train_epoch(self, runlog: RunLog) -> str:
        p, batches = self.progress, self._batches()
        while p.step < self.last_step:
            result = self.wrapped.stepper.step(batches, self.cfg.loop.accum_steps, self._wishes, len(self.data.sampler))
            if result is None:
                return "epoch"
            if not result.finite:
                raise diverged(self.progress, self.ckpt.newest())
            if not self.started:  # start-up is over: from here on a collective gets the step timeout
                self.started = True
                set_timeout(self.ctx, timedelta(seconds=self.cfg.loop.timeout_s))
                if self.record is not None:
                    self._mark("first step")
                    self.record.write(self.dir, self.ctx.rank, self.ctx.world_size, self.ctx.store_use.as_dict())
            runlog.step(p.step, self._epochs(), self.parts.schedule.current_lr(), result)
            every = self.cfg.checkpoint.every_steps
            if result.save or result.stop or (every and p.step % every == 0):
                self._save("signal" if result.stop else "periodic")
            if result.stop:
                return "terminate" if result.stop == 2 else "stop"
        return "done"

    def _commit(self, result) -> None:
        """After the step's update (under the rescue's lock): the step counts, and the rescue takes the boundary.
        A step whose update was skipped (a loss not finite) does not count."""
        if not result.finite:
            return
        self.progress.step += 1
        if self.rescue is not None:
            self.rescue.take_boundary()

    def _batches(self):
        """The epoch's micro-batches, normalized and mixed. The sampler advances by each batch as the step takes
        it, whatever the loader's workers have read ahead. Recorded samples carry the step that takes them, written
        before its exchange: a just-in-time checkpoint drops the steps after the one it saves from every rank's
        record (:mod:`hpcdl.train.rescue`)."""
        for images, labels in self.data.train_loader:
            trained = self.data.sampler.advance(len(labels))
            if self.samples is not None:
                step = self.progress.step + 1
                self.samples.write("".join(f"{s.epoch} {int(s)} {step}\n" for s in trained))
                self.samples.flush()
            images = self._prepare(images)
            yield self.data.mix(images, labels) if self.data.mix else (images, labels)

    def _prepare(self, images):
        return self.data.prepare(images)

    def _wishes(self) -> tuple[bool, bool]:
        """Rank 0's (stop, checkpoint now); the step's control all-reduce hands them to every rank."""
        minutes = self.cfg.checkpoint.every_minutes
        due = bool(minutes) and time.monotonic() - self.ckpt.last_time >= 60 * minutes
        return self.stop.wish, due

    def _evaluate(self, runlog: RunLog, may_stop: bool = True) -> None:
        """Evaluate, log, note the best; where it reached loop.target_top1 under loop.stop_at_target at an epoch's
        end (``may_stop``: the run's last epoch's too, not a loop.max_steps cut), the run stops at this step."""
        if self.data.val_loader is None:
            return
        p = self.progress
        with self.ckpt.parts["model"].evaluating():  # Schedule-Free's x; a rescue meanwhile saves y all the same
            metrics = evaluate(self.wrapped.net, self.data.val_loader, self._prepare, group=self.ctx.group,
                               num_classes=self.cfg.num_classes, progress=runlog.evaluating)
        runlog.evaluation(p.step, self._epochs(), metrics, self.data.classes)
        metrics.pop("confusion", None)
        with self.ckpt.lock:
            if p.evaluated(metrics, self.cfg.loop.target_top1) and self.cfg.loop.stop_at_target and may_stop:
                p.stopped_at = p.step  # the metrics are all-reduced: every rank stops
            if self.rescue:  # a rescue from here on holds this evaluation, and the stop
                self.rescue.take_boundary()

    def _epochs(self) -> float:
        """Epochs done, fractional: the share of the current epoch trained, counting runs before a cut."""
        return self.progress.epoch + self.data.sampler.fraction_done()

    def _summary(self, outcome: Outcome) -> dict:
        if self.rescue is not None:
            self.rescue.stop_watch()  # the ranks leave one by one from here: a stopped heartbeat is no loss
        if self.record is not None:
            self.record.finish(self.ctx.store_use.as_dict())
        return write_summary(self.cfg, self.ctx, self.progress, outcome=outcome, epochs=self._epochs(),
                             run_dir=self.dir, replicas=self.replicas)

