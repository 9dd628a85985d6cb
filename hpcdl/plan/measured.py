"""The step model's inputs measured by the benchmarks: the network fitted to ``hpcdl bench allreduce --json``, a
node's compute curve read from ``hpcdl bench step --json``, and the compute and overlap fitted to ``hpcdl bench
scaling --json`` (``hpcdl plan --calibrate``). :class:`hpcdl.plan.planner.PlanInputs` chooses among them."""

from __future__ import annotations

import dataclasses
import statistics

from hpcdl.bench.reports import AllreduceReport, ScalingReport, StepReport, fit_ring
from hpcdl.errors import DataError
from hpcdl.plan.cost import BACKWARD_SHARE, BatchCurve, Link, StepModel, allreduce_cost

__all__ = ["Calibration", "calibrate", "curve_from_step", "link_from_allreduce"]


def link_from_allreduce(report: AllreduceReport, backend: str | None = None, source: str = "the report") -> Link:
    """The alpha-beta link that best explains ``hpcdl bench allreduce --json``'s times (``backend``'s rows of a
    ``--backends`` report, default the first backend's), each a ring of its ``world_size`` ranks
    (:func:`hpcdl.bench.reports.comm.fit_ring`)."""
    measured = list(dict.fromkeys(r.backend for r in report.rows))
    backend = backend or (measured[0] if measured else None)
    if backend not in measured:
        raise DataError(f"{source}: no rows of backend {backend!r}; it measured {', '.join(measured)}")
    alpha, beta = fit_ring(report.meta.world_size, [(r.bytes, r.time_us * 1e-6) for r in report.rows
                                                    if r.backend == backend])
    return Link(latency_s=alpha, bandwidth_bytes_s=1 / beta)


def curve_from_step(report: StepReport) -> BatchCurve:
    """A node's images/s against its batch from ``hpcdl bench step --json``: the tuned node of the tuning
    comparison, and every point of its batch sweep when it ran one."""
    points = [(float(b), v) for b, v in (report.curve.points if report.curve else ())]
    if report.tuning:
        c = report.config
        points.append((c.tuning_batch * c.ranks_per_node, report.tuning.images_per_s["tuned"]))
    if not points:
        raise DataError("the bench step report holds no node throughput; run hpcdl bench step without --only overhead")
    by_batch: dict[float, list[float]] = {}
    for b, v in points:
        by_batch.setdefault(b, []).append(v)
    return BatchCurve(tuple((b, statistics.median(v)) for b, v in by_batch.items()))


@dataclasses.dataclass(frozen=True, slots=True)
class Calibration:
    throughput: BatchCurve
    overlap: float
    backward_share: float
    ranks_per_node: int
    points: list[dict]  # each measured point beside what the calibrated model gives for it


def calibrate(report: ScalingReport, network: Link, algorithm: str = "ring", messages: int = 1,
              intra: Link | None = None) -> Calibration:
    """Fit the per-node compute and the overlap to ``hpcdl bench scaling --json``.

    - compute: a full node's images/s at its batch, from every point whose ranks fill their nodes (step
      minus the exposed communication);
    - backward's share of compute: from the one-rank points' phases;
    - overlap: the hidden part of each multi-rank point's modelled all-reduce (modelled minus measured
      exposed), over what backward could hide, averaged and held in [0, 1]. A point whose communication
      was all hidden only bounds the overlap from below: measure where it shows (more ranks, or nodes).
    """
    rpn = report.meta.ranks_per_node
    full = [p for p in report.points if p.ranks == p.nodes * rpn]
    if not full:
        raise DataError(f"no point of the scaling report fills its nodes ({rpn} ranks each); run bench scaling "
                        f"with all of a node's ranks")
    samples: dict[float, list[float]] = {}
    for p in full:
        batch = p.batch_per_rank * rpn
        compute_s = (p.step_ms.mean - p.phases_ms.comm_wait) / 1e3
        samples.setdefault(batch, []).append(batch / compute_s)
    curve = BatchCurve(tuple((b, statistics.median(v)) for b, v in samples.items()))
    singles = [p for p in report.points if p.ranks == 1]
    share = statistics.median(p.phases_ms.backward / (p.phases_ms.forward + p.phases_ms.backward + p.phases_ms.optimizer)
                              for p in singles) if singles else BACKWARD_SHARE
    overlaps = []
    for p in full:
        if p.ranks < 2:
            continue
        comm = allreduce_cost(algorithm, report.meta.gradient_bytes, p.nodes, rpn, network, intra)
        modelled = comm.latency_s * messages + comm.bandwidth_s
        compute_s = (p.step_ms.mean - p.phases_ms.comm_wait) / 1e3
        hidden = modelled - p.phases_ms.comm_wait / 1e3
        overlaps.append(hidden / (share * compute_s))
    overlap = min(1.0, max(0.0, statistics.fmean(overlaps))) if overlaps else 0.0
    model = StepModel(gradient_bytes=report.meta.gradient_bytes, throughput=curve, network=network,
                      ranks_per_node=rpn, algorithm=algorithm, intra=intra, messages=messages, overlap=overlap,
                      backward_share=share)
    checked = [{"mode": p.mode, "ranks": p.ranks, "nodes": p.nodes, "measured_images_s": p.images_per_s,
                "model_images_s": model.terms(p.nodes, p.global_batch)["images_s"]} for p in full]
    return Calibration(curve, overlap, share, rpn, checked)
