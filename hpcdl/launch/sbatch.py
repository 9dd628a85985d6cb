"""``hpcdl sbatch``: a complete, quoted sbatch script for an hpcdl command.

Two quoting rules meet in one file. ``#SBATCH`` lines are read by sbatch's own parser, which groups
text in double quotes and takes ``\\"`` and ``\\\\`` as escapes; bash sees them as comments. The
script body is bash, quoted with :func:`shlex.quote`. A value that neither can carry (a newline) is
rejected by :class:`~hpcdl.launch.request.JobRequest`.

``python -m hpcdl.launch.sbatch DIR`` rewrites the ready scripts committed in ``slurm/``.
"""

from __future__ import annotations

import os
import re
import shlex
import sys

from hpcdl import __version__
from hpcdl.launch.layout import load_layout
from hpcdl.launch.request import JobRequest, job_request
from hpcdl.names import ALLOCATOR_CHOICES, ALLOCATORS
from hpcdl.utils import atomic_write_text, format_duration

__all__ = ["READY_SCRIPTS", "render_sbatch", "sbatch_quote", "write_ready_scripts"]

_ALLREDUCE = ["bench", "allreduce", "--json", "allreduce-%j.json"]


def _train_imagenet(preset: str, *extra: str) -> list[str]:
    """``hpcdl train PRESET`` on ImageNet packed in $SCRATCH (expanded on the nodes, not here)."""
    return ["train", preset, "--set", "data.train=$SCRATCH/imagenet1k/train", "--set",
            "data.val=$SCRATCH/imagenet1k/val", *extra]


_RUNS_IN_SCRATCH = ("--set", "run_dir=$SCRATCH/hpcdl-runs/{name}-{job}")

# The scripts committed in slurm/: name -> (job parameters, hpcdl command).
READY_SCRIPTS: dict[str, tuple[dict, list[str]]] = {
    "stampede2-skx.sbatch": (dict(profile="stampede2-skx", nodes=4, tasks_per_node=2, time="00:30:00",
                                  job_name="hpcdl-allreduce"), _ALLREDUCE),
    "stampede2-knl.sbatch": (dict(profile="stampede2-knl", nodes=4, tasks_per_node=1, time="00:30:00",
                                  job_name="hpcdl-allreduce"), _ALLREDUCE),
    "stampede3-spr.sbatch": (dict(profile="stampede3-spr", nodes=4, tasks_per_node=2, time="00:30:00",
                                  job_name="hpcdl-allreduce"), _ALLREDUCE),
    "generic.sbatch": (dict(profile="generic", nodes=1, tasks_per_node=2, time="00:30:00",
                            job_name="hpcdl-allreduce"), _ALLREDUCE),
    # The published Stampede2 runs (docs/reproduce-stampede2.md). The SKX ones keep 4 spare nodes: a lost node costs
    # a restart inside the job (docs/reliability.md); the KNL one uses the partition's 2,048 nodes, and without a
    # spare its batch of 32K would go on on 1,024 (the most nodes up to 2,047 that divide it): none there.
    "train-alexnet-bn-skx1024.sbatch": (
        dict(profile="stampede2-skx", partition="skx-large", nodes=512, spares=4, tasks_per_node=2, time="01:00:00",
             job_name="alexnet-bn-b32k", output="alexnet-bn-b32k-%j.out"),
        _train_imagenet("alexnet_bn_b32k_skx1024", *_RUNS_IN_SCRATCH)),
    "train-resnet50-skx1600.sbatch": (
        dict(profile="stampede2-skx", partition="skx-large", nodes=800, spares=4, tasks_per_node=2, time="02:00:00",
             job_name="resnet50-b32k", output="resnet50-b32k-%j.out"),
        _train_imagenet("resnet50_b32k_lars_skx1600", *_RUNS_IN_SCRATCH)),
    "train-resnet50-knl2048.sbatch": (
        dict(profile="stampede2-knl", partition="large", nodes=2048, tasks_per_node=1, time="02:00:00",
             job_name="resnet50-b32k", output="resnet50-b32k-%j.out"),
        _train_imagenet("resnet50_b32k_lars_knl2048", *_RUNS_IN_SCRATCH)),
    "train-generic.sbatch": (
        dict(profile="generic", nodes=4, tasks_per_node=2, time="12:00:00", job_name="resnet50-b8k",
             output="resnet50-b8k-%j.out"),
        _train_imagenet("resnet50_b8k_goyal")),
}
# Seconds before the time limit at which Slurm sends the requeue signal to a training job's ranks:
# enough for every rank to finish its step and rank 0 to write a ResNet-50 checkpoint to Lustre.
TRAIN_SIGNAL_GRACE_S = 180


_PLAIN = re.compile(r"[A-Za-z0-9_.,:%/@+=-]+")


def sbatch_quote(value: str) -> str:
    """Quote a value for an ``#SBATCH`` line so sbatch reads it back literally."""
    if _PLAIN.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _directives(req: JobRequest, command: list[str]) -> list[tuple[str, str | None]]:
    training = command[:1] == ["train"]
    return [
        ("job-name", req.job_name), ("partition", req.partition_name), ("account", req.account),
        ("qos", req.qos), ("nodes", str(req.allocated_nodes)), ("ntasks-per-node", str(req.tasks_per_node)),
        ("cpus-per-task", None if req.cpus_per_task is None else str(req.cpus_per_task)),
        ("time", format_duration(req.walltime)), ("output", req.output),
        # A training job checkpoints on the signal, requeues itself and appends to the same output file.
        ("signal", f"USR2@{TRAIN_SIGNAL_GRACE_S}" if training else None),
        ("requeue", "" if training else None), ("open-mode", "append" if training else None),
        # supervised: a failed node leaves the allocation alive; the supervisor takes a spare
        ("no-kill", "" if req.supervised else None),
    ]


def _header(req: JobRequest, command: list[str]) -> list[str]:
    prof = req.cluster_profile
    lines = [
        "#!/bin/bash",
        f"# Generated by hpcdl {__version__}: hpcdl sbatch --profile {prof.name} ... -- {shlex.join(command)}",
        f"# Profile {prof.name}: {prof.description}.",
    ]
    if prof.network:
        lines.append(f"# Network: {prof.network}.")
    if req.layout:
        chosen = load_layout(req.layout)
        lines.append(f"# Node layout from {req.layout} (hpcdl tune --measure on {chosen.node.get('host', '?')}, "
                     f"{chosen.images_per_s:.1f} images/s of {chosen.model}): {chosen.describe()}.")
    lines += [
        "#",
        "# Knobs. Edit the #SBATCH lines, or override them when submitting (sbatch --nodes=8 THIS_FILE):",
        "#   --nodes, --ntasks-per-node  ranks = nodes x tasks per node; one rank per socket is a good start.",
        "#   --cpus-per-task             cores per rank; keep tasks per node x cpus per task <= cores per node"
        + (f" ({prof.cores_per_node})." if prof.cores_per_node else "."),
        "#   --time                      wall clock" + (f", at most {format_duration(prof.max_time)} here."
                                                        if prof.max_time else "."),
        "# Environment read at run time (export before sbatch; sbatch passes the environment on):",
        "#   HPCDL_PYTHON      the Python that has hpcdl installed (default below).",
        f"#   HPCDL_ALLOCATOR   {' | '.join(ALLOCATOR_CHOICES)} (default auto: the first that loads of "
        f"{', '.join(ALLOCATORS)}).",
        "#   GLOO_SOCKET_IFNAME  the interface gloo uses, e.g. ib0, when the hostname resolves to Ethernet.",
        "#   SLURM_MPI_TYPE    srun's PMI plugin, when the command uses MPI (pmi2 for MPICH, pmix for Open MPI).",
        "#   HPCDL_FI_PROVIDER libfabric's provider for backend ccl across nodes (default below: the profile's;"
        " FI_PROVIDER, if exported, wins).",
    ]
    if prof.notes:
        lines.append(f"# Note: {prof.notes}")
    return lines


# --stage-env: the environment (sys.prefix of $HPCDL_PYTHON) packed once into an archive beside it on the shared
# filesystem, rebuilt when a package was installed or removed since (site-packages' mtime); one task per node
# unpacks it to node-local disk, and the ranks start from the copy. tar keeps the venv's links (bin/python to
# the base interpreter) and an editable install's path to its source.
_STAGE_ENV = [
    "# --stage-env: every rank would open the environment's thousands of files on the shared filesystem at once;",
    "# instead one archive of it is read per node and the ranks start from a node-local copy (docs/launching.md).",
    'env_root=$("$HPCDL_PYTHON" -c "import sys; print(sys.prefix if sys.prefix != sys.base_prefix else str())")',
    'if [ -z "$env_root" ]; then',
    '  echo "hpcdl: --stage-env copies a virtual environment; $HPCDL_PYTHON is not in one (make a venv with hpcdl," \\',
    '       "set HPCDL_PYTHON to its bin/python, or drop --stage-env)" >&2; exit 2',
    "fi",
    'archive="$env_root.hpcdl-env.tar"',
    'if [ ! -e "$archive" ] || [ -n "$(find "$env_root" -maxdepth 4 -name site-packages -newer "$archive")" ]; then',
    '  echo "hpcdl: packing $env_root into $archive"',
    '  tar -C "$env_root" -cf "$archive.$SLURM_JOB_ID.tmp" . && mv -f "$archive.$SLURM_JOB_ID.tmp" "$archive"',
    "fi",
    'HPCDL_STAGE="${HPCDL_STAGE_DIR:-${TMPDIR:-/tmp}}/hpcdl-env-$SLURM_JOB_ID"',
    "# bounded: under hpcdl supervise a lost node never answers, and the job would hold its allocation",
    "hpcdl_unstage() { timeout 120 srun --overlap --ntasks-per-node=1 --ntasks=\"$SLURM_JOB_NUM_NODES\" bash -c 'rm -rf \"$1/$SLURMD_NODENAME\"' "
    "unstage \"$HPCDL_STAGE\" || true; }",
    "trap hpcdl_unstage EXIT",
    "# one task per node unpacks the archive into $HPCDL_STAGE/NODE",
    "srun --ntasks-per-node=1 --ntasks=\"$SLURM_JOB_NUM_NODES\" --kill-on-bad-exit=1 bash -c "
    "'mkdir -p \"$1/$SLURMD_NODENAME\" && tar -C \"$1/$SLURMD_NODENAME\" -xf \"$2\"' unpack \"$HPCDL_STAGE\" \"$archive\"",
    'echo "hpcdl: environment staged in $HPCDL_STAGE/NODE on $SLURM_JOB_NUM_NODES node(s)"',
]


def render_sbatch(req: JobRequest, command: list[str], stage_env: bool = False) -> str:
    """The script: #SBATCH lines, tuning exports evaluated on the node, then srun of ``hpcdl COMMAND``; with
    ``stage_env``, the ranks start from a node-local copy of the Python environment."""
    lines = _header(req, command)
    lines += [f"#SBATCH --{key}" + (f"={sbatch_quote(value)}" if value else "")
              for key, value in _directives(req, command) if value is not None]
    lines += [
        "",
        "set -euo pipefail",
        f'if [ -z "${{HPCDL_PYTHON:-}}" ]; then HPCDL_PYTHON={shlex.quote(req.python or "python3")}; fi',
        *([f'export HPCDL_FI_PROVIDER="${{HPCDL_FI_PROVIDER:-{req.cluster_profile.fi_provider}}}"']
          if req.cluster_profile.fi_provider else []),
        "# The allocator acts only if chosen before Python starts; the node itself decides which one it has.",
        f'tuning=$("$HPCDL_PYTHON" -m hpcdl tune --exports --allocator "${{HPCDL_ALLOCATOR:-{req.allocator}}}")',
        'eval "$tuning"',
        "# srun does not inherit --cpus-per-task from the allocation (Slurm >= 22.05).",
        'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi',
        'echo "hpcdl: job $SLURM_JOB_ID on $SLURM_JOB_NUM_NODES node(s) ($SLURM_JOB_NODELIST), $SLURM_NTASKS tasks"',
        *(_STAGE_ENV if stage_env else []),
        *_launch(req, command, stage_env),
        "",
    ]
    return "\n".join(lines)


def _launch(req: JobRequest, command: list[str], stage_env: bool) -> list[str]:
    ranks = (f"""bash -c 'exec "$0/$SLURMD_NODENAME/bin/python" "$@"' "$HPCDL_STAGE" -m hpcdl {shlex.join(command)}"""
             if stage_env else f'"$HPCDL_PYTHON" -m hpcdl {shlex.join(command)}')
    if not req.supervised:
        return ["# --kill-on-bad-exit: one failed rank ends the step at once instead of holding the allocation.",
                f"srun --kill-on-bad-exit=1 {ranks}"]
    return [f"# hpcdl supervise trains on {req.nodes} of the {req.allocated_nodes} nodes and, when a rank or node is lost, "
            "restarts the step",
            "# inside this allocation from the survivors' just-in-time checkpoint, on a spare for a lost node "
            "(docs/reliability.md).",
            f'"$HPCDL_PYTHON" -m hpcdl supervise --spares {req.spares} --max-restarts {req.max_restarts} '
            f"--tasks-per-node {req.tasks_per_node} -- {ranks}"]


def write_ready_scripts(directory: str) -> list[str]:
    written = []
    for name, (params, command) in READY_SCRIPTS.items():
        path = os.path.join(directory, name)
        atomic_write_text(path, render_sbatch(job_request(**params), command), mode=0o755)
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write_ready_scripts(sys.argv[1] if len(sys.argv) > 1 else "slurm"):
        print(f"wrote {path}")
