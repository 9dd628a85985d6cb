"""``hpcdl bench large-batch``: which optimizer keeps accuracy at which batch, for a model on a dataset.

Every cell of the grid (optimizer x global batch) trains the same epochs from the same initialisation
seeds, with a small learning-rate sweep: the optimizer's reference lr at that batch (its row's ``reference_lr``
in :data:`hpcdl.names.OPTIMIZER_TABLE`, scaled by its ``lr_scaling``) times each of ``--lr-factors``, each over
``--seeds`` seeds, at its row's ``reference_momentum``. A cell reports its best lr by mean validation accuracy,
with that lr's mean and spread over the seeds; an untuned baseline is the classic mistake of optimizer
comparisons (Nado et al. 2021, arXiv:2102.06356), so no optimizer gets one lr at every batch. The schedule is
the same for all: linear warmup, then poly 2 to 0 (Schedule-Free: constant after the warmup, as it needs),
``mlperf`` semantics, one weight decay.

The data: scikit-learn's digits (1,797 8x8 scans, split 80/20 with a fixed seed), or any dataset ``hpcdl
pack`` wrote (a folder with ``train/`` and ``val/``; images resized to ``--crop``), decoded once into memory:
the harness is for datasets a rank holds (digits, Animal-MNIST, a sample of yours), not for ImageNet.

On a job's ranks (``srun hpcdl bench large-batch ...``, or ``hpcdl sbatch -- bench large-batch ...``) the runs
are dealt round-robin, each rank training its own one at a time on ``--threads`` threads; rank 0 gathers them.
Before the first run, rank 0 prints the budget: the number of runs, the images they train, and the time that
a short calibration (a few steps at the smallest and largest batch) predicts.
"""

from __future__ import annotations

import io
import math
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image

from hpcdl import names
from hpcdl.bench.configs import LargeBatchBench as Config
from hpcdl.bench.reports import LargeBatchCell, LargeBatchReport
from hpcdl.data.dataset import ShardDataset
from hpcdl.errors import ConfigError
from hpcdl.models import build_model
from hpcdl.optim.config import OptimConfig
from hpcdl.optim.factory import build_optimizer
from hpcdl.optim.modes import evaluation_weights, has_modes
from hpcdl.optim.schedule import LRSchedule, ScheduleConfig, steps_per_epoch
from hpcdl.plot import counts_axis, pyplot, save_png

BN_BATCHES = 8  # Schedule-Free: training batches whose statistics BatchNorm takes at x before evaluating


@dataclass(frozen=True, slots=True)
class Run:
    optimizer: str
    batch: int
    lr: float
    seed: int


def _list(text: str, flag: str, kind=str) -> list:
    try:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: give a comma-separated list, e.g. {flag} 8,32,128") from None
    if not values:
        raise ConfigError(f"{flag} is empty")
    return values


def grid(cfg: Config) -> tuple[list[str], list[int], list[float]]:
    optimizers = _list(cfg.optimizers, "--optimizers")
    for name in optimizers:
        names.check("--optimizers", name, names.OPTIMIZER_TABLE)
    batches = _list(cfg.batches, "--batches", int)
    factors = _list(cfg.lr_factors, "--lr-factors", float)
    if min(batches) < 1 or min(factors) <= 0 or cfg.seeds < 1 or cfg.epochs <= 0:
        raise ConfigError(f"--batches {cfg.batches}, --lr-factors {cfg.lr_factors}, --seeds {cfg.seeds} and "
                          f"--epochs {cfg.epochs} must all be above 0")
    return optimizers, batches, factors


def reference_lr(optimizer: str, batch: int) -> float:
    """The optimizer's row's ``reference_lr`` (at :data:`hpcdl.names.REFERENCE_BATCH`) carried to ``batch`` by its
    ``lr_scaling``."""
    row = names.OPTIMIZER_TABLE[optimizer]
    ratio = batch / names.REFERENCE_BATCH
    return row.reference_lr * (ratio if row.lr_scaling == "linear" else math.sqrt(ratio))


def runs_of(cfg: Config) -> list[Run]:
    optimizers, batches, factors = grid(cfg)
    return [Run(o, b, reference_lr(o, b) * f, s) for o in optimizers for b in batches for f in factors
            for s in range(cfg.seeds)]


# -- data ------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Data:
    name: str
    train: tuple[torch.Tensor, torch.Tensor]
    val: tuple[torch.Tensor, torch.Tensor]
    classes: int

    @property
    def channels(self) -> int:
        return self.train[0].shape[1]


def load_data(cfg: Config) -> Data:
    return _digits() if cfg.data == "digits" else _packed(cfg.data, cfg.crop)


def _digits() -> Data:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError("hpcdl bench large-batch --data digits reads scikit-learn's digits: pip install "
                          "scikit-learn (make venv installs it)") from None
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    cut = int(len(y) * 0.8)
    x = (x - x[order[:cut]].mean()) / x[order[:cut]].std()
    return Data("scikit-learn's digits (8x8)", (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]]), 10)


def _packed(root: str, crop: int) -> Data:
    """A packed dataset's train/ and val/ decoded into memory at crop x crop, normalized by the training images'
    channel statistics."""
    splits = {}
    for split in ("train", "val"):
        path = os.path.join(root, split)
        if not os.path.isdir(path):
            raise ConfigError(f"--data {root}: no {split}/ in it; give a folder that holds hpcdl pack's train/ and "
                              "val/ (datasets/animal_mnist/README.md builds one), or --data digits")
        ds = ShardDataset(path)
        images, labels = [], []
        for i in range(len(ds)):
            data, label = ds[i]
            im = Image.open(io.BytesIO(data)).convert("RGB").resize((crop, crop), Image.Resampling.BILINEAR)
            images.append(torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(crop, crop, 3))
            labels.append(label)
        splits[split] = (torch.stack(images).permute(0, 3, 1, 2).float() / 255, torch.tensor(labels))
        classes = len(ds.classes)
    mean = splits["train"][0].mean(dim=(0, 2, 3), keepdim=True)
    std = splits["train"][0].std(dim=(0, 2, 3), keepdim=True)
    norm = {k: ((x - mean) / std, y) for k, (x, y) in splits.items()}
    return Data(f"{root} ({crop}x{crop})", norm["train"], norm["val"], classes)


# -- one run ---------------------------------------------------------------------------------------------

def train_one(run: Run, cfg: Config, data: Data, model_name: str, steps: int | None = None) -> float:
    """Validation top-1 % after ``cfg.epochs`` epochs of ``run`` (``steps``: stop after that many, for the
    calibration); NaN when the loss stopped being finite."""
    xt, yt = data.train
    torch.manual_seed(run.seed)
    model = build_model(model_name, data.classes, in_channels=data.channels)
    momentum = names.OPTIMIZER_TABLE[run.optimizer].reference_momentum
    opt = build_optimizer(model, OptimConfig(name=run.optimizer, lr=run.lr, weight_decay=cfg.weight_decay,
                                             momentum=momentum, eta=cfg.lars_eta, semantics="mlperf"))
    spe = steps_per_epoch(len(yt), run.batch)
    schedule_free = has_modes(opt)
    sched = LRSchedule(opt, ScheduleConfig(base_lr=run.lr, global_batch=run.batch, steps_per_epoch=spe,
                                           epochs=cfg.epochs, warmup_epochs=min(cfg.warmup_epochs, cfg.epochs / 4),
                                           decay="constant" if schedule_free else "poly", power=2.0))
    g = torch.Generator().manual_seed(run.seed)
    done = 0
    model.train()
    while done < sched.cfg.total_steps and (steps is None or done < steps):
        order = torch.randperm(len(yt), generator=g)
        for i in range(spe):
            idx = order[i * run.batch:(i + 1) * run.batch]
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(xt[idx]), yt[idx])
            if not torch.isfinite(loss):
                return math.nan
            loss.backward()
            opt.step()
            sched.step()
            done += 1
            if done >= sched.cfg.total_steps or (steps is not None and done >= steps):
                break
    with evaluation_weights(opt):
        if schedule_free:
            _recompute_bn(model, xt, run.batch, g)
        model.eval()
        with torch.no_grad():
            xv, yv = data.val
            logits = torch.cat([model(xv[i:i + 1024]) for i in range(0, len(yv), 1024)])
        accuracy = float((logits.argmax(1) == yv).float().mean()) * 100
    return accuracy if torch.isfinite(logits).all() else math.nan


def _recompute_bn(model: nn.Module, xt: torch.Tensor, batch: int, g: torch.Generator) -> None:
    """BatchNorm's running statistics taken again at Schedule-Free's x (they were gathered at y): a cumulative
    average over :data:`BN_BATCHES` training batches, as the schedulefree package's authors advise."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative
    model.train()
    order = torch.randperm(len(xt), generator=g)
    with torch.no_grad():
        for i in range(min(BN_BATCHES, math.ceil(len(xt) / batch))):
            model(xt[order[i * batch:(i + 1) * batch]])


# -- the grid on the job's ranks -------------------------------------------------------------------------

def calibrate(cfg: Config, data: Data, runs: list[Run]) -> float:
    """Seconds the runs should take on one rank. At the smallest and the largest batch, a run of 1 step and one
    of 5 (after one to warm up) give a run's fixed cost (model, optimizer, evaluation) and a step's; the step's
    is fitted as a + c * batch; summed over every run's steps."""
    batches = sorted({r.batch for r in runs})
    lo, hi = batches[0], batches[-1]
    fixed, step = {}, {}
    for b in {lo, hi}:
        run = Run("sgd", b, reference_lr("sgd", b), 0)
        train_one(run, cfg, data, cfg.model, steps=1)
        took = {}
        for k in (1, 5):
            start = time.perf_counter()
            train_one(run, cfg, data, cfg.model, steps=k)
            took[k] = time.perf_counter() - start
        step[b] = max((took[5] - took[1]) / 4, 0.0)
        fixed[b] = max(took[1] - step[b], 0.0)
    c = (step[hi] - step[lo]) / (hi - lo) if hi > lo else 0.0
    a = step[lo] - c * lo
    n = len(data.train[1])
    per_run = statistics.mean(fixed.values())
    return sum(per_run + round(cfg.epochs * steps_per_epoch(n, r.batch)) * max(a + c * r.batch, 0.0) for r in runs)


def run(cfg: Config, job) -> LargeBatchReport | None:
    torch.set_num_threads(cfg.threads)
    all_runs = runs_of(cfg)
    data = load_data(cfg)
    rank, world = job.rank, (job.ctx.world_size if job.ctx is not None else 1)
    estimate = 0.0
    if rank == 0:
        estimate = calibrate(cfg, data, all_runs) / world
        n = len(data.train[1])
        images = len(all_runs) * cfg.epochs * n
        optimizers, batches, factors = grid(cfg)
        print(f"budget: {len(optimizers)} optimizers x {len(batches)} batches x {len(factors)} lrs x {cfg.seeds} "
              f"seeds = {len(all_runs)} runs of {cfg.epochs:g} epochs over {n:,} images ({images / 1e6:.2f}M images "
              f"trained) on {world} rank{'s' * (world > 1)} of {cfg.threads} thread{'s' * (cfg.threads > 1)}: "
              f"about {estimate / 60:.1f} min (from a calibration of the smallest and largest batch)", flush=True)
    start = time.perf_counter()
    mine = {i: train_one(r, cfg, data, cfg.model) for i, r in enumerate(all_runs) if i % world == rank}
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, mine, group=job.ctx.group)
        mine = {i: acc for part in gathered for i, acc in part.items()}
    if rank != 0:
        return None
    return LargeBatchReport(data=data.name, model=cfg.model, train_images=len(data.train[1]),
                            val_images=len(data.val[1]), classes=data.classes, ranks=world, runs=len(all_runs),
                            estimated_s=estimate, seconds=time.perf_counter() - start,
                            cells=tuple(_cells(all_runs, mine, len(data.train[1]))))


def _cells(runs: list[Run], accuracy: dict[int, float], n: int) -> list[LargeBatchCell]:
    by_cell: dict[tuple[str, int], dict[float, list[float]]] = {}
    for i, r in enumerate(runs):
        by_cell.setdefault((r.optimizer, r.batch), {}).setdefault(r.lr, []).append(accuracy[i])
    cells = []
    for (optimizer, batch), sweep in by_cell.items():
        means = {lr: statistics.mean(0.0 if math.isnan(a) else a for a in accs) for lr, accs in sweep.items()}
        best = max(means, key=means.get)
        accs = tuple(0.0 if math.isnan(a) else a for a in sweep[best])
        cells.append(LargeBatchCell(optimizer=optimizer, batch=batch, steps_per_epoch=steps_per_epoch(n, batch),
                                    lrs=tuple(sweep), means=tuple(means.values()), best_lr=best, accuracy=accs,
                                    mean=means[best], stdev=statistics.stdev(accs) if len(accs) > 1 else 0.0,
                                    diverged=sum(math.isnan(a) for accs_ in sweep.values() for a in accs_)))
    return cells


# -- the report ------------------------------------------------------------------------------------------

def format_report(r: LargeBatchReport) -> str:
    c = r.config
    batches = sorted({cell.batch for cell in r.cells})
    optimizers = list(dict.fromkeys(cell.optimizer for cell in r.cells))
    at = {(cell.optimizer, cell.batch): cell for cell in r.cells}
    n = r.train_images
    lines = [f"large batch: {r.model} on {r.data}, {r.train_images:,} train / {r.val_images:,} val images, "
             f"{r.classes} classes; {c.epochs:g} epochs in every cell, lr sweep x{c.lr_factors} of each optimizer's "
             f"reference, {c.seeds} seeds; {r.runs} runs on {r.ranks} rank(s) in {r.seconds / 60:.1f} min "
             f"(budget stated: {r.estimated_s / 60:.1f} min)",
             "best validation top-1 % per cell (mean +- sd over the seeds at the best lr; * a run diverged)",
             f"{'optimizer':17s}" + "".join(f"{f'batch {b} ({b / n:.0%})':>24s}" for b in batches)]
    for o in optimizers:
        row = f"{o:17s}"
        for b in batches:
            cell = at.get((o, b))
            shown = "" if cell is None else \
                f"{cell.mean:.1f} +- {cell.stdev:.1f} (lr {cell.best_lr:.3g})" + ("*" if cell.diverged else "")
            row += f"{shown:>24s}"
        lines.append(row)
    for b in batches:
        cells = sorted((at[o, b] for o in optimizers if (o, b) in at), key=lambda x: -x.mean)
        best = cells[0]
        close = [x.optimizer for x in cells[1:] if best.mean - x.mean <= max(best.stdev, x.stdev)]
        lines.append(f"batch {b}: best {best.optimizer} {best.mean:.1f}%"
                     + (f"; within a standard deviation: {', '.join(close)}" if close else ""))
    edge = [cell for cell in r.cells if cell.best_lr in (min(cell.lrs), max(cell.lrs)) and len(cell.lrs) > 1]
    if edge:
        lines.append(f"{len(edge)} of {len(r.cells)} cells' best lr is at the edge of the sweep: widen --lr-factors "
                     "before trusting those")
    return "\n".join(lines) + "\n"


def plot(report: LargeBatchReport, out: str) -> str:
    plt = pyplot("hpcdl bench large-batch --plot")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for o in dict.fromkeys(cell.optimizer for cell in report.cells):
        cells = sorted((cell for cell in report.cells if cell.optimizer == o), key=lambda x: x.batch)
        ax.errorbar([x.batch for x in cells], [x.mean for x in cells], yerr=[x.stdev for x in cells], marker="o",
                    capsize=3, label=o)
    counts_axis([ax], sorted({cell.batch for cell in report.cells}),
                f"global batch (of {report.train_images:,} training images)")
    ax.set_ylabel("best validation top-1 %")
    ax.set_title(f"{report.model} on {report.data}: {report.config.epochs:g} epochs per cell, best of "
                 f"{len(report.cells[0].lrs)} lrs, {report.config.seeds} seeds", fontsize=9)
    return save_png(fig, out)
