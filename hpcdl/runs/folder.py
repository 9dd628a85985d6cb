"""The run folder's layout: every path a run writes or reads in it, named once (torch-free, so the login node and
the supervisor read a run folder with the trainer's names).

::

    RUN/config.yaml                      the resolved config
    RUN/summary.json                     the run's summary, written at its end
    RUN/supervisor.json                  the supervisor's restarts
    RUN/train.jsonl                      the step and evaluation records
    RUN/checkpoints/ckpt-STEP.pt         a checkpoint (STEP: 9 digits), .ckpt-STEP.pt.HOST.PID.tmp while written
    RUN/checkpoints/ckpt-STEP.rankRRRRR.pt   a rank's own part of it (chunk_sparse residuals)
    RUN/jit/START/                       one start's just-in-time rescue (reports, RNG streams, result.json)
    RUN/samples/rankRRRRR.txt            loop.record_samples
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

from hpcdl.utils import atomic_write_text

__all__ = ["CHECKPOINT", "RunFolder", "checkpoint_name", "checkpoints_in", "rank_part_of"]

CHECKPOINT = re.compile(r"ckpt-(\d{9})\.pt")  # a complete checkpoint's name; its step is the group


@dataclasses.dataclass(frozen=True, slots=True)
class RunFolder:
    root: str

    @property
    def checkpoints(self) -> str:
        return os.path.join(self.root, "checkpoints")

    @property
    def jit(self) -> str:
        return os.path.join(self.root, "jit")

    @property
    def samples(self) -> str:
        return os.path.join(self.root, "samples")

    @property
    def summary(self) -> str:
        return os.path.join(self.root, "summary.json")

    @property
    def config(self) -> str:
        return os.path.join(self.root, "config.yaml")

    @property
    def supervisor(self) -> str:
        return os.path.join(self.root, "supervisor.json")

    @property
    def steps_log(self) -> str:
        return os.path.join(self.root, "train.jsonl")

    def rescue(self, start: str) -> str:
        """The folder of one start's just-in-time rescue; ``start`` is unique to that start
        (:func:`hpcdl.train.rescue.attempt_name`), so a folder of an earlier start is never read as this one's."""
        return os.path.join(self.jit, start)

    def sample_record(self, rank: int) -> str:
        return os.path.join(self.samples, f"rank{rank:05d}.txt")

    def open_sample_record(self, rank: int):
        """loop.record_samples: each rank appends "epoch index step" of every sample it trains."""
        os.makedirs(self.samples, exist_ok=True)
        return open(self.sample_record(rank), "a")

    def drop_samples_after(self, step: int) -> None:
        """loop.record_samples after a rescue: every rank writes a step's samples before its exchange, so a lost
        rank's record holds each step it took part in, and every record may hold the step in flight: keep the steps
        up to ``step``. Each file is replaced (a survivor still appending writes to the old one)."""
        for path in glob.glob(os.path.join(glob.escape(self.samples), "rank*.txt")):
            with open(path) as f:
                kept = [line for line in f if len(line.split()) < 3 or int(line.split()[2]) <= step]
            atomic_write_text(path, "".join(kept))

    def checkpoint(self, step: int) -> str:
        return os.path.join(self.checkpoints, checkpoint_name(step))

    def rank_part(self, step: int, rank: int) -> str:
        """The file beside step's checkpoint that holds ``rank``'s own state."""
        return rank_part_of(self.checkpoint(step), rank)

    def checkpoint_list(self) -> list[str]:
        """Complete checkpoints, newest first."""
        return checkpoints_in(self.checkpoints)

    def newest_checkpoint(self) -> str | None:
        found = self.checkpoint_list()
        return found[0] if found else None


def checkpoints_in(folder: str) -> list[str]:
    """The complete checkpoints in ``folder``, newest first (temporary files of interrupted writes and rank parts
    are not listed)."""
    found = [p for p in glob.glob(os.path.join(glob.escape(folder), "ckpt-*.pt"))
             if CHECKPOINT.fullmatch(os.path.basename(p))]
    return sorted(found, reverse=True)


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:09d}.pt"


def rank_part_of(checkpoint: str, rank: int) -> str:
    """The file beside ``checkpoint`` that holds ``rank``'s own state."""
    return f"{checkpoint[:-len('.pt')]}.rank{rank:05d}.pt"
