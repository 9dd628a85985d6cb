"""The optimizer's config, without torch (a login node builds it): :mod:`hpcdl.optim.factory` turns it
into an optimizer."""

from __future__ import annotations

from dataclasses import dataclass

from hpcdl.errors import ConfigError
from hpcdl.names import ADAPTIVE_OPTIMIZERS, OPTIMIZERS, SEMANTICS, check

__all__ = ["GroupRule", "OptimConfig", "SEMANTICS"]


@dataclass(frozen=True, slots=True)
class GroupRule:
    pattern: str  # a regular expression, searched in each parameter name
    weight_decay: float | None = None
    adapt: bool | None = None


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    name: str = "lars"
    lr: float = 0.1  # the peak lr; the schedule sets each step's
    momentum: float = 0.9
    weight_decay: float = 1e-4
    eta: float = 0.001
    eps: float | None = None  # default: 0 for LARS, 1e-6 for LAMB, 1e-8 for AdamW
    betas: tuple[float, float] = (0.9, 0.999)
    trust_clip: bool = False
    semantics: str = "mlperf"
    groups: tuple[GroupRule, ...] = ()

    def __post_init__(self):
        check("optimizer.name", self.name, OPTIMIZERS)
        check("optimizer.semantics", self.semantics, SEMANTICS)
        if self.name not in ADAPTIVE_OPTIMIZERS and (self.trust_clip or any(r.adapt is not None for r in self.groups)):
            raise ConfigError(f"optimizer {self.name!r} has no trust ratio: trust_clip and group 'adapt' need "
                              "lars, larc or lamb")
