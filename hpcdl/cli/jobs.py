"""``hpcdl sbatch``, ``hpcdl submit`` and ``hpcdl profiles``: jobs on a cluster's nodes."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field

from hpcdl.cli.common import command, exit_code
from hpcdl.cli.train import checked_config, parse_train
from hpcdl.errors import HpcdlError
from hpcdl.flags import meta
from hpcdl.launch.executor import hpcdl_command
from hpcdl.launch.executor import submit as submit_job
from hpcdl.launch.layout import load_layout, train_overrides
from hpcdl.launch.profiles import PROFILES
from hpcdl.launch.request import JobRequest
from hpcdl.launch.sbatch import render_sbatch
from hpcdl.launch.supervisor import from_slurm
from hpcdl.launch.train_job import TrainJob
from hpcdl.presets import resolve
from hpcdl.runs.outcome import summary_text
from hpcdl.runs.preflight import run_dir
from hpcdl.utils import atomic_write_text, format_duration

_COMMAND = meta(remainder=True)


@dataclass(kw_only=True, slots=True)
class SbatchCommand:
    write: str | None = field(default=None, metadata=meta(metavar="FILE"))  # write the script here instead of printing it
    # copy the Python environment to each node's local disk before the ranks start, and start them from that copy
    # (docs/launching.md: one archive read per node instead of thousands of files per rank)
    stage_env: bool = False
    command: tuple[str, ...] = field(default=(), metadata=_COMMAND)  # -- then the hpcdl command to run, e.g. -- bench allreduce


@dataclass(kw_only=True, slots=True)
class SubmitCommand:
    folder: str = "hpcdl-jobs/%j"  # submitit's log folder
    cluster: str | None = field(default=None, metadata=meta(choices=("slurm", "local")))  # where to run: slurm or local (default: slurm when it answers, else local)
    no_wait: bool = False  # return after submitting
    command: tuple[str, ...] = field(default=(), metadata=_COMMAND)  # -- then the hpcdl command to run, e.g. -- bench allreduce


@dataclass(kw_only=True, slots=True)
class SuperviseCommand:
    spares: int = 0  # the allocation's last nodes kept idle, each to take a lost node's place
    # restarts of the training step inside the allocation; the next failure ends the job (default: 3, or --spares
    # when more: each spare serves a restart)
    max_restarts: int | None = None
    tasks_per_node: int = 0  # ranks per node (0: SLURM_NTASKS_PER_NODE)
    probe_timeout_s: float = 15.0  # a suspect node that cannot run a one-task step in this long is lost
    # -- then what srun starts on every rank: PYTHON -m hpcdl train CONFIG --set ...
    command: tuple[str, ...] = field(default=(), metadata=_COMMAND)


@dataclass(kw_only=True, slots=True)
class ProfilesCommand:
    pass


def add_commands(sub) -> None:
    command(sub, "sbatch", sbatch, JobRequest, SbatchCommand,
            help="print or write an sbatch script that runs an hpcdl command")
    command(sub, "submit", submit, JobRequest, SubmitCommand,
            help="submit an hpcdl command through submitit (Slurm, or local processes)")
    command(sub, "supervise", supervise, SuperviseCommand,
            help="in a batch script: run the training step, and restart it inside the allocation when a rank or "
                 "node is lost (hpcdl sbatch --spares writes the call)")
    command(sub, "profiles", profiles, ProfilesCommand, help="list the cluster profiles")


def _argv(command: tuple[str, ...], req: JobRequest) -> list[str]:
    """The hpcdl command to run; a train command gets the precision and memory format of ``--layout``."""
    argv = list(command[1:] if command[:1] == ("--",) else command)
    if not argv:
        raise HpcdlError("no command given: put the hpcdl command after --, e.g. 'hpcdl sbatch ... -- bench allreduce'")
    if req.layout:
        argv = train_overrides(argv, load_layout(req.layout))
    return argv


def sbatch(req: JobRequest, cmd: SbatchCommand) -> int:
    argv = _argv(cmd.command, req)
    if argv[0] == "train":
        checked_config(parse_train(argv), req.ntasks)
    elif req.supervised:
        raise HpcdlError(f"--spares and --max-restarts restart a training step; '{argv[0]}' is not one: drop them")
    script = render_sbatch(req, argv, stage_env=cmd.stage_env)
    if cmd.write:
        atomic_write_text(cmd.write, script, mode=0o755)
        print(f"wrote {cmd.write}; submit it with: sbatch {cmd.write}", file=sys.stderr)
    else:
        sys.stdout.write(script)
    return 0


def submit(req: JobRequest, cmd: SubmitCommand) -> int:
    argv = _argv(cmd.command, req)
    if req.supervised:
        raise HpcdlError("--spares and --max-restarts need hpcdl's supervisor in the batch script, and submitit "
                         "writes its own and starts the ranks itself: use hpcdl sbatch --spares K ... -- train ... "
                         "(sbatch the file it writes), or drop them")
    params = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)}
    if argv[0] == "train":  # a checkpointable job object: submitit's requeue protocol reaches the trainer

        train = parse_train(argv)
        cfg = checked_config(train, req.ntasks)
        job = submit_job(TrainJob(train.config, list(train.set)), folder=cmd.folder, cluster=cmd.cluster,
                         **params | {"job_name": req.job_name if req.job_name != "hpcdl" else cfg.name})
    else:
        job = submit_job(hpcdl_command(argv), folder=cmd.folder, cluster=cmd.cluster, **params)
    print(f"submitted job {job.job_id}; logs in {job.paths.folder}", file=sys.stderr)
    if cmd.no_wait:
        return 0
    outputs = job.results()  # raises submitit.core.utils.FailedJobError with the task's traceback
    if outputs and isinstance(outputs[0], dict):
        print(summary_text(outputs[0]))
        return exit_code(outputs[0]["outcome"])
    sys.stdout.write(outputs[0] if outputs and isinstance(outputs[0], str) else "")
    return 0


def supervise(cmd: SuperviseCommand) -> int:
    ranks = list(cmd.command[1:] if cmd.command[:1] == ("--",) else cmd.command)
    at = next((i + 2 for i in range(len(ranks) - 2) if ranks[i:i + 3] == ["-m", "hpcdl", "train"]), None)
    if at is None:
        raise HpcdlError("hpcdl supervise restarts a training step: give what srun starts on each rank after --, "
                         "e.g. -- python3 -m hpcdl train PRESET --set ...")
    train = parse_train(ranks[at:])
    cfg = resolve(train.config, train.set)
    restarts = max(3, cmd.spares) if cmd.max_restarts is None else cmd.max_restarts
    return from_slurm(ranks, run_dir(cfg), cfg.global_batch, spares=cmd.spares, max_restarts=restarts,
                      tasks_per_node=cmd.tasks_per_node, probe_timeout_s=cmd.probe_timeout_s,
                      startup_s=cfg.loop.startup_timeout_s, stall_s=cfg.loop.timeout_s,
                      max_requeues=cfg.checkpoint.max_requeues).run()


def profiles(_: ProfilesCommand) -> int:
    for p in PROFILES.values():
        limits = ", ".join(x for x in (
            f"partition {p.partition}" if p.partition else "default partition",
            f"{p.cores_per_node} cores" if p.cores_per_node else "",
            f"{p.mem_gb_per_node} GB" if p.mem_gb_per_node else "",
            f"max {p.max_nodes} nodes" if p.max_nodes else "",
            f"max {format_duration(p.max_time)}" if p.max_time else "") if x)
        node = ", ".join(x for x in (
            f"{p.sockets} sockets, {p.numa_per_node} NUMA domains" if p.numa_per_node else "",
            f"{p.hbm_gb_per_node} GB HBM" if p.hbm_gb_per_node else "", p.cpu_flags,
            f"{p.peak_fp32_tflops:.2f} fp32 TFLOPS" if p.peak_fp32_tflops else "",
            f"{p.peak_bf16_tflops:.1f} bf16 TFLOPS" if p.peak_bf16_tflops else
            ("bf16 emulated" if p.peak_fp32_tflops else ""), p.network, p.fi_provider and f"libfabric {p.fi_provider}") if x)
        storage = ", ".join(x for x in (
            p.storage, f"{p.fs_gb_s:g} GB/s" if p.fs_gb_s else "", f"{p.fs_opens_per_s:,.0f} opens/s" if p.fs_opens_per_s
            else "", f"{p.local_disk_gb:g} GB node-local disk" if p.local_disk_gb else "") if x)
        print(f"{p.name:14s} {p.description}\n{'':14s} {limits}" + "".join(
            f"\n{'':14s} {text}" for text in (node, p.notes, p.source and f"source: {p.source}",
                                              p.unconfirmed and f"unconfirmed: {p.unconfirmed}",
                                              storage and f"storage: {storage} (source: {p.storage_source})") if text))
    return 0
