"""The step shared by hpcdl's multi-tensor optimizers."""

from __future__ import annotations

import torch
from torch.optim import Optimizer


class MultiTensorOptimizer(Optimizer):
    """Each step: per group, the tensors that have a gradient, their state, and one multi-tensor update.

    Subclasses give ``_state(p, group)`` (creating it on first use) and ``_update(group, params, grads, states)``.
    """

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(group, params, [p.grad for p in params], [self._state(p, group) for p in params])
        return loss

    def _state(self, p: torch.Tensor, group: dict):
        raise NotImplementedError

    def _update(self, group: dict, params: list, grads: list, states: list) -> None:
        raise NotImplementedError
