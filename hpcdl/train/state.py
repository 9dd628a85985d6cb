"""The trainer's state as stateful parts: each gives ``state_dict()`` and takes ``load_state_dict()``, as
torch's modules, optimizers and hpcdl's schedule already do. A checkpoint is their composition (the trainer's
``parts``), so that adding a part is one entry there."""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

import torch.distributed as dist

from hpcdl.data.sampler import DistributedShardSampler
from hpcdl.train.checkpoint import rank_seed, rng_state, seed_rng, set_rng_state

__all__ = ["FORMAT", "Frozen", "Progress", "RankRng", "SamplerPosition", "Stateful", "upgrade"]

FORMAT = 2  # 1: the counters at the top level of the checkpoint


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Frozen:
    """A part's state taken earlier (the just-in-time checkpoint's boundary), as a part: it saves, never loads."""

    state: object

    def state_dict(self):
        return self.state

    def load_state_dict(self, state: dict) -> None:
        raise TypeError("a Frozen part is for saving: load into the live part")


@dataclasses.dataclass(slots=True)
class Progress:
    """The train loop's counters: steps and epochs done, training time (that of earlier runs, and this
    process's since :meth:`start_clock`), the best evaluation, the epochs done and the step at the last
    evaluation (a checkpoint taken at an epoch's turn, before its evaluation, tells the resume to evaluate first;
    a finished run is not evaluated again), the time to the target accuracy and the step where the run stopped at
    it (``loop.stop_at_target``)."""

    step: int = 0
    epoch: int = 0
    elapsed_before: float = 0.0
    best: dict | None = None
    evaluated_epoch: int = 0
    evaluated_step: int | None = None
    time_to_target_s: float | None = None
    target_top1: float | None = 0.0  # the target time_to_target_s was timed for (None: a checkpoint's, unknown)
    stopped_at: int | None = None  # the step whose evaluation reached the target and ended the run
    evaluations: int = 0  # made by this process (not saved)
    started_at: float | None = None  # time.monotonic() when this process began training

    def start_clock(self) -> None:
        self.started_at = time.monotonic()

    def elapsed(self) -> float:
        return self.elapsed_before + (time.monotonic() - self.started_at if self.started_at is not None else 0.0)

    def aim(self, target_top1: float) -> None:
        """This run's target: a run resumed with another one times it from its own evaluations and has not
        stopped at it (a checkpoint's unknown target, None, keeps its time)."""
        if self.target_top1 is not None and target_top1 != self.target_top1:
            self.time_to_target_s, self.stopped_at = None, None
        self.target_top1 = target_top1

    def evaluated(self, metrics: dict, target_top1: float) -> bool:
        """Note an evaluation at this step: the best so far, and when ``target_top1`` was first reached.
        Whether this one reached it."""
        if self.best is None or metrics["top1"] > self.best["top1"]:
            self.best = {"step": self.step, **metrics}
        self.evaluated_epoch, self.evaluated_step, self.evaluations = self.epoch, self.step, self.evaluations + 1
        self.aim(target_top1)
        reached = bool(target_top1) and metrics["top1"] >= target_top1
        if reached and self.time_to_target_s is None:
            self.time_to_target_s = self.elapsed()
        return reached

    def evaluation_due(self, every: int, last_step: int) -> bool:
        """Whether the epochs done call for an evaluation (``loop.eval_every``) not yet made: at the epoch's turn,
        or first thing on resuming a checkpoint taken there before it (a rank lost during the evaluation). The
        run's last step has its own, after the loop. A resume that turns evaluation on (``data.val`` added,
        ``loop.eval_every`` changed) mid-epoch evaluates at once where the epochs done call for it."""
        return bool(every) and self.epoch > self.evaluated_epoch and self.epoch % every == 0 and self.step < last_step

    def state_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "elapsed_s": self.elapsed(), "best": self.best,
                "evaluated_epoch": self.evaluated_epoch, "evaluated_step": self.evaluated_step,
                "time_to_target_s": self.time_to_target_s, "target_top1": self.target_top1,
                "stopped_at": self.stopped_at}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.epoch, self.elapsed_before = state["step"], state["epoch"], state["elapsed_s"]
        self.best, self.time_to_target_s = state["best"], state["time_to_target_s"]
        # older checkpoints: the epoch as if evaluated, and the best's step as the last evaluated
        self.evaluated_epoch = state.get("evaluated_epoch", self.epoch)
        self.evaluated_step = state.get("evaluated_step", (self.best or {}).get("step"))
        # checkpoints before loop.stop_at_target: the target is unknown (time_to_target_s stays as it was)
        self.target_top1, self.stopped_at = state.get("target_top1"), state.get("stopped_at")


class SamplerPosition:
    """The sampler's epoch, order and how far into the epoch this rank has trained. On another number of ranks
    the epoch's unseen samples are dealt to this job's ranks (the resume plan refused the checkpoint before
    this when ``checkpoint.resume_ranks=same``)."""

    def __init__(self, sampler: DistributedShardSampler):
        self.sampler = sampler

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state, remap=True)


class RankRng:
    """Every rank's torch, numpy and Python RNG states. Collective on save: each rank gives its own and rank 0,
    which writes the checkpoint, gathers them (the others get None). On load each rank takes the saved
    streams ``rng_from`` names for it (the resume plan's), or, with none (or a lost rank's), seeds them by the rule
    of the start."""

    collective = True  # every rank calls state_dict, also where rank 0 alone writes

    def __init__(self, group, rank: int, world_size: int, seed: int, rng_from: tuple[int | None, ...] | None = None):
        self.group, self.rank, self.world_size, self.seed = group, rank, world_size, seed
        self.rng_from = rng_from

    def state_dict(self) -> list | None:
        states = [None] * self.world_size if self.rank == 0 else None
        if self.world_size == 1:
            return [rng_state()]
        dist.gather_object(rng_state(), states, dst=0, group=self.group)
        return states

    def load_state_dict(self, states: list) -> None:
        source = self.rng_from[self.rank] if self.rng_from is not None else \
            (self.rank if self.rank < len(states) else None)
        if source is not None and states[source] is not None:  # None: a rank lost before a just-in-time save
            set_rng_state(states[source])
        else:
            seed_rng(rank_seed(self.seed, self.rank))


def upgrade(state: dict) -> dict:
    """A checkpoint of an earlier format in this one's layout."""
    if state.get("format", 1) == 1:
        state = {**state, "format": FORMAT, "counters": {k: state[k] for k in
                                                          ("step", "epoch", "elapsed_s", "best", "time_to_target_s")}}
    return state
