"""``hpcdl bench startup``: what a job's start-up and restart cost at N ranks, and what of it grows with N.

For each job size it launches ``hpcdl train`` twice on a small packed data set (written to a temporary folder):
a start, from nothing, to its first step and a checkpoint, and a restart from that checkpoint. Each rank
records its start-up (``loop.record_startup``, with ``HPCDL_RECORD_STARTUP=1`` so that the interpreter's own
imports count: :mod:`hpcdl.train.startup_record`): the time of each phase, the files and bytes it opened under the
Python environment, the data and the run folder, its connections to rank 0's rendezvous store and the requests
it sent there. On an oversubscribed machine the times are inflated; the counts are not, and their fit against
N (``count = a + b N``) is what extrapolates to thousands of ranks (``hpcdl plan --startup-json``).

Then, in this process, one TCPStore server and ``--store-clients`` client connections: the requests per
second the server answers with that many connections open, against what the heartbeat of that many ranks
sends. The clients share this machine's cores with the server, so the capacity is a lower bound.

Run it where ranks can start: a login shell with ``mpiexec``, or inside an allocation with ``--launcher srun``.
"""

from __future__ import annotations

import glob
import json
import math
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from hpcdl.bench.configs import LAUNCHERS
from hpcdl.bench.configs import StartupBench as Config
from hpcdl.bench.reports import CountFit, StartupReport, StartupRow, StoreCapacity
from hpcdl.data.images import Encoding
from hpcdl.data.pack import PackConfig, pack
from hpcdl.data.synthetic import generate
from hpcdl.errors import ConfigError, LaunchError

__all__ = ["Config", "format_report", "run"]

# (leg, the step it trains to): the restart resumes from step 1 and trains on for a few heartbeats' worth
LEGS = (("start", 1), ("restart", 8))
PHASES = ("interpreter and imports", "rendezvous and backend", "checkpoint read", "model", "data open",
          "loader probe", "checkpoint restore", "DDP", "first step")
# The counts fitted against N, from the rows of one leg: (name, leg, value of a row)
COUNTS = (
    ("python files per rank", "start", lambda r: r.files_per_rank.get("python", 0.0)),
    ("store connections per rank", "start", lambda r: r.store_connections / r.ranks),
    ("rendezvous requests per rank", "start", lambda r: r.store_rendezvous_requests / r.ranks),
    ("heartbeat requests per s per rank", "restart", lambda r: r.heartbeat_per_rank_per_s),
    ("other store requests after start-up per rank", "restart", lambda r: r.store_requests_after_startup / r.ranks),
    ("restart run-folder bytes / checkpoint", "restart", lambda r: r.run_folder_bytes / r.checkpoint_bytes),
)


def run(cfg: Config, job) -> StartupReport:
    launch = list(LAUNCHERS[cfg.launcher])  # the venv's own mpiexec (the mpich wheel's) first
    found = shutil.which(launch[0], path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    if not found:
        raise ConfigError(f"--launcher {cfg.launcher}: {launch[0]} is not on PATH")
    launch[0] = found
    sizes = cfg.sizes()
    batch = math.lcm(*sizes) * max(1, math.ceil(2 * max(sizes) / math.lcm(*sizes)))  # 2 or more images a rank
    store = _store_capacity(cfg.store_clients, cfg.store_seconds, cfg.heartbeat) if cfg.store_clients else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpcdl-bench-startup-") as tmp:
        data = _data(Path(tmp), batch)
        for n in sizes:
            run_dir = Path(tmp, f"run-{n}")
            checkpoint = 0  # the size of the checkpoint the start wrote, which the restart reads
            for leg, steps in LEGS:
                _launch([*launch, str(n)], cfg.backend, data, run_dir, batch, steps, leg)
                rows.append(_row(n, leg, run_dir, checkpoint))
                if leg == "start":
                    checkpoint = (run_dir / "checkpoints" / "ckpt-000000001.pt").stat().st_size
                shutil.rmtree(run_dir / "startup")
    fits = tuple(_fit(name, [(r.ranks, v) for r in rows if r.leg == leg and (v := value(r)) is not None])
                 for name, leg, value in COUNTS)
    return StartupReport(rows=tuple(rows), fits=fits, store=store)


def _data(root: Path, batch: int) -> Path:
    """Two steps' worth of small JPEGs in 8 classes, packed; 8 validation images."""
    for split, per_class, seed in (("train", max(1, 2 * batch // 8), 1), ("val", 1, 2)):
        src = generate(str(root / f"src-{split}"), classes=8, per_class=per_class, size=(40, 32), seed=seed)
        pack(PackConfig(src=src.root, out=str(root / split), shard_size="64K", encoding=Encoding(short_side=32),
                        workers=1))
    return root


def _launch(launch: list[str], backend: str, data: Path, run_dir: Path, batch: int, steps: int, leg: str) -> None:
    cmd = [*launch, sys.executable, "-m", "hpcdl", "train", "demo_tiny_lars", "--set", f"data.train={data / 'train'}",
           "--set", f"data.val={data / 'val'}", "--set", f"run_dir={run_dir}", "--set", f"loop.backend={backend}",
           "--set", f"global_batch={batch}", "--set", "crop=32", "--set", "data.eval_resize=32",
           "--set", "data.workers=0", "--set", "epochs=10", "--set", f"loop.max_steps={steps}",
           "--set", "checkpoint.every_steps=1" if leg == "start" else "checkpoint.every_steps=0",
           "--set", "checkpoint.every_minutes=0", "--set", "loop.eval_every=0",
           "--set", "loop.record_startup=true"]
    env = {**os.environ, "HPCDL_RECORD_STARTUP": "1", "PYTHONUNBUFFERED": "1"}
    if os.path.basename(launch[0]) == "mpiexec":  # a job of its own, on a port of its own
        env = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "PMI_", "RANK", "WORLD_SIZE"))}
        env["MASTER_PORT"] = str(_free_port())
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise LaunchError(f"bench startup: the {leg} of {launch[-1]} ranks failed (exit {done.returncode}: "
                          f"{' '.join(cmd)}):\n{done.stderr[-3000:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _row(n: int, leg: str, run_dir: Path, checkpoint: int) -> StartupRow:
    records = [json.loads(Path(p).read_text()) for p in sorted(glob.glob(str(run_dir / "startup" / "rank*.json")))]
    if len(records) != n:
        raise LaunchError(f"bench startup: {len(records)} of {n} ranks wrote a start-up record in {run_dir}/startup")
    roots = sorted({root for r in records for root in r["reads"]})
    return StartupRow(
        ranks=n, leg=leg, phases_s={p: max(r["phases_s"].get(p, 0.0) for r in records) for p in PHASES},
        total_s=max(r["total_s"] for r in records),
        files_per_rank={root: sum(r["reads"][root]["files"] for r in records) / n for root in roots},
        bytes_per_rank={root: sum(r["reads"][root]["bytes"] for r in records) / n for root in roots},
        run_folder_bytes=sum(r["reads"]["run folder"]["bytes"] for r in records),
        checkpoint_bytes=checkpoint,
        store_connections=sum(r["store"]["connections"] for r in records),
        store_rendezvous_requests=sum(r["store"]["rendezvous_requests"] for r in records),
        store_requests_after_startup=sum(r["store_at_end"]["rendezvous_requests"] - r["store"]["rendezvous_requests"]
                                         for r in records),
        heartbeat_per_rank_per_s=_mean([r["store_at_end"]["heartbeat_requests_per_s"] for r in records]))


def _mean(values: list[float | None]) -> float | None:
    """The mean of those measured (a rank whose run ended before its second heartbeat has none)."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _fit(count: str, points: list[tuple[int, float]]) -> CountFit:
    """Least squares of ``count = a + b N``; one size: the count itself, no slope."""
    if not points:
        return CountFit(count, float("nan"), float("nan"))
    if len({n for n, _ in points}) < 2:
        return CountFit(count, points[0][1], 0.0)
    mean_n = sum(n for n, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = sum((n - mean_n) * (y - mean_y) for n, y in points) / sum((n - mean_n) ** 2 for n, _ in points)
    return CountFit(count, mean_y - slope * mean_n, slope)


def _store_capacity(clients: int, seconds: float, heartbeat_s: float, threads: int = 64) -> StoreCapacity:
    """Requests per second one TCPStore server answers with ``clients`` connections open, ``threads`` sending
    ``add`` (the heartbeat's request) round-robin over them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * clients + 256  # both ends of each connection live in this process
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ConfigError(f"--store-clients {clients} needs {need} open files; this shell allows {hard} "
                              f"(ulimit -n): lower --store-clients")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    port = _free_port()
    timeout = timedelta(seconds=60)
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timeout)
    threads = min(threads, clients)
    # Connected from all threads at once, as ranks do: one connection takes a round trip or more (0.2 s
    # here, where the reverse lookup of the client's address times out), which in a row would take minutes.
    conns: list = [None] * clients

    def connect(t: int) -> None:
        for i in range(t, clients, threads):
            conns[i] = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)

    _in_threads(connect, threads)
    done = [0] * threads
    stop = threading.Event()

    def send(t: int) -> None:
        mine = conns[t::threads]
        i = 0
        while not stop.is_set():
            mine[i % len(mine)].add(f"hb/{t}", 1)
            done[t] += 1
            i += 1

    def measure() -> None:
        time.sleep(min(1.0, seconds / 3))  # every thread sending
        before, start = sum(done), time.perf_counter()
        time.sleep(seconds)
        measured.append((sum(done) - before) / (time.perf_counter() - start))
        stop.set()

    measured: list[float] = []
    timer = threading.Thread(target=measure, daemon=True)
    timer.start()
    _in_threads(send, threads)  # until the timer stops them
    timer.join()
    rate = measured[0]
    del conns, server
    return StoreCapacity(clients=clients, threads=threads, requests_per_s=rate, heartbeat_s=heartbeat_s,
                         heartbeat_load=clients / heartbeat_s / rate)


def _in_threads(fn, threads: int) -> None:
    workers = [threading.Thread(target=fn, args=(t,), daemon=True) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def format_report(report: StartupReport) -> str:
    lines = ["# hpcdl train's start-up per job size: the slowest rank's time in each phase, seconds (inflated where "
             "the ranks outnumber the cores; the counts below are not)",
             f"{'ranks':>6} {'leg':<8} " + " ".join(f"{_short(p):>9}" for p in PHASES) + f" {'total':>8}"]
    for r in report.rows:
        lines.append(f"{r.ranks:>6} {r.leg:<8} " + " ".join(f"{r.phases_s[p]:>9.2f}" for p in PHASES)
                     + f" {r.total_s:>8.2f}")
    lines += ["# what grows with N: per rank unless marked",
              f"{'ranks':>6} {'leg':<8} {'py files':>9} {'py bytes':>9} {'data files':>10} {'run folder':>11} "
              f"{'checkpoint':>11} {'store conn':>10} {'rendezvous':>10} {'then':>10} {'heartbeat':>9}",
              f"{'':>6} {'':<8} {'':>9} {'MB':>9} {'':>10} {'MB, all':>11} {'MB':>11} {'':>10} {'requests':>10} "
              f"{'requests':>10} {'req/s':>9}"]
    for r in report.rows:
        data_files = r.files_per_rank.get("training data", 0) + r.files_per_rank.get("validation data", 0)
        beat = "-" if r.heartbeat_per_rank_per_s is None else f"{r.heartbeat_per_rank_per_s:.3f}"
        lines.append(f"{r.ranks:>6} {r.leg:<8} {r.files_per_rank.get('python', 0):>9.0f} "
                     f"{_mb(r.bytes_per_rank.get('python', 0)):>9} {data_files:>10.1f} "
                     f"{_mb(r.run_folder_bytes):>11} {_mb(r.checkpoint_bytes):>11} "
                     f"{r.store_connections / r.ranks:>10.2f} {r.store_rendezvous_requests / r.ranks:>10.1f} "
                     f"{r.store_requests_after_startup / r.ranks:>10.1f} {beat:>9}")
    lines.append("# fits against N (ranks), count = a + b N:")
    lines += [f"#   {f.count}: {f.intercept:.3g} + {f.slope:.3g} N" for f in report.fits]
    if report.store:
        s = report.store
        lines.append(f"# rank 0's store: {s.requests_per_s:,.0f} requests/s with {s.clients:,} connections open "
                     f"({s.threads} threads sending, one process); the heartbeat of {s.clients:,} ranks every "
                     f"{s.heartbeat_s:g} s sends {s.clients / s.heartbeat_s:,.0f}/s: {s.heartbeat_load:.1%} of it")
    return "\n".join(lines)


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def _short(phase: str) -> str:
    return {"interpreter and imports": "imports", "rendezvous and backend": "rendezv", "checkpoint read": "ckpt read",
            "data open": "data", "loader probe": "probe", "checkpoint restore": "restore",
            "first step": "1st step"}.get(phase, phase)
