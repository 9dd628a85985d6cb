"""What a train config needs from the job and the data, checked without torch: on the login node by
``hpcdl sbatch`` and ``hpcdl submit`` before anything is queued, and again by every rank."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

from hpcdl.config import RunConfig
from hpcdl.data.format import Manifest
from hpcdl.data.verify import load_manifest
from hpcdl.errors import ConfigError
from hpcdl.runs.folder import RunFolder

log = logging.getLogger(__name__)


def preflight(cfg: RunConfig, world_size: int, manifest: Manifest | None = None) -> RunConfig:
    """``cfg`` as it will run on ``world_size`` ranks; raises before anything is submitted when it cannot.
    ``manifest``: data.train's, read already (a job's ranks get rank 0's, which also read data.val's)."""
    if not cfg.data.train:
        raise ConfigError(f"{cfg.name}: data.train is not set; --set data.train=/path/to/packed/train "
                          "(a folder hpcdl pack wrote)")
    train_root = os.path.expandvars(cfg.data.train)
    if manifest is None:
        manifest = load_manifest(train_root)  # DataError naming the path when it is not a packed dataset
        if cfg.data.val:
            load_manifest(os.path.expandvars(cfg.data.val))
    if len(manifest.classes) > cfg.num_classes:
        raise ConfigError(f"{train_root} holds {len(manifest.classes)} classes but num_classes={cfg.num_classes}; "
                          f"--set num_classes={len(manifest.classes)}")
    if cfg.global_batch % world_size:
        divisors = [n for n in range(1, min(cfg.global_batch, 4096) + 1) if cfg.global_batch % n == 0]
        raise ConfigError(f"global_batch={cfg.global_batch} does not split over {world_size} ranks; run on one of "
                          f"{divisors[-12:]} ranks, or --set global_batch to a multiple of {world_size}")
    if cfg.loop.stop_at_target and not cfg.data.val:
        raise ConfigError(f"{cfg.name}: loop.stop_at_target stops at an evaluation, and data.val is not set; "
                          "--set data.val=/path/to/packed/val")
    check_writable(cfg)
    images = sum(s.count for s in manifest.shards)
    if (cfg.ranks, cfg.train_images) != (world_size, images):
        log.info("config %s: ranks %d -> %d (this job), train_images %d -> %d (%s)", cfg.name, cfg.ranks,
                 world_size, cfg.train_images, images, train_root)
    return dataclasses.replace(cfg, ranks=world_size, train_images=images)


def check_writable(cfg: RunConfig) -> None:
    """The run folder (or the folder it will be made in) must take files: a refusal here costs seconds, one
    on the compute nodes costs the wait in the queue. Folders named with $VARS or {job} are checked from
    the first existing folder above them."""
    folder = os.path.expandvars(cfg.run_dir.split("{")[0]) or "."
    while not os.path.isdir(folder) and os.path.dirname(os.path.abspath(folder)) != os.path.abspath(folder):
        folder = os.path.dirname(os.path.abspath(folder))
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"run_dir={cfg.run_dir!r}: {folder} is not writable by this user; --set run_dir to a "
                          "folder you can write (e.g. $SCRATCH/runs/{name}-{job})")


def run_dir(cfg: RunConfig) -> str:
    """The run folder: ``run_dir`` with ``{name}`` and ``{job}`` (the job that requeues, or "local") filled in."""
    return os.path.expandvars(cfg.run_dir.format(name=cfg.name, job=requeue_target() or "local"))


def make_run_dir(cfg: RunConfig) -> str:
    """The run folder with its checkpoints folder, made; a ConfigError when it cannot be."""
    check_writable(cfg)  # the refusal the login node gives, before the folder is made
    folder = run_dir(cfg)
    try:
        os.makedirs(RunFolder(folder).checkpoints, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"run_dir {folder}: cannot create it ({exc.strerror or exc}); --set run_dir to a folder "
                          "this job can write") from None
    return folder


def requeue_target(environ: Mapping[str, str] = os.environ) -> str | None:
    """The id ``scontrol requeue`` needs: ``ARRAYJOBID_TASKID`` for an array task, else the job id."""
    if "SLURM_ARRAY_JOB_ID" in environ and "SLURM_ARRAY_TASK_ID" in environ:
        return f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    return environ.get("SLURM_JOB_ID")
