"""Every name a config field or flag takes, in one torch-free place.

A config is checked against these tables when it is built, so a login node (``hpcdl sbatch``,
``hpcdl submit``) refuses a misspelt model or backend before the job waits in the queue; the
implementations take their lists from here, and each registry of implementations (models, backends,
allocators, pack trees) is checked against its table with :func:`registry`. An optimizer has no registry
beside its row: :data:`OPTIMIZER_TABLE` names the class that implements it.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import signal

from hpcdl.errors import ConfigError



@dataclasses.dataclass(frozen=True, slots=True)
class ModelRow:
    """What is known of one of hpcdl's own models without torch: the one place each fact is written."""

    crop: int  # the training crop it is defined for (config crop: 0 means this)
    description: str
    gradient_bytes: int  # fp32 gradients, one per parameter, at 1,000 classes
    train_flops: float  # per image, forward and backward, at its crop (a multiply-add is 2)
    tensors: int  # parameter tensors
    largest: int  # the largest parameter tensor's elements: no rank's share of a sharded update is less


# hpcdl.models builds each (and checks its registry against these names); the counts are
# hpcdl.bench.flops.count_model_facts(name)'s, so that planning needs no torch (a login node); tests/test_plan.py
# recounts them.
MODEL_TABLE = {
    "alexnet_bn": ModelRow(227, "AlexNet with BN after each pool/conv, as in the Stampede2 LARS runs",
                           249_522_336, 6_600_706_176.0, 24, largest=37_748_736),
    "resnet18": ModelRow(224, "torchvision ResNet-18", 46_758_048, 10_648_412_160.0, 62, largest=2_359_296),
    "resnet50": ModelRow(224, "torchvision ResNet-50 (v1.5)", 102_228_128, 24_299_077_632.0, 161,
                         largest=2_359_296),
    "resnet101": ModelRow(224, "torchvision ResNet-101 (v1.5)", 178_196_640, 46_572_404_736.0, 314,
                          largest=2_359_296),
    "tiny_cnn": ModelRow(32, "a small CNN for tests and the demo; any input size", 152_544, 9_039_360.0, 8,
                         largest=32_000),
    "tiny_cnn_fc": ModelRow(32, "tiny_cnn with a 4,096-unit fully-connected layer: 8.4M parameters, 99.9% in the "
                                "head (comm hooks)", 49_979_360, 83_755_008.0, 10, largest=8_388_608),
}
MODELS = tuple(MODEL_TABLE)
MODEL_SOURCES = ("torchvision", "timm")  # model="torchvision:NAME", "timm:NAME"; "package.module:callable" too


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerRow:
    """What is known of one optimizer without torch: the one place each fact is written.
    :func:`hpcdl.optim.factory.build_optimizer` builds it from ``update``; ``OptimConfig`` and ``RunConfig`` check
    a config against it; ``hpcdl plan`` sizes its state; ``hpcdl bench large-batch`` sweeps around its reference lr."""

    description: str
    # "module:attribute" (hpcdl.deferred), imported when the optimizer is built: its class (or a function), called
    # as (param_groups, **keywords)
    update: str
    options: tuple[str, ...]  # the OptimConfig fields it takes, passed as keywords of the same names (eps: below)
    defaults: dict = dataclasses.field(default_factory=dict)  # keywords it is always given (torch's foreach=True)
    eps: float | None = None  # its eps when optimizer.eps is null, passed as eps=; None: it takes none
    eps_positive: bool = False  # eps guards a division (Adam's sqrt(v) + eps): optimizer.eps=0 is refused
    # tensors of state per weight (momentum: 1; Adam's two moments: 2; Schedule-Free AdamW's z and one moment: 2;
    # an adaptive row's: of the tensors it adapts, those it leaves out keep its plain row's): the checkpoint holds the
    # weights and these, a rank's memory adds the gradients
    state_copies: int
    adaptive: bool = False  # a per-tensor rule that parameter groups switch with 'adapt'
    plain: str = ""  # adaptive: the optimizer (its row's name) whose update the tensors it does not adapt take
    hidden_matrices: bool = False  # adaptive: by default only the hidden layers' matrices adapt (Muon), not all
    trust_ratio: bool = False  # adaptive: a LARS/LAMB trust ratio per tensor, which trust_clip clips
    schedule_free: bool = False  # no decay of the lr; built in train mode, evaluated and checkpointed in eval mode
    reference_lr: float  # hpcdl bench large-batch's lr at REFERENCE_BATCH, which its sweep multiplies
    lr_scaling: str  # how that lr follows the batch: "linear" (Goyal et al.'s rule, the SGD family) or "sqrt"
    reference_momentum: float = 0.9  # hpcdl bench large-batch's momentum

    def __post_init__(self):
        if self.lr_scaling not in ("linear", "sqrt"):
            raise ValueError(f"OptimizerRow lr_scaling={self.lr_scaling!r}: choose linear or sqrt")
        if self.adaptive != bool(self.plain) or (self.trust_ratio or self.hidden_matrices) and not self.adaptive:
            raise ValueError("OptimizerRow: an adaptive row names the plain update of the tensors it leaves out "
                             "(plain='sgd', 'adamw'), and only an adaptive row has trust_ratio or hidden_matrices")
        if self.eps_positive and not (self.eps or 0.0) > 0:
            raise ValueError(f"OptimizerRow eps_positive with eps={self.eps}: give the default eps above 0")


REFERENCE_BATCH = 64  # hpcdl bench large-batch's batch of each row's reference_lr
# Every optimizer: hpcdl.optim.factory builds a row, and adding an optimizer is a row here and the class its
# update names. Read the table when a check runs, never a copy taken at import: a row added later counts.
OPTIMIZER_TABLE = {
    "sgd": OptimizerRow(
        description="torch.optim.SGD with momentum (Goyal et al.'s recipe)", update="torch.optim:SGD",
        options=("lr", "momentum", "weight_decay"), defaults={"foreach": True}, state_copies=1,
        reference_lr=0.2, lr_scaling="linear"),
    "nesterov": OptimizerRow(
        description="torch.optim.SGD with Nesterov momentum (Nado et al. 2021's large-batch baseline)",
        update="torch.optim:SGD", options=("lr", "momentum", "weight_decay"),
        defaults={"foreach": True, "nesterov": True}, state_copies=1, reference_lr=0.2, lr_scaling="linear"),
    "lars": OptimizerRow(
        description="LARS, the MLPerf/Intel Caffe update (hpcdl.optim.lars)", update="hpcdl.optim.lars:LARS",
        options=("lr", "momentum", "weight_decay", "eta"), eps=0.0, state_copies=1, adaptive=True, plain="sgd",
        trust_ratio=True, reference_lr=1.0, lr_scaling="sqrt"),
    "larc": OptimizerRow(
        description="LARS with LARC's clip: local lr = min(trust, lr)", update="hpcdl.optim.lars:LARS",
        options=("lr", "momentum", "weight_decay", "eta"), defaults={"trust_clip": True}, eps=0.0, state_copies=1,
        adaptive=True, plain="sgd", trust_ratio=True, reference_lr=1.0, lr_scaling="sqrt"),
    "lamb": OptimizerRow(
        description="LAMB with bias correction (You et al. 2019)", update="hpcdl.optim.lamb:LAMB",
        options=("lr", "betas", "weight_decay"), eps=1e-6, eps_positive=True, state_copies=2, adaptive=True,
        plain="adamw", trust_ratio=True, reference_lr=0.02, lr_scaling="sqrt"),
    "adamw": OptimizerRow(
        description="torch.optim.AdamW", update="torch.optim:AdamW", options=("lr", "betas", "weight_decay"),
        defaults={"foreach": True}, eps=1e-8, eps_positive=True, state_copies=2, reference_lr=0.01,
        lr_scaling="sqrt"),
    "schedulefree": OptimizerRow(
        description="Schedule-Free AdamW (Defazio et al. 2024; the schedulefree package): constant lr",
        update="schedulefree:AdamWScheduleFree", options=("lr", "betas", "weight_decay"), defaults={"foreach": True},
        eps=1e-8, eps_positive=True, state_copies=2, schedule_free=True, reference_lr=0.01, lr_scaling="sqrt"),
    "schedulefree_sgd": OptimizerRow(
        description="Schedule-Free SGD (the schedulefree package): constant lr", update="schedulefree:SGDScheduleFree",
        options=("lr", "momentum", "weight_decay"), defaults={"foreach": True}, state_copies=1, schedule_free=True,
        reference_lr=0.5, lr_scaling="linear"),
    "muon": OptimizerRow(
        description="Muon on the hidden matrices and convolutions, AdamW on the rest (hpcdl.optim.muon)",
        update="hpcdl.optim.muon:Muon", options=("lr", "momentum", "weight_decay", "betas"), eps=1e-8,
        eps_positive=True, state_copies=1, adaptive=True, plain="adamw", hidden_matrices=True, reference_lr=0.02,
        lr_scaling="sqrt", reference_momentum=0.95),  # torch.optim.Muon's momentum; the others take hpcdl's 0.9
}
SEMANTICS = ("mlperf", "caffe")
DECAYS = ("poly", "poly_caffe", "cosine", "multistep", "constant")
BACKENDS = ("gloo", "mpi", "ccl")  # and "auto"
HOOKS = ("none", "fp16", "bf16", "hierarchical", "chunk_sparse")
# optimizer.shard reduce-scatters the gradients under these hooks on these backends (hpcdl.optim.shard.scatters)
SCATTER_HOOKS = ("none", "fp16", "bf16")
SCATTER_BACKENDS = ("mpi", "ccl")
PRECISIONS = ("auto", "fp32", "bf16")
MEMORY_FORMATS = ("auto", "true", "false")  # loop.channels_last
SAMPLERS = ("global", "shard")
# data.cache: auto (node on more than one node when the training set is not on node-local storage), read the
# shards directly, or through the node cache (hpcdl.data.cache)
DATA_CACHES = ("auto", "none", "node")
RESUME_RANKS = ("any", "same")  # checkpoint.resume_ranks
VERIFY = ("none", "quick", "full")
NORMALIZE = ("auto", "dataset", "imagenet", "model")
DECODERS = ("pillow", "torchvision")
IPEX = ("auto", "off")
ALLOCATORS = ("jemalloc", "tcmalloc", "glibc")
ALLOCATOR_CHOICES = ("auto", "none", *ALLOCATORS)
TREES = ("imagenet-train", "imagenet-val", "imagenet22k-tars", "folder", "csv")

IMAGENET_TRAIN = 1_281_167  # ImageNet-1K (ILSVRC2012) training images: the presets' and the planner's default


def check(field: str, value, choices, fix: str = "") -> None:
    """A ConfigError naming ``field``, ``value`` and the valid names when ``value`` is not one of them."""
    if value not in choices:
        raise ConfigError(f"{field}={value!r} is unknown; choose one of {', '.join(map(str, choices))}"
                          + (f" ({fix})" if fix else ""))


_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_LIBRARY_NAME = re.compile(r"[A-Za-z0-9_][\w.\-]*")


def check_model(name: str) -> None:
    """``model=``: one of :data:`MODELS`, ``torchvision:NAME``, ``timm:NAME`` or ``package.module:callable`` (a
    builder of one's own). Only the form is checked here, without torch; whether torchvision or timm has NAME
    is :func:`hpcdl.models.model_info`'s to say (``hpcdl sbatch`` asks it in a subprocess)."""
    source, colon, rest = str(name).partition(":")
    if name in MODELS or colon and (source in MODEL_SOURCES and _LIBRARY_NAME.fullmatch(rest)
                                    or _MODULE.fullmatch(source) and rest.isidentifier()):
        return
    close = difflib.get_close_matches(str(name), MODELS, n=3, cutoff=0.6) or \
        ([f"torchvision:{name}", f"timm:{name}"] if _LIBRARY_NAME.fullmatch(str(name)) else [])
    raise ConfigError(f"model={name!r} is unknown; choose one of {', '.join(MODELS)}, or name any classifier as "
                      "torchvision:NAME (torchvision's zoo), timm:NAME (pip install 'hpcdl[timm]') or "
                      "package.module:callable (your builder, called with num_classes)"
                      + (f"; did you mean {' or '.join(close)}?" if close else ""))


def signal_number(field: str, name: str) -> signal.Signals:
    """``USR2``, ``SIGUSR2`` or ``usr2`` -> the signal; a ConfigError naming ``field`` otherwise."""
    try:
        return signal.Signals[f"SIG{str(name).upper().removeprefix('SIG')}"]
    except KeyError:
        raise ConfigError(f"{field}={name!r} is not a signal name; use e.g. USR2 (Slurm's --signal=USR2@120) "
                          "or TERM") from None


def registry(kind: str, table: dict, names: tuple[str, ...]) -> dict:
    """``table`` (name -> implementation), refused at import when its names differ from ``names``: the
    login node's checks and the implementations cannot drift apart."""
    if tuple(table) != tuple(names):
        raise RuntimeError(f"hpcdl.names lists {kind} {names}, the implementations {tuple(table)}")
    return table
