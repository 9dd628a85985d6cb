"""The just-in-time checkpoint with ``optimizer.shard=true`` (:mod:`hpcdl.train.rescue`), whole although a lost rank's
share of the optimizer state is gone with it.

What a survivor holds at its boundary: every weight (its own tensors as its last update left them, the others as
the last all-gather brought them; with ``optimizer.gather_ahead``, as far as the next forward had taken it in) and
the optimizer state of its own tensors. Each survivor writes its share, its
tensors' weights and state, beside its RNG streams in the rescue's folder; the writer composes the checkpoint from
its own model with every survivor's tensors put in, and from the optimizer state of the newest checkpoint on disk
with every survivor's share put in. So in the checkpoint:

- the survivors' tensors are at the step saved, weights and state (a survivor whose collective of that step failed
  holds the step before: its tensors miss that one update, counted as ``behind``);
- a lost rank's tensors have the weights of the last all-gather the writer completed: the step saved, or the one
  before where the lost rank's share of the step in flight never arrived (those tensors then miss that one update).
  The all-gather lands in the weights in place (:meth:`hpcdl.optim.shard.ShardedOptimizer.gather`): where the
  loss cut it mid-way, element by element the step saved or the one before, counted as ``cut_gather``;
- and the optimizer state of the newest checkpoint on disk (momentum and moments at most ``checkpoint.every_steps``
  or ``every_minutes`` old). Where no checkpoint holds it (none written yet) and the optimizer keeps state, no
  just-in-time checkpoint is written: fresh moments under LAMB's and Muon's group step counters would be corrected
  as if they had run all along, so the run resumes from its newest checkpoint, as before. ``result.json``'s
  ``optimizer_state`` counts the tensors of each kind.

The choice (docs/reliability.md): nothing is paid per step, in memory or in time; a copy of each share on a buddy
node would keep the lost state current at the price of sending each rank's state every step (as many bytes as its
share of the weights, twice that for Adam's and LAMB's two moments). The cost is paid at a loss: each survivor
writes its share, the writer reads the newest checkpoint.
"""

from __future__ import annotations

import logging

import torch

from hpcdl.train.state import Frozen

__all__ = ["compose_parts", "describe", "load_rank_file", "rank_share", "sharded"]

log = logging.getLogger(__name__)


def sharded(parts: dict) -> bool:
    """Whether the optimizer part is sharded (its ``state_dict`` is a collective the rescue cannot make)."""
    return getattr(parts.get("optimizer"), "collective", False)


def rank_share(parts: dict) -> dict:
    """This rank's share, for its file in the rescue's folder: its tensors' weights by name and their optimizer state
    by index (the replicated layout's); nothing when the optimizer is not sharded. Under the rescue's lock."""
    if not sharded(parts):
        return {}
    optimizer, model = parts["optimizer"], parts["model"].model
    names = {id(p): name for name, p in model.named_parameters()}
    weights = {names[id(p)]: p.detach().clone() for p in optimizer.params if id(p) in optimizer.mine and id(p) in names}
    return {"shard": {"weights": weights, "state": optimizer.optimizer.state_dict()["state"]}}


def load_rank_file(path: str) -> dict | Exception:
    """A survivor's file in the rescue's folder (mmapped: its RNG streams, its share), or what its load raised (none
    written: no step completed; unreadable)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        return exc


def compose_parts(ckpt, parts: dict, files: dict[int, dict | Exception], steps: dict[int, int | None], step: int
                  ) -> tuple[dict | None, dict]:
    """``parts`` (the boundary's) with the model and optimizer parts composed, and the account of where each
    tensor's optimizer state came from: the shares of the survivors (``steps``: each one's completed step) in their
    rescue files (``files``: each one's, loaded, or the exception its load raised), then the newest checkpoint on
    disk. None for the parts where a lost rank's tensors would have no
    state while the optimizer keeps some: LAMB's and Muon's group step counters would then correct fresh moments as
    if they had run all along; the run resumes from its newest checkpoint instead."""
    shares = {}
    for r in steps:
        file = files.get(r, KeyError("no file"))
        if isinstance(file, Exception) or "shard" not in file:  # none written (no step completed) or unreadable
            log.warning("rescue: rank %d's share not read (%s): its tensors are taken as a lost rank's", r,
                        file if isinstance(file, Exception) else "its file holds none")
        else:
            shares[r] = file["shard"]
    whole = ckpt.parts["optimizer"].optimizer.state_dict()  # the param groups (their lr and step counters, alike)
    newest = ckpt.manager().load_latest()
    state, weights, behind = dict(newest[1]["optimizer"]["state"]) if newest else {}, {}, 0
    older = set(state)
    for r, share in shares.items():
        state.update(share["state"])
        older -= set(share["state"])
        weights.update(share["weights"])
        behind += len(share["state"]) if steps[r] != step else 0  # its step's update never ran: one missed
    whole["state"] = state
    indices = {i for g in whole["param_groups"] for i in g["params"]}
    account = {"current": len(indices & state.keys()) - len(older) - behind, "behind": behind,
               "from_checkpoint": len(older), "checkpoint": newest[0] if newest else None,
               "fresh": len(indices - state.keys()), "shares": sorted(shares),
               "cut_gather": bool(getattr(ckpt.parts["optimizer"], "gathering", False))}
    if account["fresh"] and any(share["state"] for share in shares.values()):
        return None, account
    return {**parts, "model": Frozen({**parts["model"].state_dict(), **weights}), "optimizer": Frozen(whole)}, account


def describe(account: dict | None) -> str:
    """The rescue's line's tail: where the checkpoint's optimizer state came from (None: not sharded)."""
    if account is None:
        return ""
    return (f"; optimizer state of {account['current']} tensors from the survivors ({account['behind']} of them a "
            f"step behind), {account['from_checkpoint']} from {account['checkpoint'] or 'no checkpoint'}, "
            f"{account['fresh']} with none" + ("; the lost rank's weights from an all-gather cut mid-way (element by "
                                               "element the step saved or the one before)"
                                               if account.get("cut_gather") else ""))
