"""How a training run ended. ``hpcdl.cli.exit_code`` maps each to the process's exit status."""

from __future__ import annotations

import enum

__all__ = ["Outcome"]


class Outcome(str, enum.Enum):
    FINISHED = "finished"  # every step ran; the last checkpoint and summary are written
    REQUEUED = "requeued"  # stopped on the requeue signal, checkpointed, and the job was requeued to go on
    STOPPED = "stopped"  # stopped on the requeue signal and checkpointed, but not requeued (none left, or none possible)
    TERMINATED = "terminated"  # stopped on SIGTERM (scancel, a time limit without --signal), checkpointed

    def __str__(self) -> str:
        return self.value
