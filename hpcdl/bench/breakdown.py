"""Where a training step's time goes: ``hpcdl bench step --profile``.

torch's profiler records every operator of a few steps (after warm-up steps that create the optimizer's
state); each operator's *self* time (its own, less the operators it called) goes to one class of work:

- ``matrix``: convolutions, matrix products and attention, forward and backward (the work a GEMM rate
  measures; its rate is the step's counted FLOPs over this time);
- ``casts``: dtype conversions (autocast's ``_to_copy`` of weights and activations);
- ``normalization``: batch, layer and group norm, forward and backward;
- ``element-wise``: every other operator (activations, additions, pooling, the loss, copies);
- ``optimizer``: whatever runs inside ``optimizer.step()`` and ``zero_grad()`` (torch's optimizers open a
  record_function named ``Optimizer.step#...``);
- ``framework``: the rest of the step's wall time: Python, autograd's engine, the dispatcher, the
  profiler's own bookkeeping (a microsecond or two per operator).

The shares are of the profiled steps' wall time. The profiler slows a step by its per-operator cost, so
``ms/step`` here runs a little above the precision comparison's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch.profiler

from hpcdl.bench.reports import Breakdown, ClassTime, TopOperator

__all__ = ["CLASSES", "breakdown", "classify", "format_breakdown", "summarize"]

CLASSES = ("matrix", "casts", "normalization", "element-wise", "optimizer", "framework")

_MATRIX = ("conv", "addmm", "::mm", "bmm", "matmul", "linear", "scaled_dot_product", "attention", "einsum")
_CASTS = ("aten::_to_copy", "aten::to", "aten::_autocast_to_reduced_precision", "aten::_autocast_to_full_precision")
_NORMS = ("batch_norm", "layer_norm", "group_norm", "instance_norm", "native_norm")


def classify(name: str, ancestors: Iterable[str]) -> str:
    """The class of an operator ``name`` called (directly or not) from ``ancestors`` (outermost last or first:
    any order)."""
    ancestors = tuple(ancestors)
    if any(a.startswith("Optimizer.") for a in ancestors) or name.startswith("Optimizer."):
        return "optimizer"
    if not name.startswith("aten::") and not name.startswith("mkldnn"):
        return "framework"  # autograd's engine, record_function scopes: their own time is bookkeeping
    if name in _CASTS or any(a in _CASTS for a in ancestors):
        return "casts"
    operators = [name.lower(), *(a.lower() for a in ancestors if a.startswith("aten::"))]
    if any(k in op for op in operators for k in _NORMS):
        return "normalization"
    if any(k in op for op in operators for k in _MATRIX):
        return "matrix"
    return "element-wise"


def summarize(events, wall_s: float, steps: int) -> tuple[dict[str, ClassTime], list[tuple[str, str, float]]]:
    """Each class's time per step from profiler ``events`` (FunctionEvents: ``name``, ``self_cpu_time_total`` in
    microseconds, ``cpu_parent``) covering ``steps`` steps of ``wall_s`` seconds; and the operators' totals,
    largest first."""
    totals = dict.fromkeys(CLASSES, 0.0)
    calls = dict.fromkeys(CLASSES, 0)
    by_op: dict[tuple[str, str], float] = {}
    for event in events:
        ancestors, parent = [], event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        kind = classify(event.name, ancestors)
        seconds = event.self_cpu_time_total / 1e6
        totals[kind] += seconds
        calls[kind] += kind != "framework"
        by_op[(event.name, kind)] = by_op.get((event.name, kind), 0.0) + seconds
    totals["framework"] += max(0.0, wall_s - sum(totals.values()))  # outside any operator: Python
    classes = {k: ClassTime(ms=totals[k] / steps * 1e3, share=totals[k] / wall_s if wall_s else 0.0,
                            calls=calls[k] / steps) for k in CLASSES}
    top = sorted(((name, kind, s / steps * 1e3) for (name, kind), s in by_op.items()), key=lambda r: -r[2])
    return classes, top


def profile_step(step: Callable[[], None], steps: int, warmup: int = 2):
    """Run ``step`` ``warmup`` times, then ``steps`` times under torch's profiler (CPU); (events, wall seconds)."""
    for _ in range(warmup):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - t0
    return prof.events(), wall


def breakdown(model: str, precision: str, batch: int, crop: int, steps: int, gemm: float, flops: float,
              make_step: Callable[[], Callable[[], None]]) -> Breakdown:
    events, wall = profile_step(make_step(), steps)
    classes, top = summarize(events, wall, steps)
    per_step = wall / steps
    matrix_s = classes["matrix"].ms / 1e3
    return Breakdown(model=model, precision=precision, batch=batch, ms_per_step=per_step * 1e3, classes=classes,
                     flops_per_step=flops, matrix_gflops=flops / matrix_s / 1e9 if matrix_s else 0.0,
                     gemm_gflops=gemm, step_of_gemm=flops / per_step / 1e9 / gemm if gemm else 0.0,
                     top=tuple(TopOperator(n, k, round(ms, 3)) for n, k, ms in top[:5]))


def format_breakdown(b: Breakdown) -> list[str]:
    lines = [f"where a step goes: {b.model} {b.precision}, batch {b.batch}: {b.ms_per_step:.1f} ms/step profiled, "
             f"{b.flops_per_step / 1e9:.1f} GFLOP: {b.step_of_gemm:.0%} of the {b.precision} GEMM rate "
             f"({b.gemm_gflops:.0f} GFLOP/s)",
             f"  {'class':14s} {'ms/step':>9s} {'share':>6s} {'ops/step':>9s}  rate"]
    for name, c in b.classes.items():
        rate = (f"{b.matrix_gflops:.0f} GFLOP/s, {b.matrix_gflops / b.gemm_gflops:.0%} of GEMM"
                if name == "matrix" and b.gemm_gflops else "")
        calls = f"{c.calls:9.0f}" if name != "framework" else f"{'':9s}"
        lines.append(f"  {name:14s} {c.ms:9.1f} {c.share:6.0%} {calls}  {rate}")
    lines.append("  largest operators: " + "; ".join(f"{t.name} ({t.kind}) {t.ms:.1f} ms" for t in b.top))
    return lines
