"""What the machine can do and what a step asks of it: the GEMM rate of each precision, measured here, and
a training step's floating-point operations, counted by torch. ``bench step`` divides the one by the other
(the step's achieved rate as a fraction of the machine's), and ``hpcdl tune`` reads the same rates."""

from __future__ import annotations

import time

import torch

from hpcdl.model_facts import ModelFacts, ddp_buckets
from hpcdl.models.count import count, flop_counter_mode

__all__ = ["count_model_facts", "gemm_gflops", "training_flops"]

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def gemm_gflops(precision: str, *, largest: int = 2048, min_seconds: float = 0.5) -> float:
    """GFLOP/s of a square matrix product in ``precision`` on torch's current threads. A 256-wide product
    first gauges the rate (after one untimed); then the side is the largest power of two up to ``largest`` whose product takes
    at most a quarter of ``min_seconds`` (an emulated bf16 runs 100x slower than fp32), and as many products
    as fill ``min_seconds`` (at least two) are timed after one that sets their count."""
    dtype = getattr(torch, DTYPES[precision])
    n = 256
    small = torch.randn(n, n).to(dtype)
    small @ small  # the library's first call sets itself up
    rate = _timed_products(small, 2)
    while n < largest and 2 * (2 * n) ** 3 / rate < min_seconds / 4:
        n *= 2
    a = torch.randn(n, n).to(dtype)
    repeat = max(2, int(min_seconds * _timed_products(a, 1) / (2 * n ** 3)))
    return _timed_products(a, repeat) / 1e9


def _timed_products(a, repeat: int) -> float:
    """FLOP/s of ``repeat`` products ``a @ a``."""
    t0 = time.perf_counter()
    for _ in range(repeat):
        a @ a
    return 2 * a.shape[0] ** 3 * repeat / max(time.perf_counter() - t0, 1e-9)


def training_flops(model, images, labels, criterion) -> float:
    """Floating-point operations of one forward and backward of ``model`` on this batch, as torch's
    FlopCounterMode counts them (convolutions and matrix products: the work a GEMM rate measures), grouped
    convolutions' backward corrected (:func:`hpcdl.models.count.flop_counter_mode`)."""
    counter = flop_counter_mode()
    with counter:
        criterion(model(images), labels).backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def count_model_facts(name: str) -> ModelFacts:
    """The model's facts (:func:`hpcdl.models.count.count`): what :data:`hpcdl.model_facts.MODEL_FACTS` holds for a
    login node."""
    counted = count(name)
    return ModelFacts(name, **counted, buckets=ddp_buckets(counted["gradient_bytes"]))
