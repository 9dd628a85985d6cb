"""Distributed evaluation: top-1, top-5, loss and the confusion matrix, each validation image counted once.

The sampler pads ranks to equal length with :class:`hpcdl.data.sampler.Sample` indices marked
``padding``, which the dataset labels ``PADDING_LABEL``; they are left out of every count here, and one
all-reduce of the sums at the end makes the totals.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpcdl.data.dataset import PADDING_LABEL

CONFUSION_MAX_CLASSES = 1024  # above this the matrix (8 bytes a cell, summed over the ranks) is not kept


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, prepare: Callable[[torch.Tensor], torch.Tensor] | None = None,
             group=None, num_classes: int = 0, progress: Callable[[int], None] | None = None,
             every_s: float = 60.0) -> dict:
    """-> {"images", "top1", "top5", "loss"} over all ranks (percentages; loss per image), and with
    ``num_classes`` up to :data:`CONFUSION_MAX_CLASSES`, "confusion": counts[true class, predicted class].
    ``progress(batches done)`` is called at the start and then at most every ``every_s`` seconds: the run's
    train.jsonl grows during a long evaluation, so the supervisor's watchdog does not take it for a hang."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64)  # images, top-1 hits, top-5 hits, summed loss
    n = num_classes if 0 < num_classes <= CONFUSION_MAX_CLASSES else 0
    cells = [torch.zeros(0, dtype=torch.int64)]  # true class * n + predicted class, per image
    if progress is not None:
        progress(0)
    last = time.monotonic()
    for done, (images, labels) in enumerate(loader):
        if progress is not None and time.monotonic() - last >= every_s:
            progress(done)
            last = time.monotonic()
        logits = model(prepare(images) if prepare else images)
        real = labels != PADDING_LABEL
        logits, labels = logits[real], labels[real]
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices == labels[:, None]
        if n:
            cells.append(labels * n + logits.argmax(1))
        sums += torch.tensor([len(labels), top[:, 0].sum().item(), top.any(1).sum().item(),
                              F.cross_entropy(logits.float(), labels, reduction="sum").item() if len(labels) else 0.0],
                             dtype=torch.float64)
    confusion = torch.bincount(torch.cat(cells), minlength=n * n) if n else None
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums, group=group)
        if n:
            dist.all_reduce(confusion, group=group)
    model.train(was_training)
    count = max(sums[0].item(), 1.0)
    out = {"images": int(sums[0].item()), "top1": 100 * sums[1].item() / count, "top5": 100 * sums[2].item() / count,
           "loss": sums[3].item() / count}
    if n:
        out["confusion"] = confusion.view(n, n)
    return out
