"""The cost of failures in ``hpcdl plan``: expected time to train at N nodes when nodes fail, on three paths.

A job of N nodes whose nodes fail independently, each after ``node_mtbf`` on average, fails after
``M = node_mtbf / N``. With ``T0`` the failure-free time to train, ``C`` the time to write one checkpoint,
``R`` a restart (start-up and the checkpoint read and broadcast: :mod:`hpcdl.plan.startup_terms`), ``tau`` the
checkpoint interval and ``Q`` the queue's wait, each failure costs the work since the last checkpoint (tau / 2
on average) and the way back; to first order (Young 1974; Daly 2006, whose model this is without the
higher-order terms) the expected time is the failure-free time with its checkpoints, stretched by the share of
each failure-free interval M that failures take:

    T = T0 (1 + C / tau) / (1 - L / M)

with the loss per failure L:

- (a) requeue through the queue: ``tau / 2 + R + Q``, what Slurm's requeue and every launcher do today;
- (b) restart inside the allocation from the last periodic checkpoint (spares, no queue): ``tau / 2 + R``;
- (c) the just-in-time path (:mod:`hpcdl.train.rescue`, :mod:`hpcdl.launch.supervisor`): the step in flight
  (half a step on average), the detection ``D`` (heartbeats, the survivors' agreement), one checkpoint written
  by a survivor ``C`` and ``R``; no periodic checkpoint is needed for failures (tau -> infinity), only for the
  time limit.

When L >= M the job does not finish on average: the row says so (infinite). The interval that minimizes (a)
and (b): Young's ``sqrt(2 C M)`` and Daly's higher-order estimate
``sqrt(2 C M) (1 + sqrt(C / (2M)) / 3 + C / (18 M)) - C`` (for C < 2M; M otherwise).
"""

from __future__ import annotations

import dataclasses
import math

from hpcdl.errors import ConfigError

__all__ = ["FailureModel", "daly_interval", "expected_time", "young_interval"]

# The default node MTBF is an assumption, not a measurement of the user's machine: Schroeder and Gibson (DSN 2006,
# 9 years of LANL clusters) found a system's failure rate grows in proportion to its processors and ranged from
# 20 to 1,000 failures a year per system; 5 years per node puts a 2,048-node job at one failure in 21 hours, a
# 256-node one at one in 7 days: "a node lost every few hours to days" at the scale of the published runs.
NODE_MTBF_HOURS = 5 * 365 * 24.0


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    r = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - checkpoint_s


def expected_time(t0: float, checkpoint_s: float, interval_s: float, loss_s: float, mtbf_s: float) -> float:
    """T0 (1 + C / tau) / (1 - L / M); infinite when the loss per failure reaches the job's MTBF."""
    if loss_s >= mtbf_s:
        return math.inf
    overhead = checkpoint_s / interval_s if math.isfinite(interval_s) else 0.0
    return t0 * (1 + overhead) / (1 - loss_s / mtbf_s)


@dataclasses.dataclass(kw_only=True, slots=True)
class FailureModel:
    """``hpcdl plan``'s failure questions (docs/reliability.md, "What a failure costs")."""

    # a node's mean time between failures, hours (default: an assumption from Schroeder and Gibson's LANL data,
    # hpcdl/plan/failures.py says which; give your site's)
    node_mtbf_hours: float = NODE_MTBF_HOURS
    queue_wait_hours: float = 4.0  # the wait of a requeued job of this size in the queue (path a)
    checkpoint_minutes: float = 30.0  # the periodic checkpoint's interval (checkpoint.every_minutes; paths a, b)
    # the just-in-time path's detection and agreement, s: heartbeats (5 intervals), the stall bound, the reports
    detect_s: float = 30.0

    def __post_init__(self):
        for name in ("node_mtbf_hours", "checkpoint_minutes"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be more than 0")
        if self.queue_wait_hours < 0 or self.detect_s < 0:
            raise ConfigError("--queue-wait-hours and --detect-s must be >= 0")

    def terms(self, nodes: int, t0: float, step_s: float, checkpoint_write_s: float, restart_s: float) -> dict:
        mtbf = self.node_mtbf_hours * 3600 / nodes
        tau = self.checkpoint_minutes * 60
        c, r, q = checkpoint_write_s, restart_s, self.queue_wait_hours * 3600
        losses = {"requeue": tau / 2 + r + q, "allocation": tau / 2 + r,
                  "jit": step_s / 2 + self.detect_s + c + r}
        daly = daly_interval(c, mtbf)
        return {"job_mtbf_s": mtbf, "failures": t0 / mtbf, "checkpoint_write_s": c, "loss_s": losses,
                "requeue_s": expected_time(t0, c, tau, losses["requeue"], mtbf),
                "allocation_s": expected_time(t0, c, tau, losses["allocation"], mtbf),
                "jit_s": expected_time(t0, c, math.inf, losses["jit"], mtbf),
                "young_interval_s": young_interval(c, mtbf), "daly_interval_s": daly,
                "requeue_at_daly_s": expected_time(t0, c, daly, daly / 2 + r + q, mtbf),
                "allocation_at_daly_s": expected_time(t0, c, daly, daly / 2 + r, mtbf)}


def format_failures(rows: list[dict], model: FailureModel) -> str:
    lines = [f"# failures: node MTBF {model.node_mtbf_hours:,.0f} h, periodic checkpoint every "
             f"{model.checkpoint_minutes:g} min, queue wait {model.queue_wait_hours:g} h, just-in-time detection "
             f"{model.detect_s:g} s; expected time to train, h (docs/reliability.md)",
             f"{'nodes':>6} {'job MTBF':>9} {'failures':>9} {'no fail':>8} {'requeue':>8} {'in alloc':>8} "
             f"{'just-in':>8} {'Young':>7} {'Daly':>7} {'requeue':>8} {'in alloc':>8}",
             f"{'':>6} {'h':>9} {'':>9} {'':>8} {'(a)':>8} {'(b)':>8} {'time (c)':>8} {'min':>7} {'min':>7} "
             f"{'at Daly':>8} {'at Daly':>8}"]
    for row in rows:
        f = row["failures_model"]
        lines.append(f"{row['nodes']:>6} {f['job_mtbf_s'] / 3600:>9.1f} {f['failures']:>9.2f} "
                     f"{row['time_to_train_s'] / 3600:>8.2f} {_h(f['requeue_s'])} {_h(f['allocation_s'])} "
                     f"{_h(f['jit_s'])} {f['young_interval_s'] / 60:>7.1f} {f['daly_interval_s'] / 60:>7.1f} "
                     f"{_h(f['requeue_at_daly_s'])} {_h(f['allocation_at_daly_s'])}")
    return "\n".join(lines)


def _h(seconds: float) -> str:
    return f"{seconds / 3600:>8.2f}" if math.isfinite(seconds) else f"{'never':>8}"
