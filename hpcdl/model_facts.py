"""What the planner knows of each model without torch: gradient bytes, training FLOPs, DDP's buckets,
parameter tensors."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from hpcdl.config import SyncConfig
from hpcdl.errors import ConfigError
from hpcdl.names import MODEL_SOURCES, MODEL_TABLE, check_model
from hpcdl.utils import atomic_write_text, cache_dir

__all__ = ["MODEL_FACTS", "ModelFacts", "ddp_buckets", "facts_cache", "model_facts"]


def ddp_buckets(gradient_bytes: int, sync: SyncConfig | None = None) -> int:
    """DDP's all-reduces per step for ``gradient_bytes`` of gradients at ``sync``'s bucket sizes (hpcdl's
    defaults): the first bucket capped at ``first_bucket_mb``, the others at ``bucket_cap_mb``."""
    sync = sync or SyncConfig()
    first = min(sync.first_bucket_mb or sync.bucket_cap_mb, sync.bucket_cap_mb) * 2 ** 20
    return 1 + math.ceil(max(0.0, gradient_bytes - first) / (sync.bucket_cap_mb * 2 ** 20))


@dataclasses.dataclass(frozen=True, slots=True)
class ModelFacts:
    name: str
    gradient_bytes: int  # fp32 gradients, one per parameter
    train_flops: float  # per image, forward and backward, at the model's crop (a multiply-add is 2)
    buckets: int  # DDP's all-reduces per step at hpcdl's bucket sizes
    tensors: int  # parameter tensors: the per-layer work a step does whatever its batch
    crop: int = 0  # the input size the flops are counted at: the model's stated one (hpcdl's rows: names.MODEL_TABLE)
    largest: int = 0  # the largest parameter tensor's elements (a sharded update deals tensors whole)


# hpcdl's own models at 1,000 classes, from the one table of what is known of them (hpcdl.names.MODEL_TABLE)
MODEL_FACTS = {name: ModelFacts(name, row.gradient_bytes, row.train_flops, ddp_buckets(row.gradient_bytes),
                                row.tensors, row.crop, row.largest) for name, row in MODEL_TABLE.items()}


def model_facts(name: str, num_classes: int = 1000) -> ModelFacts:
    """The model's gradient bytes, training flops and buckets with ``num_classes`` outputs: :data:`MODEL_FACTS`'
    row for hpcdl's models at 1,000; for any other model or class count (``torchvision:``, ``timm:``,
    ``package.module:callable``; ImageNet-22K's 21,841) counted once by :mod:`hpcdl.models.count` in a
    subprocess (torch stays out of this one) and kept in :func:`facts_cache`. A ConfigError, with the closest
    names, when ``name`` names no model."""
    check_model(name)
    if name in MODEL_FACTS and num_classes == 1000:
        return MODEL_FACTS[name]
    key = name if num_classes == 1000 else f"{name} with {num_classes} classes"
    source = _source_stamp(name)
    known = _read_cache()
    kept = known.get(key, {})
    if "largest" not in kept or kept.get("source") != source:  # not counted, by an older hpcdl, or the module changed
        counted = subprocess.run([sys.executable, "-m", "hpcdl.models.count", name, str(num_classes)],
                                 capture_output=True, text=True)
        if counted.returncode:
            raise ConfigError((counted.stderr.strip().splitlines() or [f"counting {name} failed"])[-1])
        counted = json.loads(counted.stdout)
        kept = {"name": name, **counted, "buckets": ddp_buckets(counted["gradient_bytes"]), "source": source}
        cache = facts_cache()
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(str(cache), json.dumps(_read_cache() | {key: kept}, indent=1, sort_keys=True) + "\n")
    return ModelFacts(**{k: v for k, v in kept.items() if k != "source"})


def _read_cache() -> dict:
    cache = facts_cache()
    try:
        return json.loads(cache.read_text()) if cache.exists() else {}
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{cache}: unreadable ({exc}); remove it, hpcdl counts the models again") from None


def _source_stamp(name: str) -> float | None:
    """For ``package.module:callable``, its module file's modification time (the facts are counted again
    when it changes); None for the libraries' models. The module is found, not run."""
    module, _, _ = name.partition(":")
    if module in MODEL_SOURCES or name in MODEL_FACTS:
        return None
    try:
        spec = importlib.util.find_spec(module)
        return os.path.getmtime(spec.origin) if spec and spec.origin else None
    except (ImportError, ValueError, OSError):
        return None


def facts_cache(environ=os.environ) -> Path:
    """Where counted models' facts are kept: ``$XDG_CACHE_HOME/hpcdl/model-facts.json`` (``~/.cache``)."""
    return cache_dir(environ) / "model-facts.json"
