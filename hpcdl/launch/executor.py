"""``hpcdl.launch.submit``: run a function or a command as a job through submitit.

On a machine where Slurm answers this is submitit's Slurm executor; elsewhere its local executor
runs the tasks as processes here (one node only). Either way each task starts with the same
allocator exports as the generated sbatch scripts, through submitit's setup lines.
"""

from __future__ import annotations

import logging
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

import submitit

from hpcdl.errors import ConfigError
from hpcdl.launch.profiles import slurm_answers
from hpcdl.launch.request import JobRequest, job_request

__all__ = ["hpcdl_command", "make_executor", "submit"]

log = logging.getLogger(__name__)


def setup_lines(req: JobRequest, python: str) -> list[str]:
    q = shlex.quote(python)
    return [f'tuning=$({q} -m hpcdl tune --exports --allocator {shlex.quote(req.allocator)}) && eval "$tuning"']


def make_executor(req: JobRequest, folder: str, cluster: str | None = None) -> submitit.Executor:
    """A submitit executor for ``req``: ``cluster`` is "slurm", "local", or None to pick by what answers."""
    cluster = cluster or ("slurm" if slurm_answers() else "local")
    if cluster == "local" and req.nodes != 1:
        raise ConfigError(f"nodes={req.nodes}: no Slurm answers here, and submitit's local executor runs one node; "
                          "ask for nodes=1 or submit from a Slurm login node")
    python = req.python or sys.executable
    if cluster == "local" and python != sys.executable:
        raise ConfigError(f"python={python!r}: submitit's local executor runs tasks with this interpreter "
                          f"({sys.executable}); leave python unset, or submit to Slurm")
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster, **({"slurm_python": shlex.quote(python)}
                                                                         if cluster == "slurm" else {}))
    params: dict[str, Any] = dict(name=req.job_name, nodes=req.nodes, tasks_per_node=req.tasks_per_node,
                                  timeout_min=max(1, int(req.walltime.total_seconds() // 60)))
    if cluster == "slurm":
        # --kill-on-bad-exit, as hpcdl sbatch's scripts: a rank that fails at start-up (its store's port taken)
        # ends the step, instead of the others waiting for it to the start-up timeout or the time limit
        params |= dict(slurm_setup=setup_lines(req, python), slurm_partition=req.partition_name,
                       slurm_account=req.account, slurm_qos=req.qos, cpus_per_task=req.cpus_per_task,
                       slurm_srun_args=["--kill-on-bad-exit=1"])
    else:
        params |= dict(local_setup=setup_lines(req, python))
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    log.info("submitit %s executor: %d node(s) x %d task(s), folder %s", cluster, req.nodes, req.tasks_per_node, folder)
    return executor


def hpcdl_command(args: Sequence[str]) -> list[str]:
    """The argv that runs ``hpcdl ARGS`` with this interpreter."""
    return [sys.executable, "-m", "hpcdl", *args]


def submit(fn_or_command: Callable | Sequence[str], *, args: Sequence = (), kwargs: dict | None = None,
           folder: str = "hpcdl-jobs/%j", cluster: str | None = None, **job: Any) -> submitit.Job:
    """Submit ``fn_or_command`` to run in every task of a job.

    ``fn_or_command`` is a picklable callable (called as ``fn(*args, **kwargs)`` in each task; each
    task's return value comes back through ``job.results()``) or an argv list, run as a process in
    each task (its standard output comes back). ``job`` holds the :class:`JobRequest` fields
    (``nodes``, ``tasks_per_node``, ``profile``, ``time``, ...); any other name is an error listing
    the valid ones, raised before anything is submitted.
    """
    req = job_request(**job)
    if callable(fn_or_command):
        fn, call_args = fn_or_command, tuple(args)
    elif isinstance(fn_or_command, Sequence) and not isinstance(fn_or_command, str) and fn_or_command:
        fn, call_args = submitit.helpers.CommandFunction(list(fn_or_command), verbose=False), ()
    else:
        raise ConfigError("submit() takes a callable or a non-empty argv list such as ['hpcdl', 'bench', 'allreduce']")
    job_obj = make_executor(req, folder, cluster).submit(fn, *call_args, **(kwargs or {}))
    log.info("submitted job %s (%s)", job_obj.job_id, req.job_name)
    return job_obj
