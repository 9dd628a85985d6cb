"""Every name a config field or flag takes, in one torch-free place.

A config is checked against these tables when it is built, so a login node (``hpcdl sbatch``,
``hpcdl submit``) refuses a misspelt model or backend before the job waits in the queue; the
implementations take their lists from here, and each registry of implementations (models, optimizers,
backends, allocators, pack trees) is checked against its table with :func:`registry`.
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


# hpcdl.models builds each (and checks its registry against these names); the counts are
# hpcdl.bench.flops.count_model_facts(name)'s, so that planning needs no torch (a login node); tests/test_plan.py
# recounts them.
MODEL_TABLE = {
    "alexnet_bn": ModelRow(227, "AlexNet with BN after each pool/conv, as in the Stampede2 LARS runs",
                           249_522_336, 6_600_706_176.0, 24),
    "resnet18": ModelRow(224, "torchvision ResNet-18", 46_758_048, 10_648_412_160.0, 62),
    "resnet50": ModelRow(224, "torchvision ResNet-50 (v1.5)", 102_228_128, 24_299_077_632.0, 161),
    "resnet101": ModelRow(224, "torchvision ResNet-101 (v1.5)", 178_196_640, 46_572_404_736.0, 314),
    "tiny_cnn": ModelRow(32, "a small CNN for tests and the demo; any input size", 152_544, 9_039_360.0, 8),
    "tiny_cnn_fc": ModelRow(32, "tiny_cnn with a 4,096-unit fully-connected layer: 8.4M parameters, 99.9% in the "
                                "head (comm hooks)", 49_979_360, 83_755_008.0, 10),
}
MODELS = tuple(MODEL_TABLE)
MODEL_SOURCES = ("torchvision", "timm")  # model="torchvision:NAME", "timm:NAME"; "package.module:callable" too
OPTIMIZERS = ("sgd", "nesterov", "lars", "larc", "lamb", "adamw", "schedulefree", "schedulefree_sgd", "muon")
ADAPTIVE_OPTIMIZERS = ("lars", "larc", "lamb", "muon")  # a per-tensor rule that groups switch with 'adapt'
TRUST_OPTIMIZERS = ("lars", "larc", "lamb")  # of those, a trust ratio (trust_clip)
SCHEDULE_FREE = ("schedulefree", "schedulefree_sgd")  # no decay of the lr; evaluation and checkpoints in eval mode
# Tensors of optimizer state per parameter tensor (momentum, Adam's two moments, Schedule-Free's z): the
# checkpoint holds the weights and these; a rank's memory adds the gradients. Muon: 1 for the matrices it
# orthogonalizes, AdamW's 2 for the rest (biases, norms, the input and output layers).
OPTIMIZER_STATE_COPIES = {"sgd": 1, "nesterov": 1, "lars": 1, "larc": 1, "lamb": 2, "adamw": 2, "schedulefree": 2,
                          "schedulefree_sgd": 1, "muon": 1}
SEMANTICS = ("mlperf", "caffe")
DECAYS = ("poly", "poly_caffe", "cosine", "multistep", "constant")
BACKENDS = ("gloo", "mpi", "ccl")  # and "auto"
HOOKS = ("none", "fp16", "bf16", "hierarchical", "chunk_sparse")
PRECISIONS = ("auto", "fp32", "bf16")
MEMORY_FORMATS = ("auto", "true", "false")  # loop.channels_last
SAMPLERS = ("global", "shard")
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
