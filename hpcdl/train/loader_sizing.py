"""The cores a rank keeps for its DataLoader's workers (:mod:`hpcdl.data.loader`), sized from measured rates.

A core given to the loader whatever its need is a core lost to compute: on a 2-core node training ResNet-50,
such a core sat 97% idle while compute ran on the other (9.1 images/s against 16.4 with both cores
computing). So the rank measures two rates at start-up:

- the loader's cost: seconds of one core per image. The probe decodes and transforms images of the
  job's own training shards in this process (:func:`loader_cost`).
- the step's rate: images per second of one forward and backward on every core the rank has, in the
  run's precision. :func:`step_rate` undoes every effect of this step.

The loader needs ``cost x rate`` cores (:func:`size_loader`). The rank keeps whole cores only: ``floor``
of that need, and none when the need is a fraction of a core. The workers run at a lower priority
(``nice`` +10) and may use every core of the rank. So they take what they need from compute, and
compute gets the rest. ``data.reserve_cores`` set to a count skips the probe.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time

from hpcdl.data.loader import LOADER_NICE
from hpcdl.train.step import effects_undone

__all__ = ["LoaderSizing", "loader_cost", "size_loader", "step_rate"]

PROBE_S = 0.3  # about how long each probe of the loader runs
PROBE_IMAGES = (4, 64)  # at least, at most


@dataclasses.dataclass(frozen=True, slots=True)
class LoaderSizing:
    """The cores kept for the loader and why."""

    reserved: int
    cost_s_per_image: float | None = None  # one core's seconds per image, measured
    step_images_s: float | None = None  # the step's rate on every core of the rank, measured
    why: str = ""

    @property
    def need(self) -> float | None:
        if self.cost_s_per_image is None or self.step_images_s is None:
            return None
        return self.cost_s_per_image * self.step_images_s

    def describe(self) -> str:
        if self.need is None:
            return f"loader: {self.reserved} cores kept ({self.why})"
        return (f"loader: {self.cost_s_per_image * 1e3:.2f} ms of a core per image x {self.step_images_s:.1f} "
                f"images/s of the step = {self.need:.2f} cores needed: {self.reserved} kept ({self.why})")


def size_loader(setting: str, workers: int, measure) -> LoaderSizing:
    """The cores to keep for ``workers`` loader workers. ``setting`` is data.reserve_cores: ``auto``, or a
    count. ``measure()`` returns (cost s/image, step images/s); it is called only for ``auto`` with workers."""
    if workers == 0:
        return LoaderSizing(0, why="data.workers=0: the training process loads between steps")
    if setting != "auto":
        return LoaderSizing(int(setting), why=f"data.reserve_cores={setting}")
    cost, rate = measure()
    need = cost * rate
    reserved = math.floor(need)
    why = ("a fraction of a core: the workers share every core at nice +%d" % LOADER_NICE if reserved == 0 else
           f"whole cores only; the workers also take the rest of the need from compute at nice +{LOADER_NICE}")
    return LoaderSizing(reserved, cost, rate, why)


def loader_cost(dataset, budget_s: float = PROBE_S) -> float:
    """One core's seconds per image of ``dataset`` (read, decode, transform), measured in this process on a
    copy (its open shards are the copy's own), over the first images of a spread of its indices."""
    probe = copy.copy(dataset)
    if getattr(probe, "cache", None) is not None:  # the reader's own cost: not every rank's cold reads of one stride
        probe.cache = None
    n = len(probe)
    stride = max(1, n // PROBE_IMAGES[1])
    probe[0]  # the first read opens a shard and warms the decoder
    done, t0 = 0, time.perf_counter()
    while done < PROBE_IMAGES[1] and (done < PROBE_IMAGES[0] or time.perf_counter() - t0 < budget_s):
        probe[(1 + done) * stride % n]
        done += 1
    return (time.perf_counter() - t0) / done


def step_rate(model, criterion, images, labels, autocast) -> float:
    """Images/s of one forward and backward of ``model`` on this batch, on torch's current threads, after an
    untimed one; the parameters' gradients, the buffers (batch-norm statistics) and the RNG are as before."""
    with effects_undone(model):
        for timed in (False, True):
            t0 = time.perf_counter()
            with autocast():
                loss = criterion(model(images), labels)
            loss.backward()
            if timed:
                seconds = time.perf_counter() - t0
    return images.shape[0] / seconds
