"""The just-in-time checkpoint: when a peer is lost, the surviving ranks save the last completed step.

Data parallelism keeps the whole state on every rank: the weights and the optimizer's are replicas, the
sampler's position and each sample's augmentation follow from the step. When a rank or a node is lost, each
survivor holds that state in memory; this module writes it instead of losing everything since the last
periodic checkpoint (Gupta et al., "Just-In-Time Checkpointing", EuroSys 2024, do the same for GPU jobs).

Which step. A step updates the weights only after its control all-reduce returned (:mod:`hpcdl.train.step`:
micro-batches with the bucket all-reduces, the control all-reduce, then the update), whatever the comm hook
or the accumulation (a micro-batch under ``no_sync`` exchanges nothing). A collective that returned on one
rank had every rank's contribution, so a survivor that completed step s + 1 holds the state every rank would
have had after it; one whose collective failed holds step s. No collective can make the two agree (the lost
rank may have sent its last message to one survivor and not the next), so the survivors take the **highest**
completed step any of them reports, and one rank that completed it writes it: at most the step in flight is
trained again.

What each survivor keeps. The update and its bookkeeping run under :attr:`Rescue.lock`; right after, the
*boundary* is taken: the step and epoch counters, the sampler's position, this rank's RNG streams and the
model's buffers (batch norm's statistics, which the next forward changes before its exchange). The
weights and the optimizer's state are read live: nothing changes them outside the lock.

How they agree, without the process group (it is what broke) or the rendezvous store (rank 0 serves it, and
rank 0 may be the one lost): through the run folder, which every rank reaches. In ``RUN/jit/ATTEMPT/`` each
survivor writes its report (rank, completed step, the ranks it found lost) and its RNG streams, then waits a
bounded time for the reports of the ranks it believes alive. The lowest rank of those at the highest step
writes the checkpoint, as every periodic one (temporary name, fsync, rename) and ``result.json``; every
survivor exits with :data:`EXIT_PEER_LOST`, which the supervisor (:mod:`hpcdl.launch.supervisor`) reads.

How it starts. A collective that fails raises in the training thread (gloo's reset connection, the MPI and
oneCCL groups' watchdog): :meth:`Rescue.run` there. A collective that hangs (a stopped rank, a peer that
died while this rank waits on a third) does not return, so a watch thread looks when no step has completed
for :meth:`Rescue.stall_s`: another rank's report in the folder, or (once a step of this start completed) a
rank whose heartbeat stopped, starts the rescue from that thread while the training thread stays blocked. A
store that does not answer must fail two probes, 10 s apart: under start-up's load at 32 ranks on 2 cores one
probe timed out while rank 0 was alive.

What is lost: the lost ranks' RNG streams (their successors are seeded by the start's rule) and every rank's
chunk_sparse residuals (the failed step may have folded its gradients into some buckets' residuals; they
restart from zero, as after a checkpoint from an older hpcdl).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import socket
import statistics
import threading
import time
from collections import deque

import torch

from hpcdl.errors import CheckpointError
from hpcdl.train.checkpoint import CheckpointManager, rng_state
from hpcdl.train.outcome import EXIT_PEER_LOST, read_result
from hpcdl.train.orphan import after_rescue
from hpcdl.utils import atomic_write_text, leave_now

__all__ = ["EXIT_PEER_LOST", "Boundary", "Rescue", "attempt_name", "read_result"]

log = logging.getLogger(__name__)

def attempt_name(master_port: int) -> str:
    """The folder of this start's rescue: the supervisor names its attempts (HPCDL_ATTEMPT); otherwise the job,
    the Slurm step and the rendezvous port, which every rank of one start shares."""
    named = os.environ.get("HPCDL_ATTEMPT")
    if named:
        return named
    return f"{os.environ.get('SLURM_JOB_ID', 'local')}.{os.environ.get('SLURM_STEP_ID', '0')}.{master_port}"


@dataclasses.dataclass(slots=True)
class Boundary:
    """What this rank held after its last completed step (see the module's docstring)."""

    step: int
    counters: dict
    sampler: dict
    rng: dict
    buffers: dict[str, torch.Tensor]
    at: float  # time.monotonic() of the snapshot


class Rescue:
    """One per start, made before the trainer (a loss during start-up is reported too) and given it by
    :meth:`attach`: its ``parts`` (model, optimizer, schedule), ``data.sampler``, ``progress``, ``cfg``,
    ``dir``, ``last_save_step`` and :meth:`checkpoint_header`."""

    def __init__(self, ctx, run_folder: str):
        self.ctx, self.trainer = ctx, None
        self.rank, self.world = ctx.rank, ctx.world_size
        self.folder = os.path.join(run_folder, "jit", attempt_name(ctx.env.master_port))
        self.lock = threading.Lock()  # the update and the boundary; the rescue takes it and never gives it back
        self._started = threading.Lock()
        self.boundary: Boundary | None = None
        self._steps: deque[float] = deque(maxlen=20)  # recent step durations, for the stall bound
        self.heartbeat_s = ctx.heartbeat.interval_s  # the job's heartbeat: what a lost rank's detection takes
        self.created = time.monotonic()
        self._stop = threading.Event()

    def attach(self, trainer) -> None:
        self.trainer = trainer

    # -- the boundary -------------------------------------------------------------------------------------
    def take_boundary(self) -> None:
        """Call under :attr:`lock` after each update (and when the epoch turns)."""
        t = self.trainer
        now = time.monotonic()
        if self.boundary is not None and t.progress.step != self.boundary.step:
            self._steps.append(now - self.boundary.at)
        self.boundary = Boundary(t.progress.step, t.progress.state_dict(), t.data.sampler.state_dict(), rng_state(),
                                 {name: b.detach().clone() for name, b in t.parts.model.named_buffers()}, now)

    def stall_s(self, report: bool = False) -> float:
        """How long without a completed step before the watch thread looks for a lost peer: three median
        steps, and at least five heartbeat intervals before it probes the heartbeats (``report``: one before
        it looks for another rank's report, which a rank that saw the failure writes at once)."""
        typical = statistics.median(self._steps) if self._steps else 0.0
        return max(3 * typical, (1 if report else 5) * self.heartbeat_s)

    # -- the watch thread ---------------------------------------------------------------------------------
    def start_watch(self) -> None:
        threading.Thread(target=self._look, name="hpcdl-rescue-watch", daemon=True).start()

    def stop_watch(self) -> None:
        self._stop.set()

    def _look(self) -> None:
        probed, unreachable = 0.0, 0
        while not self._stop.wait(0.5):
            since = self.boundary.at if self.boundary is not None else self.created
            now = time.monotonic()
            if now - since < self.stall_s(report=True):
                continue
            if self._others_reported():  # a stat of one folder, only while no step completes
                self.run("another rank reported a lost peer (see its report in " + self.folder + ")")
            # The heartbeats from the start on (a stall of start-up is a stall too: its first step may take
            # minutes, and the heartbeats beat through it on their own thread), at most every 10 s and two of
            # them (rank 0's and the next rank's: Heartbeat.watch), so that rank 0's store sees no more requests.
            if now - since < self.stall_s() or now - probed < 10.0:
                continue
            probed = now
            lost = self.ctx.heartbeat.watch()
            unreachable = unreachable + 1 if lost is None else 0
            # a store that does not answer in time may be busy (start-up's rendezvous loads it most): ask again
            if lost is None and unreachable < (2 if self._steps else 3):
                continue
            if (lost is None or lost) and not self._stop.is_set():
                self.run(self._describe(lost) + f"; no step completed for {time.monotonic() - since:.0f} s")

    def _others_reported(self) -> bool:
        return bool(glob.glob(os.path.join(glob.escape(self.folder), "report-*.json")))

    def _describe(self, lost: list[int] | None) -> str:
        if lost is None:
            return "rank 0 was lost (the rendezvous store it served no longer answers)"
        names = "; ".join(f"rank {r} ({self.ctx.heartbeat.who(r)})" for r in lost)
        return f"lost {names}: heartbeat stopped"

    # -- the rescue ---------------------------------------------------------------------------------------
    def run(self, reason: str) -> None:
        """Save what this rank can, agree with the other survivors, exit with EXIT_PEER_LOST. Never returns;
        a second caller (the other thread) waits here until the process ends."""
        if not self._started.acquire(blocking=False):
            threading.Event().wait()
        self._stop.set()
        self.lock.acquire()  # the training thread is blocked in a collective or between steps: not in an update
        try:
            self._rescue(reason)
        except CheckpointError as exc:  # leaving anyway: the supervisor restarts from the newest one on disk
            log.error("rank %d: the just-in-time checkpoint failed: %s", self.rank, exc)
        except Exception:
            log.exception("rank %d: the just-in-time checkpoint failed", self.rank)
        result = read_result(self.folder)
        saved = (f"step {result['step']} in {result['checkpoint']}" if result and result["checkpoint"] else
                 "none: the run resumes from its newest checkpoint") if result else f"see {self.folder}"
        log.error("rank %d stops (status %d), a peer lost or stuck: %s; just-in-time checkpoint: %s", self.rank,
                  EXIT_PEER_LOST,
                  reason.split("; rank ")[0], saved)
        after_rescue(self.folder, self.rank)  # a supervised step whose supervisor is gone: requeue the job
        leave_now(EXIT_PEER_LOST)

    def _rescue(self, reason: str) -> None:
        b = self.boundary
        lost = self.ctx.heartbeat.recent(fresh_s=15.0)
        log.error("rank %d: %s; the survivors save step %s (RUN/jit/%s)", self.rank, reason,
                  b.step if b else "none", os.path.basename(self.folder))
        os.makedirs(self.folder, exist_ok=True)
        mine = {"rank": self.rank, "step": b.step if b else None, "reason": reason, "lost": lost,
                "node": os.environ.get("SLURMD_NODENAME"), "host": socket.gethostname(), "pid": os.getpid(),
                "slurm_step": os.environ.get("SLURM_STEP_ID"), "time": time.time()}
        if b is not None:
            _save(os.path.join(self.folder, f"rank-{self.rank:05d}.pt"), {"step": b.step, "rng": b.rng})
        atomic_write_text(self._report_path(self.rank), json.dumps(mine) + "\n")
        reports = self._wait_for_reports(lost)
        steps = [r["step"] for r in reports.values() if r["step"] is not None]
        best = max(steps) if steps else None
        writer = min(r for r, rep in reports.items() if rep["step"] == best)
        if writer == self.rank and self._claim():
            self._write(best, reports, lost)

    def _report_path(self, rank: int) -> str:
        return os.path.join(self.folder, f"report-{rank:05d}.json")

    def _wait_for_reports(self, lost: list[int] | None) -> dict[int, dict]:
        """Every report the ranks believed alive write within the bound, what was there at the deadline otherwise.
        After a lost rank, the survivors that were not its peers in the failed collective join after their own
        stall bound and a heartbeat probe. After a timeout with every heartbeat alive (a rank stuck), the others
        timed out within about a step of each other, and the stuck one will not report."""
        gone = set(lost) if lost is not None else {0}
        expected = set(range(self.world)) - gone
        bound = self.stall_s() + 4 * self.heartbeat_s + 5.0 if gone else self.heartbeat_s
        deadline = time.monotonic() + bound
        while True:
            reports = {}
            for path in glob.glob(os.path.join(glob.escape(self.folder), "report-*.json")):
                try:
                    with open(path) as f:
                        rep = json.load(f)
                except (OSError, ValueError):
                    continue  # being renamed into place
                reports[int(rep["rank"])] = rep
            if expected <= reports.keys() or time.monotonic() > deadline:
                return reports
            time.sleep(0.2)

    def _claim(self) -> bool:
        """One writer, also when two survivors saw different report sets at their deadlines."""
        try:
            os.close(os.open(os.path.join(self.folder, "writer"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def _write(self, step: int | None, reports: dict[int, dict], lost: list[int] | None) -> None:
        t = self.trainer
        started = time.monotonic()
        survivors = sorted(reports)
        rngs: list = [None] * self.world
        for r in survivors:
            if reports[r]["step"] != step:
                continue  # its streams are those of an earlier step: seeded afresh like a lost rank's
            path = os.path.join(self.folder, f"rank-{r:05d}.pt")
            try:
                rngs[r] = torch.load(path, map_location="cpu", weights_only=True)["rng"]
            except Exception as exc:
                log.warning("rescue: %s unreadable (%s); rank %d's RNG streams are seeded afresh", path, exc, r)
        missing = [r for r in range(self.world) if rngs[r] is None]
        manager = CheckpointManager(os.path.join(t.dir, "checkpoints"), t.cfg.checkpoint.keep) if t else None
        if not step:  # no step in this start (lost during start-up), or none trained yet
            path, wrote = None, False
        elif t.last_save_step == step and os.path.exists(manager.path(step)):
            path, wrote = manager.path(step), False  # the periodic checkpoint of this very step is on disk
        else:
            path, wrote = manager.save(step, self._state(step, rngs, survivors, missing, lost)), True
        if t is not None and t.cfg.loop.record_samples and step is not None:
            _drop_samples_after(os.path.join(t.dir, "samples"), step)
        where = {r: self.ctx.heartbeat.who(r) for r in lost} if lost else {}
        result = {"step": step, "checkpoint": path, "written": wrote, "writer": self.rank, "survivors": survivors,
                  "lost": lost if lost is not None else [0], "rank0_lost": lost is None, "rng_lost": missing,
                  "lost_where": where,
                  "reports": [reports[r] for r in survivors], "write_s": round(time.monotonic() - started, 3),
                  "time": time.time()}
        atomic_write_text(os.path.join(self.folder, "result.json"), json.dumps(result, indent=1) + "\n")
        log.error("rank %d: just-in-time checkpoint of step %s: %s (survivors %s; lost %s)", self.rank, step,
                  f"written to {path}" if wrote else f"the periodic one, {path}" if path else
                  "none (no step trained in this start): the run resumes from its newest checkpoint",
                  _ranges(survivors), result["lost"])

    def _state(self, step: int, rngs: list, survivors: list[int], missing: list[int], lost) -> dict:
        t, b = self.trainer, self.boundary
        model = t.parts.model.state_dict()
        model.update(b.buffers)
        state = t.checkpoint_header()
        state.update({"model": model, "optimizer": t.parts.optimizer.state_dict(),
                      "schedule": t.parts.schedule.state_dict(), "sampler": b.sampler, "counters": b.counters,
                      "rng": rngs, "rank_states": False,
                      "jit": {"survivors": survivors, "lost": lost if lost is not None else [0], "rng_lost": missing,
                              "residuals_lost": t.cfg.sync.hook == "chunk_sparse"}})
        return state


def _drop_samples_after(folder: str, step: int) -> None:
    """loop.record_samples: every rank writes a step's samples before its exchange, so a lost rank's record holds
    each step it took part in, and every record may hold the step in flight: keep the steps up to ``step``.
    Each file is replaced (a survivor still appending writes to the old one)."""
    for path in glob.glob(os.path.join(glob.escape(folder), "rank*.txt")):
        with open(path) as f:
            kept = [line for line in f if len(line.split()) < 3 or int(line.split()[2]) <= step]
        atomic_write_text(path, "".join(kept))


def _save(path: str, obj) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _ranges(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{len(ranks)} ranks ({ranks[0]}-{ranks[-1]})"
