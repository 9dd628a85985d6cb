"""The old home of :class:`hpcdl.launch.train_job.TrainJob`. submitit pickles the job it runs by its module's name
and unpickles it when the job starts and after every requeue: a job submitted before the class moved (2026-11, issue
45) still starts after an upgrade. New code imports :mod:`hpcdl.launch.train_job`."""

from hpcdl.launch.train_job import TrainJob

__all__ = ["TrainJob"]
