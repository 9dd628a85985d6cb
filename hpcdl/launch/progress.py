"""What the supervisor reads of a running step: its ranks' train.jsonl (rank 0's records), for the watchdog
and for the cost of a restart."""

from __future__ import annotations

import json
import os
import time

__all__ = ["StepLog", "first_step_after"]


class StepLog:
    """train.jsonl's growth: how long since its last record, and the longest gap between two in this step."""

    def __init__(self, path: str):
        self.path = path
        self.size, self.since = self._size(), time.monotonic()
        self.grew, self.longest = False, 0.0

    def _size(self) -> int:
        try:
            return os.stat(self.path).st_size
        except OSError:
            return 0

    def idle_s(self) -> float:
        size, now = self._size(), time.monotonic()
        if size != self.size:
            if self.grew:
                self.longest = max(self.longest, now - self.since)
            self.size, self.since, self.grew = size, now, True
        return now - self.since


def first_step_after(path: str, started: float) -> float | None:
    """The time of the first step record at or after ``started`` (time.time()), None before one."""
    try:
        with open(path) as f:
            for line in f:
                if '"kind": "step"' in line:
                    record = json.loads(line)
                    if record["time"] >= started:
                        return record["time"]
    except (OSError, ValueError):
        pass
    return None
