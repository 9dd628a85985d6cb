"""``hpcdl bench feed``: does the loader keep up? ``hpcdl train`` on packed JPEGs against the same training fed
from memory.

For each layout (``RANKSxTHREADS`` on this node: ``1x2`` is one process with 2 threads, ``2x1`` two ranks of
one thread each) and each precision, the runs of ``hpcdl train`` alternate, round by round:

- **jpeg, N workers**, one case for each N of ``workers`` (default 0, 1 and 4: the rank's own process, one
  worker, and ``data.workers``' default): the packed shards read, decoded and augmented by N DataLoader workers per
  rank, their cores sized by the rank at start-up (``data.reserve_cores=auto``, :mod:`hpcdl.train.loader_sizing`);
- **memory**: the same config with ``data.in_memory`` (a batch's worth of images decoded once, then trained on
  in turn) and no workers: the step with no loader in it.

Each run's figure is the median images/s of its steps after ``warmup`` (from rank 0's ``train.jsonl``); each
case's is the median of its rounds. Each ratio jpeg / memory is what that loader costs the job: 1.0 means
nothing. The ranks meet over gloo on loopback (``LOCAL_*`` variables, as torchrun sets them).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

from hpcdl.bench.configs import FeedBench as Config
from hpcdl.bench.reports import FeedReport, FeedRow, FeedRun
from hpcdl.bench.rounds import alternate, medians
from hpcdl.bench.runner import machine_line
from hpcdl.data.images import Encoding
from hpcdl.data.pack import PackConfig, pack
from hpcdl.data.synthetic import generate


def _packed(cfg: Config, tmp: str) -> str:
    if cfg.data:
        return cfg.data
    src, out = os.path.join(tmp, "jpeg"), os.path.join(tmp, "packed")
    ranks = max(int(layout.split("x")[0]) for layout in cfg.layouts)
    # one epoch holds every run's steps: a new epoch would start the workers again inside the timing
    generate(src, classes=10, per_class=-(-cfg.batch * ranks * (cfg.steps + cfg.warmup + 1) // 10))
    pack(PackConfig(src=src, out=out, shard_size="16M", encoding=Encoding(short_side=256)))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(cfg: Config, data: str, run: str, layout: str, precision: str, workers: int | None) -> FeedRun:
    """One ``hpcdl train`` on this node's ranks: with ``workers`` loader workers per rank, or (None) fed from
    memory."""
    memory = workers is None
    ranks, threads = (int(x) for x in layout.split("x"))
    args = [sys.executable, "-m", "hpcdl", "train", "resnet50_b8k_goyal", "--set", f"model={cfg.model}",
            "--set", f"global_batch={cfg.batch * ranks}", "--set", f"crop={cfg.crop}", "--set", f"data.train={data}",
            "--set", "data.val=", "--set", f"run_dir={run}", "--set", f"loop.max_steps={cfg.steps + cfg.warmup}",
            "--set", "loop.eval_every=0", "--set", f"loop.precision={precision}", "--set", "loop.backend=gloo",
            "--set", "checkpoint.every_steps=0", "--set", "epochs=1000", "--set", "loop.log_every=1000",
            "--set", f"data.workers={0 if memory else workers}",
            *(["--set", f"data.in_memory={cfg.batch}"] if memory else [])]
    port, cpus = _free_port(), sorted(os.sched_getaffinity(0))
    procs = []
    for r in range(ranks):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "OMPI_", "MPI_"))}
        env.update(RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        mine = cpus[r * threads:(r + 1) * threads] or cpus  # the rank's own cores, as srun --cpu-bind gives them
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      preexec_fn=lambda mine=mine: os.sched_setaffinity(0, mine)))
    logs = [p.communicate()[1] for p in procs]
    if any(p.returncode for p in procs):
        what = "memory" if memory else f"{workers} workers"
        raise RuntimeError(f"bench feed: hpcdl train ({layout}, {precision}, {what}) "
                           f"failed:\n{logs[0][-3000:]}")
    records = [json.loads(line) for line in open(os.path.join(run, "train.jsonl")) if '"kind": "step"' in line]
    timed = [r for r in records if r["step"] > cfg.warmup]
    rate = statistics.median(cfg.batch * ranks / r["t_step"] for r in timed)
    loader = next((line.split("INFO hpcdl.train.trainer: ", 1)[-1] for line in logs[0].splitlines()
                   if "loader: " in line), "")
    return FeedRun(images_per_s=rate, loader=loader, data_share=statistics.median(r["t_data"] / r["t_step"] for r in timed))


def run(cfg: Config, job=None) -> FeedReport:
    rows = []
    jpeg = {f"jpeg, {w} workers": w for w in cfg.workers}
    with tempfile.TemporaryDirectory(prefix="hpcdl-bench-feed-") as tmp:
        data = _packed(cfg, tmp)
        for layout in cfg.layouts:
            for precision in cfg.precisions:
                cases = {name: (lambda name=name, w=w, n=iter(range(10 ** 6)): _train(
                    cfg, data, os.path.join(tmp, f"run-{layout}-{precision}-{name.replace(', ', '-')}-{next(n)}"),
                    layout, precision, w)) for name, w in {**jpeg, "memory": None}.items()}
                runs = alternate(cases, cfg.rounds, warmup=0)
                median = medians(runs, key=lambda r: r.images_per_s)
                rows.append(FeedRow(layout=layout, precision=precision, images_per_s=median,
                                    ratios={k: median[k] / median["memory"] for k in jpeg},
                                    data_share={k: runs[k][-1].data_share for k in jpeg},
                                    loader=runs[max(jpeg, key=jpeg.get)][-1].loader,
                                    runs={k: tuple(v) for k, v in runs.items()}))
    return FeedReport(rows=tuple(rows))


def format_report(r: FeedReport) -> str:
    c = r.config
    lines = [machine_line(r),
             f"hpcdl train {c.model}, batch {c.batch} per rank at {c.crop} px: packed JPEGs (loader workers per rank: "
             f"{', '.join(map(str, c.workers))}) against the same step fed from memory, median of {c.rounds} "
             f"alternating rounds of {c.steps} steps after {c.warmup}:",
             f"  {'layout':8s} {'precision':9s} {'workers':>7s} {'jpeg img/s':>10s} {'memory img/s':>12s} "
             f"{'jpeg/memory':>11s} {'data wait':>9s}"]
    for row in r.rows:
        for case, ratio in row.ratios.items():
            workers = case.removeprefix("jpeg, ").removesuffix(" workers")
            lines.append(f"  {row.layout:8s} {row.precision:9s} {workers:>7s} {row.images_per_s[case]:10.2f} "
                         f"{row.images_per_s['memory']:12.2f} {ratio:10.3f}x {row.data_share[case]:9.1%}")
        lines.append(f"  {'':8s} {'':9s} loader sizing (rank 0, the most workers): {row.loader}")
    return "\n".join(lines) + "\n"
