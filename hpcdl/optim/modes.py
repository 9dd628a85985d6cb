"""Schedule-Free's two sets of weights, for the trainer and the benchmarks.

A Schedule-Free optimizer trains at ``y``, an interpolation of the averaged weights ``x`` and the SGD/Adam
sequence ``z``; ``optimizer.eval()`` puts ``x`` in the model, ``optimizer.train()`` computes ``y`` back from
them. That round trip is not exact in floating point, so hpcdl never makes it: evaluation sees ``x`` and then
gets the very ``y`` it interrupted (:func:`evaluation_weights` keeps a copy), and a checkpoint holds the
training state (``y``, ``z``, the group's counters, in train mode), so a resumed run is the uninterrupted one bit
for bit, with or without evaluations and checkpoints in between. Beside it the checkpoint holds ``x`` as
``eval_model`` (:func:`eval_state`): the weights to deploy or fine-tune from (``model.weights`` reads it first).
Every other optimizer has no modes: these calls do nothing for them.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["eval_state", "evaluation_weights", "has_modes", "training_weights"]


def has_modes(optimizer: torch.optim.Optimizer) -> bool:
    return all("train_mode" in g for g in optimizer.param_groups) and callable(getattr(optimizer, "eval", None))


def training_weights(optimizer: torch.optim.Optimizer) -> None:
    """The weights to train at in the model (Schedule-Free's ``y``): before the first step, and after a resume
    (hpcdl's checkpoints are in train mode already; a state dict saved in eval mode elsewhere is not)."""
    if has_modes(optimizer) and not optimizer.param_groups[0]["train_mode"]:
        optimizer.train()


@contextlib.contextmanager
def evaluation_weights(optimizer: torch.optim.Optimizer):
    """Schedule-Free's ``x`` in the model inside the block; after it, the exact ``y`` that was there (the blocks
    nest)."""
    switch = has_modes(optimizer) and optimizer.param_groups[0]["train_mode"]
    if not switch:
        yield
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    kept = [p.detach().clone() for p in params]
    optimizer.eval()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, y in zip(params, kept):
                p.copy_(y)
        for group in optimizer.param_groups:
            group["train_mode"] = True


def eval_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
    """The model's state dict with Schedule-Free's ``x`` (copies), or None for an optimizer without modes."""
    if not has_modes(optimizer):
        return None
    with evaluation_weights(optimizer):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
