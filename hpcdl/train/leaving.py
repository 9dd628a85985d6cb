"""A rank that stops on an error of its own (an :class:`~hpcdl.errors.HpcdlError`, not a lost peer): how it leaves,
and what it tells the others.

- **Every rank raised it**, after the collective that agreed on it (start-up's check of the shards split over the
  ranks, rank 0's error handed round, a loss not finite): the ranks leave together
  (:func:`~hpcdl.distributed.group.lifecycle.leave_together`), none while another's side of that collective is
  in flight. On oneCCL, CI saw rank 1 leave right after the shards' check and rank 0's side of its all-reduce
  stranded, then failed by its watchdog as a lost rank: exit 4, not 2.
- **The error is this rank's alone** (an image that fails its CRC32, a full disk, a loader worker killed): the
  others do not come within two heartbeats; the rank leaves its *word* in the start's rescue folder (a report marked
  ``left``, with its message) and goes. The others, their collective broken or their watch finding the word, save
  the last step just in time and stop naming its error (:func:`adopt`): with status 2 when a restart would meet it
  again (its ``restartable`` is false: bad input, damaged data), which no supervisor restarts; with 4 otherwise, as
  after a lost peer. Without a just-in-time checkpoint (``checkpoint.jit=false``) there is no folder and no word:
  the others stop as after a lost peer.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import signal
import socket
import threading
import time

from hpcdl.distributed.group.lifecycle import DistContext, leave_together
from hpcdl.errors import HpcdlError
from hpcdl.runs.outcome import EXIT_BAD_INPUT, EXIT_PEER_LOST, read_result
from hpcdl.utils import atomic_write_text

__all__ = ["adopt", "error_text", "leaving_together", "origin", "write_word"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def leaving_together(ctx: DistContext, rescue):
    """The start and the training under it (inside ``fail_fast``, which turns a failed collective into a lost peer;
    around the loader's naming of a dead worker, whose error it sees): see the module's docstring. ``rescue``: the
    start's :class:`~hpcdl.train.rescue.Rescue`, or None. Whatever fails while leaving (a signal, the store), the
    rank's own error goes on up."""
    try:
        yield
    except HpcdlError as exc:
        if ctx.world_size == 1:
            raise
        try:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would raise here for a worker's exit
            if rescue is not None:
                rescue.hold()  # no rescue from here: the others leaving on the same error are no loss
            name = os.path.basename(rescue.folder) if rescue is not None else None
            leave_together(ctx, 2 * ctx.heartbeat.interval_s, name,
                           alone=(lambda: write_word(rescue, exc)) if rescue is not None else lambda: None)
        except BaseException as other:  # leaving anyway, with this rank's error
            log.error("rank %d: while leaving on its error: %s: %s", ctx.rank, type(other).__name__, other)
        raise


def write_word(rescue, exc: BaseException) -> None:
    """This rank's word in ``rescue``'s folder: its error, and the status the others stop with."""
    word = {"rank": rescue.rank, "step": None, "reason": error_text(exc), "left": True,
            "status": EXIT_PEER_LOST if getattr(exc, "restartable", False) else EXIT_BAD_INPUT,
            "node": os.environ.get("SLURMD_NODENAME"), "host": socket.gethostname(), "pid": os.getpid(),
            "slurm_step": os.environ.get("SLURM_STEP_ID"), "time": time.time()}
    try:
        os.makedirs(rescue.folder, exist_ok=True)
        atomic_write_text(rescue.report_path(rescue.rank), json.dumps(word) + "\n")
    except OSError as failed:  # a full disk: the others stop as after a lost peer
        log.error("rank %d: its word in %s could not be written (%s)", rescue.rank, rescue.folder, failed)


def origin(folder: str) -> dict | None:
    """The report in a rescue ``folder`` of the rank whose own error started it: a word, or the report of a rank whose
    read failed (status 2, :func:`hpcdl.train.finish.on_storage_error`); not a report that followed another's."""
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), "report-*.json"))):
        report = read_result(folder, os.path.basename(path))  # None while unreadable
        if report and report.get("follows") is None and (report.get("left") or report.get("status") == EXIT_BAD_INPUT):
            return report
    return None


def adopt(found: dict, reason: str, status: int, why: str, folder: str) -> tuple[str, int, str]:
    """(reason, status, why) of a rank that stops after ``found`` (:func:`origin`), its own ``reason`` kept after it."""
    here = f"(its report in {folder}; here: {reason})"
    if found.get("status") == EXIT_BAD_INPUT:
        return f"rank {found['rank']}'s input failed: {found['reason']} {here}", EXIT_BAD_INPUT, "a rank's input failed"
    return f"rank {found['rank']} stopped on its error: {found['reason']} {here}", status, why


def error_text(exc: BaseException) -> str:
    """An error's own message, without the traceback that a loader worker's carries (``Caught DataError in DataLoader
    worker process 0. Original Traceback ... hpcdl.errors.DataError: MESSAGE``)."""
    text = str(exc).strip()
    said = list(re.finditer(r"^hpcdl\.errors\.\w+: ", text, re.MULTILINE))
    return text[said[-1].end():] if said else text or type(exc).__name__
