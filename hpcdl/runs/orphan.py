"""A supervised step whose supervisor is gone: the job requeues itself instead of holding its nodes idle.

``hpcdl supervise`` runs in the batch script, on the job's first node, and so does that node's rank. When the
node is lost, the other ranks save the last step just in time (:mod:`hpcdl.train.rescue`) and exit; nothing
is left to start the next step, and a ``--no-kill`` job keeps its allocation, idle, to its time limit. So the
supervisor beats (:class:`Beat`): every :data:`BEAT_S` seconds it rewrites ``RUN/supervisor.alive`` (a
counter, its node and process, the job's requeue budget) and names the file to the ranks
(``HPCDL_SUPERVISOR``). After its rescue each rank looks at it (:func:`after_rescue`): a counter that does not
move for :data:`STALE_S` seconds means that no supervisor will read the rescue's result, and one rank, once
the result is written, requeues the job (``scontrol requeue``: the job starts again, from the checkpoint just
saved), or, where the job cannot requeue, cancels it naming that checkpoint. What it did is kept in
``RUN/jit/ATTEMPT/orphan.json``.

A counter, not a time: the supervisor's clock and a rank's are on different nodes. The file is rewritten in
place, not renamed: NFS's close-to-open consistency revalidates an opened file's data, but a name renamed over
is seen only once the directory's attribute cache expires (up to a minute); a read of a half-written file is
read again. Cost: one write of about 150 bytes every 2 s.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time

from hpcdl.runs.folder import RunFolder
from hpcdl.runs.outcome import read_result
from hpcdl.runs.preflight import requeue_target
from hpcdl.utils import atomic_write_text

__all__ = ["BEAT_S", "ENV", "STALE_S", "Beat", "after_rescue", "supervisor_alive"]

log = logging.getLogger(__name__)

ENV = "HPCDL_SUPERVISOR"  # the beat's file, set by the supervisor for the ranks it starts
BEAT_S = 2.0
STALE_S = 15.0  # a beat unchanged this long: the supervisor (or its node) is gone
RESULT_WAIT_S = 600.0  # the most a rank waits for the writer's result, while the writer's claim is touched
CLAIM_STALE_S = 15.0  # a writer's claim not touched for this long: the writer is gone (rescue.py imports both)
CLAIM_WAIT_S = 30.0  # how long a survivor waits for the writer to claim the write


class Beat:
    """The supervisor's side: a daemon thread that rewrites ``path`` every ``every_s`` seconds."""

    def __init__(self, path: str, info: dict, every_s: float = BEAT_S):
        self.path, self.info, self.every_s = path, info, every_s
        self._stop = threading.Event()
        self._count = 0

    def start(self) -> Beat:
        self._write()
        threading.Thread(target=self._run, name="hpcdl-supervisor-beat", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self._write()
            except OSError as exc:  # a filesystem hiccup: the ranks wait STALE_S before they act
                log.warning("supervisor beat: %s not written (%s)", self.path, exc)

    def _write(self) -> None:
        self._count += 1
        text = json.dumps({**self.info, "beat": self._count, "time": time.time()}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:  # one write of the whole text, then the rest cut: a reader sees the old text, the new one, or a mix it rejects
            os.write(fd, text.encode())
            os.ftruncate(fd, len(text.encode()))
        finally:
            os.close(fd)


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def supervisor_alive(path: str, stale_s: float = STALE_S) -> tuple[bool, dict | None]:
    """Whether the beat in ``path`` moves within ``stale_s`` seconds; (that, the last beat read)."""
    first = _read(path)
    deadline = time.monotonic() + stale_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = _read(path)
        if now is not None and (first is None or now.get("beat") != first.get("beat")):
            return True, now
    return False, first


def after_rescue(folder: str, rank: int, stale_s: float = STALE_S) -> None:
    """Called by every rank after its rescue. Under a supervisor that is alive: nothing. Under one that is gone:
    the first rank to claim it, once the writer's ``result.json`` is in ``folder``, requeues the job, or cancels
    it naming the checkpoint when it cannot requeue."""
    path = os.environ.get(ENV)
    if not path:
        return
    alive, beat = supervisor_alive(path, stale_s)
    if alive:
        return
    gone = (f"the supervisor ({beat.get('host')}, Slurm node {beat.get('node')}, pid {beat.get('pid')})"
            if beat else "the supervisor") + f" has not beaten in {path} for {stale_s:.0f} s"
    result = _wait_for_result(folder)
    try:  # one rank acts
        os.close(os.open(os.path.join(folder, "orphan"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    except OSError as exc:
        log.error("rank %d: %s, and %s cannot be written (%s)", rank, gone, folder, exc)
        return
    checkpoint = (result or {}).get("checkpoint") or "the newest in " + RunFolder(
        os.path.dirname(os.path.dirname(folder))).checkpoints
    act(gone, checkpoint, folder, rank, int((beat or {}).get("max_requeues", 20)))


def _wait_for_result(folder: str) -> dict | None:
    """The writer's result.json, or None once the writer is gone: as the rescue's own wait for it, no claim
    (``folder/writer``) within CLAIM_WAIT_S or a claim untouched for CLAIM_STALE_S (the writer touches it every 2 s
    while it writes), and at most RESULT_WAIT_S. A failed write (disk full) leaves the survivors idle for seconds,
    not the whole allocation for RESULT_WAIT_S."""
    claim, since = os.path.join(folder, "writer"), time.monotonic()
    while (result := read_result(folder)) is None and time.monotonic() - since < RESULT_WAIT_S:
        try:
            if time.time() - os.path.getmtime(claim) > CLAIM_STALE_S:
                log.error("the writer's claim %s is %.0f s old: the writer is gone, acting without its result",
                          claim, time.time() - os.path.getmtime(claim))
                return None
        except OSError:  # no claim yet
            if time.monotonic() - since > CLAIM_WAIT_S:
                log.error("no writer claimed %s within %.0f s: acting without its result", folder, CLAIM_WAIT_S)
                return None
        time.sleep(0.5)
    return result


def act(gone: str, checkpoint: str, folder: str, rank: int, max_requeues: int) -> None:
    """Requeue the job (it resumes from ``checkpoint``), or cancel it naming the checkpoint."""
    target = requeue_target(os.environ)
    done = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    record = {"rank": rank, "why": gone, "checkpoint": checkpoint, "job": target, "time": time.time()}
    if target is None:
        log.error("rank %d: %s; not in a Slurm job: nothing to requeue. Resume from %s", rank, gone, checkpoint)
        return
    if done < max_requeues:
        log.error("rank %d: %s: no one will restart the step; requeueing job %s (%d of at most %d), which "
                  "resumes from %s", rank, gone, target, done + 1, max_requeues, checkpoint)
        atomic_write_text(os.path.join(folder, "orphan.json"), json.dumps({**record, "action": "requeue"}) + "\n")
        # SIGTERM ignored, a disposition exec keeps: the requeue's own SIGTERM to this step must not cut scontrol
        run = subprocess.run(["sh", "-c", 'trap "" TERM; exec scontrol requeue "$0"', target], capture_output=True,
                             text=True)
        if run.returncode == 0:
            return
        why = f"scontrol requeue {target} failed: {(run.stderr or run.stdout).strip()}"
    else:
        why = f"job {target} was requeued {done} times already (checkpoint.max_requeues={max_requeues})"
    log.error("rank %d: %s; %s: cancelling the job instead of leaving its nodes idle. Submit it again to resume "
              "from %s", rank, gone, why, checkpoint)
    atomic_write_text(os.path.join(folder, "orphan.json"), json.dumps({**record, "action": "cancel", "why_not": why})
                      + "\n")
    subprocess.run(["scancel", target], capture_output=True)
