""":func:`build_optimizer`, which turns a model and an :class:`OptimConfig` into parameter groups and the
optimizer its row in :data:`hpcdl.names.OPTIMIZER_TABLE` names.

Semantics decide the default groups:

- ``mlperf``: tensors with ndim <= 1 (the weights and biases of every norm layer, every bias, whatever the
  layers are called) and those a timm model names in ``no_weight_decay()`` (a ViT's position embedding and
  class token) get no weight decay and, for the adaptive optimizers, no trust ratio: plain momentum SGD
  (LARS) or AdamW (LAMB, Muon) at the global lr.
- ``caffe``: every tensor is adapted and decayed, as Intel Caffe's LARS did in the Stampede2 runs.

Muon (a row with ``hidden_matrices``) adapts (orthogonalizes) only the matrices of hidden layers, found by structure
(:func:`muon_matrices`): the weights of ``nn.Linear`` and of ungrouped ``nn.Conv1d/2d/3d`` modules and
``nn.MultiheadAttention``'s input projections, not those of the stem (the first such layer in module order) nor of
the head (timm's ``get_classifier()``, else the last ``nn.Linear``). Tokens, position embeddings, ``nn.Embedding``
weights, relative position bias tables, layer scales, grouped and depthwise convolutions, every 1-D tensor and any
tensor the semantics exclude take AdamW, under ``caffe`` semantics too.

``groups`` rules come first: each is a regular expression over parameter names (``model.named_parameters()``)
with the options it sets (``weight_decay``, ``adapt``); the first rule that matches a name wins, and a rule
that matches nothing is an error.
"""

from __future__ import annotations

import re

import torch

from hpcdl import names
from hpcdl.deferred import deferred
from hpcdl.errors import ConfigError
from hpcdl.optim.config import SEMANTICS, GroupRule, OptimConfig

__all__ = ["SEMANTICS", "GroupRule", "OptimConfig", "build_optimizer", "muon_matrices", "options", "param_groups",
           "update_rules"]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lr_scales: dict[str, float] | None = None,
                    body: set[str] | None = None) -> torch.optim.Optimizer:
    """``cfg``'s optimizer over ``model``'s parameters: its row's ``update`` called with the groups and
    :func:`options`. Fine-tuning (:func:`hpcdl.models.finetune.lr_scales`) gives ``lr_scales`` (name -> factor of
    the schedule's lr) and the ``body``'s names (frozen first, when the run says so): each group then carries
    ``lr_scale`` and ``body``, which :class:`LRSchedule` applies.

    A Schedule-Free optimizer is returned in train mode: hpcdl's LRSchedule does the warmup (the package's
    ``warmup_steps`` stays 0), and the trainer puts it in eval mode around evaluation and checkpoints
    (:func:`hpcdl.optim.modes.evaluation_weights`)."""
    row = names.OPTIMIZER_TABLE[cfg.name]
    optimizer = deferred(row.update)(param_groups(model, cfg, lr_scales, body), **options(cfg))
    if row.schedule_free:
        optimizer.train()
    return optimizer


def options(cfg: OptimConfig) -> dict:
    """The keyword arguments of ``cfg``'s optimizer: the fields its row takes, its fixed ones, and its eps."""
    row = names.OPTIMIZER_TABLE[cfg.name]
    out = {k: getattr(cfg, k) for k in row.options} | row.defaults
    if row.eps is not None:
        out["eps"] = row.eps if cfg.eps is None else cfg.eps
    if row.trust_ratio and cfg.trust_clip:
        out["trust_clip"] = True
    return out


def param_groups(model: torch.nn.Module, cfg: OptimConfig, lr_scales: dict[str, float] | None = None,
                 body: set[str] | None = None) -> list[dict]:
    """Parameters grouped by the options their rule (or the semantics) gives them, and by their lr scale and
    place (body or head) when fine-tuning (see :func:`build_optimizer`)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    no_decay = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()  # timm's: pos_embed...
    rules = [(re.compile(r.pattern), r) for r in cfg.groups]
    hidden = set(muon_matrices(model)) if names.OPTIMIZER_TABLE[cfg.name].hidden_matrices else set()
    used, groups = set(), {}
    for name, p in named:
        options = _default_options(p, cfg, name in no_decay, name in hidden)
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


def _default_options(p: torch.Tensor, cfg: OptimConfig, named_no_decay: bool = False, hidden: bool = False) -> dict:
    excluded = cfg.semantics == "mlperf" and (p.ndim <= 1 or named_no_decay)
    options = {"weight_decay": 0.0 if excluded else cfg.weight_decay}
    row = names.OPTIMIZER_TABLE[cfg.name]
    if row.adaptive:
        options["adapt"] = not excluded and (hidden or not row.hidden_matrices)
    return options


MATRIX_LAYERS = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
EMBEDDINGS = (torch.nn.Embedding, torch.nn.EmbeddingBag)
ATTENTION_MATRICES = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")  # nn.MultiheadAttention


def muon_matrices(model: torch.nn.Module) -> list[str]:
    """The names of the parameters Muon orthogonalizes by default: the hidden layers' matrices, found by the modules
    that own them, not by shape (a ViT's ``cls_token`` and ``pos_embed`` are 3-D, Swin's bias tables 2-D).

    A matrix is the weight of an ``nn.Linear``, of an ``nn.Conv1d/2d/3d`` with ``groups=1`` (a grouped or depthwise
    convolution's weight is a stack of blocks of its matrix, not the matrix), or one of ``nn.MultiheadAttention``'s
    input projections (torchvision's ViT). Left out, as Muon's authors advise: the stem, the first such layer (or
    ``nn.Embedding``) in module order, and the head, timm's ``get_classifier()`` (every layer in it), else the last
    ``nn.Linear`` (the last such layer in a model without one). Module order, not a forward: the optimizer is built
    without an input (its size is the data's; a timm ViT refuses any other), a forward costs a step's time and
    memory on every rank, and torch.fx does not trace many timm models; in torchvision's and timm's classifiers
    the stem and the head are also the first and last layers a forward calls (tests/test_optim.py checks ResNet,
    both ViTs, ConvNeXt, Swin). A model that registers its layers in another order: set ``optimizer.groups``
    rules with ``adapt``."""
    layers = [m for m in model.modules() if isinstance(m, MATRIX_LAYERS)]
    if not layers:
        return []
    stem = next(m for m in model.modules() if isinstance(m, MATRIX_LAYERS + EMBEDDINGS))
    head = model.get_classifier() if hasattr(model, "get_classifier") else None
    heads = head if isinstance(head, (tuple, list)) else (head,)  # a distilled DeiT's: (head, head_dist)
    ends = {id(m) for h in heads if isinstance(h, torch.nn.Module) for m in h.modules()}
    if not any(id(m) in ends for m in layers):
        linear = [m for m in layers if isinstance(m, torch.nn.Linear)]
        ends = {id((linear or layers)[-1])}
    ends.add(id(stem))  # an nn.Embedding (AdamW anyway) when the model starts with one
    chosen = set()
    for module in model.modules():
        if isinstance(module, MATRIX_LAYERS) and id(module) not in ends and getattr(module, "groups", 1) == 1:
            chosen.add(id(module.weight))
        elif isinstance(module, torch.nn.MultiheadAttention):
            chosen.update(id(getattr(module, a)) for a in ATTENTION_MATRICES if getattr(module, a) is not None)
    return [n for n, p in model.named_parameters() if id(p) in chosen]


def update_rules(model: torch.nn.Module, cfg: OptimConfig) -> dict[str, str]:
    """Each trainable parameter's update under ``cfg`` (name -> rule): an adaptive optimizer's name where it adapts,
    its row's ``plain`` elsewhere (Muon: ``muon`` or ``adamw``; LARS and LARC: their name or ``sgd``; LAMB: its
    name or ``adamw``); otherwise the optimizer's name."""
    plain = names.OPTIMIZER_TABLE[cfg.name].plain or cfg.name
    adapted = {id(p) for g in param_groups(model, cfg) if g.get("adapt", True) for p in g["params"]}
    return {n: cfg.name if id(p) in adapted else plain for n, p in model.named_parameters() if p.requires_grad}
