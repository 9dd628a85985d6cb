"""Checkpoints that stay loadable: written to a temporary name, fsynced, renamed; the last K are kept;
loading falls back past an unreadable newest one and says so.

A checkpoint is one ``torch.save`` of a dict of tensors, numbers, strings, lists and dicts, so it loads
with ``torch.load(weights_only=True)``: no pickled code runs when a run resumes. State that differs per
rank and is too large to gather on rank 0 (the chunk_sparse hook's residuals: a whole gradient per rank)
goes into one file per rank beside it, ``ckpt-STEP.rankRRRRR.pt``, written before rank 0 writes the
checkpoint that lists them, and removed with it.

:class:`Checkpointer` is the one owner of what a checkpoint holds: it is handed the training state's parts (each a
``state_dict``/``load_state_dict`` pair, as torchtitan's ``components/checkpoint.py`` ``CheckpointManager`` holds
its ``Stateful`` states in one dict) and composes, writes, loads and names them, for the trainer's periodic, signal
and final checkpoints and for the just-in-time one (:mod:`hpcdl.train.rescue`) alike. Every write runs under its
lock, the same one the update runs under, so two writes of one process (a rescue and a periodic save) never
overlap. The file names are :class:`hpcdl.runs.folder.RunFolder`'s.

A restart reads the checkpoint from the shared filesystem once per job: rank 0 loads it and the job's group
streams its tensors to the others (:func:`load_latest_shared`, through
:func:`hpcdl.distributed.group.share.broadcast_state`: one copy of the state per rank plus a 64 MiB chunk, every
call under 2 GiB), so the filesystem serves one reader at any number of ranks; each per-rank file is read by
the one rank that needs it.
"""

from __future__ import annotations

import glob
import logging
import os
import random
import socket
import threading
import time
from typing import Callable

import numpy as np
import torch

from hpcdl.distributed.group.share import broadcast_state
from hpcdl.errors import CheckpointError, ConfigError
from hpcdl.runs.folder import CHECKPOINT, RunFolder, checkpoint_name, checkpoints_in, rank_part_of

log = logging.getLogger(__name__)
NAME = CHECKPOINT


class CheckpointManager:
    def __init__(self, folder: str, keep: int = 3, *, clean: bool = True):
        """``clean``: remove the temporary files of writes that were killed. Only rank 0 at a start may: a rescue's
        writer on another rank would remove the file rank 0 is still writing."""
        if keep < 1:
            raise ConfigError(f"checkpoint keep={keep}: keep at least 1 checkpoint")
        self.folder, self.keep = folder, keep
        os.makedirs(folder, exist_ok=True)
        for stale in glob.glob(os.path.join(glob.escape(folder), ".ckpt-*.tmp")) if clean else ():
            try:
                os.unlink(stale)  # a write that was killed
            except FileNotFoundError:
                pass

    def path(self, step: int) -> str:
        return os.path.join(self.folder, checkpoint_name(step))

    def save(self, step: int, state: dict) -> str:
        """Write ``state`` as the checkpoint of ``step``; older ones beyond ``keep`` are removed after. A
        write that fails (a full disk, a quota) leaves the older ones as they were and raises a
        CheckpointError naming the path and the bytes."""
        path = _save_atomically(self.path(step), state, kept=self.checkpoints())
        _fsync_dir(self.folder)
        for old in self.checkpoints()[self.keep:]:
            os.unlink(old)
            for rank_file in glob.glob(glob.escape(old[:-len(".pt")]) + ".rank*.pt"):
                os.unlink(rank_file)
        return path

    def checkpoints(self) -> list[str]:
        """Complete checkpoints, newest first (temporary files of interrupted writes are not listed)."""
        return checkpoints_in(self.folder)

    def load_latest(self) -> tuple[str, dict] | None:
        """(path, state) of the newest checkpoint that loads; None when there is none. Each file is read once."""
        skipped = []
        for path in self.checkpoints():
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # torch raises RuntimeError, EOFError, UnpicklingError, zipfile errors...
                skipped.append(f"{path} ({type(exc).__name__}: {exc})")
                continue
            if skipped:
                log.warning("checkpoint: skipped unreadable %s; resuming from %s", "; ".join(skipped), path)
            return path, state
        if skipped:
            log.warning("checkpoint: no readable checkpoint in %s (skipped %s); starting fresh", self.folder,
                        "; ".join(skipped))
        return None


def load_latest_shared(manager: CheckpointManager | None, group) -> tuple[str, dict] | None:
    """Collective over ``group``: (path, state) of the checkpoint rank 0 (the one with ``manager``) chose, on
    every rank, or None. Rank 0 reads the file; the others get its tensors over the group, not from the
    filesystem."""
    latest = manager.load_latest() if manager is not None else None
    return broadcast_state(latest, group)


class Checkpointer:
    """One per start, on every rank: the training state's parts (:meth:`attach`: name -> a ``state_dict`` /
    ``load_state_dict`` part; the model's part may also give ``eval_state_dict``, Schedule-Free's averaged weights)
    and a header, composed into one checkpoint (:meth:`compose`) and written (:meth:`write`) under :attr:`lock`.
    Rank 0 writes the periodic, signal and final checkpoints; any survivor may write the just-in-time one, with the
    same parts and the same :meth:`write`."""

    def __init__(self, folder: RunFolder, keep: int, rank: int, lock: threading.RLock | None = None):
        if keep < 1:
            raise ConfigError(f"checkpoint keep={keep}: keep at least 1 checkpoint")
        self.folder, self.keep, self.rank = folder, keep, rank
        self.lock = lock or threading.RLock()  # the update, the evaluation's weight swap and every write
        self.parts: dict = {}
        self.header: Callable[[], dict] = dict
        self.last_step, self.last_time = -1, time.monotonic()  # the newest checkpoint this start wrote or resumed
        self._manager = CheckpointManager(folder.checkpoints, keep) if rank == 0 else None

    def attach(self, parts: dict, header: Callable[[], dict]) -> None:
        self.parts, self.header = parts, header

    def manager(self) -> CheckpointManager:
        """Made once per process (under :attr:`lock` on a rank other than 0: its first write is a rescue's), so
        that no second manager removes the temporary file of a write in flight."""
        if self._manager is None:  # a rescue's writer on a rank other than 0: rank 0 may be writing
            self._manager = CheckpointManager(self.folder.checkpoints, self.keep, clean=False)
        return self._manager

    def load_latest_shared(self, group, cut_records: bool = False) -> tuple[str, dict] | None:
        """Collective: the newest readable checkpoint, read by rank 0 and streamed to the others. With
        ``cut_records`` (``loop.record_samples``) rank 0 first drops the recorded samples of the steps after the
        checkpoint's, which the run trains again (a rescue that wrote no checkpoint: ``optimizer.shard`` with a lost
        rank's state in no checkpoint yet; a newest file unreadable), before any rank opens its record (after this
        collective and the start's next ones)."""
        if not cut_records or self._manager is None:
            return load_latest_shared(self._manager, group)
        latest = self._manager.load_latest()
        self.folder.drop_samples_after(latest[1]["counters"]["step"] if latest else 0)
        return broadcast_state(latest, group)

    def newest(self) -> str | None:
        return self.folder.newest_checkpoint()

    def has(self, step: int) -> bool:
        """Whether this start wrote (or resumed) the checkpoint of ``step`` and it is on disk."""
        return self.last_step == step and os.path.exists(self.folder.checkpoint(step))

    def compose(self, parts: dict | None = None, **extra) -> dict:
        """The checkpoint's dict: the header, each part's state (collective where a part is: the RNG streams'
        gather), the model part's ``eval_state_dict`` as ``eval_model`` where it gives one, then ``extra``.
        ``parts`` replaces some of the attached ones (the rescue's boundary)."""
        parts = {**self.parts, **(parts or {})}
        state = {**self.header(), **{name: part.state_dict() for name, part in parts.items()}}
        averaged = getattr(parts.get("model"), "eval_state_dict", lambda: None)()
        if averaged is not None:
            state["eval_model"] = averaged
        state.update(extra)
        return state

    def save(self, step: int, why: str, rank_part: dict | None = None,
             gathered: Callable[[], None] | None = None) -> str | None:
        """Collective: the checkpoint of ``step``, written by rank 0; the others give only what a collective part
        gathers (the RNG streams). ``rank_part``: this rank's comm hook state; its residuals go to the rank's own file
        first, the rest into the checkpoint as ``hook``. ``gathered`` runs once the collectives are over."""
        getattr(self.parts.get("optimizer"), "settle", lambda: None)()  # optimizer.gather_ahead's tensors in
        extra = {"rank_states": rank_part is not None}
        if rank_part is not None:
            self.save_rank_part(step, rank_part)
            extra["hook"] = {k: v for k, v in rank_part.items() if k != "residuals"}
        if self.rank == 0:
            state = self.compose(**extra)
        else:
            state = None
            for part in self.parts.values():
                if getattr(part, "collective", False):
                    part.state_dict()
        if gathered is not None:
            gathered()
        path = self.write(step, state, why) if state is not None else None
        self.last_step, self.last_time = step, time.monotonic()
        return path

    def save_rank_part(self, step: int, state: dict) -> str:
        """This rank's own part of step's checkpoint (before rank 0 writes the checkpoint that lists it)."""
        return save_rank_state(self.folder.checkpoints, step, self.rank, state)

    def write(self, step: int, state: dict, why: str) -> str:
        """Write ``state`` as the checkpoint of ``step``, under :attr:`lock`: a rescue waits for a periodic write
        in flight (and finds it on disk, :meth:`has`), never writes beside it."""
        with self.lock:
            return self.write_locked(step, state, why)

    def write_locked(self, step: int, state: dict, why: str) -> str:
        """:meth:`write` by a caller that holds :attr:`lock` (the rescue holds it to the end of the process)."""
        _slow_for_tests(why)
        path = self.manager().save(step, state)
        self.last_step, self.last_time = step, time.monotonic()
        log.info("checkpoint (%s): %s", why, path)
        return path


def _slow_for_tests(why: str) -> None:
    """A test hook, set by tests only: HPCDL_TEST_SLOW_SAVE="WHY[,WHY]:SECONDS" makes each write of those kinds (end,
    signal, periodic, just in time) take SECONDS longer, as a large checkpoint's write on a slow filesystem does."""
    kinds, _, seconds = os.environ.get("HPCDL_TEST_SLOW_SAVE", "").rpartition(":")
    if why in kinds.split(","):
        log.warning("HPCDL_TEST_SLOW_SAVE: the %s checkpoint's write takes %s s longer (a test's slow write)", why,
                    seconds)
        time.sleep(float(seconds))


def _write_failed(path: str, tmp: str, state: dict, exc: Exception, kept: list[str]) -> str:
    written = os.path.getsize(tmp) if os.path.exists(tmp) else 0
    needed = sum(t.numel() * t.element_size() for t in _tensors(state))
    fs = os.statvfs(os.path.dirname(path))
    free = fs.f_bavail * fs.f_frsize
    why = getattr(exc, "strerror", None) or str(exc).strip().splitlines()[-1]
    if free < needed:
        why = f"No space left on device: {free:,} bytes free; torch said: {why}" \
            if "space" not in why else why
    previous = f"the previous checkpoint {kept[0]} is kept" if kept else "no earlier checkpoint exists"
    return (f"{path}: the checkpoint could not be written ({why}; {written:,} bytes written of "
            f"about {needed:,}); {previous}. Free space there (or raise the quota), or set run_dir on a "
            "filesystem with room, and run again: it resumes from the last checkpoint")


def _tensors(tree):
    if torch.is_tensor(tree):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


rank_path = rank_part_of


def save_rank_state(folder: str, step: int, rank: int, state: dict) -> str:
    """Write ``rank``'s state for the checkpoint of ``step`` in ``folder`` (temporary name, fsync, rename)."""
    os.makedirs(folder, exist_ok=True)
    return _save_atomically(rank_part_of(os.path.join(folder, checkpoint_name(step)), rank), state, kept=[])


def _save_atomically(path: str, state: dict, kept: list[str]) -> str:
    """``torch.save`` to a temporary name beside ``path``, fsync, rename; a CheckpointError naming the path,
    the bytes and ``kept``'s newest when the write fails."""
    # the host too: a rescue's writer on another node may have rank 0's pid
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{socket.gethostname()}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:  # torch's zip writer reports a full disk as a RuntimeError
        raise CheckpointError(_write_failed(path, tmp, state, exc, kept)) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load_rank_state(checkpoint: str, rank: int) -> dict:
    """``rank``'s state saved with ``checkpoint``; a ConfigError naming the file when it cannot be read."""
    path = rank_path(checkpoint, rank)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(f"{path}: rank {rank}'s part of {checkpoint} cannot be read ({type(exc).__name__}: "
                          f"{exc}); an exact resume needs it. Move {checkpoint} and its .rank*.pt files aside to "
                          "resume from the previous checkpoint") from None


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict:
    """This process's torch, numpy and Python RNG states, in types ``weights_only`` loading accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "python": {"version": version, "state": list(py_state), "gauss": py_gauss}}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))


def rank_seed(seed: int, rank: int) -> int:
    """The seed of ``rank``'s RNG streams in a run of ``loop.seed`` = ``seed``: a hash of both, so ranks draw
    independent streams (dropout masks, stochastic depth) and a rank gets the same one whatever the run's
    history (from the start, or added by a resume on more ranks)."""
    return int(np.random.SeedSequence([seed % 2 ** 63, rank]).generate_state(1, np.uint64)[0] >> 1)


def seed_rng(seed: int) -> None:
    """Seed this process's torch, numpy and Python RNGs."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2 ** 32)
    random.seed(seed)
