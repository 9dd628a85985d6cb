"""``hpcdl pack``: images in, HDF5 shards and a manifest out.

One run packs one *part* of the dataset: all of it by default, or slice ``i`` of ``n`` for a Slurm array
task, an MPI rank or ``--part i/n``. A part encodes its images with ``--workers`` processes, in a fixed
order, and writes them into shards one after another. After each shard it records the shard in the
part's progress file (``parts/part-i-of-n.json``), so ``--resume`` keeps every shard whose sha256 still
matches and starts at the first image after it. The last part to finish merges the parts' files into
``manifest.json``; ``--merge`` does it by hand.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from datetime import timedelta

from hpcdl import __version__
from hpcdl.data.format import (
    MANIFEST,
    PARTS_DIR,
    TMP_SUFFIX,
    Manifest,
    ShardEntry,
    check_shard,
    part_name,
    shard_name,
    write_shard,
)
from hpcdl.data.images import Encoding, Rejected, prepare
from hpcdl.data.options import PackConfig
from hpcdl.data.sources import Item, catalog
from hpcdl.data.stats import measure
from hpcdl.distributed.ranks.env import rank_and_world
from hpcdl.errors import ConfigError, DataError
from hpcdl.utils import format_duration

log = logging.getLogger(__name__)




def detect_part(spec: str | None, environ=os.environ) -> tuple[int, int]:
    """(part, parts) from ``--part i/n``, else a Slurm array task, else an MPI/srun rank, else (0, 1)."""
    if spec:
        i, _, n = spec.partition("/")
        if not (i.isdigit() and n.isdigit() and int(i) < int(n)):
            raise ConfigError(f"--part {spec!r} must be i/n with 0 <= i < n, e.g. --part 3/16")
        return int(i), int(n)
    if "SLURM_ARRAY_TASK_ID" in environ:
        lo, hi = int(environ["SLURM_ARRAY_TASK_MIN"]), int(environ["SLURM_ARRAY_TASK_MAX"])
        if int(environ.get("SLURM_ARRAY_TASK_COUNT", hi - lo + 1)) != hi - lo + 1:
            raise ConfigError(f"the Slurm array {lo}-{hi} has gaps or a step; pack with a contiguous "
                              f"--array={lo}-{hi}, or give --part i/n")
        return int(environ["SLURM_ARRAY_TASK_ID"]) - lo, hi - lo + 1

    return rank_and_world(environ)  # no rendezvous needed: mpiexec across nodes works without MASTER_ADDR


def pack(cfg: PackConfig) -> Manifest:
    """Pack this process's part; returns the merged manifest when every part is done, else the part's."""
    part, parts = detect_part(cfg.part)
    os.makedirs(os.path.join(cfg.out, PARTS_DIR), exist_ok=True)
    if os.path.exists(os.path.join(cfg.out, MANIFEST)) and not cfg.resume:
        raise ConfigError(f"{cfg.out} already holds a packed dataset; pick another OUT or remove it")
    cat = catalog(cfg.tree, cfg.src, cfg.sources)
    items = cat.items_for_part(part, parts, cfg.seed)
    if cfg.holdout:
        items = [i for i in items if held_out(i.key, cfg.holdout) == (cfg.split == "val")]
    progress = _start_part(cfg, part, parts, cat.classes)
    if not progress.complete:
        log.info("pack part %d/%d: %d inputs from %s, %d already packed", part, parts, len(items), cfg.src,
                 progress.shards[-1].stop if progress.shards else 0)
        _pack_items(cfg, progress, items)
    return merge(cfg.out) if _all_parts_done(cfg.out, parts) else progress


def held_out(key: str, fraction: float) -> bool:
    """Whether the image named ``key`` is in the held-out ``fraction``: by a hash of its name alone, so the train
    and val packs of the same source (any parts, any seed) split it the same way."""
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2 ** 64


def _options(cfg: PackConfig) -> dict:
    e = cfg.encoding
    split = {"holdout": cfg.holdout, "split": cfg.split} if cfg.holdout else {}
    return {"source": os.path.abspath(cfg.src), "shard_size": cfg.shard_size, "seed": cfg.seed,
            "max_side": e.max_side, "short_side": e.short_side, "quality": e.quality, "hpcdl": __version__, **split}


def _start_part(cfg: PackConfig, part: int, parts: int, classes: list[dict]) -> Manifest:
    path = os.path.join(cfg.out, part_name(part, parts))
    for tmp in glob.glob(os.path.join(glob.escape(cfg.out), f"shard-p{part:04d}-*{TMP_SUFFIX}")):
        os.unlink(tmp)  # left by a killed run of this part
    if not os.path.exists(path):
        progress = Manifest(tree=cfg.tree, classes=classes, shards=[], rejected=[], options=_options(cfg),
                            part=part, parts=parts)
        _remove_unlisted(cfg.out, part, [])
        progress.save(path)
        return progress
    if not cfg.resume:
        raise ConfigError(f"{path} exists: part {part}/{parts} was started before. Rerun with --resume to "
                          "keep its finished shards, or remove OUT to start over")
    progress = Manifest.load(path)
    _check_resumable(cfg, progress, path, classes)
    return _keep_sound_shards(cfg.out, progress, path)


def _check_resumable(cfg: PackConfig, progress: Manifest, path: str, classes: list[dict]) -> None:
    now = _options(cfg)
    changed = [k for k in ("source", "shard_size", "seed", "max_side", "short_side", "quality")
               if progress.options.get(k) != now[k]]
    if changed or progress.tree != cfg.tree or progress.classes != classes:
        what = changed or ["tree or classes"]
        raise ConfigError(f"--resume: {path} was packed with different {', '.join(what)}; rerun with the "
                          "original options, or remove OUT to start over")


def _keep_sound_shards(out: str, progress: Manifest, path: str) -> Manifest:
    """Keep the listed shards up to the first one that fails its full check; drop the rest."""
    kept = []
    for entry in progress.shards:
        problems = check_shard(out, entry, progress.num_classes, full=True)
        if problems:
            log.warning("--resume: repacking from %s on: %s", entry.file, "; ".join(problems))
            break
        kept.append(entry)
    if len(kept) < len(progress.shards) or not progress.complete:
        progress.shards, progress.complete = kept, False
        progress.rejected = [r for s in kept for r in s.rejected]
        _remove_unlisted(out, progress.part, kept)
        progress.save(path)
    return progress


def _remove_unlisted(out: str, part: int, kept: list[ShardEntry]) -> None:
    listed = {s.file for s in kept}
    for f in glob.glob(os.path.join(glob.escape(out), f"shard-p{part:04d}-*.h5")):
        if os.path.basename(f) not in listed:
            os.unlink(f)  # written by a run that died before recording it


def _encode(enc: Encoding, timeout_s: float, item: Item) -> tuple:
    """("ok", bytes, size, original size) or ("rejected", reason): whatever the input holds."""
    if item.bad_name:
        return ("rejected", "file name is not valid UTF-8")
    try:
        with _time_limit(timeout_s):
            try:
                data = item.read()
            except OSError as exc:
                return ("rejected", f"unreadable: {exc.strerror or exc}")
            return ("ok", *prepare(data, enc))
    except Rejected as exc:
        return ("rejected", str(exc))
    except Exception as exc:  # a decoder's error that prepare() does not know: the pack still finishes
        log.warning("%s: unexpected %s from the image decoder: %s", item.key, type(exc).__name__, exc)
        return ("rejected", f"truncated or corrupt: {type(exc).__name__}: {exc}")


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raise Rejected in this (main) thread after ``seconds``: a decoder that would run for minutes on a
    crafted file gives up instead of stalling the pack. Pillow's decoders return to Python between chunks,
    where the alarm's handler runs. Off a main thread (no signals there) there is no limit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise Rejected(f"took longer than {seconds:g} s to read and decode (--image-timeout)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _ShardBuffer:
    def __init__(self):
        self.images, self.labels, self.sizes, self.orig_sizes, self.keys, self.rejected = [], [], [], [], [], []
        self.bytes = 0

    def add(self, item: Item, data: bytes, size: tuple[int, int], orig_size: tuple[int, int]) -> None:
        self.images.append(data)
        self.labels.append(item.label)
        self.sizes.append(size)
        self.orig_sizes.append(orig_size)
        self.keys.append(item.key)
        self.bytes += len(data)


def _pack_items(cfg: PackConfig, progress: Manifest, items: list[Item]) -> None:
    path = os.path.join(cfg.out, part_name(progress.part, progress.parts))
    start = progress.shards[-1].stop if progress.shards else 0
    bar = Progress(total=len(items) - start, what=f"part {progress.part}/{progress.parts}")
    buf = _ShardBuffer()
    with _Results(cfg, items[start:]) as results:
        for pos, (item, result) in enumerate(zip(items[start:], results), start=start):
            if result[0] == "rejected":
                buf.rejected.append({"path": item.key, "reason": result[1]})
            else:
                buf.add(item, *result[1:])
            bar.update(rejected=len(buf.rejected) + len(progress.rejected))
            if buf.bytes >= cfg.shard_size:
                buf = _flush(cfg, progress, buf, pos + 1, path)
    if buf.images or buf.rejected:
        _flush(cfg, progress, buf, len(items), path)
    bar.close()
    progress.complete = True
    progress.save(path)


class _Results:
    """Encoded results in item order, from a process pool (or in this process with one worker)."""

    def __init__(self, cfg: PackConfig, items: list[Item]):
        self.fn = functools.partial(_encode, cfg.encoding, cfg.image_timeout)
        self.items, self.workers, self.pool = items, cfg.workers, None

    def __enter__(self):
        if self.workers == 1:
            return map(self.fn, self.items)
        self.pool = multiprocessing.get_context("fork").Pool(self.workers)
        return self.pool.imap(self.fn, self.items, chunksize=8)

    def __exit__(self, *exc):
        if self.pool:
            self.pool.terminate()
            self.pool.join()


def _flush(cfg: PackConfig, progress: Manifest, buf: _ShardBuffer, stop: int, path: str) -> _ShardBuffer:
    """Write the buffered images as the part's next shard and record it with the inputs it covers."""
    if buf.images:
        entry = write_shard(os.path.join(cfg.out, shard_name(progress.part, len(progress.shards))), buf.images,
                            buf.labels, buf.keys, buf.sizes, buf.orig_sizes, {"num_classes": progress.num_classes, "part": progress.part})
        entry.first, entry.stop, entry.rejected = progress.shards[-1].stop if progress.shards else 0, stop, buf.rejected
        progress.shards.append(entry)
    elif progress.shards:  # only rejected inputs since the last shard: its range takes them in
        last = progress.shards[-1]
        last.stop, last.rejected = stop, last.rejected + buf.rejected
    progress.rejected.extend(buf.rejected)
    progress.save(path)
    return _ShardBuffer()


def _part_files(out: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(out), PARTS_DIR, "part-*-of-*.json")))


def _all_parts_done(out: str, parts: int) -> bool:
    names = [os.path.join(out, part_name(p, parts)) for p in range(parts)]
    return all(os.path.exists(n) and Manifest.load(n).complete for n in names)


def merge(out: str) -> Manifest:
    """Merge the parts' files into ``manifest.json``; refuse while a part is missing or unfinished."""
    files = _part_files(out)
    if not files:
        raise DataError(f"{out}/{PARTS_DIR}: no part files; run 'hpcdl pack' first")
    loaded = [Manifest.load(f) for f in files]
    parts = loaded[0].parts
    done = {m.part for m in loaded if m.complete and m.parts == parts}
    if len(done) != parts or len(loaded) != parts:
        todo = sorted(set(range(parts)) - done)
        raise DataError(f"{out}: parts {todo} of {parts} are not finished (or part files of another split "
                        f"are present); rerun those array tasks with --resume")
    if any(m.classes != loaded[0].classes or m.tree != loaded[0].tree for m in loaded):
        raise DataError(f"{out}: the part files disagree on classes or tree; they come from different packs")
    shards = [ShardEntry(file=s.file, count=s.count, bytes=s.bytes, sha256=s.sha256) for m in loaded for s in m.shards]
    merged = Manifest(tree=loaded[0].tree, classes=loaded[0].classes, shards=shards,
                      rejected=[r for m in loaded for r in m.rejected], options={**loaded[0].options, "parts": parts},
                      part=0, parts=1, complete=True)
    merged.stats = measure(out, merged)
    merged.save(os.path.join(out, MANIFEST))
    return merged


def restat(out: str) -> Manifest:
    """Measure the stats of a dataset packed before hpcdl did (``hpcdl pack --stats OUT``)."""
    manifest = Manifest.load(os.path.join(out, MANIFEST))
    manifest.stats = measure(out, manifest)
    manifest.save(os.path.join(out, MANIFEST))
    return manifest


class Progress:
    """Images per second and ETA on stderr: redrawn in place on a terminal, a line a minute in job logs."""

    def __init__(self, total: int, what: str, stream=sys.stderr):
        self.total, self.what, self.stream, self.done, self.rejected = total, what, stream, 0, 0
        self.tty = stream.isatty()
        self.t0 = self.last = time.monotonic()

    def update(self, n: int = 1, rejected: int = 0) -> None:
        self.done += n
        self.rejected = rejected
        now = time.monotonic()
        if now - self.last >= (0.5 if self.tty else 60.0):
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        rate = self.done / max(now - self.t0, 1e-9)
        eta = format_duration(timedelta(seconds=(self.total - self.done) / rate)) if rate else "?"
        line = (f"pack {self.what}: {self.done}/{self.total} images, {self.rejected} rejected, "
                f"{rate:.0f} img/s, ETA {eta}")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        self._draw(time.monotonic())
        if self.tty:
            self.stream.write("\n")
