"""Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"), as torch.optim.Muon
computes it, for every parameter tensor hpcdl gives it: matrices and convolutions (viewed as out x in*k*k)
in groups that adapt, AdamW for the rest, in one optimizer (one state dict, one checkpoint part).

In a group with ``adapt=True``, for each tensor ``W`` (viewed as a matrix ``out x rest``) with gradient ``G``:
    B     = momentum * B + (1 - momentum) * G               (torch's lerp)
    U     = G + momentum * (B - G)  (nesterov)  or  B
    O     = NewtonSchulz5(U)                               (about U V^T of U's SVD, in bfloat16 as torch does
                                                            where the CPU has native bf16, else in float32)
    W     = W * (1 - lr * wd) - lr * 0.2 * sqrt(max(out, rest)) * O

The last factor is torch's ``adjust_lr_fn="match_rms_adamw"`` (Liu et al. 2025, "Muon is Scalable for LLM
Training"): the update's RMS matches AdamW's, so one lr and one schedule serve both kinds of group. Groups with
``adapt=False`` take AdamW with bias correction (:func:`hpcdl.optim.lamb.adam_direction`) at the same lr.
:func:`hpcdl.optim.factory.param_groups` decides which tensors adapt: the hidden layers' matrices, found by the
modules that own them (:func:`hpcdl.optim.factory.muon_matrices`), not the stem's nor the head's, as Muon's
authors advise, and never a token or an embedding; ``groups`` rules change that.

The Newton-Schulz iteration and the momentum follow torch 2.14's ``torch/optim/_muon.py``; on a 2-D tensor the
update is the same, bit for bit, where the Newton-Schulz runs in bfloat16 (tests/test_optim.py checks it).
"""

from __future__ import annotations

import math

import torch

from hpcdl.errors import ConfigError
from hpcdl.optim.base import MultiTensorOptimizer
from hpcdl.optim.lamb import adam_direction, adam_moments
from hpcdl.utils import NATIVE_BF16, cpu_flags

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch's (and Keller Jordan's) quintic
NS_STEPS = 5
NS_EPS = 1e-7


def newton_schulz_dtype(flags: set[str] | None = None) -> torch.dtype:
    """bfloat16 where the CPU multiplies it natively (avx512_bf16, amx_bf16), as torch's Muon computes; float32
    elsewhere, as ``loop.precision=auto`` chooses: torch's emulated bf16 matrix product (Zen 3, Skylake, Cascade
    Lake) did not finish one step of ``tiny_cnn_fc``'s Newton-Schulz in 14 min on a 2-core EPYC here."""
    flags = cpu_flags() if flags is None else flags
    return torch.bfloat16 if set(NATIVE_BF16) & flags else torch.float32


def orthogonalize(update: torch.Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The quintic Newton-Schulz iteration on a matrix, in ``dtype`` (:func:`newton_schulz_dtype`): ``update``'s
    singular values pushed towards 1 (roughly to [0.5, 1.5]), its singular vectors kept."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=NS_EPS))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(MultiTensorOptimizer):
    orthogonalize_steps = NS_STEPS  # what a sharded step counts the cost of an adapted matrix by (hpcdl.optim.shard)

    @staticmethod
    def state_elements(p: torch.Tensor, group: dict) -> int:
        """The elements of ``p``'s state: a momentum buffer where it adapts, AdamW's two moments elsewhere."""
        return p.numel() * (1 if group["adapt"] else 2)

    @staticmethod
    def counts_step(group: dict) -> bool:
        """Whether a step moves ``group["step"]``: AdamW's bias correction does, an orthogonalized matrix does not."""
        return not group["adapt"]

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0,
                 betas=(0.9, 0.999), eps: float = 1e-8, nesterov: bool = True, adapt: bool = True):
        for name, value in (("lr", lr), ("weight_decay", weight_decay), ("eps", eps)):
            if value < 0:
                raise ConfigError(f"Muon {name}={value} must be >= 0")
        if not (0 <= momentum < 1 and 0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ConfigError(f"Muon momentum={momentum} and betas={betas} must lie in [0, 1)")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, betas=tuple(betas),
                                      eps=eps, nesterov=nesterov, adapt=adapt, step=0))
        self.ns_dtype = newton_schulz_dtype()
        for group in self.param_groups:
            flat = [tuple(p.shape) for p in group["params"] if p.ndim < 2]
            if group["adapt"] and flat:
                raise ConfigError(f"Muon orthogonalizes matrices; tensors of shapes {flat[:4]} have fewer than 2 "
                                  "dimensions: give them adapt=false (AdamW) in optimizer.groups")

    def _state(self, p: torch.Tensor, group: dict):
        state = self.state[p]
        if group["adapt"]:
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            return state["momentum_buffer"]
        return adam_moments(state, p)

    def _update(self, group: dict, params: list, grads: list, states: list) -> None:
        if not group["adapt"]:
            group["step"] += 1
            torch._foreach_add_(params, adam_direction(group, params, grads, states), alpha=-group["lr"])
            return
        lr, m, wd = group["lr"], group["momentum"], group["weight_decay"]
        for p, g, buf in zip(params, grads, states):
            buf.lerp_(g, 1 - m)
            update = g.lerp(buf, m) if group["nesterov"] else buf
            matrix = update.reshape(update.size(0), -1)
            out, rest = matrix.shape
            if wd:
                p.mul_(1 - lr * wd)
            p.add_(orthogonalize(matrix, dtype=self.ns_dtype).view_as(p), alpha=-(lr * (0.2 * math.sqrt(max(out, rest)))))  # torch's order
