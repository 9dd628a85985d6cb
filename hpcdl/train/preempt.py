"""Stopping for the wall-clock limit or preemption: every rank stops at the same step boundary.

Slurm sends the requeue signal (USR2 by default; ``#SBATCH --signal=B:USR2@120`` or ``--signal=USR2@120``)
to the ranks it reaches, not necessarily all of them at the same moment. Each rank only notes the
signal. At every step boundary rank 0 broadcasts whether *it* has seen one, so all ranks act on the same
answer at the same step: checkpoint, then rank 0 requeues the job (:func:`requeue`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Mapping

import torch
import torch.distributed as dist

from hpcdl.errors import LaunchError
from hpcdl.names import signal_number
from hpcdl.runs.preflight import requeue_target

log = logging.getLogger(__name__)


class StopSignal:
    """Notes ``signame`` (e.g. ``USR2``: stop, checkpoint, requeue) and SIGTERM (``scancel``, preemption
    without a warning signal: stop, checkpoint, exit) in this process; :meth:`agreed` is the collective
    answer to the first."""

    def __init__(self, signame: str = "USR2"):
        self.signum = signal_number("checkpoint.signal", signame)
        self.seen = self.terminated = False
        self._previous = signal.signal(self.signum, self._note)
        self._previous_term = signal.signal(signal.SIGTERM, self._note_term) \
            if self.signum != signal.SIGTERM else None

    def arm(self) -> None:
        """Install the handlers again. Libraries loaded since may have replaced them: libfabric's psm
        provider (libinfinipath, which oneCCL's libfabric loads) installs a SIGTERM handler that calls exit()
        inside the handler, and the process then deadlocked in malloc until Slurm's SIGKILL."""
        signal.signal(self.signum, self._note)
        if self._previous_term is not None:
            signal.signal(signal.SIGTERM, self._note_term)

    def _note(self, signum, frame) -> None:
        self.seen = True

    def _note_term(self, signum, frame) -> None:
        self.terminated = True

    @property
    def wish(self) -> int:
        """What this rank asks at the next step: 2 stop on SIGTERM, 1 stop and requeue, 0 go on."""
        return 2 if self.terminated else 1 if self.seen else 0

    def agreed(self, group=None) -> bool:
        """Rank 0's answer on every rank (one broadcast of one byte); this rank's alone without a group."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.seen
        flag = torch.tensor([1 if self.seen else 0], dtype=torch.uint8)
        dist.broadcast(flag, src=0, group=group)
        return bool(flag.item())

    def close(self) -> None:
        signal.signal(self.signum, self._previous)
        if self._previous_term is not None:
            signal.signal(signal.SIGTERM, self._previous_term)


def requeue(max_requeues: int, environ: Mapping[str, str] = os.environ) -> bool:
    """Requeue this Slurm job unless it has been requeued ``max_requeues`` times; True when requeued."""
    target = requeue_target(environ)
    if target is None:
        log.warning("requeue: not in a Slurm job; stopping after the checkpoint")
        return False
    done = int(environ.get("SLURM_RESTART_COUNT") or 0)
    if done >= max_requeues:
        log.warning("requeue: job %s was requeued %d times already (max %d); stopping after the checkpoint",
                    target, done, max_requeues)
        return False
    # The requeue ends this very step: slurmd's SIGTERM to the step's processes can reach scontrol before
    # slurmctld's reply does (CI, 2026-11-26: the job was requeued, scontrol died without a word). scontrol
    # runs with SIGTERM ignored, a disposition exec keeps, so its status says whether the requeue took;
    # SIGKILL follows only after the partition's KillWait.
    run = subprocess.run(["sh", "-c", 'trap "" TERM; exec scontrol requeue "$0"', target],
                         capture_output=True, text=True)
    if run.returncode < 0:
        raise LaunchError(f"scontrol requeue {target} was killed by {signal.Signals(-run.returncode).name} "
                          "before Slurm answered; whether the job was requeued is unknown: its Restarts= in "
                          f"`scontrol show job {target}` says")
    if run.returncode != 0:
        raise LaunchError(f"scontrol requeue {target} failed: {run.stderr.strip() or run.stdout.strip()}; "
                          "the job needs --requeue (hpcdl's sbatch scripts set it) and a partition that allows it")
    log.info("requeue: job %s requeued (%d of at most %d)", target, done + 1, max_requeues)
    return True


def submitit_handles(stop: StopSignal) -> bool:
    """Whether the handler before hpcdl's is submitit's (it is installed in every task of a submitit job)."""
    owner = getattr(stop._previous, "__self__", None)
    return type(owner).__name__ == "SignalHandler" and type(owner).__module__.startswith("submitit.")


def hand_to_submitit(stop: StopSignal) -> bool:
    """Under submitit, pass the signal on to the handler submitit had installed; False elsewhere.

    That handler, on global rank 0, calls the job object's ``checkpoint()`` (hpcdl's returns the same
    job, which resumes from the run folder), requeues within submitit's bound and exits.
    """
    handler = stop._previous
    owner = getattr(handler, "__self__", None)
    if type(owner).__name__ != "SignalHandler" or not type(owner).__module__.startswith("submitit."):
        return False
    log.info("requeue: handing the signal to submitit (checkpoint() and requeue)")
    handler(stop.signum, None)
    return True
