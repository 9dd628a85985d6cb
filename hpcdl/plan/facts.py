"""What the planner knows of each model without torch: gradient bytes, training FLOPs, DDP's buckets,
parameter tensors."""

from __future__ import annotations

import dataclasses

from hpcdl.names import MODELS, check

__all__ = ["MODEL_FACTS", "ModelFacts", "model_facts"]


@dataclasses.dataclass(frozen=True, slots=True)
class ModelFacts:
    name: str
    gradient_bytes: int  # fp32 gradients, one per parameter
    train_flops: float  # per image, forward and backward, at the model's crop (a multiply-add is 2)
    buckets: int  # DDP's all-reduces per step at hpcdl's bucket sizes
    tensors: int  # parameter tensors: the per-layer work a step does whatever its batch


# hpcdl.bench.flops.count_model_facts(name) for every model, so that planning needs no torch (a login node);
# tests/test_plan.py recounts them.
MODEL_FACTS = {f.name: f for f in (
    ModelFacts("alexnet_bn", 249_522_336, 6_600_706_176.0, 11, 24),
    ModelFacts("resnet18", 46_758_048, 10_648_412_160.0, 3, 62),
    ModelFacts("resnet50", 102_228_128, 24_299_077_632.0, 5, 161),
    ModelFacts("resnet101", 178_196_640, 46_572_404_736.0, 8, 314),
    ModelFacts("tiny_cnn", 152_544, 9_039_360.0, 1, 8),
    ModelFacts("tiny_cnn_fc", 49_979_360, 83_755_008.0, 3, 10),
)}


def model_facts(name: str) -> ModelFacts:
    """The model's gradient bytes, training flops and buckets, from :data:`MODEL_FACTS`
    (:func:`hpcdl.bench.flops.count_model_facts` counts them with torch)."""
    check("model", name, MODELS)
    return MODEL_FACTS[name]
