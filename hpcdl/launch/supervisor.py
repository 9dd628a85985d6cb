"""``hpcdl supervise``: inside the allocation, a lost rank or node costs a restart, not a queue wait.

The batch script of ``hpcdl sbatch --spares K`` (or ``--max-restarts R``) runs this on the job's first node,
one process and no daemon. The job holds N + K nodes and keeps them when one fails (``#SBATCH --no-kill``).
The supervisor starts the training step on N of them, and when the step ends without finishing:

1. It reads what the surviving ranks wrote (:mod:`hpcdl.train.rescue`): the lost ranks, the Slurm node
   each ran on (from the heartbeat's record), the step they saved just in time. A step whose survivors
   finished that rescue but whose lost node cannot answer is ended here (``scancel --signal=KILL`` of the
   step, then srun itself): a dead node never reports its tasks' end.
2. It asks each suspect node's slurmd for a connection (a refused or unanswered one: the node is lost, at
   once; srun itself retries a refused launch for Slurm's ``MessageTimeout``, 10 s by default), then for a
   one-task step (``srun -w NODE true``, bounded): a node that answers
   was a rank's failure (kill -9, the OOM killer, a stopped process), and the next step uses it again; one
   that does not is dropped from the list and a spare takes its place; with none left the step goes on
   fewer nodes, the largest count whose ranks divide the global batch (a resume keeps the global batch).
3. It starts the step again, which resumes from the newest checkpoint: the just-in-time one.

A spare is probed before it is used: at the supervisor's start, each spare runs the ranks' Python importing
hpcdl's trainer (bounded); one that fails is skipped and named. A start that fails before its first step
with a rank's node named (srun's report of a task's exit, or the rescue's lost ranks) counts against that node,
and a node on which :data:`FAILED_STARTS` starts failed is not used again. A step on which no rank reports
is ended by a watchdog: a rank that failed in start-up while the others wait for it (after
``startup_grace_s``), or no record in ``train.jsonl`` for the bound the ranks' own timeouts give (``_stuck``).
Each step's rescue folder is named for the job, its start (``SLURM_RESTART_COUNT``: a requeue keeps the job
id) and the attempt, never one already there. Every 2 s the supervisor rewrites ``RUN/supervisor.alive``
(:mod:`hpcdl.runs.orphan`): when the first node is lost with the supervisor on it, the survivors' rescue finds
the beat stopped and requeues the job instead of leaving its allocation idle.

Each restart is logged with its cause, the nodes involved and its cost, and appended to
``RUN/supervisor.json``. After ``max_restarts`` restarts the next failure ends the job with status 1 and the
newest checkpoint named (``--max-restarts`` is at least ``--spares`` by default). Steps are started with
``--overlap``: a step whose node died is never confirmed ended by Slurm (until the node is declared down,
minutes later) and would otherwise hold the CPUs of the survivors' nodes. The requeue path (the time limit's signal, preemption) is the trainer's, as without
the supervisor.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

from hpcdl.distributed.ranks.hostlist import expand_hostlist
from hpcdl.errors import LaunchError
from hpcdl.launch.nodes import TASK_EXIT, fit_nodes, lost_nodes, steps_named
from hpcdl.launch.probe import python_failures, unanswering
from hpcdl.launch.progress import StepLog, first_step_after
from hpcdl.runs.folder import RunFolder
from hpcdl.runs.orphan import Beat
from hpcdl.runs.orphan import ENV as BEAT_ENV
from hpcdl.runs.outcome import EXIT_BAD_INPUT, read_result
from hpcdl.utils import atomic_write_text

__all__ = ["Supervisor", "from_slurm"]

log = logging.getLogger("hpcdl.supervise")

BAD_INPUT = EXIT_BAD_INPUT  # the trainer refused its input, or could not read it: restarting cannot help
PEER_LOST = 4  # a rank's rescue (hpcdl.runs.outcome.EXIT_PEER_LOST)
FAILED_STARTS = 2  # a node on which this many starts failed in start-up is not used again


@dataclasses.dataclass(kw_only=True)
class Supervisor:
    rank_command: list[str]  # what srun starts on every rank, e.g. python -m hpcdl train PRESET --set ...
    run_dir: str
    global_batch: int
    nodes: list[str]  # the allocation's, in Slurm's order
    tasks_per_node: int
    spares: int = 0
    max_restarts: int = 3
    cpus_per_task: int | None = None
    probe_timeout_s: float = 10.0  # a node that cannot start a one-task step in this long is lost
    grace_s: float = 2.0  # after the survivors' rescue, how long srun may take to end by itself
    rescue_timeout_s: float = 300.0  # after the first report, how long the rescue may take before the step is ended
    spare_probe_s: float = 120.0  # a spare whose Python cannot import hpcdl's trainer in this long is skipped
    startup_grace_s: float = 10.0  # after a rank failed in start-up, how long the step may take to end by itself
    # the watchdog: a start with no record in train.jsonl for startup_s + stall_s, or a running one with none for
    # max(2 x stall_s, 3 x its longest gap between records), is ended and restarted (its ranks hang unreported)
    startup_s: float = 600.0  # the ranks' loop.startup_timeout_s
    stall_s: float = 300.0  # the ranks' loop.timeout_s
    max_requeues: int = 20  # checkpoint.max_requeues: the beat tells a rank that finds the supervisor gone
    job: str = dataclasses.field(default_factory=lambda: os.environ.get("SLURM_JOB_ID", "local"))
    events: list[dict] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.spares < 0 or self.max_restarts < 0:
            raise LaunchError(f"spares={self.spares} and max_restarts={self.max_restarts} must be >= 0")
        if self.spares >= len(self.nodes):
            raise LaunchError(f"--spares {self.spares} leaves no node to train on: the job has {len(self.nodes)} "
                              f"({','.join(self.nodes)}); ask for more nodes or fewer spares")
        self.active = self.nodes[:len(self.nodes) - self.spares]
        self.spare = self.nodes[len(self.nodes) - self.spares:]
        self.lost: list[str] = []
        self.skipped: dict[str, str] = {}  # spares whose Python could not start, with what it said
        self.failed_starts: collections.Counter[str] = collections.Counter()  # per node, across attempts
        self.requeues = int(os.environ.get("SLURM_RESTART_COUNT") or 0)  # this start of the job: 0, then each requeue
        self._pool = concurrent.futures.ThreadPoolExecutor(2)  # the probes that run while a step runs or ends
        self._probing = None
        self._spares_checked = None
        self._task_exits: list[tuple[str, str, float]] = []  # (node, what srun said, when) of the step in flight
        self._stuck_why: str | None = None
        self._ended_at: float | None = None  # when the supervisor ended the step in flight (time.monotonic())
        self._beat_path = os.path.join(self.run_dir, "supervisor.alive")

    # -- the loop -------------------------------------------------------------------------------------------
    def run(self) -> int:
        log.info("supervising job %s (start %d: requeued %d time(s)): training on %d node(s) %s, spares %s, at most "
                 "%d restart(s); run folder %s", self.job, self.requeues + 1, self.requeues, len(self.active),
                 ",".join(self.active), ",".join(self.spare) or "none", self.max_restarts, self.run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        beat = Beat(self._beat_path, {"job": self.job, "node": os.environ.get("SLURMD_NODENAME"),
                                      "host": socket.gethostname(), "pid": os.getpid(),
                                      "max_requeues": self.max_requeues}).start()
        if self.spare:  # before any is needed: a spare that answers srun but cannot start the ranks' Python
            self._spares_checked = self._pool.submit(self._probe_python, list(self.spare))
        try:
            return self._loop()
        finally:
            beat.stop()

    def _loop(self) -> int:
        attempt, restarts = 0, 0
        while True:
            attempt += 1
            count = fit_nodes(len(self.active), self.tasks_per_node, self.global_batch)
            if count == 0:
                return self._give_up(f"no count of the {len(self.active)} node(s) left has ranks that divide the "
                                     f"global batch {self.global_batch}")
            use = sorted(self.active, key=self.nodes.index)[:count]
            name = self._attempt_name(attempt)
            started = time.time()
            self._mark_recovery(started)
            code, result = self._run_step(use, name)
            ended = time.time()
            finished = self._summary_since(started)
            if finished is not None:
                log.info("training ended: %s after %d restart(s)", finished["outcome"], restarts)
                self._write(final=finished["outcome"])
                return 0 if finished["outcome"] in ("finished", "requeued") else 3
            failed = result and any(r.get("status") == BAD_INPUT for r in result.get("reports", []))
            if (code == BAD_INPUT and result is None) or failed:  # a restart would meet the same input
                log.error("the training step %s (status 2): not restarted%s",
                          "could not read its input" if failed else "refused its input",
                          f"; step {result['step']} saved in {result['checkpoint']}" if failed else "")
                self._write(final="refused", why="input failed" if failed else "input refused")
                return BAD_INPUT
            trained = first_step_after(RunFolder(self.run_dir).steps_log, started) is not None
            event = self._diagnose(code, result, use, started, ended, trained)
            self.events.append(event)
            if restarts >= self.max_restarts:
                return self._give_up(f"{event['cause']}; {restarts} restart(s) done, --max-restarts "
                                     f"{self.max_restarts}")
            restarts += 1
            event["restart"] = restarts
            log.warning("restart %d of %d: %s; nodes now %s", restarts, self.max_restarts, event["what"],
                        ",".join(sorted(self.active, key=self.nodes.index)))
            self._write()

    def _attempt_name(self, attempt: int) -> str:
        """The rescue folder's name for this step: the job, its start (a requeue keeps the job id) and the attempt;
        a folder already there (a job id Slurm gave again) is never read as this step's."""
        name = f"{self.job}-r{self.requeues}-a{attempt}"
        if os.path.exists(RunFolder(self.run_dir).rescue(name)):
            name += f"-{secrets.token_hex(3)}"
        return name

    def _run_step(self, use: list[str], name: str) -> tuple[int, dict | None]:
        """srun the ranks on ``use``; (its exit status, the rescue's result or None)."""
        cpus = [f"--cpus-per-task={self.cpus_per_task}"] if self.cpus_per_task else []
        argv = ["srun", "--overlap", "--kill-on-bad-exit=0", f"--job-name=hpcdl-{name}", f"--nodes={len(use)}",
                f"--ntasks={len(use) * self.tasks_per_node}", f"--ntasks-per-node={self.tasks_per_node}",
                f"--nodelist={','.join(use)}", *cpus, *self.rank_command]
        log.info("step %s: %d rank(s) on %s", name, len(use) * self.tasks_per_node, ",".join(use))
        self._task_exits, self._ended_at = [], None
        proc = subprocess.Popen(argv, env={**os.environ, "HPCDL_ATTEMPT": name, BEAT_ENV: self._beat_path},
                                stderr=subprocess.PIPE)
        pump = threading.Thread(target=self._pump, args=(proc.stderr,), name="hpcdl-srun-stderr", daemon=True)
        pump.start()
        folder = RunFolder(self.run_dir).rescue(name)
        first_report = done_at = None
        self._probing = None
        progress = StepLog(RunFolder(self.run_dir).steps_log)
        while proc.poll() is None:
            time.sleep(0.25)
            if first_report is None and os.path.isdir(folder) and any(f.startswith("report-")
                                                                       for f in os.listdir(folder)):
                first_report = time.monotonic()
            stuck = self._stuck(progress) if first_report is None else None
            if stuck:
                log.warning("step %s: %s; ending it", name, stuck)
                self._stuck_why = stuck
                self._end_step(proc, folder, name)
                break
            result = read_result(folder) if done_at is None else None
            if result is not None:  # ask the suspect nodes now, while the step ends
                done_at = time.monotonic()
                suspects = lost_nodes(result, use, self.tasks_per_node) or list(use)
                self._probing = (suspects, self._pool.submit(self._probe, suspects))
            late = (done_at is not None and time.monotonic() - done_at > self.grace_s) or \
                (first_report is not None and time.monotonic() - first_report > self.rescue_timeout_s)
            if late:
                self._end_step(proc, folder, name)
                break
        code = proc.wait()
        pump.join(timeout=5)
        return code, read_result(folder)

    def _pump(self, stream) -> None:
        """srun's standard error to the job's, and each task's exit that srun reports, with its node."""
        for line in iter(stream.readline, b""):
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
            said = TASK_EXIT.match(line.decode(errors="replace").strip())
            if said and said.group(2) not in ("Exited with exit code 0", f"Exited with exit code {PEER_LOST}"):
                self._task_exits.append((said.group(1), said.group(2), time.monotonic()))
        stream.close()

    def _stuck(self, progress: StepLog) -> str | None:
        """Why the step in flight, which no rank has reported on, is to be ended now; None to go on waiting."""
        idle, now = progress.idle_s(), time.monotonic()
        failed = [] if progress.grew else self._task_exits
        if failed and now - failed[0][2] > self.startup_grace_s:
            return ("rank(s) failed in start-up: " + "; ".join(f"{node}: {what}" for node, what, _ in failed[:8]) +
                    f" (the others have not ended in {self.startup_grace_s:.0f} s)")
        bound = max(2 * self.stall_s, 3 * progress.longest) if progress.grew else self.startup_s + self.stall_s
        if idle > bound:
            return (f"the watchdog: no record in train.jsonl for {idle:.0f} s (bound {bound:.0f} s: "
                    + ("2 x loop.timeout_s, or 3 x the longest gap seen" if progress.grew else
                       "loop.startup_timeout_s + loop.timeout_s, and this start trained no step") +
                    ") and no rank's report: every rank hangs")
        return None

    def _end_step(self, proc: subprocess.Popen, folder: str, name: str) -> None:
        """The survivors are done; what is left are tasks on a dead node (or stopped ones): end the step."""
        self._ended_at = time.monotonic()  # the tasks' exits after this are this end's, not failures of their own
        steps = set()
        for entry in os.listdir(folder) if os.path.isdir(folder) else ():
            if entry.startswith("report-"):
                try:
                    with open(os.path.join(folder, entry)) as f:
                        steps.add(json.load(f).get("slurm_step"))
                except (OSError, ValueError):
                    pass
        if not steps - {None}:  # no rank reported (a start-up failure, the watchdog): the step by its name
            steps = set(steps_named(self.job, f"hpcdl-{name}"))
        for step in steps - {None}:  # not waited for: slurmctld answers only once it gave up on a dead node (11 s)
            subprocess.Popen(["scancel", "--signal=KILL", f"{self.job}.{step}"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=self.grace_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)  # srun waits for a node that cannot answer

    # -- after a failed step ----------------------------------------------------------------------------------
    def _diagnose(self, code: int, result: dict | None, use: list[str], started: float, ended: float,
                  trained: bool = True) -> dict:
        exits = [e for e in self._task_exits if self._ended_at is None or e[2] < self._ended_at]
        exited = sorted({node for node, _, _ in exits if node in use})
        if result is not None:
            # only this step's nodes: a node named by an older rescue, or one no longer in the allocation, is not
            suspects = [n for n in lost_nodes(result, use, self.tasks_per_node) if n in use]
            first = min(result["reports"], key=lambda r: r["time"]) if result.get("reports") else {}
            found = first.get("reason", "?").split(": heartbeat stopped")[0].split("; rank ")[0]
            cause = (f"rank(s) {','.join(map(str, result['lost']))} lost on {','.join(suspects) or '?'} (rank "
                     f"{first.get('rank')} found: {found[:200]})" if result["lost"] else
                     "a collective timed out with every heartbeat alive")
            saved = result.get("checkpoint")
            detected = first.get("time", ended)
        else:
            # every node of the step: a node that died says nothing (no task exit), while its peers' ranks exit
            suspects, saved, detected = list(use), None, ended
            cause = getattr(self, "_stuck_why", None) or f"the step ended with status {code} and no rank's report"
            if exited and "start-up" not in cause:
                cause += "; " + "; ".join(f"{n}: {w}" for n, w, _ in exits[:8])
        self._stuck_why = None
        suspects = suspects or list(use)
        started_probe = self._probing
        dead = started_probe[1].result() if started_probe and started_probe[0] == suspects else self._probe(suspects)
        dead = [n for n in dead if n in self.active]
        if not trained and not dead:  # a start that failed before its first step, no node lost: the nodes blamed
            for node in (exited if result is None else suspects):  # are those whose ranks failed, not their peers
                self.failed_starts[node] += 1
        twice = [n for n in use if self.failed_starts[n] >= FAILED_STARTS and n not in dead and n in self.active]
        replaced = {}
        for node in dead + twice:
            self.active.remove(node)
            self.lost.append(node)
            spare = self._take_spare()
            if spare:
                replaced[node] = spare
                self.active.append(spare)
        if dead or twice:
            what = "; ".join((f"node {n} lost, " if n in dead else
                              f"node {n} failed {self.failed_starts[n]} starts in start-up, not used again, ") +
                             (f"spare {replaced[n]} takes its place" if n in replaced else "no spare left")
                             for n in dead + twice)
        else:
            what = f"node(s) {','.join(suspects) or 'none'} answer: the same nodes again"
        saved_text = f"step {result['step']} saved just in time ({saved})" if saved else \
            "nothing saved just in time: the newest checkpoint on disk"
        log.warning("step ended (status %s): %s; %s; %s", code, cause, what, saved_text)
        return {"cause": cause, "what": f"{cause}; {what}; {saved_text}", "status": code, "lost_nodes": dead,
                "failed_start_nodes": twice, "healthy_suspects": [n for n in suspects if n not in dead + twice],
                "spares_taken": replaced, "saved_step": result.get("step") if result else None, "checkpoint": saved,
                "detected_at": detected, "step_ended_at": ended, "ranks_lost": result["lost"] if result else None,
                "trained": trained}

    def _take_spare(self) -> str | None:
        """The next spare whose Python starts (probed at the supervisor's start); one that does not is skipped and
        named."""
        checked = self._spares_checked.result() if self._spares_checked is not None else {}
        while self.spare:
            node = self.spare.pop(0)
            error = checked[node] if node in checked else self._probe_python([node])[node]
            if error is None:
                return node
            self.skipped[node] = error
            log.warning("spare %s skipped: %s", node, error)
        return None

    def _probe_python(self, nodes: list[str]) -> dict[str, str | None]:
        return python_failures(nodes, self.rank_command, self.spare_probe_s)

    def _probe(self, nodes: list[str]) -> list[str]:
        return unanswering(nodes, self.probe_timeout_s)

    def _mark_recovery(self, started: float) -> None:
        """The last restart's cost once its step has started: noted when the next attempt begins, or at the end."""
        self._pending = (self.events[-1] if self.events else None, started)

    def _summary_since(self, started: float) -> dict | None:
        self._note_recovery()
        path = RunFolder(self.run_dir).summary
        try:
            if os.path.getmtime(path) < started:
                return None
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _note_recovery(self) -> None:
        """For the restart before the step that just ended: when its first step trained (train.jsonl), and the
        time from the loss's first report to it."""
        event, started = getattr(self, "_pending", (None, None))
        if event is None or "next_step_at" in event:
            return
        first = first_step_after(RunFolder(self.run_dir).steps_log, started)
        if first is not None:
            event["next_step_at"] = first
            event["loss_to_next_step_s"] = round(first - event["detected_at"], 1)
            log.info("restart %s cost: %.1f s from the first report of the loss to the next training step "
                     "(%.1f s of it until the step ended, %.1f s to start and resume)", event.get("restart"),
                     first - event["detected_at"], event["step_ended_at"] - event["detected_at"],
                     first - event["step_ended_at"])

    def _give_up(self, why: str) -> int:
        newest = RunFolder(self.run_dir).newest_checkpoint()
        log.error("giving up: %s. Newest checkpoint: %s; submit the job again to resume from it", why,
                  newest or "none")
        self._write(final="gave up", why=why)
        return 1

    def _write(self, final: str | None = None, why: str | None = None) -> None:
        state = {"job": self.job, "start": self.requeues + 1, "nodes": self.nodes, "active": self.active,
                 "spares_left": self.spare, "spares_skipped": self.skipped, "lost": self.lost,
                 "failed_starts": dict(self.failed_starts), "restarts": self.events, "outcome": final, "why": why}
        atomic_write_text(RunFolder(self.run_dir).supervisor, json.dumps(state, indent=1) + "\n")


def from_slurm(rank_command: list[str], run_dir: str, global_batch: int, **kw) -> Supervisor:
    """A supervisor of this Slurm job's nodes (SLURM_JOB_NODELIST), with its tasks and CPUs per node."""
    if "SLURM_JOB_NODELIST" not in os.environ:
        raise LaunchError("hpcdl supervise runs inside a Slurm allocation (its batch script): SLURM_JOB_NODELIST "
                          "is not set; submit it with hpcdl sbatch --spares K")
    if not kw.get("tasks_per_node"):
        per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "1")
        kw["tasks_per_node"] = int(re.match(r"\d+", per_node).group())
    if kw.get("cpus_per_task") is None and os.environ.get("SLURM_CPUS_PER_TASK"):
        kw["cpus_per_task"] = int(os.environ["SLURM_CPUS_PER_TASK"])
    return Supervisor(rank_command=rank_command, run_dir=run_dir, global_batch=global_batch,
                      nodes=expand_hostlist(os.environ["SLURM_JOB_NODELIST"]), **kw)

