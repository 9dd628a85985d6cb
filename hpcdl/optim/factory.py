"""Optimizers as data, and :func:`build_optimizer`, which turns a model and an :class:`OptimConfig`
into parameter groups and an optimizer.

Semantics decide the default groups:

- ``mlperf``: tensors with ndim <= 1 (the weights and biases of every norm layer, every bias, whatever the
  layers are called) and those a timm model names in ``no_weight_decay()`` (a ViT's position embedding and
  class token) get no weight decay and, for the adaptive optimizers, no trust ratio: plain momentum SGD
  (LARS) or AdamW (LAMB, Muon) at the global lr.
- ``caffe``: every tensor is adapted and decayed, as Intel Caffe's LARS did in the Stampede2 runs.

Muon adapts (orthogonalizes) only tensors of 2 or more dimensions, and not the model's first and last such
tensors (the input layer and the classifier): those, and any tensor the semantics exclude, take AdamW.

``groups`` rules come first: each is a regular expression over parameter names (``model.named_parameters()``)
with the options it sets (``weight_decay``, ``adapt``); the first rule that matches a name wins, and a rule
that matches nothing is an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import schedulefree
import torch

from hpcdl import names
from hpcdl.errors import ConfigError
from hpcdl.names import registry
from hpcdl.optim.config import SEMANTICS, GroupRule, OptimConfig
from hpcdl.optim.lamb import LAMB
from hpcdl.optim.lars import LARS
from hpcdl.optim.muon import Muon

__all__ = ["OPTIMIZERS", "SEMANTICS", "GroupRule", "OptimConfig", "OptimInfo", "build_optimizer", "options",
           "param_groups"]

@dataclass(frozen=True, slots=True)
class OptimInfo:
    name: str
    build: Callable  # (param_groups, **options) -> Optimizer
    options: tuple[str, ...]  # the OptimConfig fields it takes
    defaults: dict = field(default_factory=dict)
    adaptive: bool = False  # has a per-tensor trust ratio (groups may set adapt)
    description: str = ""


OPTIMIZERS: dict[str, OptimInfo] = {i.name: i for i in (
    OptimInfo("sgd", torch.optim.SGD, ("lr", "momentum", "weight_decay"), {"foreach": True},
              description="torch.optim.SGD with momentum (Goyal et al.'s recipe)"),
    OptimInfo("nesterov", torch.optim.SGD, ("lr", "momentum", "weight_decay"), {"foreach": True, "nesterov": True},
              description="torch.optim.SGD with Nesterov momentum (Nado et al. 2021's large-batch baseline)"),
    OptimInfo("lars", LARS, ("lr", "momentum", "weight_decay", "eta", "eps"), adaptive=True,
              description="LARS, the MLPerf/Intel Caffe update (hpcdl.optim.lars)"),
    OptimInfo("larc", LARS, ("lr", "momentum", "weight_decay", "eta", "eps"), {"trust_clip": True}, adaptive=True,
              description="LARS with LARC's clip: local lr = min(trust, lr)"),
    OptimInfo("lamb", LAMB, ("lr", "betas", "eps", "weight_decay"), adaptive=True,
              description="LAMB with bias correction (You et al. 2019)"),
    OptimInfo("adamw", torch.optim.AdamW, ("lr", "betas", "eps", "weight_decay"), {"foreach": True},
              description="torch.optim.AdamW"),
    OptimInfo("schedulefree", lambda groups, **kw: _schedulefree("AdamWScheduleFree", groups, **kw),
              ("lr", "betas", "eps", "weight_decay"), {"foreach": True},
              description="Schedule-Free AdamW (Defazio et al. 2024; the schedulefree package): constant lr"),
    OptimInfo("schedulefree_sgd", lambda groups, **kw: _schedulefree("SGDScheduleFree", groups, **kw),
              ("lr", "momentum", "weight_decay"), {"foreach": True},
              description="Schedule-Free SGD (the schedulefree package): constant lr"),
    OptimInfo("muon", Muon, ("lr", "momentum", "weight_decay", "betas", "eps"), adaptive=True,
              description="Muon on the hidden matrices and convolutions, AdamW on the rest (hpcdl.optim.muon)"),
)}


def _schedulefree(name: str, groups: list[dict], **options) -> torch.optim.Optimizer:
    """Schedule-Free's optimizer ``name`` from the maintained package, in train mode: hpcdl's LRSchedule does
    the warmup (its ``warmup_steps`` stays 0), and the trainer puts it in eval mode around evaluation and
    checkpoints (:func:`hpcdl.optim.modes.evaluation_weights`)."""
    optimizer = getattr(schedulefree, name)(groups, **options)
    optimizer.train()
    return optimizer


OPTIMIZERS = registry("optimizers", OPTIMIZERS, names.OPTIMIZERS)


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lr_scales: dict[str, float] | None = None,
                    body: set[str] | None = None) -> torch.optim.Optimizer:
    """``cfg``'s optimizer over ``model``'s parameters. Fine-tuning (:func:`hpcdl.models.finetune.lr_scales`)
    gives ``lr_scales`` (name -> factor of the schedule's lr) and the ``body``'s names (frozen first, when the
    run says so): each group then carries ``lr_scale`` and ``body``, which :class:`LRSchedule` applies."""
    info = OPTIMIZERS[cfg.name]
    return info.build(param_groups(model, cfg, lr_scales, body), **options(cfg))


def options(cfg: OptimConfig) -> dict:
    """The keyword arguments of ``cfg``'s optimizer class."""
    info = OPTIMIZERS[cfg.name]
    eps = cfg.eps if cfg.eps is not None else {"lars": 0.0, "larc": 0.0, "lamb": 1e-6}.get(cfg.name, 1e-8)
    values = {"lr": cfg.lr, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay, "eta": cfg.eta,
              "eps": eps, "betas": cfg.betas}
    out = {k: values[k] for k in info.options} | info.defaults
    if info.adaptive and cfg.trust_clip:
        out["trust_clip"] = True
    return out


def param_groups(model: torch.nn.Module, cfg: OptimConfig, lr_scales: dict[str, float] | None = None,
                 body: set[str] | None = None) -> list[dict]:
    """Parameters grouped by the options their rule (or the semantics) gives them, and by their lr scale and
    place (body or head) when fine-tuning (see :func:`build_optimizer`)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    no_decay = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()  # timm's: pos_embed...
    rules = [(re.compile(r.pattern), r) for r in cfg.groups]
    matrices = [n for n, p in named if p.ndim >= 2]
    ends = {matrices[0], matrices[-1]} if matrices else set()  # the input layer and the classifier
    used, groups = set(), {}
    for name, p in named:
        options = _default_options(p, cfg, name in no_decay, name in ends)
        if body is not None:
            options |= {"lr_scale": (lr_scales or {}).get(name, 1.0), "body": name in body}
        for i, (rx, rule) in enumerate(rules):
            if rx.search(name):
                used.add(i)
                options |= {k: v for k, v in (("weight_decay", rule.weight_decay), ("adapt", rule.adapt))
                            if v is not None}
                break
        groups.setdefault(tuple(sorted(options.items())), []).append(p)
    unused = [cfg.groups[i].pattern for i in range(len(rules)) if i not in used]
    if unused:
        raise ConfigError(f"optimizer group patterns {unused} match no parameter; names look like "
                          f"{[n for n, _ in named[:4]]}")
    return [{"params": ps, **dict(key)} for key, ps in groups.items()]


def _default_options(p: torch.Tensor, cfg: OptimConfig, named_no_decay: bool = False, end: bool = False) -> dict:
    excluded = cfg.semantics == "mlperf" and (p.ndim <= 1 or named_no_decay)
    options = {"weight_decay": 0.0 if excluded else cfg.weight_decay}
    if cfg.name == "muon":
        options["adapt"] = not excluded and p.ndim >= 2 and not end
    elif OPTIMIZERS[cfg.name].adaptive:
        options["adapt"] = not excluded
    return options
