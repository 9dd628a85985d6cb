"""``hpcdl``: the one command. Subcommands import their heavy dependencies (torch) only when run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

from hpcdl import __version__
from hpcdl.errors import HpcdlError, RankLostError
from hpcdl.utils import leave_now

log = logging.getLogger("hpcdl")


def _add_job_flags(p: argparse.ArgumentParser) -> None:
    from hpcdl.launch.job import JobRequest

    defaults = JobRequest.__dataclass_fields__
    p.add_argument("--profile", default="generic", help="cluster profile (hpcdl profiles lists them)")
    p.add_argument("--nodes", type=int, default=defaults["nodes"].default)
    p.add_argument("--tasks-per-node", type=int, default=defaults["tasks_per_node"].default)
    p.add_argument("--cpus-per-task", type=int, help="default: the profile's cores per node / tasks per node")
    p.add_argument("--time", default=defaults["time"].default, help="wall clock: MM, HH:MM:SS or D-HH:MM:SS")
    p.add_argument("--job-name", default=defaults["job_name"].default)
    p.add_argument("--output", default=defaults["output"].default, help="Slurm output path (%%j: job id)")
    p.add_argument("--partition", help="default: the profile's")
    p.add_argument("--account")
    p.add_argument("--qos")
    p.add_argument("--allocator", default="auto", help="auto | jemalloc | tcmalloc | glibc | none")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the hpcdl command to run, e.g. -- bench allreduce")


def _job_params(args: argparse.Namespace) -> dict:
    names = ("profile", "nodes", "tasks_per_node", "cpus_per_task", "time", "job_name", "output", "partition",
             "account", "qos", "allocator")
    return {n: getattr(args, n) for n in names}


def _command(args: argparse.Namespace) -> list[str]:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise HpcdlError("no command given: put the hpcdl command after --, e.g. 'hpcdl sbatch ... -- bench allreduce'")
    return command


def cmd_sbatch(args: argparse.Namespace) -> int:
    from hpcdl.launch.job import job_request
    from hpcdl.launch.sbatch import render_sbatch
    from hpcdl.utils import atomic_write_text

    command = _command(args)
    if command[0] == "train":
        _checked_train_config(build_parser().parse_args(command), args.nodes * args.tasks_per_node)
    script = render_sbatch(job_request(**_job_params(args), python=args.python), command)
    if args.write:
        atomic_write_text(args.write, script, mode=0o755)
        print(f"wrote {args.write}; submit it with: sbatch {args.write}", file=sys.stderr)
    else:
        sys.stdout.write(script)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from hpcdl.launch.executor import hpcdl_command, submit

    command = _command(args)
    if command[0] == "train":  # a checkpointable job object: submitit's requeue protocol reaches the trainer
        train_args = build_parser().parse_args(command)
        cfg = _checked_train_config(train_args, args.nodes * args.tasks_per_node)
        from hpcdl.train.job import TrainJob

        job = submit(TrainJob(train_args.config, train_args.set), folder=args.folder, cluster=args.cluster,
                     **_job_params(args) | {"job_name": args.job_name if args.job_name != "hpcdl" else cfg.name})
    else:
        job = submit(hpcdl_command(command), folder=args.folder, cluster=args.cluster, **_job_params(args))
    print(f"submitted job {job.job_id}; logs in {job.paths.folder}", file=sys.stderr)
    if args.no_wait:
        return 0
    outputs = job.results()  # raises submitit.core.utils.FailedJobError with the task's traceback
    if outputs and isinstance(outputs[0], dict):
        from hpcdl.train.metrics import summary_text

        print(summary_text(outputs[0]))
        return 0 if outputs[0]["outcome"] == "finished" else 3
    sys.stdout.write(outputs[0] if outputs and isinstance(outputs[0], str) else "")
    return 0


def _checked_train_config(args: argparse.Namespace, ranks: int):
    """The train command's config as it will run on ``ranks`` ranks: errors before anything is submitted."""
    from hpcdl.config import resolve
    from hpcdl.train.preflight import preflight

    return preflight(resolve(args.config, args.set), ranks)


def cmd_train(args: argparse.Namespace) -> int:
    from hpcdl.config import dump_yaml, resolve

    cfg = resolve(args.config, args.set)
    if args.print_config:
        sys.stdout.write(dump_yaml(cfg))
        return 0
    from hpcdl.train.trainer import train

    summary = train(cfg)
    return 0 if summary["outcome"] in ("finished", "requeued") else 3


def cmd_tune(args: argparse.Namespace) -> int:
    from hpcdl.distributed.affinity import allocator_exports, allocator_in_use, plan_cpus
    from hpcdl.distributed.env import discover

    if args.exports:
        sys.stdout.write(allocator_exports(args.allocator))
        return 0
    env = discover()
    plan = plan_cpus(local_rank=env.local_rank, local_size=env.local_size, comm_threads=args.comm_threads,
                     data_workers=args.data_workers)
    print(f"rank:      {env.describe()}")
    print(f"cpu:       {plan.describe()}")
    print(f"allocator: this process runs with {allocator_in_use()}")
    print("exports for the job script (hpcdl tune --exports):")
    sys.stdout.write("".join("  " + line + "\n" for line in allocator_exports(args.allocator).splitlines()))
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from hpcdl.distributed.env import discover

    # One write: under mpiexec the ranks share stdout, and print's separate newline can land after
    # another rank's line when Python runs unbuffered.
    sys.stdout.write(json.dumps(dataclasses.asdict(discover())) + "\n")
    sys.stdout.flush()
    return 0


def cmd_ccl(args: argparse.Namespace) -> int:
    from hpcdl.distributed import ccl_runtime

    if args.action == "install":
        root = ccl_runtime.install(Path(args.prefix) if args.prefix else None,
                                   wheels=Path(args.wheels) if args.wheels else None, force=args.force)
        print(f"oneCCL {ccl_runtime.VERSION} runtime in {root} (every file matches its pinned sha256)")
        if args.prefix and Path(args.prefix) != ccl_runtime.home():
            print(f"use it with: export HPCDL_CCL_HOME={root}")
        return 0
    ccl = ccl_runtime.load()
    print(f"oneCCL {ccl.version} from {ccl.runtime.library} ({ccl.runtime.source})")
    return 0


def cmd_profiles(args: argparse.Namespace) -> int:
    from hpcdl.launch.profiles import PROFILES
    from hpcdl.utils import format_duration

    for p in PROFILES.values():
        limits = ", ".join(x for x in (
            f"partition {p.partition}" if p.partition else "default partition",
            f"{p.cores_per_node} cores" if p.cores_per_node else "",
            f"{p.mem_gb_per_node} GB" if p.mem_gb_per_node else "",
            f"max {p.max_nodes} nodes" if p.max_nodes else "",
            f"max {format_duration(p.max_time)}" if p.max_time else "") if x)
        print(f"{p.name:14s} {p.description}\n{'':14s} {limits}" + (f"\n{'':14s} {p.notes}" if p.notes else ""))
    return 0


def cmd_bench_allreduce(args: argparse.Namespace) -> int:
    from hpcdl.bench.allreduce import bench

    report = bench(backend=args.backend, backends=args.backends, timeout_s=args.timeout,
                   startup_timeout_s=args.startup_timeout,
                   heartbeat_s=args.heartbeat, min_bytes=args.min_bytes, max_bytes=args.max_bytes, dtype=args.dtype,
                   warmup=args.warmup, seconds_per_size=args.seconds_per_size, max_iters=args.max_iters,
                   json_path=args.json)
    if report is not None and not all(row["correct"] for row in report["rows"]):
        log.error("allreduce produced wrong values; see the check column")
        return 1
    return 0


def cmd_bench_data(args: argparse.Namespace) -> int:
    from hpcdl.bench.data import DataBenchConfig, bench, format_report

    report = bench(DataBenchConfig(src=args.src, images=args.images, classes=args.classes,
                                   short_side=args.short_side, workers=args.workers, batch_size=args.batch_size,
                                   rounds=args.rounds, json_path=args.json))
    sys.stdout.write(format_report(report))
    return 0


def cmd_bench_optim(args: argparse.Namespace) -> int:
    from hpcdl.bench.optim import OptimBenchConfig, bench, format_report

    sys.stdout.write(format_report(bench(OptimBenchConfig(model=args.model, steps=args.steps, rounds=args.rounds,
                                                          threads=args.threads))))
    return 0


def cmd_bench_step(args: argparse.Namespace) -> int:
    from hpcdl.bench.step import StepBenchConfig, bench, format_report

    cfg = StepBenchConfig(model=args.model, batch=args.batch, crop=args.crop, steps=args.steps, rounds=args.rounds,
                          tuning_model=args.tuning_model, tuning_batch=args.tuning_batch, tuning_crop=args.tuning_crop,
                          tuning_steps=args.tuning_steps, tuning_rounds=args.tuning_rounds, threads=args.threads,
                          ranks_per_node=args.ranks_per_node, curve_batches=_ints(args.curve_batches, "--curve-batches"))
    report = bench(cfg, tuple(args.only.split(",")) if args.only else ("overhead", "tuning"))
    sys.stdout.write(format_report(report))
    if args.json:
        from hpcdl.utils import atomic_write_text

        atomic_write_text(args.json, json.dumps(report, indent=1) + "\n")
    return 0


def cmd_bench_sync(args: argparse.Namespace) -> int:
    from hpcdl.distributed.process_group import backend_groups, init_distributed, shutdown
    from hpcdl.bench.sync import SyncBenchConfig, bench, bucket_spec, format_comparison, format_report

    caps = {k: v for k, v in (("bucket_cap_mb", args.bucket_cap_mb), ("first_bucket_mb", args.first_bucket_mb))
            if v is not None}
    cfg = SyncBenchConfig(model=args.model, backend=args.backend, rounds=args.rounds, scaling_model=args.scaling_model,
                          scaling_batch=args.scaling_batch, scaling_steps=args.scaling_steps,
                          buckets=tuple(filter(None, args.buckets.split(","))), **caps)
    for spec in cfg.buckets:  # before any rank starts
        bucket_spec(spec)
    ctx = init_distributed("gloo" if args.backends else cfg.backend)
    groups = backend_groups(ctx, args.backends) if args.backends else {ctx.backend.name: ctx.group}
    reports = {name: bench(cfg, ctx.env, group) for name, group in groups.items()}
    if ctx.rank == 0:
        for report in reports.values():
            sys.stdout.write(format_report(report))
        if len(reports) > 1:
            sys.stdout.write(format_comparison(reports))
        if args.json:
            from hpcdl.utils import atomic_write_text

            out = reports if len(reports) > 1 else next(iter(reports.values()))
            atomic_write_text(args.json, json.dumps(out, indent=1) + "\n")
    shutdown(ctx)
    return 0


def cmd_bench_scaling(args: argparse.Namespace) -> int:
    from datetime import timedelta

    from hpcdl.distributed.process_group import init_distributed, shutdown
    from hpcdl.bench.scaling import ScalingBenchConfig, run

    cfg = ScalingBenchConfig(model=args.model, batch=args.batch, global_batch=args.global_batch, crop=args.crop,
                             steps=args.steps, warmup=args.warmup, rounds=args.rounds, ranks=_ints(args.ranks, "--ranks"),
                             modes=tuple(filter(None, args.modes.split(","))), threads=args.threads,
                             json_path=args.json, plot_path=args.plot)
    ctx = init_distributed(args.backend, timeout=timedelta(seconds=args.startup_timeout))
    cfg.points(ctx.world_size)  # a bad rank count or batch stops every rank before any work
    run(ctx, cfg, timedelta(seconds=args.timeout))
    shutdown(ctx)
    return 0


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise HpcdlError(f"{flag} {text!r}: give whole numbers separated by commas, e.g. 256,512,1024") from None


def cmd_plan(args: argparse.Namespace) -> int:
    from hpcdl.utils import atomic_write_text

    if args.validate:
        from hpcdl.plan.validate import format_validation, validate

        rows = validate()
        print(format_validation(rows))
        if args.json:
            atomic_write_text(args.json, json.dumps(rows, indent=1) + "\n")
        return 0
    from hpcdl.plan.planner import PlanInputs, format_plan, plan, plot

    if not args.nodes or not args.batch:
        raise HpcdlError("hpcdl plan needs --nodes and --batch (or --validate)")
    inputs = PlanInputs(model=args.model, profile=args.profile, throughput=args.throughput, step_json=args.step_json,
                        calibrate_json=args.calibrate, allreduce_json=args.allreduce_json,
                        intra_json=args.intra_allreduce_json, algorithm=args.algorithm,
                        ranks_per_node=args.ranks_per_node, overlap=args.overlap, data_images_s=args.data_images_s)
    model, notes = inputs.build()
    rows = plan(model, list(_ints(args.nodes, "--nodes")), args.batch, args.epochs, args.train_images)
    title = f"{args.model}, global batch {args.batch}, {args.epochs:g} epochs of {args.train_images:,} images"
    print(format_plan(rows, "\n".join(f"# {line}" for line in [title, *notes])))
    if args.json:
        atomic_write_text(args.json, json.dumps({"inputs": dataclasses.asdict(inputs), "notes": notes, "rows": rows},
                                                indent=1) + "\n")
    if args.plot:
        plot(rows, title, args.plot)
    return 0


def cmd_timeline(args: argparse.Namespace) -> int:
    from hpcdl.train.timeline import merge, render

    if args.action == "merge":
        print(merge(args.run_dir))
    else:
        print(render(args.trace, args.out, steps=args.steps, skip=args.skip))
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    from hpcdl.config import PRESETS, describe, resolve

    if args.action == "show":
        if not args.name:
            raise HpcdlError("hpcdl presets show NAME: name a preset (hpcdl presets lists them)")
        sys.stdout.write(describe(resolve(args.name, args.set)))
        return 0
    for name, fn in PRESETS.items():
        cfg = fn()
        first = (fn.__doc__ or describe(cfg).splitlines()[0]).strip().splitlines()[0]
        print(f"{name:28s} {cfg.model:10s} batch {cfg.global_batch:>6,} x {cfg.ranks:>4} ranks  {first}")
    return 0


def cmd_bench_large_batch(args: argparse.Namespace) -> int:
    from hpcdl.bench.largebatch import LargeBatchConfig, bench, format_report

    report = bench(LargeBatchConfig(epochs=args.epochs, seeds=args.seeds))
    sys.stdout.write(format_report(report))
    if args.json:
        from hpcdl.utils import atomic_write_text

        atomic_write_text(args.json, json.dumps(report, indent=1) + "\n")
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    from hpcdl.data.format import summarize
    from hpcdl.data.images import Encoding
    from hpcdl.data.pack import PackConfig, merge, pack
    from hpcdl.data.sources import SourceOptions

    if not args.merge and not args.src:
        raise HpcdlError("hpcdl pack needs SRC and OUT (or --merge OUT)")
    if args.merge:
        manifest = merge(args.out)
    else:
        manifest = pack(PackConfig(
            src=args.src, out=args.out, layout=args.layout, shard_size=args.shard_size, workers=args.workers,
            encoding=Encoding(max_side=args.max_side, short_side=args.short_side, quality=args.quality),
            resume=args.resume, seed=args.seed, part=args.part, image_timeout_s=args.image_timeout,
            sources=SourceOptions(names=args.names, val_labels=args.val_labels, synsets=args.synsets)))
    s = summarize(manifest)
    where = "dataset" if manifest.parts == 1 else f"part {manifest.part}/{manifest.parts}"
    print(f"{args.out}: {where} holds {s['images']} images in {s['shards']} shards; {s['rejected']} inputs "
          f"rejected {s['rejected_by_reason'] or ''} (reasons per file in the manifest)", file=sys.stderr)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from hpcdl.data.verify import verify

    problems = verify(args.dir, full=args.full, sample=args.sample)
    for p in problems:
        print(p)
    print(f"{args.dir}: {'OK' if not problems else f'{len(problems)} problems'}"
          f"{' (sha256 of every shard checked)' if args.full else ''}", file=sys.stderr)
    return 1 if problems else 0


def cmd_stage(args: argparse.Namespace) -> int:
    from hpcdl.data.stage import stage
    from hpcdl.distributed.env import discover

    local_rank = discover().local_rank
    print(stage(args.root, args.dest, local_rank, timeout_s=args.timeout))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpcdl", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hpcdl {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True, metavar="BENCH")
    p = bench.add_parser("allreduce", help="allreduce latency and bandwidth over message sizes, checked")
    p.add_argument("--backend", default="auto", help="auto | gloo | ccl | mpi")
    p.add_argument("--backends", help="compare several side by side in one run, e.g. gloo,mpi,ccl (mpi needs "
                   "mpiexec or srun --mpi)")
    p.add_argument("--min-bytes", help="smallest message (default: one element, 4 B for float32)")
    p.add_argument("--max-bytes", default="256M")
    p.add_argument("--dtype", default="float32", help="float32 | float64 | int64")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seconds-per-size", type=float, default=0.5, help="repeat each size for about this long")
    p.add_argument("--max-iters", type=int, default=1000)
    p.add_argument("--json", help="also write the report here (%%j: job id)")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in s once all ranks joined")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="timeout in s for all ranks to join")
    p.add_argument("--heartbeat", type=float, default=2.0, help="heartbeat interval in s (names lost ranks)")
    p.set_defaults(fn=cmd_bench_allreduce)

    p = bench.add_parser("data", help="shard reader vs ImageFolder vs a bare decode loop, images/s per worker")
    p.add_argument("--src", help="a class-folder tree of JPEGs (default: synthetic ImageNet-sized JPEGs)")
    p.add_argument("--images", type=int, default=3200, help="synthetic images to generate")
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--short-side", type=int, default=256, help="pack with this short side")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (processes) per reader")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="epochs per reader, alternating; the median counts")
    p.add_argument("--json", help="also write the report here (%%j: job id)")
    p.set_defaults(fn=cmd_bench_data)

    p = bench.add_parser("optim", help="one optimizer step: LARS and LAMB against torch SGD(foreach)")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds per optimizer, alternating; the median counts")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.set_defaults(fn=cmd_bench_optim)

    p = bench.add_parser("step", help="a training step through hpcdl vs a bare loop; ResNet-50 tuned vs untuned")
    p.add_argument("--model", default="resnet18", help="the overhead comparison's model")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--crop", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="steps per round")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds; the median counts")
    p.add_argument("--tuning-model", default="resnet50", help="the tuning comparison's model")
    p.add_argument("--tuning-batch", type=int, default=8, help="images per rank")
    p.add_argument("--tuning-crop", type=int, default=224)
    p.add_argument("--tuning-steps", type=int, default=2, help="steps per rank process")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks the tuning comparison runs at once")
    p.add_argument("--tuning-rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="the overhead comparison's threads (default: torch's)")
    p.add_argument("--only", help="overhead, tuning or curve, comma-separated (default: overhead,tuning; curve "
                                  "whenever --curve-batches is given)")
    p.add_argument("--curve-batches", default="", metavar="B,...",
                   help="also the tuned node's images/s at these per-rank batches (hpcdl plan --step-json reads it)")
    p.add_argument("--json", help="also write the report here")
    p.set_defaults(fn=cmd_bench_step)

    p = bench.add_parser("sync", help="a model's gradient set: per-tensor, fused, flat, each comm hook; latency, "
                          "weak scaling, bucket sweep (run on a job's ranks)")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--backend", default="auto", help="auto | gloo | ccl | mpi")
    p.add_argument("--backends", help="compare several in one run, e.g. gloo,mpi,ccl: each runs the whole benchmark "
                   "in turn on its own group")
    p.add_argument("--bucket-cap-mb", type=float, help="hpcdl's DDP: the bucket cap (default: sync.bucket_cap_mb)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--scaling-model", default="alexnet_bn", help="weak scaling: this model, 1 rank vs all")
    p.add_argument("--scaling-batch", type=int, default=32, help="weak scaling: images per rank")
    p.add_argument("--scaling-steps", type=int, default=3, help="weak scaling: steps per measurement (0: skip)")
    p.add_argument("--first-bucket-mb", type=float,
                   help="hpcdl's DDP: the first bucket's cap (default: sync.first_bucket_mb)")
    p.add_argument("--buckets", default="", metavar="FIRST:CAP,...",
                   help="bucket sweep of the scaling model's DDP step, e.g. 25,1:25,5,100 (MB; default: skip)")
    p.add_argument("--json", help="also write the report here")
    p.set_defaults(fn=cmd_bench_sync)

    p = bench.add_parser("scaling", help="training throughput at 1, 2, 4 ... N ranks, weak and strong: table, JSON, "
                                         "PNG (run on a job's ranks)")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=8, help="weak scaling: images per rank")
    p.add_argument("--global-batch", type=int, help="strong scaling: images per step (default: batch x largest count)")
    p.add_argument("--crop", type=int, help="image side in px (default: the model's training crop)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per point and round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first, each round")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds over the points")
    p.add_argument("--ranks", default="", help="rank counts, e.g. 1,2,4 (default: 1, 2, 4 ... and the job's size)")
    p.add_argument("--modes", default="weak,strong", help="weak, strong or both")
    p.add_argument("--threads", type=int, default=0,
                   help="compute threads per rank (default: hpcdl's CPU plan; give 1 when simulated nodes share cores)")
    p.add_argument("--backend", default="auto", help="auto | gloo | ccl | mpi")
    p.add_argument("--json", help="write the report here (%%j: job id); hpcdl plan --calibrate reads it")
    p.add_argument("--plot", help="write a PNG here (%%j: job id; needs matplotlib: hpcdl[plot])")
    p.add_argument("--timeout", type=float, default=1800.0, help="collective timeout in s once all ranks joined")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="timeout in s for all ranks to join")
    p.set_defaults(fn=cmd_bench_scaling)

    p = bench.add_parser("large-batch", help="LARS + warmup at batch N/8 vs small-batch SGD vs linear-scaled SGD, "
                                             "on scikit-learn's digits")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--json", help="also write the report here")
    p.set_defaults(fn=cmd_bench_large_batch)

    _add_pack_parser(sub)
    _add_plan_parser(sub)
    p = sub.add_parser("verify", help="check a packed dataset's shards against its manifest")
    p.add_argument("dir", help="the dataset root (where manifest.json is)")
    p.add_argument("--full", action="store_true", help="also compare every shard's sha256")
    p.add_argument("--sample", type=int, default=4, help="images to decode per shard")
    p.set_defaults(fn=cmd_verify)

    p = sub.add_parser("stage", help="copy a packed dataset to node-local disk once per node; prints its path",
                       description="Local rank 0 copies and verifies; the node's other local ranks wait.")
    p.add_argument("root", help="the packed dataset (where manifest.json is)")
    p.add_argument("dest", help="node-local directory, e.g. $TMPDIR")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds the other local ranks wait")
    p.set_defaults(fn=cmd_stage)

    p = sub.add_parser("sbatch", help="print or write an sbatch script that runs an hpcdl command")
    _add_job_flags(p)
    p.add_argument("--python", help="interpreter with hpcdl on the compute nodes (default: python3 on PATH)")
    p.add_argument("--write", metavar="FILE", help="write the script here instead of printing it")
    p.set_defaults(fn=cmd_sbatch)

    p = sub.add_parser("submit", help="submit an hpcdl command through submitit (Slurm, or local processes)")
    _add_job_flags(p)
    p.add_argument("--folder", default="hpcdl-jobs/%j", help="submitit's log folder")
    p.add_argument("--cluster", choices=("slurm", "local"), help="default: slurm when it answers, else local")
    p.add_argument("--no-wait", action="store_true", help="return after submitting")
    p.set_defaults(fn=cmd_submit)

    p = sub.add_parser("tune", help="show this rank's CPU plan and allocator, or print the exports for a job script")
    p.add_argument("--exports", action="store_true", help="print shell export lines only")
    p.add_argument("--allocator", default="auto", help="auto | jemalloc | tcmalloc | glibc | none")
    p.add_argument("--comm-threads", type=int, default=0)
    p.add_argument("--data-workers", type=int, default=0)
    p.set_defaults(fn=cmd_tune)

    p = sub.add_parser("presets", help="list the presets of published runs, or show one resolved")
    p.add_argument("action", nargs="?", choices=("list", "show"), default="list")
    p.add_argument("name", nargs="?")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set global_batch=16384 --set optimizer.lr=25 (repeatable)")
    p.set_defaults(fn=cmd_presets)

    p = sub.add_parser("train", help="train a preset or a YAML config on this job's ranks",
                       description="Runs the same under srun, mpiexec, torchrun, submitit and as one process; "
                                   "resumes from the newest checkpoint in the run folder.")
    p.add_argument("config", help="a preset name (hpcdl presets) or a YAML file (a run folder's config.yaml, or "
                                   "'preset: NAME' plus the keys to change)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set data.train=$SCRATCH/imagenet1k/train (repeatable)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.set_defaults(fn=cmd_train)

    timeline = sub.add_parser("timeline", help="per-rank trace timelines").add_subparsers(dest="action", required=True)
    p = timeline.add_parser("merge", help="all ranks' spans as RUN_DIR/timeline.json (chrome://tracing, Perfetto)")
    p.add_argument("run_dir")
    p.set_defaults(fn=cmd_timeline)
    p = timeline.add_parser("render", help="a PNG of a merged trace's steps (needs matplotlib: hpcdl[plot])")
    p.add_argument("trace", help="a merged trace (RUN_DIR/timeline.json)")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--steps", type=int, default=1, help="training steps to show")
    p.add_argument("--skip", type=int, default=2, help="steps to skip first (start-up)")
    p.set_defaults(fn=cmd_timeline)

    sub.add_parser("env", help="print this process's rank discovery as JSON").set_defaults(fn=cmd_env)
    ccl = sub.add_parser("ccl", help="the oneCCL runtime of backend ccl").add_subparsers(dest="action", required=True)
    p = ccl.add_parser("install", help="assemble hpcdl's pinned oneCCL runtime from PyPI's wheels (sha256-checked); "
                       "run it on the login node")
    p.add_argument("--prefix", help="where (default: HPCDL_CCL_HOME, or ~/.cache/hpcdl/oneccl-VERSION)")
    p.add_argument("--wheels", help="a folder holding the wheels already (no download)")
    p.add_argument("--force", action="store_true", help="assemble it again even if it is there")
    p.set_defaults(fn=cmd_ccl)
    ccl.add_parser("info", help="which libccl backend ccl loads, from which source, and its version"
                   ).set_defaults(fn=cmd_ccl)
    sub.add_parser("profiles", help="list the cluster profiles").set_defaults(fn=cmd_profiles)
    return parser


def _add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict step time, time to train and efficiency at each node count",
                       description="A performance model (docs/scaling.md): per-node compute, the all-reduce's "
                                   "alpha-beta cost, its overlap with backward, data loading. --validate checks "
                                   "it against published Stampede2 runs.")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--nodes", default="", help="node counts, e.g. 256,512,1024,1600,2048")
    p.add_argument("--batch", type=int, help="global batch, e.g. 32768")
    p.add_argument("--epochs", type=float, default=90)
    p.add_argument("--train-images", type=int, default=1_281_167, help="images per epoch (default: ImageNet-1K)")
    p.add_argument("--profile", default="generic", help="the cluster: its network (hpcdl profiles lists them)")
    p.add_argument("--throughput", help="one node's compute: IMAGES_S, or BATCH:IMAGES_S,... against its batch")
    p.add_argument("--step-json", help="one node's compute from hpcdl bench step --json (with --curve-batches: "
                                       "its curve)")
    p.add_argument("--calibrate", metavar="RESULTS.json",
                   help="fit the compute and the overlap to hpcdl bench scaling --json")
    p.add_argument("--allreduce-json", help="fit the network's latency and bandwidth to hpcdl bench allreduce --json "
                                            "(default: the profile's)")
    p.add_argument("--algorithm", default="ring", choices=("ring", "rabenseifner", "hierarchical"))
    p.add_argument("--intra-allreduce-json", help="hierarchical: hpcdl bench allreduce --json on one node's ranks")
    p.add_argument("--ranks-per-node", type=int, help="default: the calibration's, else the profile's sockets")
    p.add_argument("--overlap", type=float, help="fraction of backward the all-reduce can hide behind, 0-1 "
                                                 "(default: the calibration's, else 0)")
    p.add_argument("--data-images-s", type=float, help="one node's data-loading capacity (hpcdl bench data)")
    p.add_argument("--validate", action="store_true", help="check the model against the published runs")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--plot", help="write a PNG of time to train and efficiency against nodes (needs hpcdl[plot])")
    p.set_defaults(fn=cmd_plan)


def _add_pack_parser(sub) -> None:
    from hpcdl.data.sources import LAYOUTS

    p = sub.add_parser("pack", help="pack images into HDF5 shards with a manifest",
                       description="Pack SRC into shards in OUT. Inside a Slurm array or an MPI/srun job, "
                                   "each task packs its part and the last one merges the manifest.")
    p.add_argument("src", nargs="?", help="the images (see --layout)")
    p.add_argument("out", help="the dataset root to write")
    p.add_argument("--layout", default="folder", choices=list(LAYOUTS))
    p.add_argument("--shard-size", default="512MB", help="bytes of images per shard")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--max-side", type=int, help="resize so the longer side is at most N")
    size.add_argument("--short-side", type=int, help="resize so the shorter side is at most N")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality when re-encoding")
    p.add_argument("--workers", type=int, default=0, help="encoding processes (default: one per CPU)")
    p.add_argument("--resume", action="store_true", help="keep finished, verified shards and go on")
    p.add_argument("--image-timeout", type=float, default=60.0, metavar="S",
                   help="reject an input that takes longer than S seconds to read and decode")
    p.add_argument("--seed", type=int, default=0, help="the shuffle before sharding")
    p.add_argument("--part", help="i/n: pack part i of n (default: from the Slurm array or MPI rank)")
    p.add_argument("--merge", action="store_true", help="only merge finished parts into manifest.json")
    p.add_argument("--names", help="file of 'wnid human name' lines (synset_words.txt)")
    p.add_argument("--val-labels", help="imagenet-val: ILSVRC2012_validation_ground_truth.txt")
    p.add_argument("--synsets", help="imagenet-val: wnids in ILSVRC2012_ID order, or map_clsloc.txt")
    p.set_defaults(fn=cmd_pack)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank = _rank_for_logging()
    from hpcdl.log import setup_logging

    setup_logging(rank, args.verbose)
    try:
        return args.fn(args)
    except RankLostError as exc:
        log.error("%s", exc)
        leave_now(1)  # a broken process group can hang interpreter shutdown
    except HpcdlError as exc:
        log.error("%s", exc)
        if _one_rank_of_many():  # the others notice its heartbeat stop; finalizing could wait on them
            leave_now(2)
        return 2


def _one_rank_of_many() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _rank_for_logging() -> int:
    from hpcdl.distributed.env import LAUNCHERS

    row = next((r for r in LAUNCHERS if r.marker in os.environ), None)
    value = os.environ.get(row.rank, "0") if row else "0"
    return int(value) if value.isdigit() else 0  # a bad value is reported by discovery itself
