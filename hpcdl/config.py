"""The typed run config: one dataclass per component, checked as it is built, each message naming the field
that fixes it. The presets of published runs, plain functions that return a config, are in
:mod:`hpcdl.presets`; ``hpcdl presets show NAME`` prints one resolved, with the derived numbers
(:func:`describe`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import yaml

from hpcdl import names
from hpcdl.data import recipe
from hpcdl.errors import ConfigError
from hpcdl.names import IMAGENET_TRAIN, check
from hpcdl.optim.config import OptimConfig
from hpcdl.optim.schedule import ScheduleConfig, steps_per_epoch
from hpcdl.schema import to_dict
from hpcdl.utils import parse_bytes


@dataclass(kw_only=True, slots=True)
class DataConfig:
    train: str = ""  # a packed dataset root (hpcdl pack); $VARS are expanded on the compute node
    val: str = ""  # "" : no evaluation
    workers: int = 4  # DataLoader worker processes per rank (they run at nice +10 on the rank's cores)
    # whole cores kept from compute for the workers: auto (sized at start-up from the loader's measured cost
    # per image and the step's images/s; none when they need a fraction of a core) or a count
    reserve_cores: str | int = "auto"
    # > 0: decode this many training images once at start-up and train on them from memory, in turn (the step
    # without the loader, as hpcdl bench feed compares; not for real training)
    in_memory: int = 0
    sampler: str = "global"  # global | shard (see hpcdl.data.sampler)
    # none: each rank's loader reads the shards; node: one agent per node reads them, each sample from the shared
    # filesystem once per job, kept by the node that owns its shard and served to the others (hpcdl.data.cache);
    # auto: node when the job has more than one node and data.train is not on node-local storage (ext4, xfs, tmpfs..)
    cache: str = "auto"
    # the node cache's RAM for the samples its node owns: a share of the node's memory ("25%") or bytes ("8G")
    cache_budget: str = "25%"
    seed: int = 0  # the shuffle and each sample's augmentation (seed, epoch, index)
    verify: str = "quick"  # none | quick | full: shard checks at start-up
    # the training augmentation: a recipe (imagenet, light, none) or a list of steps, e.g.
    # [resized_crop(min_scale=0.5), rot90, mixup]; held expanded (hpcdl.data.recipe lists the steps)
    augment: str | tuple[str, ...] = "imagenet"
    eval_resize: int = 256  # evaluation: short side, then a center crop of the run's crop
    # the channel statistics images are normalized with: dataset (measured by hpcdl pack, in the manifest),
    # imagenet, model (those the model's library states: timm's pretrained config, torchvision's weights), or
    # auto: the model's when fine-tuning from model.weights and it states them, else the dataset's; data.mean and
    # data.std, when given (0..1 units, one per channel), take precedence
    normalize: str = "auto"
    channels: int = 3  # 3 (RGB) or 1 (gray: decoded to one channel, the model's first layer takes one)
    # torchvision (decode_jpeg: the fastest in hpcdl bench data) or pillow (draft mode: decodes no more than the
    # crop needs; the ImageNet presets and the demo keep it, so that they train pixel for pixel as before)
    decoder: str = "torchvision"
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

    def __post_init__(self):
        check("data.sampler", self.sampler, names.SAMPLERS)
        check("data.verify", self.verify, names.VERIFY)
        check("data.cache", self.cache, names.DATA_CACHES)
        cache_budget_bytes(self.cache_budget, memory=1)  # refuses what is not a size or a share
        check("data.normalize", self.normalize, names.NORMALIZE)
        check("data.decoder", self.decoder, names.DECODERS)
        self.augment = recipe.expand(self.augment)
        check("data.channels", self.channels, (1, 3))
        recipe.check_stats("data.mean", self.mean, self.channels)
        recipe.check_stats("data.std", self.std, self.channels, positive=True)
        if bool(self.mean) != bool(self.std):
            raise ConfigError(f"data.mean={list(self.mean)} and data.std={list(self.std)}: give both, or neither "
                              f"(data.normalize={self.normalize} then chooses)")
        if self.eval_resize < 1:
            raise ConfigError(f"data.eval_resize={self.eval_resize} must be at least 1 (e.g. 256 for crop 224)")
        if self.workers < 0:
            raise ConfigError(f"data.workers={self.workers} must be >= 0 (0: load in the training process)")
        if self.in_memory < 0:
            raise ConfigError(f"data.in_memory={self.in_memory} must be >= 0 (0: read the shards)")
        self.reserve_cores = str(self.reserve_cores)  # a YAML file may give a number
        if self.reserve_cores != "auto" and not self.reserve_cores.isdigit():
            raise ConfigError(f"data.reserve_cores={self.reserve_cores!r}: give auto or a count of cores, e.g. 1")


@dataclass(kw_only=True, slots=True)
class LoopConfig:
    precision: str = "auto"  # auto | fp32 | bf16; auto: bf16 only with avx512_bf16 or amx_bf16
    # auto | true | false; auto: channels_last for a model with convolutions past its stem (more than one Conv2d),
    # contiguous for one whose only convolution embeds the patches (a ViT): docs/performance.md has the figures
    channels_last: str | bool = "auto"
    compile: bool = False  # torch.compile the model
    ipex: str = "auto"  # auto: ipex.optimize when intel_extension_for_pytorch imports and matches torch; off
    accum_steps: int = 1  # micro-batches per optimizer step; each is per_rank_batch / accum_steps images
    backend: str = "auto"  # auto: ccl when a oneCCL runtime loads, else gloo (the backends: docs/communication.md)
    ccl_lib: str = ""  # the libccl.so.2 (or its folder) for backend ccl; "": HPCDL_CCL_LIB, CCL_ROOT, hpcdl's runtime
    timeout_s: float = 300.0  # collective timeout from the first completed step on
    # start-up: rendezvous, checkpoint load and broadcast, DDP construction, the first step (torch.compile's)
    startup_timeout_s: float = 600.0
    max_steps: int = 0  # stop after this many steps (0: the schedule's total)
    eval_every: int = 1  # epochs between evaluations (0: at the end only)
    log_every: int = 10  # steps between progress lines and TensorBoard points (the JSONL log has every step)
    seed: int = 0  # the model's initial weights
    target_top1: float = 0.0  # time-to-accuracy: first evaluation at or above this top-1 (0: none)
    # end the run at that evaluation, as MLPerf's time-to-train rule does (the summary says so); a resume of a run
    # that stopped there trains no further
    stop_at_target: bool = False
    timeline: bool = False  # per-rank trace spans in RUN_DIR/timeline (hpcdl timeline merge RUN_DIR)
    # each rank appends the samples it trains to RUN_DIR/samples/rankRRRRR.txt, "EPOCH INDEX STEP" a line: to audit
    # the data order, or count that an epoch saw every sample once across restarts on any number of ranks
    record_samples: bool = False
    # each rank writes RUN_DIR/startup/rankRRRRR.json at its first step: each start-up phase's time and the
    # files it opened on the run folder, the data and the Python environment (hpcdl bench startup reads them)
    record_startup: bool = False

    def __post_init__(self):
        check("loop.precision", self.precision, names.PRECISIONS)
        self.channels_last = str(self.channels_last).lower()  # a YAML file may give a bool
        check("loop.channels_last", self.channels_last, names.MEMORY_FORMATS)
        check("loop.ipex", self.ipex, names.IPEX)
        check("loop.backend", self.backend, ("auto", *names.BACKENDS))
        if not self.timeout_s > 0 or not self.startup_timeout_s > 0:
            raise ConfigError(f"loop.timeout_s={self.timeout_s} and loop.startup_timeout_s={self.startup_timeout_s} "
                              "must be more than 0 seconds (e.g. 300 and 600)")
        if self.accum_steps < 1 or self.log_every < 1:
            raise ConfigError(f"loop.accum_steps={self.accum_steps} and loop.log_every={self.log_every} must be >= 1")
        if self.stop_at_target and not self.target_top1 > 0:
            raise ConfigError("loop.stop_at_target needs the top-1 to stop at: --set loop.target_top1=75.9 (a percent)")
        if self.stop_at_target and self.eval_every < 1:
            raise ConfigError("loop.stop_at_target stops at an evaluation, and loop.eval_every=0 evaluates only at "
                              "the end: --set loop.eval_every=1")


@dataclass(kw_only=True, slots=True)
class SyncConfig:
    """Gradient synchronization (hpcdl.distributed.gradients.ddp, hpcdl.distributed.gradients.hooks)."""

    hook: str = "none"  # one of names.HOOKS (docs/communication.md describes each)
    # DDP's buckets: gradients are all-reduced in buckets of bucket_cap_mb MB, the first (the last layers,
    # ready first) of first_bucket_mb (None: bucket_cap_mb). Measured: docs/communication.md, bucket sweep.
    # With optimizer.shard's reduce-scatters, bucket_cap_mb is also their segment size (first_bucket_mb is not used).
    bucket_cap_mb: float = 25.0
    first_bucket_mb: float | None = 1.0
    gradient_as_bucket_view: bool = True  # gradients live in DDP's buckets: no copy in or out
    keep: float = 0.1  # chunk_sparse: the fraction of chunks sent each step
    chunk: int = 32768  # chunk_sparse: elements per chunk
    dense_warmup_epochs: float = 1.0  # chunk_sparse: all-reduce densely this long first
    fp16: bool = False  # chunk_sparse: send the selected chunks in fp16

    def __post_init__(self):
        check("sync.hook", self.hook, names.HOOKS)
        if not 0 < self.keep <= 1 or self.chunk < 1 or self.bucket_cap_mb <= 0 or (self.first_bucket_mb or 1) <= 0:
            raise ConfigError(f"sync: keep={self.keep} must lie in (0, 1], chunk={self.chunk} >= 1, "
                              f"bucket_cap_mb={self.bucket_cap_mb} > 0 and first_bucket_mb={self.first_bucket_mb} > 0")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every_steps: int = 0  # 0: not by steps
    every_minutes: float = 30.0  # 0: not by time
    keep: int = 3
    signal: str = "USR2"  # the requeue signal: #SBATCH --signal=USR2@120 (hpcdl's train scripts set it)
    max_requeues: int = 20
    # a checkpoint of another number of ranks: "any" resumes it (same global batch, the epoch's unseen samples
    # dealt to this job's ranks; docs/training.md says what differs), "same" refuses it
    resume_ranks: str = "any"
    # when a peer rank is lost, the survivors save the last completed step before they exit (status 4; the
    # supervisor of hpcdl sbatch --spares restarts from it): hpcdl.train.rescue. false: every rank exits at once
    jit: bool = True

    def __post_init__(self):
        names.signal_number("checkpoint.signal", self.signal)
        names.check("checkpoint.resume_ranks", self.resume_ranks, names.RESUME_RANKS)
        if self.keep < 1 or self.every_steps < 0 or self.every_minutes < 0 or self.max_requeues < 0:
            raise ConfigError(f"checkpoint: keep={self.keep} must be >= 1, every_steps, every_minutes and "
                              "max_requeues >= 0")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """``model:`` (docs/models.md). ``model: NAME`` or ``--set model=NAME`` sets the name alone."""

    name: str  # one of hpcdl's, torchvision:NAME, timm:NAME or package.module:callable (names.check_model)
    # fine-tune from these weights: a state dict (torch.save), a .safetensors file, an hpcdl checkpoint or run
    # folder; read by rank 0 with weights_only when the run starts without a checkpoint of its own
    weights: str = ""
    body_lr_scale: float = 1.0  # the lr of every parameter but the classifier head's, as a fraction of the head's
    freeze_body_epochs: float = 0.0  # the body's lr is 0 for this many epochs: the head trains alone first
    layer_decay: float = 1.0  # timm's layer-wise lr decay (ViTs: 0.65-0.75): block i of n gets decay ** (n - i)

    def __post_init__(self):
        names.check_model(self.name)
        if not 0 <= self.body_lr_scale <= 1 or not 0 < self.layer_decay <= 1 or self.freeze_body_epochs < 0:
            raise ConfigError(f"model: body_lr_scale={self.body_lr_scale} must lie in [0, 1], layer_decay="
                              f"{self.layer_decay} in (0, 1] and freeze_body_epochs={self.freeze_body_epochs} >= 0")
        if (self.body_lr_scale != 1 or self.freeze_body_epochs or self.layer_decay != 1) and not self.weights:
            raise ConfigError("model.body_lr_scale, freeze_body_epochs and layer_decay shape fine-tuning: set "
                              "model.weights=PATH to the weights to start from, or leave them at 1, 0 and 1")


@dataclass(kw_only=True, slots=True)
class RunConfig:
    name: str
    model: ModelConfig  # a string sets model.name (RunConfig(model="resnet50") too)
    global_batch: int
    epochs: float
    optimizer: OptimConfig
    schedule: ScheduleConfig
    ranks: int = 1  # processes; each takes global_batch / ranks images per step
    num_classes: int = 1000
    train_images: int = IMAGENET_TRAIN
    crop: int = 0  # the training crop; 0: the one the model is defined for (its library's stated input size)
    label_smoothing: float = 0.0
    run_dir: str = "runs/{name}-{job}"  # {name}: this config's; {job}: the Slurm job id (kept across requeues)
    data: DataConfig = field(default_factory=DataConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if isinstance(self.model, str):
            self.model = ModelConfig(name=self.model)
        if self.crop == 0:
            self.crop = names.MODEL_TABLE[self.model.name].crop if self.model.name in names.MODEL_TABLE else 0  # others: hpcdl.models.with_model_defaults
        for key in ("global_batch", "train_images", "num_classes"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)} must be at least 1")
        if self.crop < 0:
            raise ConfigError(f"crop={self.crop} must be at least 1 (or 0: the model's own input size)")
        if not (math.isfinite(self.epochs) and self.epochs > 0):
            raise ConfigError(f"epochs={self.epochs} must be a finite number above 0 (e.g. 90)")
        # The schedule's batch, epochs and steps per epoch follow the run's: set them here, not there.
        self.schedule = dataclasses.replace(self.schedule, global_batch=self.global_batch, epochs=self.epochs,
                                            steps_per_epoch=steps_per_epoch(self.train_images, self.global_batch))
        self.optimizer = dataclasses.replace(self.optimizer, lr=self.schedule.peak_lr)  # the schedule sets it per step
        if self.ranks < 1 or self.global_batch % self.ranks:
            raise ConfigError(f"{self.name}: global_batch {self.global_batch} does not split over ranks={self.ranks}; "
                              "choose ranks that divide it (or derive the variant with with_ranks)")
        if self.per_rank_batch % self.loop.accum_steps:
            raise ConfigError(f"{self.name}: the per-rank batch {self.per_rank_batch} does not split into "
                              f"loop.accum_steps={self.loop.accum_steps} micro-batches; choose a divisor of it")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"{self.name}: label_smoothing {self.label_smoothing} must lie in [0, 1)")
        if names.OPTIMIZER_TABLE[self.optimizer.name].schedule_free and self.schedule.decay != "constant":
            raise ConfigError(f"{self.name}: optimizer {self.optimizer.name} needs no decay (its average of the weights "
                              f"replaces it): set schedule.decay=constant, not {self.schedule.decay!r}; a warmup "
                              "(schedule.warmup_epochs) is kept")

    @property
    def per_rank_batch(self) -> int:
        return self.global_batch // self.ranks

    @property
    def micro_batch(self) -> int:
        """Images per forward and backward: the per-rank batch over ``loop.accum_steps``."""
        return self.per_rank_batch // self.loop.accum_steps

    def derived(self) -> dict:
        s = self.schedule
        return {"steps_per_epoch": s.steps_per_epoch, "images_per_step": self.global_batch,
                "exact_steps_per_epoch": round(self.train_images / self.global_batch, 2),
                "warmup_steps": s.warmup_steps, "total_steps": s.total_steps, "per_rank_batch": self.per_rank_batch,
                "peak_lr": s.peak_lr}


# Schedule fields that RunConfig derives (see RunConfig.__post_init__): --set refuses them.
DERIVED = {"schedule.global_batch": "follows global_batch; set global_batch",
           "schedule.epochs": "follows epochs; set epochs",
           "schedule.steps_per_epoch": "follows train_images / global_batch; set those",
           "optimizer.lr": "the schedule sets the lr every step; set schedule.base_lr (and schedule.base_batch)"}


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False, width=120)


def describe(cfg: RunConfig) -> str:
    d = cfg.derived()
    s, o = cfg.schedule, cfg.optimizer
    takes = names.OPTIMIZER_TABLE[o.name].options
    lines = [
        f"{cfg.name}: {cfg.model.name}, crop {cfg.crop or 'as the model states'}, {cfg.epochs:g} epochs, label smoothing {cfg.label_smoothing:g}",
        f"  global batch {cfg.global_batch:,} = {cfg.ranks:,} ranks x {d['per_rank_batch']} per rank",
        f"  steps per epoch {d['steps_per_epoch']} ({cfg.train_images:,} / {cfg.global_batch:,} = "
        f"{d['exact_steps_per_epoch']}, rounded up: the last batch of an epoch is partial)",
        f"  optimizer {o.name} ({o.semantics} semantics): momentum {o.momentum:g}, weight decay {o.weight_decay:g}"
        + (f", eta {o.eta:g}" if "eta" in takes else "")
        + (f", betas {o.betas[0]:g}/{o.betas[1]:g}" if "betas" in takes else ""),
        f"  peak lr {d['peak_lr']:.6g}" + (f" (= {s.base_lr:g} x {s.global_batch} / {s.base_batch})" if s.base_batch else ""),
        f"  warmup {s.warmup_epochs:g} epochs = {d['warmup_steps']} steps, from lr {s.warmup_start_lr:g}",
        f"  decay {s.decay}" + (f" power {s.power:g} to {s.end_lr:g}" if s.decay.startswith("poly") else "")
        + (f" x{s.gamma:g} at epochs {', '.join(f'{m:g}' for m in s.milestones)}" if s.decay == "multistep" else ""),
        f"  total {d['total_steps']:,} steps",
    ]
    return "\n".join(lines + [f"  note: {n}" for n in cfg.notes]) + "\n"


def cache_budget_bytes(text: str, memory: int) -> int:
    """``data.cache_budget`` in bytes: ``25%`` of ``memory`` (the node's), or a size such as ``8G``."""
    text = str(text).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            share = -1.0
        if not 0 < share <= 100:
            raise ConfigError(f"data.cache_budget={text!r}: a share of the node's memory is 1% to 100%, e.g. 25%")
        return int(memory * share / 100)
    return parse_bytes(text, "data.cache_budget")
