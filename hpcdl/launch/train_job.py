"""``TrainJob``: training as a submitit job, resumable through submitit's ``checkpoint()`` protocol."""

from __future__ import annotations

import logging

import submitit

from hpcdl.deferred import deferred
from hpcdl.distributed.ranks.env import rank_and_world
from hpcdl.log import setup_logging
from hpcdl.presets import resolve

log = logging.getLogger(__name__)


class TrainJob(submitit.helpers.Checkpointable):
    """``TrainJob(config, overrides)()`` trains in each task of a submitit job.

    On the requeue signal the trainer stops every rank at one step and checkpoints, then hands the
    signal to submitit, which calls :meth:`checkpoint` on rank 0 and requeues the job. The requeued job
    runs this object again and resumes from the newest checkpoint in the run folder.
    """

    def __init__(self, config: str, overrides: list[str] | tuple[str, ...] = ()):
        self.config, self.overrides = config, list(overrides)

    def __call__(self) -> dict:
        setup_logging(rank_and_world()[0])
        return deferred("hpcdl.train.trainer:train")(resolve(self.config, self.overrides))

    def checkpoint(self) -> submitit.helpers.DelayedSubmission:
        log.info("submitit checkpoint(): the requeued job resumes from the run folder's newest checkpoint")
        return submitit.helpers.DelayedSubmission(TrainJob(self.config, self.overrides))
