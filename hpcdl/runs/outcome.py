"""How a training run ended (``hpcdl.cli.exit_code`` maps each to the process's exit status), and its summary
as the log and ``hpcdl submit`` print it."""

from __future__ import annotations

import enum
import json
import os

__all__ = ["EXIT_BAD_INPUT", "EXIT_PEER_LOST", "Outcome", "read_result", "summary_text"]

EXIT_BAD_INPUT = 2  # a config, flag or file was refused, or the data could not be read; not restarted
EXIT_PEER_LOST = 4  # a peer was lost; the survivors wrote what they could (RUN/jit/ATTEMPT/result.json)


class Outcome(str, enum.Enum):
    FINISHED = "finished"  # every step ran; the last checkpoint and summary are written
    REQUEUED = "requeued"  # stopped on the requeue signal, checkpointed, and the job was requeued to go on
    STOPPED = "stopped"  # stopped on the requeue signal and checkpointed, but not requeued (none left, or none possible)
    TERMINATED = "terminated"  # stopped on SIGTERM (scancel, a time limit without --signal), checkpointed

    def __str__(self) -> str:
        return self.value


def summary_text(s: dict) -> str:
    lines = [f"summary: {s['steps']} steps, {s['epochs']:.2f} epochs in {s['train_s']:.1f} s of training "
             f"({s['images_per_s']:.1f} images/s over {s['world_size']} ranks)"]
    if s.get("best_top1") is not None:
        lines.append(f"  best top-1 {s['best_top1']:.2f}% (top-5 {s['best_top5']:.2f}%) at step {s['best_step']}")
    if s.get("target_top1"):
        reached = s.get("time_to_target_s")
        lines.append(f"  time to top-1 {s['target_top1']:g}%: " + (f"{reached:.1f} s" if reached is not None
                                                                      else "not reached")
                     + ("; the run stopped there (loop.stop_at_target)" if s.get("stopped_at_target") else ""))
    if s.get("phases"):
        lines.append("  step time: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in s["phases"].items()))
    return "\n".join(lines)


def read_result(folder: str, name: str = "result.json") -> dict | None:
    """``result.json`` of a just-in-time rescue's folder (:mod:`hpcdl.train.rescue`), or None when no rank
    finished one there (``name``: a rank's report in it, None while unreadable)."""
    try:
        with open(os.path.join(folder, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
