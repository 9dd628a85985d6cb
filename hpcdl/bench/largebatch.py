"""``hpcdl bench large-batch``: the small-scale form of "32K loses only 0.6%".

On a small real image dataset (scikit-learn's 1,797 handwritten digits, 8x8, split 80/20 with a fixed
seed) and a small CNN, one process trains for the same number of epochs:

- ``small-batch SGD``: batch 4, momentum SGD, poly decay: the baseline;
- ``large-batch SGD``: batch N/8 with the linear scaling rule (lr x batch/4), no warmup;
- ``large-batch LARS``: batch N/8, LARS (``mlperf`` semantics) with a linear warmup, then poly decay.

Each runs over several seeds; the report gives the mean validation accuracy and its spread per recipe.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.nn as nn

from hpcdl.bench.configs import LargeBatchBench as Config
from hpcdl.bench.reports import LargeBatchReport, LargeBatchRow
from hpcdl.errors import ConfigError
from hpcdl.models.tiny import TinyCNN
from hpcdl.optim.config import OptimConfig
from hpcdl.optim.factory import build_optimizer
from hpcdl.optim.schedule import LRSchedule, ScheduleConfig, steps_per_epoch


@dataclass(frozen=True, slots=True)
class Recipe:
    name: str
    batch: int
    optimizer: OptimConfig
    base_lr: float
    base_batch: int | None
    warmup_epochs: float


def load_digits() -> tuple:
    """(train images, train labels, val images, val labels) as tensors."""
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError:
        raise ConfigError("hpcdl bench large-batch reads scikit-learn's digits: pip install scikit-learn "
                          "(make venv installs it)") from None
    d = sk_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    cut = int(len(y) * 0.8)
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def recipes(cfg: Config, n_train: int) -> list[Recipe]:
    large = n_train // 8
    sgd = OptimConfig(name="sgd", lr=cfg.small_lr, momentum=0.9, weight_decay=cfg.weight_decay, semantics="mlperf")
    lars = OptimConfig(name="lars", lr=cfg.lars_lr, momentum=0.9, weight_decay=cfg.weight_decay, eta=cfg.lars_eta,
                       semantics="mlperf")
    return [Recipe("small-batch SGD", cfg.small_batch, sgd, cfg.small_lr, None, 0.0),
            Recipe("large-batch SGD (linear scaling)", large, sgd, cfg.small_lr, cfg.small_batch, 0.0),
            Recipe("large-batch LARS + warmup", large, lars, cfg.lars_lr, None, cfg.lars_warmup_epochs)]


def train_one(recipe: Recipe, data, epochs: int, seed: int) -> float:
    """Validation accuracy (%) after ``epochs`` epochs of ``recipe``."""

    xt, yt, xv, yv = data
    torch.manual_seed(seed)
    model = TinyCNN(num_classes=10, in_channels=1, width=16)
    opt = build_optimizer(model, recipe.optimizer)
    spe = steps_per_epoch(len(yt), recipe.batch)
    sched = LRSchedule(opt, ScheduleConfig(base_lr=recipe.base_lr, base_batch=recipe.base_batch,
                                           global_batch=recipe.batch, steps_per_epoch=spe, epochs=epochs,
                                           warmup_epochs=recipe.warmup_epochs, decay="poly", power=2.0))
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(yt), generator=g)
        for i in range(spe):
            idx = order[i * recipe.batch:(i + 1) * recipe.batch]
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(xt[idx]), yt[idx]).backward()
            opt.step()
            sched.step()
    model.eval()
    with torch.no_grad():
        return float((model(xv).argmax(1) == yv).float().mean()) * 100


def run(cfg: Config, job=None) -> LargeBatchReport:
    torch.set_num_threads(cfg.threads)
    data = load_digits()
    rows = []
    for r in recipes(cfg, len(data[1])):
        accs = [train_one(r, data, cfg.epochs, seed) for seed in range(cfg.seeds)]
        rows.append(LargeBatchRow(recipe=r.name, batch=r.batch, steps_per_epoch=steps_per_epoch(len(data[1]), r.batch),
                                  peak_lr=r.base_lr * (r.batch / r.base_batch if r.base_batch else 1.0),
                                  warmup_epochs=r.warmup_epochs, accuracy=tuple(accs), mean=statistics.mean(accs),
                                  stdev=statistics.stdev(accs) if len(accs) > 1 else 0.0))
    base = rows[0].mean
    return LargeBatchReport(train_images=len(data[1]), val_images=len(data[3]), rows=tuple(rows),
                            gap_to_small_batch={r.recipe: r.mean - base for r in rows[1:]})


def format_report(r: LargeBatchReport) -> str:
    c = r.config
    lines = [f"large-batch check: digits ({r.train_images} train, {r.val_images} val, 8x8), TinyCNN, "
             f"{c.epochs} epochs, {c.seeds} seeds",
             f"{'recipe':34s} {'batch':>5s} {'steps/ep':>8s} {'peak lr':>8s} {'val acc % (mean +- sd)':>24s}"]
    for row in r.rows:
        lines.append(f"{row.recipe:34s} {row.batch:5d} {row.steps_per_epoch:8d} {row.peak_lr:8.3g} "
                     f"{row.mean:15.2f} +- {row.stdev:.2f}")
    lines += [f"{k} vs small-batch SGD: {v:+.2f} points" for k, v in r.gap_to_small_batch.items()]
    return "\n".join(lines) + "\n"
