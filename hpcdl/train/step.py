"""One optimizer step over its micro-batches, timed by phase, with the ranks' control exchange.

Phases, in seconds, summed over the micro-batches of the step:

- ``data``: waiting for the loader, and normalizing the batch;
- ``forward``: the model and the loss;
- ``backward``: gradients, with the bucket all-reduces that overlap them (DDP; ``optimizer.shard``: its
  reduce-scatters);
- ``comm_wait``: backward's wait for buckets still in flight after the last gradient, plus the control
  all-reduce below, plus ``optimizer.shard``'s wait for the reduce-scatters of the gradients (started in
  backward) and its all-gather of the updated tensors (with ``optimizer.gather_ahead``, the next forward's hooks'
  waits for it and copies from it, and the broadcast of the buffers before it at the step's end):
  communication that computation did not hide;
- ``optimizer``: the update (a sharded one: this rank's tensors), the lr schedule and zeroing the gradients.

The control all-reduce carries four numbers: this rank's loss sum and image count, whether its loss
was finite, and flags only rank 0 contributes (stop, checkpoint now). Every rank therefore takes the
same decisions at the same step, and a NaN on any rank skips the update everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from hpcdl.data.dataset import PADDING_LABEL
from hpcdl.distributed.gradients.ddp import CommTimer

PHASES = ("data", "forward", "backward", "comm_wait", "optimizer")


def criterion(label_smoothing: float = 0.0) -> torch.nn.Module:
    """Cross entropy with the run's label smoothing; evaluation padding (label -1) counts for nothing."""
    return torch.nn.CrossEntropyLoss(label_smoothing=label_smoothing, ignore_index=PADDING_LABEL)


@contextlib.contextmanager
def effects_undone(model: torch.nn.Module) -> Iterator[None]:
    """For a forward and backward run only for what they tell (a timing, DDP's bucket order): on leaving,
    the gradients are cleared and the buffers (batch-norm statistics) and torch's RNG are as they were."""
    buffers, rng = [b.clone() for b in model.buffers()], torch.get_rng_state()
    try:
        yield
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers):
                b.copy_(saved)
        torch.set_rng_state(rng)


@dataclasses.dataclass(slots=True)
class StepResult:
    loss: float  # mean over the step's images on all ranks (nan when any rank's was not finite)
    images: int  # on all ranks
    finite: bool
    stop: int  # rank 0 asked every rank to stop after this step: 0 no, 1 to requeue, 2 on SIGTERM
    save: bool  # rank 0 asked every rank to checkpoint after this step
    times: dict[str, float]


def step_shape(count: int, micro: int, left: int | None) -> tuple[int, int]:
    """(micro-batches, images) of this rank's step, whose first micro-batch holds ``micro`` images: ``count``
    micro-batches, or fewer when ``left`` (the samples not yet taken in the epoch, the first micro-batch's
    included) ends the epoch sooner. The loader cuts micro-batches of one size, the epoch's last one shorter, so a
    first micro-batch shorter than the others is the epoch's last and ``left`` is its size."""
    images = count * micro if left is None else min(left, count * micro)
    return math.ceil(images / micro), images


class Stepper:
    """The hot path, shared by the trainer and ``hpcdl bench step``."""

    def __init__(self, net: torch.nn.Module, criterion: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 schedule, *, precision: str = "fp32", comm: CommTimer | None = None, group=None,
                 distributed: bool = True, timeline=None, guard=None,
                 commit: Callable[[StepResult], None] | None = None):
        """``guard`` (a lock) is held over the update and ``commit``, which is called after it with the result:
        the trainer's step counter and what a just-in-time checkpoint reads (:mod:`hpcdl.train.rescue`)."""
        self.net, self.criterion, self.optimizer, self.schedule = net, criterion, optimizer, schedule
        self.guard, self.commit = guard or contextlib.nullcontext(), commit
        self.comm, self.group, self.distributed, self.timeline = comm, group, distributed, timeline
        if timeline is not None and comm is not None:
            comm.on_done = lambda index, start, end: timeline.span(f"bucket {index}", start, end, thread="comm")
        self.autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" \
            else contextlib.nullcontext

    def step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], count: int,
             flags: Callable[[], tuple[bool, bool]] = lambda: (False, False),
             left: int | None = None) -> StepResult | None:
        """Train on the next ``count`` micro-batches of ``batches``, or on what is left of the epoch.

        ``left``: the samples this rank has not yet taken in the epoch (the sampler's length). It is the same on
        every rank (the sampler evens them out), so every rank knows where its step ends: an epoch's last step
        of fewer micro-batches than ``count`` exchanges the gradients at its own last one (without ``left`` no
        micro-batch of it would: each rank would apply its own gradient), and each micro-batch's loss weighs by
        its share of the step's images, so the gradient is the mean over the images trained, not ``count``
        micro-batches' worth. None: ``batches`` holds whole steps (``hpcdl bench``).
        ``flags`` gives rank 0's (stop, save) wishes; other ranks' are ignored. None when ``batches``
        is already exhausted.
        """
        times = dict.fromkeys(PHASES, 0.0)
        loss_sum, images, done, shape = torch.zeros((), dtype=torch.float64), 0, 0, (count, 0)
        t = time.perf_counter()
        for x, y in batches:
            now = time.perf_counter()
            times["data"] += now - t
            self._span("data", t, now)
            if done == 0:
                shape = step_shape(count, len(y), left)
            last, parts = done + 1 == shape[0], (shape[1] / len(y) if left is not None else count)
            loss_sum += self._micro_step(x, y, parts, last, times) * len(y)
            images, done, t = images + len(y), done + 1, time.perf_counter()
            if last:
                break
        if done == 0:
            return None
        if left is not None and done < shape[0]:
            raise RuntimeError(f"the loader ended the step after {done} of its {shape[0]} micro-batches, though the "
                               f"sampler had {left} samples left: the ranks' gradients were not exchanged; this is a "
                               "bug in hpcdl")
        t = time.perf_counter()
        flush = getattr(self.optimizer, "flush", None)  # optimizer.shard: every reduce-scatter issued before the
        if flush is not None:  # control all-reduce, on every rank alike (counted in comm_wait)
            flush()
        result = self._control(loss_sum, images, flags(), times)
        gather = getattr(self.optimizer, "gather", None)  # optimizer.shard: its step's collective parts
        if gather:  # outside the guard, which a rescue takes; waited for even when the update is skipped (not
            self.optimizer.reduce()  # finite): backward started its reduce-scatters
        t1 = time.perf_counter()
        times["comm_wait"] += t1 - t
        with self.guard:
            if result.finite:
                (self.optimizer.update if gather else self.optimizer.step)()
                self.schedule.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.commit is not None:
                self.commit(result)
        t2 = time.perf_counter()
        if gather and result.finite:  # every rank agrees on finite; outside the guard, which a rescue takes
            gather(self.guard)  # its copies into the model under it
        times["optimizer"], times["comm_wait"] = t2 - t1, times["comm_wait"] + time.perf_counter() - t2
        self._span("control", t, t1)
        self._span("optimizer", t1, t2)
        return result

    def _span(self, name: str, start: float, end: float) -> None:
        if self.timeline is not None:
            self.timeline.span(name, start, end)

    def _micro_step(self, x: torch.Tensor, y: torch.Tensor, parts: float, last: bool, times: dict) -> float:
        """Forward and backward of one micro-batch, its mean loss divided by ``parts`` (the step's images over
        its own: the count of micro-batches when they are all alike); DDP exchanges the gradients at ``last``."""
        ahead = getattr(self.optimizer, "ahead", None)  # optimizer.gather_ahead: the forward's hooks take it in
        if ahead is not None:
            ahead.taken_s = 0.0
        t0 = time.perf_counter()
        sync = contextlib.nullcontext() if last or not hasattr(self.net, "no_sync") else self.net.no_sync()
        with sync:
            with self.autocast():
                loss = self.criterion(self.net(x), y)
            t1 = time.perf_counter()
            forward_took = ahead.taken_s if ahead is not None else 0.0
            if self.comm is not None:
                self.comm.reset()
            if last and hasattr(self.optimizer, "arm"):  # optimizer.shard: its reduce-scatters overlap backward
                self.optimizer.arm()
            (loss / parts).backward()
        t2 = time.perf_counter()
        took = ahead.taken_s if ahead is not None else 0.0  # waits and copies, counted as comm_wait
        handed = self.comm.last_handover if (self.comm is not None and last and self.comm.buckets) else t2
        times["forward"] += t1 - t0 - forward_took
        times["backward"] += handed - t1 - (took - forward_took)
        times["comm_wait"] += t2 - handed + took
        self._span("forward", t0, t1)
        self._span("backward", t1, t2)
        return loss.item()

    def _control(self, loss_sum: torch.Tensor, images: int, wishes: tuple[bool, bool], times: dict) -> StepResult:
        finite = math.isfinite(loss_sum.item())
        rank0 = not self.distributed or dist.get_rank(self.group) == 0
        stop, save = wishes if rank0 else (0, False)
        control = torch.tensor([loss_sum.item() if finite else 0.0, images, 0 if finite else 1, stop, save],
                               dtype=torch.float64)
        if self.distributed:
            dist.all_reduce(control, group=self.group)
        total, n, bad, stop_n, save_n = control.tolist()
        return StepResult(loss=total / max(n, 1) if not bad else math.nan, images=int(n), finite=not bad,
                          stop=int(stop_n), save=save_n > 0, times=times)
