"""Resuming a checkpoint on this job's ranks: first a plan, as data, then the trainer applies it.

:func:`plan_resume` is a pure function of what the checkpoint says (:class:`Saved`), the number of ranks
now and the config: it returns the batch split, the sampler's cuts, where each rank's RNG streams and
chunk_sparse residuals come from, and the lines to log. Nothing in it talks to a process group or a file,
so every case is tested without processes (``tests/test_resume.py``):

- **the same number of ranks**: each rank takes its own RNG streams and residuals, the sampler its
  position; a run whose accumulation an earlier resume set keeps it.
- **fewer ranks** (W -> W' < W, W' divides the global batch): the global batch stays, each rank's share grows,
  and ``loop.accum_steps`` grows so that the micro-batch stays the saved one where the new share allows it
  (else the accumulation stays and the plan says the micro-batch changes); the epoch's samples not yet
  trained are dealt to the new ranks (a cut); old rank r's residuals are folded into rank r mod W', scaled
  by W'/W, so that the update still owed (their mean over the ranks) is the same; ranks 0..W'-1 keep their
  own RNG streams.
- **more ranks**: as for fewer; ranks W..W'-1 own no residuals and seed their RNG streams by the rule every
  rank follows at the start (:func:`hpcdl.train.checkpoint.rank_seed`).
- **a count that does not divide the global batch**: refused, naming the largest count at most W' that
  does, since a global batch that changed would change the run (the learning rate's schedule and LARS's
  trust ratios follow the batch).
- ``checkpoint.resume_ranks=same`` refuses any other count.
"""

from __future__ import annotations

import dataclasses

from hpcdl.config import RunConfig
from hpcdl.data.sampler import cuts_after
from hpcdl.errors import ConfigError
from hpcdl.schema import flatten, from_dict, to_dict
from hpcdl.train.checkpoint import load_rank_state

__all__ = ["ResumePlan", "Saved", "changed_config", "fold_residuals", "plan_resume"]


@dataclasses.dataclass(frozen=True, slots=True)
class Saved:
    """What a checkpoint says of the run that wrote it."""

    path: str
    world_size: int
    global_batch: int
    accum_steps: int
    accum_remapped: bool = False  # whether a resume set loop.accum_steps
    sampler: dict | None = None  # the sampler's state (epoch, position, cuts)
    rank_states: bool = False  # whether per-rank residual files were written with it

    @classmethod
    def of(cls, path: str, state: dict) -> "Saved":
        then = state["config"]
        return cls(path, int(state["world_size"]), int(then["global_batch"]), int(then["loop"]["accum_steps"]),
                   bool(state.get("accum_remapped")), state.get("sampler"), bool(state.get("rank_states")))

    @property
    def micro(self) -> int:
        return self.global_batch // self.world_size // self.accum_steps


@dataclasses.dataclass(frozen=True, slots=True)
class ResumePlan:
    """What the trainer does to resume ``saved`` on ``world`` ranks."""

    path: str  # the checkpoint
    saved_world: int
    world: int
    accum_steps: int  # loop.accum_steps to run with
    accum_remapped: bool  # recorded in the next checkpoints
    cuts: tuple[tuple[int, int], ...]  # the sampler's cuts of the epoch after loading (ranks, position)
    rng_from: tuple[int | None, ...]  # per rank now: the saved rank whose streams it takes, None: seeded afresh
    residuals_from: tuple[tuple[int, ...], ...]  # per rank now: the saved ranks whose residuals it folds
    residual_scale: float  # what the folded residuals are multiplied by (W' / W)
    lines: tuple[str, ...]  # what rank 0 logs

    @property
    def remapped(self) -> bool:
        return self.saved_world != self.world

    def applied(self, cfg: RunConfig) -> RunConfig:
        """``cfg`` as the plan runs it: on this job's ranks with the plan's loop.accum_steps, both at once. The config
        checks that its per-rank batch splits into loop.accum_steps micro-batches, and with its own ``ranks`` (a
        preset's, the saved run's) that is another job's per-rank batch: a 4-rank checkpoint (accum 2, micro-batch
        3, global batch 24) resumed by one process under a preset of 2 ranks was refused, 'the per-rank batch 12
        does not split into loop.accum_steps=8', where the batch per rank is 24 = 8 x 3."""
        return dataclasses.replace(cfg, ranks=self.world,
                                   loop=dataclasses.replace(cfg.loop, accum_steps=self.accum_steps))


def plan_resume(saved: Saved, world: int, cfg: RunConfig) -> ResumePlan:
    """The plan to resume ``saved`` on ``world`` ranks under ``cfg``; a ConfigError when it cannot."""
    if saved.world_size != world and cfg.checkpoint.resume_ranks == "same":
        raise ConfigError(f"{saved.path} was written by {saved.world_size} ranks, this job has {world} and "
                          f"checkpoint.resume_ranks=same; run on {saved.world_size} ranks, --set "
                          "checkpoint.resume_ranks=any, or set run_dir to a new folder")
    if cfg.global_batch % world:
        fits = max(n for n in range(1, world + 1) if cfg.global_batch % n == 0)
        raise ConfigError(f"{saved.path}: global_batch={cfg.global_batch} does not split over {world} ranks, and "
                          f"a resume keeps the global batch (the schedule and LARS's trust ratios follow it): run "
                          f"on {fits} ranks (the largest count up to {world} that divides it)")
    accum, remapped, lines = _accumulation(saved, world, cfg)
    old, now = saved.world_size, world
    rng_from = tuple(r if r < old else None for r in range(now))
    residuals_from = tuple(tuple(range(r, old, now)) for r in range(now)) if saved.rank_states else ((),) * now
    if old != now:
        lines.append(_remap_line(saved, now, cfg.global_batch))
    return ResumePlan(saved.path, old, now, accum, remapped, tuple(cuts_after(saved.sampler, now)) if saved.sampler else (),
                      rng_from, residuals_from, now / old, tuple(lines))


def _accumulation(saved: Saved, world: int, cfg: RunConfig) -> tuple[int, bool, list[str]]:
    """loop.accum_steps on ``world`` ranks: the one that keeps the saved micro-batch where the new per-rank batch
    allows it; whether it was set here (or by an earlier resume); what to log."""
    accum = cfg.loop.accum_steps
    if saved.world_size == world and not saved.accum_remapped:
        return accum, False, []
    per_rank, micro = cfg.global_batch // world, saved.micro
    if per_rank % micro:
        return accum, False, [f"resuming on {world} ranks (saved: {saved.world_size}): the saved micro-batch of "
                              f"{micro} images does not divide the {per_rank} per rank, so loop.accum_steps stays "
                              f"{accum} (micro-batch {per_rank // accum}): batch norm sees batches of another size"]
    lines = []
    if per_rank // micro != accum:
        lines.append(f"resuming on {world} ranks (saved: {saved.world_size}): loop.accum_steps {accum} -> "
                     f"{per_rank // micro} keeps the micro-batch of {micro} images")
    return per_rank // micro, per_rank // micro != accum or saved.accum_remapped, lines


def _remap_line(saved: Saved, now: int, global_batch: int) -> str:
    old = saved.world_size
    per_rank = "its own" if now <= old else f"their own on ranks 0-{old - 1}, seeded by the start's rule on the others"
    residuals = (f"; chunk_sparse residuals: old rank r's to rank r mod {now}, scaled by {now}/{old}"
                 if saved.rank_states else "")
    return (f"resuming {saved.path}, written by {old} ranks, on {now}: global batch {global_batch} = {now} x "
            f"{global_batch // now} per rank (was {old} x {saved.global_batch // old}); the epoch goes on with the "
            f"samples not yet trained, each with its augmentation (seeded by sample); RNG streams: each rank takes "
            f"{per_rank}{residuals}. What differs from an uninterrupted run: batch norm's statistics come from "
            "each rank's micro-batch, and the all-reduce adds in another order (float rounding)")


def fold_residuals(plan: ResumePlan, checkpoint: str, rank: int, shared: dict | None) -> dict | None:
    """This rank's chunk_sparse state under ``plan``: its saved ranks' residual files read one at a time and
    summed in place, scaled by ``plan.residual_scale`` when the count changed. A rank that folds none starts
    from zero residuals with ``shared``, the hook's counters rank 0 saved in the checkpoint (None from an
    older hpcdl: then rank 0's file gives them)."""
    sources = plan.residuals_from[rank]
    if not sources:
        counters = shared if shared is not None else load_rank_state(checkpoint, 0)
        return {**counters, "residuals": {}}  # the hook makes each bucket's zeros as it first meets it
    state = load_rank_state(checkpoint, sources[0])
    residuals = state["residuals"]
    for source in sources[1:]:
        for key, value in load_rank_state(checkpoint, source)["residuals"].items():
            residuals[key].add_(value)
    if plan.remapped:
        for value in residuals.values():
            value.mul_(plan.residual_scale)
    return state


def changed_config(saved: dict, cfg: RunConfig) -> str:
    """What differs between the config a checkpoint was written with and ``cfg``, as "key old -> new, ..."."""
    try:  # in today's shape: an older hpcdl's config (model: NAME) gets the keys added since, at their defaults
        saved = to_dict(from_dict(RunConfig, saved))
    except ConfigError:
        pass  # one this hpcdl cannot read: compared as it is
    now, then = flatten(to_dict(cfg)), flatten(saved)
    changed = sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))
    return ", ".join(f"{k} {then.get(k)!r} -> {now.get(k)!r}" for k in changed)
