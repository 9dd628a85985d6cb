"""The benchmarks' reports, typed: each is a dataclass that its benchmark's ``run`` fills, the runner writes as
JSON (:func:`hpcdl.schema.to_dict`) and its readers take (the table, the plot, ``hpcdl plan``'s ``--*-json``
flags, read through :func:`hpcdl.schema.from_dict`), never indexed by string keys.

Every benchmark declares its whole report here (``hpcdl tune --measure``'s result, which is no report, is
typed in :mod:`hpcdl.bench.tune`). The fit of an all-reduce report to a ring's alpha-beta cost
(:func:`fit_ring`) is here too: ``bench allreduce`` prints it and ``hpcdl plan`` prices the network with it.
A file that is not JSON, is the report of another benchmark, or lacks a field gets an error that names the
file, the field and the command that writes such a report.
"""

from __future__ import annotations

from hpcdl.bench.reports.base import Machine, Provenance, Report
from hpcdl.bench.reports.comm import (AllreduceMeta, AllreduceReport, AllreduceRow, DDPPart, NoFit, Placement,
                                      PluginImports, PluginMeta, PluginReport, PluginRow, PluginWorkerReport, RingFit,
                                      SyncFigures, SyncHook, SyncReport, WeakScaling, fit_ring)
from hpcdl.bench.reports.data import (DataPathReport, DataReport, FeedReport, FeedRow, FeedRun, PathEpoch, ReaderRow,
                                      RecipeRates)
from hpcdl.bench.reports.startup import CountFit, StartupReport, StartupRow, StoreCapacity
from hpcdl.bench.reports.train import (Breakdown, ClassTime, Compiled, LargeBatchCell, LargeBatchReport, NodeRound,
                                       NotCompiled, OptimReport, OptimShardReport, OptimShardRow, Phases, PrecisionCase, RankSetup, ScalingMeta,
                                       ScalingPoint, ScalingReport, StepCurve, StepOverhead, StepPrecision, StepReport,
                                       StepTimes, StepTuning, TopOperator)

__all__ = ["AllreduceMeta", "AllreduceReport", "AllreduceRow", "Breakdown", "ClassTime", "Compiled", "CountFit",
           "DDPPart", "DataPathReport", "DataReport", "FeedReport", "FeedRow", "FeedRun", "LargeBatchCell",
           "LargeBatchReport", "Machine", "NoFit", "NodeRound", "NotCompiled", "OptimReport", "OptimShardReport", "OptimShardRow", "PathEpoch", "Phases",
           "Placement", "PluginImports", "PluginMeta", "PluginReport", "PluginRow", "PluginWorkerReport",
           "PrecisionCase", "Provenance", "RankSetup", "ReaderRow", "RecipeRates", "Report", "RingFit", "ScalingMeta",
           "ScalingPoint", "ScalingReport", "StartupReport", "StartupRow", "StepCurve", "StepOverhead", "StepPrecision",
           "StepReport", "StepTimes", "StepTuning", "StoreCapacity", "SyncFigures", "SyncHook", "SyncReport",
           "TopOperator", "WeakScaling", "fit_ring"]
