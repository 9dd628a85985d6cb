"""The rank's DataLoader: its workers' base seed its own, their start below compute's priority with SIGTERM
blocked until they ignore it, and a worker's death (the OOM killer, most often) named as the data's. How many
cores the loader is given is measured by the rank at start-up (:mod:`hpcdl.train.loader_sizing`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import traceback

import torch
from torch.utils.data import DataLoader

from hpcdl.errors import DataError

__all__ = ["LOADER_NICE", "data_workers_named", "make_loader", "worker_death"]

LOADER_NICE = 10  # the workers' niceness: compute's threads win each core the two contend for
def make_loader(dataset, sampler, batch: int, workers: int):
    """A DataLoader over ``sampler``'s indices. It draws its workers' base seed from a generator of its own:
    from torch's global one (DataLoader's default), each new iterator took a draw that a resumed run takes at
    another point, and a model with dropout or stochastic depth then resumed otherwise than it had run. The
    augmentation is seeded per sample, not by the workers' seeds."""
    return _Loader(dataset, batch_size=batch, sampler=sampler, num_workers=workers, drop_last=False,
                   persistent_workers=False, prefetch_factor=4 if workers else None,
                   worker_init_fn=_start_worker if workers else None, generator=torch.Generator().manual_seed(0))


class _Loader(DataLoader):
    """A DataLoader whose workers start with SIGTERM blocked. scancel's SIGTERM reaches every process of the
    step, and between a worker's fork and :func:`_start_worker` torch's own handler would end the worker on it
    (the rank then fails instead of checkpointing): blocked, it stays pending until the worker ignores it."""

    def __iter__(self):
        announce = getattr(self.dataset, "announce", None)
        if announce is not None:  # the node cache prefetches the epoch's samples in the sampler's order
            announce(self.sampler)
        if not self.num_workers:
            return super().__iter__()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            return super().__iter__()  # forks the epoch's workers
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _start_worker(worker_id: int) -> None:
    """A loader worker runs below compute's priority, on one thread, on any core of the rank."""
    os.nice(LOADER_NICE)
    torch.set_num_threads(1)
    # scancel's SIGTERM reaches every process of the step; the rank stops at the next step and checkpoints,
    # which needs its workers until then (they exit with it). Ignoring it drops one that arrived while blocked.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


@contextlib.contextmanager
def data_workers_named(rank: int):
    """A DataLoader worker that dies (the OOM killer, most often) surfaces as a RuntimeError from the loader
    or from torch's SIGCHLD handler, wherever the main thread is, or as a ConnectionError when it dies
    handing a batch over: name it as the data's, with the fix."""
    try:
        yield
        return
    except (RuntimeError, ConnectionError, EOFError) as exc:
        error = exc
    for _ in range(3):  # torch's SIGCHLD handler can raise again while this runs: take its error instead
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            named = worker_death(error, rank)
            break
        except RuntimeError as again:
            error = again
    else:
        named = None
    if named is None:
        raise error
    raise named from None


def worker_death(exc: BaseException, rank: int) -> DataError | None:
    frames = traceback.extract_tb(exc.__traceback__)
    if "DataLoader worker" not in str(exc) and not any("torch/utils/data/" in f.filename for f in frames):
        return None
    first = (str(exc).strip().splitlines() or [""])[0]
    what = first if "DataLoader worker" in first else \
        f"a DataLoader worker died while handing over a batch ({type(exc).__name__}: {first})"
    died = DataError(f"rank {rank}: {what}; the OOM killer is the usual cause (the node's dmesg says): lower "
                     "data.workers or the per-rank batch, or ask Slurm for more memory per task")
    died.restartable = True  # the data is not at fault
    return died
