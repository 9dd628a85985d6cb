"""``hpcdl plan``: a job's step time, epoch time, time to train and efficiency at each node count.

The model is :class:`hpcdl.plan.cost.StepModel`. Its inputs, and where each comes from:

- per-node compute: images/s against the node's batch, given (``--throughput``), from ``hpcdl bench step
  --json`` (its tuned node, and its throughput-vs-batch curve when it measured one), or fitted from
  ``hpcdl bench scaling --json`` (``--calibrate``);
- the gradient bytes and DDP's bucket count: from the model's parameters;
- the network: the profile's alpha-beta link, or one fitted to ``hpcdl bench allreduce --json``;
- the all-reduce algorithm, the overlap with backward, and the data-loading capacity per node: flags,
  or (overlap, backward's share of compute) fitted by ``--calibrate``;
- start-up and restart (:class:`hpcdl.plan.startup_terms.StartupModel`): the counts of ``hpcdl bench startup
  --json`` (``--startup-json``; default: :data:`STARTUP_MEASURED`) over the shared filesystem's and rank 0's
  rates (flags, assumed where the cluster's are unknown);
- the checkpoint's size and a rank's memory: the weights and the optimizer's state (``--optimizer``: its row's
  ``state_copies`` in :data:`hpcdl.names.OPTIMIZER_TABLE`);
- the data path (:mod:`hpcdl.plan.data_path`): the dataset's bytes over the filesystem's bandwidth and metadata rate
  and node-local disk (the profile's figures, cited, or flags; the command prints its table after the plan's).

:mod:`hpcdl.plan.measured` reads and fits the benchmarks' reports. ``--validate`` checks the model against
published runs (:mod:`hpcdl.plan.published`).
"""

from __future__ import annotations

import dataclasses
import math

from hpcdl import names
from hpcdl.bench.reports import AllreduceReport, ScalingReport, StartupReport, StepReport, SyncReport
from hpcdl.config import SyncConfig
from hpcdl.errors import ConfigError, DataError
from hpcdl.flags import meta
from hpcdl.launch.profiles import get_profile
from hpcdl.model_facts import ModelFacts, model_facts
from hpcdl.names import IMAGENET_TRAIN
from hpcdl.plan.cost import ALGORITHM_CHOICES, BACKWARD_SHARE, BatchCurve, Link, StepModel, hook_terms
from hpcdl.plan.data_path import Figure, resolve_figure
from hpcdl.plan.measured import calibrate, curve_from_step, link_from_allreduce
from hpcdl.plan.startup_terms import StartupModel
from hpcdl.plan.validate import FITTED, NodeCompute, carried_compute
from hpcdl.plot import counts_axis, pyplot, save_png
from hpcdl.presets import get_preset

__all__ = ["PlanInputs", "PlanQuestion", "figure", "format_plan", "memory_note", "plan", "plot", "state_bytes"]


def state_bytes(optimizer: str, weight_bytes: float) -> float:
    """The optimizer's state for ``weight_bytes`` of fp32 weights: its row's ``state_copies`` tensors per weight
    (:data:`hpcdl.names.OPTIMIZER_TABLE`; momentum: 1; Adam's moments: 2; Schedule-Free AdamW: z and one moment;
    Muon: its momentum, a lower bound where its AdamW tensors keep 2)."""
    return names.OPTIMIZER_TABLE[optimizer].state_copies * weight_bytes


def memory_note(optimizer: str, weight_bytes: float) -> str:
    """A rank's memory for the model's training state: weights, gradients and the optimizer's state."""
    state = state_bytes(optimizer, weight_bytes)
    row = names.OPTIMIZER_TABLE[optimizer]
    plain = names.OPTIMIZER_TABLE[row.plain].state_copies if row.plain else 0  # the tensors it does not adapt
    bound = f" at least (its {row.plain} tensors keep {plain})" if plain > row.state_copies else ""
    return (f"memory per rank for the training state: weights {weight_bytes / 1e6:.0f} MB + gradients "
            f"{weight_bytes / 1e6:.0f} MB + optimizer {optimizer}'s state {state / 1e6:.0f} MB "
            f"({row.state_copies} tensor per weight{bound}) = "
            f"{(2 * weight_bytes + state) / 1e6:.0f} MB, activations not counted; the checkpoint holds the weights "
            f"and the state: {(weight_bytes + state) / 1e6:.0f} MB")


# hpcdl bench startup on this repository's 2-core EPYC (docs/scaling.md): the counts that --startup-json replaces.
# The rendezvous' store requests per rank, a + b N, by backend: gloo connects every pair of ranks through the
# store; oneCCL's ranks fetch one unique id (twice: the job's two groups); MPI bootstraps through its launcher.
STARTUP_MEASURED = {"python_files": 1940.0, "local_import_s": 3.4, "store_requests_per_s": 58000.0}
RENDEZVOUS_MEASURED = {"gloo": (2.0, 4.0), "ccl": (2.0, 0.0), "mpi": (0.0, 0.0)}
# The filesystem's figures start-up assumes where neither a flag nor the profile gives one (the data path asks instead)
FS_ASSUMED = {"--fs-opens-per-s": 50000.0, "--fs-gb-s": 100.0}


def plan(model: StepModel, nodes: list[int], global_batch: int, epochs: float, train_images: int,
         startup: StartupModel | None = None) -> list[dict]:
    """The model's terms at each node count, with epoch time and time to train, and start-up and restart."""
    steps = math.ceil(train_images / global_batch)
    rows = []
    for n in nodes:
        if n < 1:
            raise ConfigError(f"--nodes {n}: a job has at least 1 node")
        t = model.terms(n, global_batch)
        rows.append({"nodes": n, "ranks": n * model.ranks_per_node, **t, "steps_per_epoch": steps,
                     "epoch_s": steps * t["step_s"], "time_to_train_s": epochs * steps * t["step_s"],
                     "dominant": _dominant(t), **(startup.terms(n, t["step_s"]) if startup else {})})
    return rows


def _dominant(t: dict) -> str:
    terms = {"compute": t["compute_s"], "all-reduce latency (exposed)": t["exposed_s"] * _part(t, "latency"),
             "all-reduce bandwidth (exposed)": t["exposed_s"] * _part(t, "bandwidth"), "data loading": t["data_s"]}
    return max(terms, key=terms.get)


def _part(t: dict, which: str) -> float:
    return t[f"allreduce_{which}_s"] / t["allreduce_s"] if t["allreduce_s"] else 0.0


def format_plan(rows: list[dict], header: str) -> str:
    lines = [header, f"{'nodes':>6} {'ranks':>6} {'batch/node':>10} {'compute':>9} {'ar alpha':>9} {'ar beta':>9} "
             f"{'hidden':>8} {'exposed':>8} {'data':>8} {'step':>9} {'images/s':>10} {'eff':>6} {'epoch':>8} "
             f"{'to train':>9}  dominant", f"{'':>6} {'':>6} {'':>10} {'ms':>9} {'ms':>9} {'ms':>9} {'ms':>8} "
             f"{'ms':>8} {'ms':>8} {'ms':>9} {'':>10} {'':>6} {'min':>8} {'min':>9}"]
    for r in rows:
        lines.append(f"{r['nodes']:>6} {r['ranks']:>6} {r['batch_per_node']:>10.1f} {r['compute_s'] * 1e3:>9.1f} "
                     f"{r['allreduce_latency_s'] * 1e3:>9.2f} {r['allreduce_bandwidth_s'] * 1e3:>9.2f} "
                     f"{r['hidden_s'] * 1e3:>8.1f} {r['exposed_s'] * 1e3:>8.1f} {r['data_s'] * 1e3:>8.1f} "
                     f"{r['step_s'] * 1e3:>9.1f} {_rate(r['images_s']):>10} {r['efficiency']:>6.1%} "
                     f"{r['epoch_s'] / 60:>8.2f} {r['time_to_train_s'] / 60:>9.1f}  {r['dominant']}")
    if rows and "startup_s" in rows[0]:
        lines += ["# start-up (ranks' start to first step) and restart (the same, and the checkpoint read once and "
                  "broadcast), s; imports on the shared filesystem beside --stage-env's",
                  f"{'nodes':>6} {'ranks':>6} {'imports':>9} {'staged':>9} {'rendezv':>9} {'1st step':>9} "
                  f"{'ckpt':>9} {'start-up':>9} {'restart':>9} {'restart':>8}",
                  f"{'':>6} {'':>6} {'shared fs':>9} {'':>9} {'':>9} {'':>9} {'':>9} {'':>9} {'':>9} "
                  f"{'of train':>8}"]
        for r in rows:
            lines.append(f"{r['nodes']:>6} {r['ranks']:>6} {r['imports_shared_fs_s']:>9.1f} {r['imports_staged_s']:>9.1f} "
                         f"{r['rendezvous_s']:>9.1f} {r['first_step_s']:>9.2f} {r['checkpoint_s']:>9.2f} "
                         f"{r['startup_s']:>9.1f} {r['restart_s']:>9.1f} {r['restart_s'] / r['time_to_train_s']:>8.1%}")
    return "\n".join(lines)


def bf16_compute(node, profile):
    """The fp32 node compute carried to bf16 autocast: the per-image work runs ``bf16_step_speedup`` times faster
    (the profile's measured step, not the AMX peak: the step reaches a smaller fraction of bf16's peak than of
    fp32's); the fixed part (the fp32 weight update, per-layer calls) stays."""
    if not profile.bf16_flops_per_cycle:
        raise ConfigError(f"profile {profile.name}'s CPUs have no avx512_bf16 or AMX: bf16 is emulated there and many "
                          f"times slower than fp32; plan --precision fp32, or choose a node with AMX (stampede3-spr)")
    if not profile.bf16_step_speedup:
        raise ConfigError(f"profile {profile.name} has native bf16 but no measured bf16_step_speedup; measure it with "
                          f"hpcdl bench step on one of its nodes, or give --step-json")
    return (NodeCompute(node.fixed_s, node.per_image_s / profile.bf16_step_speedup),
            f", then bf16 at {profile.bf16_step_speedup:g}x fp32's per-image speed (the profile's measured step; "
            f"peak {profile.peak_bf16_tflops:.0f} bf16 TFLOPS a node)")


def _rate(v: float) -> str:
    return f"{v:,.0f}" if v >= 1000 else f"{v:.1f}" if v >= 100 else f"{v:.3f}"


def figure(rows: list[dict], title: str):
    """Predicted time to train and efficiency against node count."""
    plt = pyplot("hpcdl plan --plot")
    nodes = [r["nodes"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(nodes, [r["time_to_train_s"] / 60 for r in rows], "o-", color="#4c72b0", label="predicted")
    ideal = rows[0]["time_to_train_s"] * rows[0]["nodes"] / 60
    left.plot(nodes, [ideal / n for n in nodes], "--", color="grey", label=f"linear from {nodes[0]} nodes")
    left.set_ylabel("time to train, min")
    right.plot(nodes, [r["efficiency"] * 100 for r in rows], "o-", color="#dd8452", label="compute / step")
    right.set_ylabel("efficiency, %")
    right.set_ylim(0, 105)
    counts_axis((left, right), nodes, "nodes")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot(rows: list[dict], title: str, out: str) -> str:
    return save_png(figure(rows, title), out)


def parse_throughput(text: str) -> BatchCurve:
    """``IMAGES_S`` (at any batch) or ``BATCH:IMAGES_S,...``: one node's compute."""
    try:
        if ":" not in text:
            return BatchCurve(((1.0, float(text)),))
        return BatchCurve(tuple((float(b), float(v)) for b, v in (item.split(":") for item in text.split(","))))
    except ValueError:
        raise ConfigError(f"--throughput {text!r}: give images/s per node, or BATCH:IMAGES_S pairs separated by "
                          f"commas (e.g. 32:80,64:98.5)") from None


@dataclasses.dataclass(kw_only=True, slots=True)
class PlanQuestion:
    """What to plan: a global batch for so many epochs, at each node count."""

    nodes: tuple[int, ...] = ()  # node counts, e.g. 256,512,1024,1600,2048
    batch: int | None = None  # the global batch, e.g. 32768
    epochs: float = 90  # epochs to train
    train_images: int = IMAGENET_TRAIN  # images per epoch (default: ImageNet-1K)
    # a preset (hpcdl presets): its global batch, epochs, images per epoch and model replace those flags'
    preset: str = ""

    def __post_init__(self):
        if self.preset:
            cfg = get_preset(self.preset)
            self.batch, self.epochs, self.train_images = cfg.global_batch, cfg.epochs, cfg.train_images
        if not self.nodes or not self.batch:
            raise ConfigError("hpcdl plan needs --nodes and --batch, or --preset (or --validate)")


@dataclasses.dataclass(kw_only=True, slots=True)
class PlanInputs:
    """Where each of the model's inputs comes from; exactly one source of compute."""

    model: str = "resnet50"  # the model to plan for (its gradient bytes and FLOPs)
    classes: int = 1000  # the model's outputs (its head's share of the gradient bytes and FLOPs)
    profile: str = "generic"  # the cluster: its network (hpcdl profiles lists them)
    throughput: str | None = None  # one node's compute: IMAGES_S, or BATCH:IMAGES_S,... against its batch
    # one node's compute from hpcdl bench step --json (with --curve-batches: its curve); FILE,FILE,...: one report
    # per node of the allocation (bench step --json step-%N.json on every node at once), the slowest node counts
    step_json: str | None = None
    # fit the compute and the overlap to hpcdl bench scaling --json
    calibrate_json: str | None = dataclasses.field(default=None, metadata=meta(flag="--calibrate", metavar="RESULTS.json"))
    # fit the network's latency and bandwidth to hpcdl bench allreduce --json (default: the profile's)
    allreduce_json: str | None = None
    # of a --backends report (allreduce, sync), the backend whose figures count: gloo, mpi4py or oneccl (default: the first)
    allreduce_backend: str | None = None
    # hierarchical: hpcdl bench allreduce --json on one node's ranks (the node's own link)
    intra_json: str | None = dataclasses.field(default=None, metadata=meta(flag="--intra-allreduce-json"))
    algorithm: str = dataclasses.field(default="ring", metadata=meta(choices=ALGORITHM_CHOICES))  # the all-reduce's algorithm
    ranks_per_node: int | None = None  # ranks per node (default: the calibration's, else the profile's sockets)
    overlap: float | None = None  # fraction of backward the all-reduce can hide behind, 0-1 (default: the calibration's, else 0)
    data_images_s: float | None = None  # one node's data-loading capacity, images/s (hpcdl bench data)
    # the comm hook (sync.hook): its bytes on the wire; hierarchical is --algorithm hierarchical
    hook: str = dataclasses.field(default="none", metadata=meta(choices=names.HOOKS))
    # the hook's own work per step, from hpcdl bench sync --hooks none,HOOK --json (default: none counted)
    sync_json: str | None = None
    # the optimizer (optimizer.name; --preset: the preset's): its state per weight enters the checkpoint and memory
    optimizer: str = dataclasses.field(default="lars", metadata=meta(choices=names.OPTIMIZER_TABLE))
    # the replicated update's time, from hpcdl bench optim --json (its --optimizer's row): the optimizer table's
    # update and what sharding it saves (default: the table gives the memory alone)
    optim_json: str | None = None
    # the training precision: bf16 carries the compute by the profile's measured bf16 step speed-up
    precision: str = dataclasses.field(default="fp32", metadata=meta(choices=("fp32", "bf16")))
    # start-up's counts (files per rank, store requests, the store's rate) from hpcdl bench startup --json
    # (default: those measured on the 2-core EPYC, docs/scaling.md)
    startup_json: str | None = None
    # the training's backend, for its rendezvous without --startup-json (gloo's grows with the ranks)
    backend: str = dataclasses.field(default="gloo", metadata=meta(choices=names.BACKENDS))
    stage_env: bool = False  # plan the start-up with the environment staged to node-local disk (hpcdl sbatch --stage-env)
    # the shared filesystem's metadata rate, opens/s for all clients (default: the profile's; where it has none,
    # start-up assumes 50,000 and the data path asks for it)
    fs_opens_per_s: float | None = None
    fs_read_gb_s: float = 1.5  # one reader's bandwidth from the shared filesystem, GB/s (assumed: one Lustre OST)
    # the shared filesystem's aggregate read bandwidth, GB/s (default: the profile's; where it has none, start-up
    # assumes 100 and the data path asks for it)
    fs_gb_s: float | None = None
    env_gb: float = 6.0  # the Python environment's size for --stage-env, GB (this repository's venv: CUDA wheels)

    def build(self) -> tuple[StepModel, list[str]]:
        """The step model and one line per input saying where it came from."""
        sources = [s for s in (self.throughput, self.step_json, self.calibrate_json) if s]
        if len(sources) > 1:
            raise ConfigError("give the per-node compute one way: --throughput, --step-json (hpcdl bench step) or "
                              "--calibrate (hpcdl bench scaling)")
        profile = get_profile(self.profile)
        facts = model_facts(self.model, self.classes)
        algorithm = "hierarchical" if self.hook == "hierarchical" else self.algorithm
        network, intra, net_note = self._links(profile, algorithm)
        wire, hook_s, hook_note = self._hook(facts)
        classes = f" with {self.classes:,} classes" if self.classes != 1000 else ""
        notes = [f"model {facts.name}{classes}: {facts.gradient_bytes / 1e6:.1f} MB of gradients in {facts.buckets} DDP "
                 f"buckets, {facts.train_flops / 1e9:.2f} GFLOP per training image",
                 f"network: alpha {network.latency_s * 1e6:.2f} us, {network.bandwidth_bytes_s / 1e9:.2f} GB/s "
                 f"({net_note}); all-reduce {algorithm}", hook_note]
        curve, rpn, overlap, share, note = self._compute(network, intra, facts, profile, algorithm)
        rpn = rpn or profile.sockets
        points = curve.points
        shown = f"{_rate(points[0][1])} at every batch" if len(points) == 1 else ", ".join(
            f"{_rate(v)} at {b:g}" for b, v in (points if len(points) <= 8 else points[::len(points) // 6]))
        notes += [note, f"node compute, images/s: {shown}; {rpn} ranks per node; overlap {overlap:.2f}"
                  + (f"; data loading {self.data_images_s:g} images/s per node" if self.data_images_s else "")]
        model = StepModel(gradient_bytes=facts.gradient_bytes, throughput=curve, network=network, ranks_per_node=rpn,
                          algorithm=algorithm, intra=intra, messages=facts.buckets * hook_terms(self.hook)[1],
                          overlap=overlap, backward_share=share, data_images_s=self.data_images_s,
                          wire_fraction=wire, hook_s=hook_s)
        return model, notes

    def startup(self, model: StepModel) -> tuple[StartupModel, list[str]]:
        """The start-up model for ``model``'s job, and one line per input saying where it came from. The
        checkpoint is the weights and the optimizer's state (:func:`state_bytes`)."""
        measured = {**STARTUP_MEASURED, "rendezvous": RENDEZVOUS_MEASURED[self.backend]}
        source = f"the counts measured on the 2-core EPYC, backend {self.backend} (docs/scaling.md)"
        if self.startup_json:
            report = StartupReport.from_json(self.startup_json)
            fit = report.fit("rendezvous requests per rank", self.startup_json)
            if not report.rows:
                raise DataError(f"{self.startup_json}: no rows, so no start-up measured on one node; rerun hpcdl bench "
                                "startup")
            smallest = min(report.rows, key=lambda r: r.ranks)
            measured = {"python_files": report.fit("python files per rank", self.startup_json).intercept,
                        "local_import_s": smallest.phases_s["interpreter and imports"] + smallest.phases_s["model"],
                        "rendezvous": (fit.intercept, fit.slope),
                        "store_requests_per_s": report.store.requests_per_s if report.store else
                        STARTUP_MEASURED["store_requests_per_s"]}
            source = self.startup_json
        checkpoint = model.gradient_bytes + state_bytes(self.optimizer, model.gradient_bytes)
        profile = get_profile(self.profile)
        opens, gb_s = (f if f.known else Figure(FS_ASSUMED[f.flag], "assumed", f.flag) for f in (
            resolve_figure(self.fs_opens_per_s, profile, "fs_opens_per_s", "--fs-opens-per-s"),
            resolve_figure(self.fs_gb_s, profile, "fs_gb_s", "--fs-gb-s")))
        startup = StartupModel(
            ranks_per_node=model.ranks_per_node, python_files=measured["python_files"],
            local_import_s=measured["local_import_s"], rendezvous_requests=measured["rendezvous"],
            store_requests_per_s=measured["store_requests_per_s"], fs_opens_per_s=opens.value,
            fs_read_bytes_s=self.fs_read_gb_s * 1e9, fs_bandwidth_bytes_s=gb_s.value * 1e9,
            checkpoint_bytes=checkpoint, env_bytes=self.env_gb * 1e9, network=model.network, staged=self.stage_env)
        a, b = measured["rendezvous"]
        notes = [f"start-up from {source}: {measured['python_files']:,.0f} files per rank, imports "
                 f"{measured['local_import_s']:.1f} s on one node, {a:.3g} + {b:.3g} N store requests per rank "
                 f"at {measured['store_requests_per_s']:,.0f}/s; filesystem {opens.shown('opens/s')}, "
                 f"{self.fs_read_gb_s:g} GB/s one reader, {gb_s.shown('GB/s', 'g')} in all; checkpoint "
                 f"{checkpoint / 1e6:.0f} MB; environment {self.env_gb:g} GB"
                 + (" staged (--stage-env)" if self.stage_env else " on the shared filesystem")]
        notes.append(memory_note(self.optimizer, model.gradient_bytes))
        return startup, notes

    def _hook(self, facts: ModelFacts) -> tuple[float, float, str]:
        """(wire bytes per gradient byte, the hook's work per step in s, where they came from)."""
        sync = SyncConfig()
        wire, _ = hook_terms(self.hook, sync.keep, sync.chunk)
        if self.hook in ("none", "hierarchical"):
            if self.sync_json:
                raise ConfigError(f"--sync-json gives a comm hook's cost; --hook {self.hook} has none to measure")
            return wire, 0.0, f"comm hook {self.hook}: all gradient bytes on the wire"
        if not self.sync_json:
            return wire, 0.0, (f"comm hook {self.hook}: {wire:.3g} of the gradient bytes on the wire; its own work "
                               f"not counted (give --sync-json, from hpcdl bench sync --hooks none,{self.hook})")
        figures = SyncReport.from_json(self.sync_json).of(self.allreduce_backend, self.sync_json)
        per_byte = figures.hook_seconds_per_byte(self.hook, self.sync_json)
        hook_s = per_byte * facts.gradient_bytes
        return wire, hook_s, (f"comm hook {self.hook}: {wire:.3g} of the gradient bytes on the wire, its own work "
                              f"{hook_s * 1e3:.1f} ms per step (from {self.sync_json})")

    def _links(self, profile, algorithm: str) -> tuple[Link, Link | None, str]:
        """(network, the node's own link for the hierarchical all-reduce, where the network came from)."""
        intra = None
        if algorithm == "hierarchical":
            if not self.intra_json:
                raise ConfigError("--algorithm hierarchical needs the node's own link: --intra-allreduce-json, the "
                                  "JSON of hpcdl bench allreduce run on the ranks of one node")
            intra = link_from_allreduce(AllreduceReport.from_json(self.intra_json))
        if self.allreduce_json:
            link = link_from_allreduce(AllreduceReport.from_json(self.allreduce_json), self.allreduce_backend,
                                       self.allreduce_json)
            which = f" ({self.allreduce_backend})" if self.allreduce_backend else ""
            return link, intra, f"fitted to {self.allreduce_json}{which}"
        return Link.of(profile), intra, f"profile {profile.name}"

    def _compute(self, network: Link, intra: Link | None, facts: ModelFacts, profile, algorithm: str):
        """(the node's compute curve, ranks per node or None, overlap, backward's share, where they came from)."""
        overlap = 0.0 if self.overlap is None else self.overlap
        if not (self.step_json or self.throughput or self.calibrate_json):
            node, bf16 = carried_compute(facts, profile), ""
            if self.precision == "bf16":
                node, bf16 = bf16_compute(node, profile)
            return (node.curve(), self.ranks_per_node, overlap, BACKWARD_SHARE,
                    f"compute carried from the published {' and '.join(FITTED)} runs ({node.fixed_s * 1e3:.0f} ms a step + "
                    f"{node.per_image_s * 1e3:.2f} ms an image, by training FLOPs, parameter tensors and the node's nominal "
                    f"peak, as hpcdl plan --validate does{bf16}; measure with --step-json to replace it)")
        if self.precision == "bf16":
            raise ConfigError("--precision bf16 carries the published fp32 compute to bf16; measured compute "
                              "(--throughput, --step-json, --calibrate) is already in the precision it ran: drop --precision")
        if self.step_json:
            paths = [p for p in self.step_json.split(",") if p]
            curve = BatchCurve.slowest([curve_from_step(StepReport.from_json(p)) for p in paths])
            where = f"the slowest node of {', '.join(paths)}" if len(paths) > 1 else paths[0]
            return curve, self.ranks_per_node, overlap, BACKWARD_SHARE, f"compute from {where}"
        if self.throughput:
            return parse_throughput(self.throughput), self.ranks_per_node, overlap, BACKWARD_SHARE, "compute given (--throughput)"
        cal = calibrate(ScalingReport.from_json(self.calibrate_json), network, algorithm,
                        facts.buckets, intra)
        note = (f"compute and overlap fitted to {self.calibrate_json}: overlap {cal.overlap:.2f}, backward "
                f"{cal.backward_share:.0%} of compute; the fit gives its points as " + ", ".join(
                    f"{p['mode']} {p['ranks']} ranks {_rate(p['measured_images_s'])} -> {_rate(p['model_images_s'])} "
                    f"img/s" for p in cal.points))
        return (cal.throughput, self.ranks_per_node or cal.ranks_per_node,
                cal.overlap if self.overlap is None else self.overlap, cal.backward_share, note)
