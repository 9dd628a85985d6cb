"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes").

For each parameter tensor ``w`` with gradient ``g``, at step t (from 1):
    m     = b1 * m + (1 - b1) * g
    v     = b2 * v + (1 - b2) * g^2
    r     = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * w
    trust = ||w|| / ||r||              if ||w|| > 0 and ||r|| > 0, else 1   (trust_clip: min(trust, 1))
    w     = w - lr * trust * r

A group with ``adapt=False`` uses trust 1 (AdamW with bias correction at the group's lr and weight
decay), which is how the ``mlperf`` semantics treat BatchNorm and bias parameters. Multi-tensor, like
:class:`hpcdl.optim.lars.LARS`.
"""

from __future__ import annotations

import math

import torch

from hpcdl.errors import ConfigError
from hpcdl.optim.base import MultiTensorOptimizer
from hpcdl.optim.lars import trust_ratio


class LAMB(MultiTensorOptimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 trust_clip: bool = False, adapt: bool = True):
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ConfigError(f"LAMB betas={betas} must lie in [0, 1)")
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ConfigError(f"LAMB lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      trust_clip=trust_clip, adapt=adapt, step=0))

    def _state(self, p: torch.Tensor, group: dict) -> tuple[torch.Tensor, torch.Tensor]:  # the two moments
        return adam_moments(self.state[p], p)

    def _update(self, group: dict, params: list, grads: list, moments: list) -> None:
        group["step"] += 1
        r = adam_direction(group, params, grads, moments)
        if group["adapt"]:
            w_norm = torch.stack(torch._foreach_norm(params)).double()
            trust = trust_ratio(w_norm, torch.stack(torch._foreach_norm(r)).double(), w_norm)
            if group["trust_clip"]:
                trust = torch.clamp(trust, max=1.0)
            torch._foreach_addcmul_(params, r, (trust * -group["lr"]).unbind())
        else:
            torch._foreach_add_(params, r, alpha=-group["lr"])


def adam_moments(state: dict, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two moments of ``p`` in its optimizer ``state``, made zero on first use."""
    if "exp_avg" not in state:
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state["exp_avg"], state["exp_avg_sq"]


def adam_direction(group: dict, params: list, grads: list, moments: list) -> list:
    """Adam's bias-corrected direction at the group's ``step`` (already counted), plus ``wd * w``: ``r`` above.
    ``w - lr * r`` is AdamW's update (decoupled weight decay, as torch.optim.AdamW: ``w (1 - lr wd)``)."""
    (b1, b2), t, wd = group["betas"], group["step"], group["weight_decay"]
    m, v = [a for a, _ in moments], [b for _, b in moments]
    torch._foreach_lerp_(m, grads, 1 - b1)
    torch._foreach_mul_(v, b2)
    torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, math.sqrt(1 - b2 ** t))
    torch._foreach_add_(denom, group["eps"])
    r = torch._foreach_div(m, denom)
    torch._foreach_div_(r, 1 - b1 ** t)
    if wd:
        torch._foreach_add_(r, params, alpha=wd)
    return r
