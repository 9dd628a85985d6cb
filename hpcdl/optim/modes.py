"""Schedule-Free's two sets of weights, for the trainer and the benchmarks.

A Schedule-Free optimizer trains at ``y``, an interpolation of the averaged weights ``x`` and the SGD/Adam
sequence ``z``; ``optimizer.eval()`` puts ``x`` in the model, ``optimizer.train()`` computes ``y`` back from
them. That round trip is not exact in floating point, so hpcdl never makes it: evaluation sees ``x`` and then
gets the very ``y`` it interrupted (:func:`evaluation_weights` keeps a copy), and a checkpoint holds the
training state (``y``, ``z``, the group's counters, in train mode), so a resumed run is the uninterrupted one bit
for bit, with or without evaluations and checkpoints in between. Beside it the checkpoint holds ``x`` as
``eval_model`` (:func:`eval_state`): the weights to deploy or fine-tune from (``model.weights`` reads it first).
Every other optimizer has no modes: these calls do nothing for them.

:class:`ModelWeights` is the model as a checkpoint's part: it gives the training weights and ``x`` whatever the model
holds at the moment, so a just-in-time checkpoint taken during an evaluation (``x`` in the model) holds ``y`` as the
model and ``x`` as ``eval_model``, as every other checkpoint does.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["ModelWeights", "eval_state", "evaluation_weights", "has_modes", "training_weights"]


def has_modes(optimizer: torch.optim.Optimizer) -> bool:
    return all("train_mode" in g for g in optimizer.param_groups) and callable(getattr(optimizer, "eval", None))


def training_weights(optimizer: torch.optim.Optimizer) -> None:
    """The weights to train at in the model (Schedule-Free's ``y``): before the first step, and after a resume
    (hpcdl's checkpoints are in train mode already; a state dict saved in eval mode elsewhere is not)."""
    if has_modes(optimizer) and not optimizer.param_groups[0]["train_mode"]:
        optimizer.train()


@contextlib.contextmanager
def evaluation_weights(optimizer: torch.optim.Optimizer, guard=None, kept_to=None):
    """Schedule-Free's ``x`` in the model inside the block; after it, the exact ``y`` that was there (the blocks
    nest). ``guard`` (a lock) is held over each swap; ``kept_to(kept)`` is told ``y`` (a list in the optimizer's
    parameter order) after the first swap and None after the second."""
    switch = has_modes(optimizer) and optimizer.param_groups[0]["train_mode"]
    if not switch:
        yield
        return
    guard = guard or contextlib.nullcontext()
    tell = kept_to or (lambda kept: None)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    with guard:
        kept = [p.detach().clone() for p in params]
        optimizer.eval()
        tell(kept)
    try:
        yield
    finally:
        with guard:
            with torch.no_grad():
                for p, y in zip(params, kept):
                    p.copy_(y)
            for group in optimizer.param_groups:
                group["train_mode"] = True
            tell(None)


class ModelWeights:
    """The model as a checkpoint's part: ``state_dict`` holds the training weights (Schedule-Free's ``y``, also while
    :meth:`evaluating` has ``x`` in the model), ``eval_state_dict`` the averaged ``x`` (None without modes).
    ``guard``: the lock the checkpoint's writes and the update run under."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, guard=None):
        self.model, self.optimizer, self.guard = model, optimizer, guard
        self._kept: list[torch.Tensor] | None = None  # y, while x is in the model

    def _keep(self, kept: list[torch.Tensor] | None) -> None:
        self._kept = kept

    def evaluating(self):
        """A block with ``x`` in the model (:func:`evaluation_weights`), which this part knows of; the sharded
        optimizer's all-gather in flight (``optimizer.gather_ahead``) in the model first."""
        getattr(self.optimizer, "settle", lambda: None)()
        return evaluation_weights(self.optimizer, self.guard, self._keep)

    def state_dict(self) -> dict:
        # a tensor that is a view of a larger buffer (optimizer.shard's weights: hpcdl.optim.shard_layout.bind) as a
        # copy: torch.save writes a view's whole storage, the padded shares of every rank and their unset padding
        state = {k: v.clone() if v.untyped_storage().nbytes() > v.nbytes else v
                 for k, v in self.model.state_dict().items()}
        if self._kept is None:
            return state
        names = {id(p): name for name, p in self.model.named_parameters()}
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return {**state, **{names[id(p)]: y for p, y in zip(params, self._kept) if id(p) in names}}

    def load_state_dict(self, state: dict) -> None:
        getattr(self.optimizer, "settle", lambda: None)()  # no all-gather in flight to overwrite what this loads
        self.model.load_state_dict(state)

    def eval_state_dict(self) -> dict | None:
        if not has_modes(self.optimizer):
            return None
        with self.evaluating():  # x in the model: already (an evaluation), or swapped in under the guard
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def eval_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
    """The model's state dict with Schedule-Free's ``x`` (copies), or None for an optimizer without modes."""
    if not has_modes(optimizer):
        return None
    with evaluation_weights(optimizer):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
