"""The trainer's state as stateful parts: each gives ``state_dict()`` and takes ``load_state_dict()``, as
torch's modules, optimizers and hpcdl's schedule already do. A checkpoint is their composition (see
``Trainer._parts``), so that adding a part is one entry there."""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist

from hpcdl.train.checkpoint import rng_state, seed_rng, set_rng_state

__all__ = ["Counters", "RankRng", "SamplerPosition", "Stateful", "upgrade"]

FORMAT = 2  # 1: the counters at the top level of the checkpoint


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Counters:
    """The train loop's counters: steps and epochs done, training time, the best evaluation, the time to
    the target accuracy."""

    def __init__(self, trainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        t = self.trainer
        return {"step": t.step, "epoch": t.epoch, "elapsed_s": t._elapsed(), "best": t.best,
                "time_to_target_s": t.time_to_target}

    def load_state_dict(self, state: dict) -> None:
        t = self.trainer
        t.step, t.epoch, t.elapsed = state["step"], state["epoch"], state["elapsed_s"]
        t.best, t.time_to_target = state["best"], state["time_to_target_s"]


class SamplerPosition:
    """The sampler's epoch, order and how far into the epoch this rank's batches went."""

    def __init__(self, trainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        return self.trainer.sampler.state_dict(consumed=self.trainer.consumed)

    def load_state_dict(self, state: dict) -> None:
        """On another number of ranks, the epoch's unseen samples are dealt to this job's ranks (the trainer
        refused the checkpoint before this when ``checkpoint.resume_ranks=same``)."""
        sampler = self.trainer.sampler
        sampler.load_state_dict(state, remap=True)
        self.trainer.consumed = 0  # counted from the sampler's position, as state_dict takes it


class RankRng:
    """Every rank's torch, numpy and Python RNG states (collective: each rank gives its own; rank 0 saves
    them all, and each rank takes its own back). A rank beyond the saved ones seeds its streams from
    ``seed`` and its rank."""

    def __init__(self, ctx, seed: int = 0):
        self.ctx, self.seed = ctx, seed

    def state_dict(self) -> list:
        states = [None] * self.ctx.world_size
        dist.all_gather_object(states, rng_state(), group=self.ctx.group)
        return states

    def load_state_dict(self, states: list) -> None:
        if self.ctx.rank < len(states):
            set_rng_state(states[self.ctx.rank])
        else:
            seed_rng(self.seed * 100_003 + self.ctx.rank)


def upgrade(state: dict) -> dict:
    """A checkpoint of an earlier format in this one's layout."""
    if state.get("format", 1) == 1:
        state = {**state, "format": FORMAT, "counters": {k: state[k] for k in
                                                          ("step", "epoch", "elapsed_s", "best", "time_to_target_s")}}
    return state
