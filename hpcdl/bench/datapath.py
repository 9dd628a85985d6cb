"""``hpcdl bench data-path``: where a job's images come from when its dataset is on the shared filesystem.

It runs on the ranks of a job (``srun hpcdl bench data-path --data DIR``) and measures three paths one after
the other in that job, on the same packed dataset: **direct** reads of the shards on the filesystem
(``data.cache=none``); **stage**, a full copy to node-local disk first (``hpcdl stage``, timed and counted as
its own row) and then reads of the copy; **cache**, the node cache (``data.cache=node``, :mod:`hpcdl.data.cache`).
Each path builds the trainer's own loader (:func:`hpcdl.train.build.build_data`: the sampler, ``data.workers``
forked workers, the cache's agents) and runs ``--epochs`` epochs of it without a model: what is measured is what
the filesystem and the loader can feed.

Every rank meets the others at a barrier between epochs, where rank 0 runs ``--fs-counter`` (a command that prints
the bytes the filesystem has served: ``bash slurm/local/pfs.sh served`` reads the local cluster's storage
servers' link counters), so each epoch's bytes from the filesystem are measured where they leave it. Files opened
under ``--data`` are counted per node by a Python audit hook in every rank, inherited by its forked loader workers
(the shard reader opens through Python), plus the agent's own count of the shards it opened. The cache's agents
also give what they fetched from peers and answered from their node's copies.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import time

import torch.distributed as dist

from hpcdl.bench.configs import DataPathBench as Config
from hpcdl.bench.reports import DataPathReport, PathEpoch
from hpcdl.data.stage import stage
from hpcdl.data.verify import load_manifest
from hpcdl.errors import ConfigError
from hpcdl.presets import resolve
from hpcdl.train.build import build_data, read_manifests, stop_node_cache

_opened = None  # files opened under _root by this rank and its loader workers (a counter they share)
_root = ""


def _count_opens(root: str) -> None:
    global _opened, _root
    _opened, _root = multiprocessing.get_context("fork").Value("l", 0), os.path.join(os.path.abspath(root), "")

    def hook(event, args):
        if event == "open" and isinstance(args[0], (str, bytes)) and os.fsdecode(args[0]).startswith(_root):
            with _opened.get_lock():
                _opened.value += 1

    sys.addaudithook(hook)  # once per process: the forked workers inherit it


def run(cfg: Config, job) -> DataPathReport | None:
    ctx, env = job.ctx, job.env
    root = os.path.abspath(cfg.data)
    manifest = load_manifest(root)
    _count_opens(root)
    rows = []
    for path in cfg.path_list():
        rows += _path(cfg, job, path, root)
    if ctx.rank != 0:
        return None
    nodes = len(rows[0].node_images_per_s)
    return DataPathReport(nodes=nodes, ranks=ctx.world_size, images=sum(s.count for s in manifest.shards),
                          shards=len(manifest.shards), dataset_bytes=sum(s.bytes for s in manifest.shards),
                          rows=tuple(rows), ratios=_ratios(rows, sum(s.bytes for s in manifest.shards)))


def _path(cfg: Config, job, path: str, root: str) -> list[PathEpoch]:
    ctx, env = job.ctx, job.env
    rows, read_from = [], root
    if path == "stage":
        dest = job.expand(cfg.stage_to)
        target = os.path.join(dest, os.path.basename(os.path.normpath(root)))
        if env.local_rank == 0:
            shutil.rmtree(target, ignore_errors=True)  # a copy left by an earlier run would cost nothing
        mark = _mark(cfg, ctx)
        t0 = time.perf_counter()
        read_from = stage(root, dest, env.local_rank)
        rows.append(_row(cfg, ctx, env, path, -1, mark, time.perf_counter() - t0, 0, None))
    overrides = [f"data.train={read_from}", "data.val=", f"data.workers={cfg.workers}",
                 f"data.cache={'node' if path == 'cache' else 'none'}", f"data.cache_budget={cfg.cache_budget}",
                 f"ranks={ctx.world_size}", f"global_batch={cfg.batch * ctx.world_size}", f"crop={cfg.crop}"]
    try:
        run_cfg = resolve("demo_tiny_lars", overrides)
        parts = build_data(run_cfg, ctx, read_manifests(run_cfg, ctx), channels_last=False)
        cache = getattr(parts.train_loader.dataset, "cache", None) if env.local_rank == 0 else None
        for epoch in range(cfg.epochs):
            parts.sampler.set_epoch(epoch)
            mark = _mark(cfg, ctx, cache)
            t0, images = time.perf_counter(), 0
            for _, labels in parts.train_loader:
                images += len(labels)
            rows.append(_row(cfg, ctx, env, path, epoch, mark, time.perf_counter() - t0, images, cache))
        dist.barrier(group=ctx.group)  # no agent ends while another node's reads may still ask it
    finally:  # on an error too (no collective then: the other ranks are elsewhere), the agent and the copy go
        stop_node_cache()
        if path == "stage" and env.local_rank == 0:
            shutil.rmtree(read_from, ignore_errors=True)
    return rows


def _mark(cfg: Config, ctx, cache=None) -> tuple[int | None, dict]:
    """The epoch's start: the filesystem's counter (rank 0) and the node's agent's counters, read before the barrier
    that lets every rank start (a rank let go first would read before the count: 4 MB cross a 1 Gbit/s link in
    the time the counter's command takes)."""
    dist.barrier(group=ctx.group)  # the last epoch's reads are over everywhere
    _opened.value = 0
    mark = (_served(cfg.fs_counter) if ctx.rank == 0 else None), (cache.stats()[0] if cache is not None else {})
    dist.barrier(group=ctx.group)
    return mark


def _row(cfg: Config, ctx, env, path: str, epoch: int, mark, seconds: float, images: int, cache) -> PathEpoch:
    """Every rank's figures of the epoch just ended, gathered; rank 0 reads the filesystem's counter again."""
    mine = {"node": env.node_rank, "seconds": seconds, "images": images, "opens": _opened.value, "agent": {}}
    dist.barrier(group=ctx.group)  # the other nodes' requests to this node's agent are over too
    if cache is not None:
        after = cache.stats()[0]
        mine["agent"] = {k: after[k] - mark[1].get(k, 0) for k in ("source_bytes", "source_opens", "peer_bytes",
                                                                   "kept_hits", "ahead_hits")}
    elif path == "stage" and epoch < 0 and env.local_rank == 0:
        mine["agent"] = {"source_bytes": sum(s.bytes for s in load_manifest(cfg.data).shards)}
    every = [None] * ctx.world_size
    dist.all_gather_object(every, mine, group=ctx.group)
    served = _served(cfg.fs_counter) if ctx.rank == 0 else None
    nodes = sorted({r["node"] for r in every})
    by_node = {n: [r for r in every if r["node"] == n] for n in nodes}
    agents = [r["agent"] for r in every]

    def total(key: str) -> int:
        return sum(a.get(key, 0) for a in agents)

    return PathEpoch(
        path=path, epoch=epoch, seconds=max(r["seconds"] for r in every), images=sum(r["images"] for r in every),
        node_images_per_s=tuple(sum(r["images"] for r in rs) / max(r["seconds"] for r in rs)
                                for rs in by_node.values()),
        opens=tuple(sum(r["opens"] + r["agent"].get("source_opens", 0) for r in rs) for rs in by_node.values()),
        fs_bytes=None if served is None or mark[0] is None else served - mark[0],
        source_bytes=total("source_bytes"), peer_bytes=total("peer_bytes"),
        local_hits=total("kept_hits") + total("ahead_hits"))


def _served(command: str | None) -> int | None:
    if not command:
        return None
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
    out = done.stdout.strip()
    if done.returncode or not out.isdigit():
        raise ConfigError(f"--fs-counter {command!r} printed {out[-200:]!r} (exit code {done.returncode}: "
                          f"{done.stderr.strip()[-300:]}); give a command that prints one integer, the bytes the "
                          "filesystem has served")
    return int(out)


def _ratios(rows: list[PathEpoch], dataset: int) -> dict[str, float]:
    """The comparisons the report is for, from what was measured (the paths that ran)."""
    def later(path: str) -> list[PathEpoch]:  # the epochs after the first: what the cache serves from its copies
        return [r for r in rows if r.path == path and r.epoch >= 1]

    def per_node(rs: list[PathEpoch]) -> float:  # the slowest node's, on average over the epochs
        return sum(min(r.node_images_per_s) for r in rs) / len(rs)

    out = {}
    first = [r for r in rows if r.path == "cache" and r.epoch == 0]
    if first and first[0].fs_bytes is not None:
        out["cache, 1st epoch: filesystem bytes / dataset"] = first[0].fs_bytes / dataset
        if later("cache"):
            out["cache, later epochs (the most): filesystem bytes / dataset"] = \
                max(r.fs_bytes for r in later("cache")) / dataset
    for path in ("direct", "stage"):
        got = [r for r in rows if r.path == path and r.fs_bytes is not None]
        if got:
            out[f"{path}: filesystem bytes / dataset, whole path"] = sum(r.fs_bytes for r in got) / dataset
    if later("cache"):
        staged = [r for r in rows if r.path == "stage" and r.epoch >= 0]  # each of its epochs reads the local copy
        for other, rs in (("stage", staged), ("direct", later("direct"))):
            if rs:
                out[f"cache after its 1st epoch / {other}: images/s of the slowest node"] = \
                    per_node(later("cache")) / per_node(rs)
    return out


def format_report(report: DataPathReport) -> str:
    c, mb = report.config, 1e6
    lines = [f"data-path bench: {report.images} images in {report.shards} shards, {report.dataset_bytes / mb:.1f} MB "
             f"on {c.data}; {report.nodes} nodes, {report.ranks} ranks, {c.workers} loader workers per rank, crop "
             f"{c.crop}, cache budget {c.cache_budget} a node; filesystem bytes "
             + (f"from {c.fs_counter!r}" if c.fs_counter else "not measured (no --fs-counter)"),
             f"{'path':7s} {'epoch':>5s} {'s':>7s} {'img/s per node (min..max)':>26s} {'FS MB':>8s} {'x data':>7s} "
             f"{'opens, most/node':>16s} {'agents: FS MB':>13s} {'peers MB':>9s} {'local hits':>10s}"]
    for r in report.rows:
        fs = "-" if r.fs_bytes is None else f"{r.fs_bytes / mb:8.1f}"
        times = "-" if r.fs_bytes is None else f"{r.fs_bytes / report.dataset_bytes:6.2f}x"
        rate = "copy" if r.epoch < 0 else f"{min(r.node_images_per_s):.0f}..{max(r.node_images_per_s):.0f}"
        lines.append(f"{r.path:7s} {'copy' if r.epoch < 0 else r.epoch:>5} {r.seconds:7.1f} {rate:>26s} {fs:>8s} "
                     f"{times:>7s} {max(r.opens):16d} {r.source_bytes / mb:13.1f} {r.peer_bytes / mb:9.1f} "
                     f"{r.local_hits:10d}")
    lines += [f"{k}: {v:.2f}x" for k, v in report.ratios.items()]
    return "\n".join(lines) + "\n"
