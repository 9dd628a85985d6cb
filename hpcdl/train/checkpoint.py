"""Checkpoints that stay loadable: written to a temporary name, fsynced, renamed; the last K are kept;
loading falls back past an unreadable newest one and says so.

A checkpoint is one ``torch.save`` of a dict of tensors, numbers, strings, lists and dicts, so it loads
with ``torch.load(weights_only=True)``: no pickled code runs when a run resumes. State that differs per
rank and is too large to gather on rank 0 (the chunk_sparse hook's residuals: a whole gradient per rank)
goes into one file per rank beside it, ``ckpt-STEP.rankRRRRR.pt``, written before rank 0 writes the
checkpoint that lists them, and removed with it.

A restart reads the checkpoint from the shared filesystem once per job: rank 0 loads it and the job's group
streams its tensors to the others (:func:`load_latest_shared`, through
:func:`hpcdl.distributed.share.broadcast_state`: one copy of the state per rank plus a 64 MiB chunk, every
call under 2 GiB), so the filesystem serves one reader at any number of ranks; each per-rank file is read by
the one rank that needs it.
"""

from __future__ import annotations

import glob
import logging
import os
import random
import re

import numpy as np
import torch

from hpcdl.distributed.share import broadcast_state
from hpcdl.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)
NAME = re.compile(r"ckpt-(\d{9})\.pt")


class CheckpointManager:
    def __init__(self, folder: str, keep: int = 3):
        if keep < 1:
            raise ConfigError(f"checkpoint keep={keep}: keep at least 1 checkpoint")
        self.folder, self.keep = folder, keep
        os.makedirs(folder, exist_ok=True)
        for stale in glob.glob(os.path.join(glob.escape(folder), ".ckpt-*.tmp")):
            os.unlink(stale)  # a write that was killed; one rank writes a run's checkpoints

    def path(self, step: int) -> str:
        return os.path.join(self.folder, f"ckpt-{step:09d}.pt")

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
        found = [p for p in glob.glob(os.path.join(glob.escape(self.folder), "ckpt-*.pt"))
                 if NAME.fullmatch(os.path.basename(p))]
        return sorted(found, reverse=True)

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


def rank_path(checkpoint: str, rank: int) -> str:
    """The file beside ``checkpoint`` that holds ``rank``'s own state."""
    return f"{checkpoint[:-len('.pt')]}.rank{rank:05d}.pt"


def save_rank_state(folder: str, step: int, rank: int, state: dict) -> str:
    """Write ``rank``'s state for the checkpoint of ``step`` (temporary name, fsync, rename)."""
    os.makedirs(folder, exist_ok=True)
    return _save_atomically(rank_path(os.path.join(folder, f"ckpt-{step:09d}.pt"), rank), state, kept=[])


def _save_atomically(path: str, state: dict, kept: list[str]) -> str:
    """``torch.save`` to a temporary name beside ``path``, fsync, rename; a CheckpointError naming the path,
    the bytes and ``kept``'s newest when the write fails."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
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
