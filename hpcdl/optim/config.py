"""The optimizer's config, without torch (a login node builds it): :mod:`hpcdl.optim.factory` turns it
into an optimizer."""

from __future__ import annotations

from dataclasses import dataclass

from hpcdl.errors import ConfigError
from hpcdl.names import ADAPTIVE_OPTIMIZERS, OPTIMIZERS, SEMANTICS, TRUST_OPTIMIZERS, check

__all__ = ["GroupRule", "OptimConfig", "SEMANTICS"]


@dataclass(frozen=True, slots=True)
class GroupRule:
    pattern: str  # a regular expression, searched in each parameter name
    weight_decay: float | None = None
    adapt: bool | None = None  # the trust ratio (lars, larc, lamb) or the orthogonalized update (muon)


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    name: str = "lars"
    lr: float = 0.1  # the peak lr; the schedule sets each step's
    momentum: float = 0.9  # sgd, nesterov, lars, schedulefree_sgd (its interpolation), muon (torch's 0.95)
    weight_decay: float = 1e-4
    eta: float = 0.001
    eps: float | None = None  # default: 0 for LARS, 1e-6 for LAMB, 1e-8 for AdamW, Schedule-Free and Muon's AdamW
    betas: tuple[float, float] = (0.9, 0.999)
    trust_clip: bool = False
    semantics: str = "mlperf"
    groups: tuple[GroupRule, ...] = ()

    def __post_init__(self):
        check("optimizer.name", self.name, OPTIMIZERS)
        check("optimizer.semantics", self.semantics, SEMANTICS)
        if self.eps == 0 and self.name in ("lamb", "adamw", "schedulefree", "muon"):
            raise ConfigError(f"optimizer.eps=0 with {self.name}: Adam's step divides by sqrt(v) + eps, 0/0 where a "
                              "gradient element has been 0 (NaN weights). Set optimizer.eps=null (the optimizer's "
                              "default, 1e-8; 1e-6 for lamb); LARS's eps is 0, and does not carry over")
        if self.trust_clip and self.name not in TRUST_OPTIMIZERS:
            raise ConfigError(f"optimizer {self.name!r} has no trust ratio: trust_clip needs lars, larc or lamb")
        if self.name not in ADAPTIVE_OPTIMIZERS and any(r.adapt is not None for r in self.groups):
            raise ConfigError(f"optimizer {self.name!r} has no per-tensor rule: group 'adapt' needs lars, larc, lamb "
                              "(the trust ratio) or muon (the orthogonalized update)")
