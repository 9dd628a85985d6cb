"""LARS, as the MLPerf/TensorFlow reference and Intel Caffe define it (You, Gitman, Ginsburg 2017).

For each parameter tensor ``w`` with gradient ``g`` (before weight decay), in a group that adapts:
    trust    = eta * ||w|| / (||g|| + wd * ||w|| + eps)   if ||w|| > 0 and ||g|| > 0, else 1
    local_lr = lr * trust                                   (trust_clip, LARC's clip mode: min(trust, lr))
    v        = m * v + local_lr * (g + wd * w)
    w        = w - v

The momentum buffer carries ``lr * trust``, as in the reference and Intel Caffe (not torch.optim.SGD's
``v = m v + g; w -= lr v``). A group with ``adapt=False`` uses trust 1: plain momentum SGD at the
group's lr, with the group's weight decay. Which parameters adapt is decided by the parameter groups;
:func:`hpcdl.optim.factory.build_optimizer` sets them from the ``mlperf`` or ``caffe`` semantics.

The step is multi-tensor: ``torch._foreach_norm`` for all norms at once, one vector of trust ratios per
group, and ``_foreach`` updates; no per-parameter Python arithmetic.
"""

from __future__ import annotations

import torch

from hpcdl.errors import ConfigError
from hpcdl.optim.base import MultiTensorOptimizer


class LARS(MultiTensorOptimizer):
    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0, eta: float = 0.001,
                 eps: float = 0.0, trust_clip: bool = False, adapt: bool = True):
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay), ("eta", eta),
                            ("eps", eps)):
            if value < 0:
                raise ConfigError(f"LARS {name}={value} must be >= 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, eps=eps,
                                      trust_clip=trust_clip, adapt=adapt))

    def _state(self, p: torch.Tensor, group: dict) -> torch.Tensor:  # the momentum buffer
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    def _update(self, group: dict, params: list, grads: list, bufs: list) -> None:
        wd = group["weight_decay"]
        scale = local_lr(params, grads, group) if group["adapt"] else torch.full((len(params),), float(group["lr"]), dtype=torch.float64)
        torch._foreach_mul_(bufs, group["momentum"])
        torch._foreach_addcmul_(bufs, grads, scale.unbind())  # + lr * trust * g
        if wd:
            torch._foreach_addcmul_(bufs, params, (scale * wd).unbind())  # + lr * trust * wd * w
        torch._foreach_sub_(params, bufs)


def trust_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor, numerator: torch.Tensor) -> torch.Tensor:
    """numerator / u_norm where both norms are > 0, else 1 (a zero weight or zero update still moves)."""
    ok = (w_norm > 0) & (u_norm > 0)
    return torch.where(ok, numerator / torch.where(ok, u_norm, 1.0), 1.0)


def local_lr(params: list, grads: list, group: dict) -> torch.Tensor:
    """lr * trust for each tensor of a group, as one vector."""
    w = torch.stack(torch._foreach_norm(params)).double()
    g = torch.stack(torch._foreach_norm(grads)).double()
    wd, lr = group["weight_decay"], group["lr"]
    trust = trust_ratio(w, g + wd * w + group["eps"], group["eta"] * w)
    return torch.clamp(trust, max=lr) if group["trust_clip"] else trust * lr
