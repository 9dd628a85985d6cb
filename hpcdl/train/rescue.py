"""The just-in-time checkpoint: when a peer is lost, the surviving ranks save the last completed step.

Data parallelism keeps the whole state on every rank: the weights and the optimizer's are replicas, the
sampler's position and each sample's augmentation follow from the step. When a rank or a node is lost, each
survivor holds that state in memory; this module writes it instead of losing everything since the last
periodic checkpoint (Gupta et al., "Just-In-Time Checkpointing", EuroSys 2024, do the same for GPU jobs).
With ``optimizer.shard=true`` no survivor holds the optimizer's state whole: :mod:`hpcdl.train.rescue_shard` makes it.

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
model's buffers that its state dict holds (batch norm's statistics, which the next forward changes before its
exchange; not those registered with ``persistent=False``, which no strict load takes). The weights and the
optimizer's state are read live: nothing changes them outside the lock (an evaluation's swap to Schedule-Free's
averaged weights runs under it too, and the model's part gives the training weights during one) but
``optimizer.shard``'s all-gather into the weights, which a lost rank cuts (said: :mod:`hpcdl.train.rescue_shard`).

How they agree, without the process group (it is what broke) or the rendezvous store (rank 0 serves it, and
rank 0 may be the one lost): through the run folder, which every rank reaches. In ``RUN/jit/START/`` (this
start's own folder, :func:`attempt_name`: a folder of an earlier start is never read as this one's) each
survivor writes its report (rank, completed step, the ranks it found lost) and its RNG streams, then waits a
bounded time for the reports of the ranks it believes alive. The lowest rank of those at the highest step
writes the checkpoint through the start's :class:`~hpcdl.train.checkpoint.Checkpointer`, the owner of every
checkpoint (the same parts, under the lock the update and the periodic writes run under), then ``result.json``;
the others wait for that result (under ``srun --kill-on-bad-exit=1`` the first to exit ends the step), and every
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

import contextlib
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
from hpcdl.runs.folder import RunFolder
from hpcdl.runs.orphan import CLAIM_STALE_S, CLAIM_WAIT_S, after_rescue
from hpcdl.runs.outcome import EXIT_PEER_LOST, read_result
from hpcdl.train.checkpoint import rng_state
from hpcdl.train.leaving import adopt, origin
from hpcdl.train.rescue_shard import compose_parts, describe, load_rank_file, rank_share, sharded
from hpcdl.train.state import Frozen
from hpcdl.utils import atomic_write_text, leave_now

__all__ = ["EXIT_PEER_LOST", "Boundary", "Rescue", "attempt_name", "read_result"]

log = logging.getLogger(__name__)


def attempt_name(master_port: int, store=None, rank: int = 0) -> str:
    """The folder of this start's rescue, unique to the start: the supervisor names its attempts (HPCDL_ATTEMPT,
    unique per start, requeues included); otherwise the job, the Slurm step, the rendezvous port and a token rank 0
    makes at the start and hands the others through the rendezvous ``store``: the first three repeat (mpiexec or
    torchrun with the default port, a requeued job), and a folder of an earlier start read as this one's made every
    later start rescue at once."""
    named = os.environ.get("HPCDL_ATTEMPT")
    if named:
        return named
    base = f"{os.environ.get('SLURM_JOB_ID', 'local')}.{os.environ.get('SLURM_STEP_ID', '0')}.{master_port}"
    if store is None:
        return f"{base}.{_token()}"
    key = f"hpcdl/rescue-start/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # torchrun's store outlives a restart
    if rank == 0:
        store.set(key, f"{base}.{_token()}")
    return store.get(key).decode()


def _token() -> str:
    """When and where this start began: sorts by time; two starts in one second differ by the pid and the random part."""
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}-{os.urandom(3).hex()}"


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
    """One per start, made before the trainer (a loss during start-up is reported too) and given the start's
    :class:`~hpcdl.train.checkpoint.Checkpointer` by :meth:`attach`: its parts (model, optimizer, schedule, sampler,
    counters) and its write, the one every checkpoint goes through."""

    def __init__(self, ctx, run_folder: str):
        self.ctx, self.ckpt = ctx, None
        self.rank, self.world = ctx.rank, ctx.world_size
        self.run_folder = RunFolder(run_folder)
        self.folder = self.run_folder.rescue(attempt_name(ctx.env.master_port, ctx.store, ctx.rank))
        self.lock = threading.RLock()  # the update, the boundary, every write; the rescue takes it and never gives it back
        self.record_samples = self.residuals_lost = False
        self._persistent: set[str] | None = None  # the model's buffers a state dict holds
        self._started = threading.Lock()
        self.follows: int | None = None  # the rank whose own error this rescue follows (hpcdl.train.leaving)
        self.boundary: Boundary | None = None
        self._steps: deque[float] = deque(maxlen=20)  # recent step durations, for the stall bound
        self.heartbeat_s = ctx.heartbeat.interval_s  # the job's heartbeat: what a lost rank's detection takes
        self.created = time.monotonic()
        self._stop = threading.Event()

    def attach(self, ckpt, record_samples: bool = False, residuals_lost: bool = False) -> None:
        """``ckpt``: the start's Checkpointer, made with :attr:`lock`; ``record_samples``: drop the steps after the
        saved one from RUN/samples; ``residuals_lost``: the comm hook's residuals are not in a just-in-time checkpoint."""
        self.ckpt, self.record_samples, self.residuals_lost = ckpt, record_samples, residuals_lost

    # -- the boundary -------------------------------------------------------------------------------------
    def take_boundary(self) -> None:
        """Call under :attr:`lock` after each update (and when the epoch turns)."""
        parts, now = self.ckpt.parts, time.monotonic()
        progress, model = parts["counters"], parts["model"].model
        if self.boundary is not None and progress.step != self.boundary.step:
            self._steps.append(now - self.boundary.at)
        if self._persistent is None:  # a buffer registered with persistent=False is in no state dict: not saved
            self._persistent = set(model.state_dict())
        self.boundary = Boundary(progress.step, progress.state_dict(), parts["sampler"].state_dict(), rng_state(),
                                 {name: b.detach().clone() for name, b in model.named_buffers()
                                  if name in self._persistent}, now)

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

    def hold(self) -> None:
        """No rescue from here on (:func:`hpcdl.train.leaving.leaving_together`); one under way ends the process."""
        if not self._started.acquire(blocking=False):
            threading.Event().wait()
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
    def run(self, reason: str, status: int = EXIT_PEER_LOST, why: str = "a peer lost or stuck") -> None:
        """Save what this rank can, agree with the other survivors, exit with ``status`` (EXIT_PEER_LOST; a rank
        whose input failed, EXIT_BAD_INPUT: the supervisor does not restart it). Never returns; a second caller
        (the other thread) waits here until the process ends."""
        if not self._started.acquire(blocking=False):
            threading.Event().wait()
        self._stop.set()
        self.lock.acquire()  # the training thread is blocked in a collective or between steps: not in an update
        reason, status, why = self._adopt(reason, status, why)  # a rank that stopped on its error broke the collective
        try:
            reason, status, why = self._rescue(reason, status, why)
        except CheckpointError as exc:  # leaving anyway: the supervisor restarts from the newest one on disk
            log.error("rank %d: the just-in-time checkpoint failed: %s", self.rank, exc)
        except Exception:
            log.exception("rank %d: the just-in-time checkpoint failed", self.rank)
        result = read_result(self.folder)
        saved = (f"step {result['step']} in {result['checkpoint']}" if result and result["checkpoint"] else
                 "none: the run resumes from its newest checkpoint") if result else f"see {self.folder}"
        log.error("rank %d stops (status %d), %s: %s; just-in-time checkpoint: %s", self.rank, status, why,
                  reason.split("; rank ")[0], saved)
        if status == EXIT_PEER_LOST:
            after_rescue(self.folder, self.rank)  # a supervised step whose supervisor is gone: requeue the job
        leave_now(status)

    def _adopt(self, reason: str, status: int, why: str) -> tuple[str, int, str]:
        """A rank's own error behind this rescue (:func:`~hpcdl.train.leaving.origin`: its word, or its failed read)."""
        found = origin(self.folder) if self.follows is None and status == EXIT_PEER_LOST else None
        if found is None:
            return reason, status, why
        self.follows = found["rank"]
        return adopt(found, reason, status, why, self.folder)

    def _rescue(self, reason: str, status: int = EXIT_PEER_LOST,
                why: str = "a peer lost or stuck") -> tuple[str, int, str]:
        b = self.boundary
        lost = self.ctx.heartbeat.recent(fresh_s=15.0)
        log.error("rank %d: %s; the survivors save step %s (RUN/jit/%s)", self.rank, reason,
                  b.step if b else "none", os.path.basename(self.folder))
        os.makedirs(self.folder, exist_ok=True)
        mine = {"rank": self.rank, "step": b.step if b else None, "reason": reason, "lost": lost,
                "node": os.environ.get("SLURMD_NODENAME"), "host": socket.gethostname(), "pid": os.getpid(),
                "slurm_step": os.environ.get("SLURM_STEP_ID"), "time": time.time(), "status": status,
                "follows": self.follows}
        if b is not None:
            share = rank_share(self.ckpt.parts if self.ckpt else {})  # optimizer.shard: its tensors, weights and state
            _save(os.path.join(self.folder, f"rank-{self.rank:05d}.pt"), {"step": b.step, "rng": b.rng, **share})
        atomic_write_text(self.report_path(self.rank), json.dumps(mine) + "\n")
        reports = self._wait_for_reports(lost, status)
        reason, status, why = self._adopt(reason, status, why)  # a word written while this rank waited
        steps = [r["step"] for r in reports.values() if r["step"] is not None]
        best = max(steps) if steps else None
        writer = min(r for r, rep in reports.items() if rep["step"] == best and not rep.get("left"))
        if writer == self.rank and self._claim():
            with _touching(os.path.join(self.folder, "writer")):
                self._write(best, reports, lost)
        else:
            self._await_writer(writer)
        return reason, status, why

    def _await_writer(self, writer: int) -> None:
        """Wait for the writer's result.json before leaving: under ``srun --kill-on-bad-exit=1`` the first rank to
        exit non-zero ends the step, the writer in the middle of its write. Bounded: while the writer's claim is
        touched (every 2 s while it writes), and :data:`CLAIM_WAIT_S` for a claim that never comes."""
        claim, since = os.path.join(self.folder, "writer"), time.monotonic()
        while read_result(self.folder) is None:
            try:
                if time.time() - os.path.getmtime(claim) > CLAIM_STALE_S:
                    log.error("rank %d: the writer's claim %s is %.0f s old: the writer (rank %d?) is gone, leaving "
                              "without its result", self.rank, claim, time.time() - os.path.getmtime(claim), writer)
                    return
            except OSError:  # no claim yet
                if time.monotonic() - since > CLAIM_WAIT_S:
                    log.error("rank %d: no writer claimed %s within %.0f s (rank %d was to write): leaving",
                              self.rank, self.folder, CLAIM_WAIT_S, writer)
                    return
            time.sleep(0.2)

    def report_path(self, rank: int) -> str:
        return os.path.join(self.folder, f"report-{rank:05d}.json")

    def _wait_for_reports(self, lost: list[int] | None, status: int = EXIT_PEER_LOST) -> dict[int, dict]:
        """Every report the ranks believed alive write within the bound, what was there at the deadline otherwise.
        After a lost rank, the survivors that were not its peers in the failed collective join after their own
        stall bound and a heartbeat probe. After a timeout with every heartbeat alive (a rank stuck), the others
        timed out within about a step of each other, and the stuck one will not report. After a rank's input failed,
        the others are alive and join when their watch finds its report, after their stall bound."""
        gone = set(lost) if lost is not None else {0}
        expected = set(range(self.world)) - gone
        bound = self.stall_s() + 4 * self.heartbeat_s + 5.0 if gone or status != EXIT_PEER_LOST else self.heartbeat_s
        deadline = time.monotonic() + bound
        while True:
            paths = glob.glob(os.path.join(glob.escape(self.folder), "report-*.json"))
            reports = {int(r["rank"]): r for r in map(_read_json, paths) if r}  # None: unreadable
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
        started = time.monotonic()
        survivors = sorted(r for r, rep in reports.items() if not rep.get("left"))  # left: its word, not its state
        files = {r: load_rank_file(os.path.join(self.folder, f"rank-{r:05d}.pt")) for r in survivors}  # read once
        rngs: list = [None] * self.world
        for r in survivors:  # a survivor of an earlier step: its streams seeded afresh like a lost rank's
            if reports[r]["step"] == step and isinstance(files[r], Exception):
                log.warning("rescue: rank %d's file unreadable (%s); its RNG streams are seeded afresh", r, files[r])
            elif reports[r]["step"] == step:
                rngs[r] = files[r]["rng"]
        missing, account, wrote = [r for r in range(self.world) if rngs[r] is None], None, False
        # the periodic checkpoint of this very step, on disk (a write waited for); none without a step in this start
        path = self.run_folder.checkpoint(step) if step and self.ckpt is not None and self.ckpt.has(step) else None
        if step and self.ckpt is not None and path is None:
            parts = self._boundary_parts(rngs)
            if sharded(self.ckpt.parts):  # optimizer.shard: the survivors' shares, the newest checkpoint's state
                parts, account = compose_parts(self.ckpt, parts, files, {r: reports[r]["step"] for r in survivors}, step)
            state = parts and self.ckpt.compose(parts, rank_states=False, jit={
                "survivors": survivors, "lost": lost if lost is not None else [0], "rng_lost": missing,
                "residuals_lost": self.residuals_lost, "optimizer_state": account})
            path, wrote = (self.ckpt.write_locked(step, state, "just in time"), True) if state else (None, False)
        refused = account is not None and path is None  # optimizer.shard: the resume cuts the records to its own
        if self.record_samples and step is not None and not refused:
            self.run_folder.drop_samples_after(step)
        where = {r: self.ctx.heartbeat.who(r) for r in lost} if lost else {}
        result = {"step": None if refused else step, "checkpoint": path, "written": wrote, "writer": self.rank, "survivors": survivors,
                  "lost": lost if lost is not None else [0], "rank0_lost": lost is None, "rng_lost": missing,
                  "lost_where": where, "reports": [reports[r] for r in sorted(reports)],
                  "optimizer_state": account, "write_s": round(time.monotonic() - started, 3), "time": time.time()}
        atomic_write_text(os.path.join(self.folder, "result.json"), json.dumps(result, indent=1) + "\n")
        log.error("rank %d: just-in-time checkpoint of step %s: %s (survivors %s; lost %s)", self.rank, step,
                  (f"written to {path}" if wrote else f"the periodic one, {path}" if path else "none (%s): the run resumes "
                   "from its newest checkpoint" % ("a lost rank's optimizer state is in no checkpoint yet" if refused
                                                   else "no step trained in this start")) + describe(account),
                  _ranges(survivors), result["lost"])

    def _boundary_parts(self, rngs: list) -> dict:
        """The parts that the boundary holds, for :meth:`Checkpointer.compose`; the weights and the optimizer's and
        schedule's states are read live (nothing but a sharded all-gather changes them outside the lock, which the
        rescue holds)."""
        b = self.boundary
        return {"model": _AtBoundary(self.ckpt.parts["model"], b.buffers), "counters": Frozen(b.counters),
                "sampler": Frozen(b.sampler), "rng": Frozen(rngs)}


class _AtBoundary:
    """The model's part with the buffers the boundary kept (batch norm's statistics, which the next forward changes
    before its exchange)."""

    def __init__(self, model_part, buffers: dict):
        self.part, self.buffers = model_part, buffers

    def state_dict(self) -> dict:
        return {**self.part.state_dict(), **self.buffers}

    def eval_state_dict(self) -> dict | None:
        averaged = getattr(self.part, "eval_state_dict", lambda: None)()
        return {**averaged, **self.buffers} if averaged is not None else None


@contextlib.contextmanager
def _touching(path: str):
    """Touch ``path`` every 2 s inside the block: the other survivors wait while it is fresh."""
    done = threading.Event()

    def touch():
        while not done.wait(2.0):
            with contextlib.suppress(OSError):
                os.utime(path)
    thread = threading.Thread(target=touch, name="hpcdl-rescue-writing", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def _read_json(path: str) -> dict | None:
    return read_result(os.path.dirname(path), os.path.basename(path))


def _save(path: str, obj) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _ranges(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{len(ranks)} ranks ({ranks[0]}-{ranks[-1]})"
