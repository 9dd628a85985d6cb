"""What a run reports: a progress bar on rank 0, a JSONL line per step, TensorBoard scalars, a summary.

``train.jsonl`` in the run folder holds one object per step (``"kind": "step"``) with the time of each
phase (see :mod:`hpcdl.train.step`), and one per evaluation (``"kind": "eval"``), with progress lines
(``"kind": "evaluating"``) at its start and every minute while it runs (the supervisor's watchdog). It is appended to
across requeues, so a run's whole history stays in one file. Only rank 0 writes.
"""

from __future__ import annotations

import json
import os
import sys
import time

from tqdm import tqdm

from hpcdl.runs.folder import RunFolder
from hpcdl.train import confusion as cm
from hpcdl.train.step import PHASES, StepResult


class RunLog:
    def __init__(self, run_dir: str, *, rank: int, total_steps: int, start_step: int, log_every: int,
                 tensorboard: bool = True):
        self.enabled, self.log_every, self.run_dir = rank == 0, log_every, run_dir
        self._jsonl = self._tb = self._bar = None
        if not self.enabled:
            return
        self._jsonl = open(RunFolder(run_dir).steps_log, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=start_step)

        tty = sys.stderr.isatty()  # in a Slurm output file, a line every 30 s instead of a redrawn bar
        self._bar = tqdm(total=total_steps, initial=start_step, unit="step", file=sys.stderr, dynamic_ncols=tty,
                         mininterval=1.0 if tty else 30.0, ascii=not tty)

    def step(self, step: int, epoch: float, lr: float, result: StepResult) -> None:
        if not self.enabled:
            return
        wall = sum(result.times.values())
        record = {"kind": "step", "step": step, "epoch": round(epoch, 4), "lr": lr, "loss": result.loss,
                  "images": result.images, "images_per_s": result.images / wall if wall else 0.0,
                  "time": time.time(), **{f"t_{k}": round(result.times[k], 6) for k in PHASES},
                  "t_step": round(wall, 6)}
        self._jsonl.write(json.dumps(record) + "\n")
        self._bar.update(1)
        if step % self.log_every == 0:
            self._bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{lr:.4g}", img_s=f"{record['images_per_s']:.0f}",
                                  refresh=False)
            if self._tb is not None:
                for key in ("loss", "lr", "images_per_s"):
                    self._tb.add_scalar(f"train/{key}", record[key], step)
                for k in PHASES:
                    self._tb.add_scalar(f"time/{k}", result.times[k], step)

    def evaluating(self, batches: int) -> None:
        """A progress line of an evaluation in flight: train.jsonl grows, the supervisor's watchdog sees life."""
        if self.enabled:
            self._jsonl.write(json.dumps({"kind": "evaluating", "batches": batches, "time": time.time()}) + "\n")

    def evaluation(self, step: int, epoch: float, metrics: dict, classes: list[str] | None = None) -> None:
        """One evaluation's line; with its confusion matrix, also the files of :mod:`hpcdl.train.confusion`."""
        if not self.enabled:
            return
        metrics = dict(metrics)
        confusion = metrics.pop("confusion", None)
        self._jsonl.write(json.dumps({"kind": "eval", "step": step, "epoch": round(epoch, 4), "time": time.time(),
                                      **metrics}) + "\n")
        self._bar.write(f"eval at step {step} (epoch {epoch:.2f}): top-1 {metrics['top1']:.2f}%, "
                        f"top-5 {metrics['top5']:.2f}%, loss {metrics['loss']:.4f} over {metrics['images']} images")
        if self._tb is not None:
            for key in ("top1", "top5", "loss"):
                self._tb.add_scalar(f"eval/{key}", metrics[key], step)
        if confusion is not None and classes:
            self._bar.write("  " + cm.describe(cm.write(self.run_dir, step, confusion.numpy(), classes, self._tb)))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()


def phase_shares(path: str, skip: int = 2) -> dict[str, float]:
    """Each phase's share of the step time over a run's JSONL log (the first ``skip`` steps left out)."""
    totals = dict.fromkeys(PHASES, 0.0)
    with open(path) as f:
        steps = [r for r in map(json.loads, f) if r["kind"] == "step"][skip:]
    for r in steps:
        for k in PHASES:
            totals[k] += r[f"t_{k}"]
    whole = sum(totals.values()) or 1.0
    return {k: v / whole for k, v in totals.items()}
