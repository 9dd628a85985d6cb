"""The optimizer's config, without torch (a login node builds it): :mod:`hpcdl.optim.factory` turns it
into an optimizer."""

from __future__ import annotations

from dataclasses import dataclass

from hpcdl import names
from hpcdl.errors import ConfigError
from hpcdl.names import SEMANTICS, check

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
    eps: float | None = None  # null: the optimizer's own, its row's eps in hpcdl.names.OPTIMIZER_TABLE
    betas: tuple[float, float] = (0.9, 0.999)
    trust_clip: bool = False
    semantics: str = "mlperf"
    groups: tuple[GroupRule, ...] = ()
    # each tensor's update and state on one rank, the updated tensors all-gathered (hpcdl.optim.shard)
    shard: bool = False
    # with shard: the updated tensors' all-gather started at the step's end and taken in by the next forward, module
    # by module (hpcdl.optim.shard_ahead); false: waited for at the step's end. Not under loop.compile. Off by
    # default: on 2 shared cores it gained nothing over waiting at the step's end (docs/performance.md)
    gather_ahead: bool = False

    def __post_init__(self):
        table = names.OPTIMIZER_TABLE  # read now: a row added after import counts
        check("optimizer.name", self.name, table)
        check("optimizer.semantics", self.semantics, SEMANTICS)
        row = table[self.name]
        if self.eps == 0 and row.eps_positive:
            raise ConfigError(f"optimizer.eps=0 with {self.name}: its step divides by sqrt(v) + eps, 0/0 where a "
                              f"gradient element has been 0 (NaN weights). Set optimizer.eps=null (its default, "
                              f"{row.eps:g}); LARS's eps is 0, and does not carry over")
        if self.shard and row.schedule_free:
            raise ConfigError(f"optimizer.shard=true with {self.name}: a Schedule-Free optimizer's train and eval "
                              "modes move every weight with its state, which sharding deals over the ranks; set "
                              "optimizer.shard=false or choose another optimizer")
        if self.trust_clip and not row.trust_ratio:
            raise ConfigError(f"optimizer {self.name!r} has no trust ratio: trust_clip needs one of "
                              f"{', '.join(n for n, r in table.items() if r.trust_ratio)}")
        if not row.adaptive and any(r.adapt is not None for r in self.groups):
            raise ConfigError(f"optimizer {self.name!r} has no per-tensor rule: group 'adapt' needs one of "
                              f"{', '.join(n for n, r in table.items() if r.adaptive)} (a trust ratio, or Muon's "
                              "orthogonalized update)")
