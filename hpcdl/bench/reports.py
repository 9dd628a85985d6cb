"""The benchmark reports other code reads, typed: ``hpcdl plan`` reads ``bench allreduce``, ``bench step``
and ``bench scaling`` JSON through these, never by string keys of its own.

Each class names only the fields its readers use; a report may hold more. A file that is not JSON, is the
report of another benchmark, or lacks a field gets an error that names the file, the field and the
command that writes such a report.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import get_args, get_origin

from hpcdl.errors import DataError

__all__ = ["AllreduceReport", "ScalingReport", "StepReport", "SyncReport"]


class _Report:
    benchmark: typing.ClassVar[str]

    @classmethod
    def from_json(cls, path: str):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise DataError(f"{path}: cannot read it as an hpcdl bench {cls.benchmark} report ({exc})") from None
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data, source: str = "the report"):
        found = data.get("benchmark") or (data.get("meta") or {}).get("benchmark") if isinstance(data, dict) else None
        if found and found != cls.benchmark:
            raise DataError(f"{source}: this is an hpcdl bench {found} report; give the JSON of hpcdl bench "
                            f"{cls.benchmark} --json FILE")
        return _read(cls, data, "", source, cls.benchmark)


def _read(cls, data, where: str, source: str, bench: str):
    if not isinstance(data, dict):
        raise DataError(f"{source}: {where or 'the report'} is {type(data).__name__}, not a mapping; give the JSON of "
                        f"hpcdl bench {bench} --json FILE")
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        key = f"{where}.{f.name}" if where else f.name
        if f.name not in data:
            if f.default is not dataclasses.MISSING:
                continue
            raise DataError(f"{source}: {key} is missing; it is not a report of hpcdl bench {bench} --json FILE "
                            f"(or one from an older hpcdl: measure it again)")
        kw[f.name] = _value(hints[f.name], data[f.name], key, source, bench)
    return cls(**kw)


def _value(tp, value, key: str, source: str, bench: str):
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        tp, origin, args = args[0], get_origin(args[0]), get_args(args[0])
    if dataclasses.is_dataclass(tp):
        return _read(tp, value, key, source, bench)
    if origin in (list, tuple) and isinstance(value, list):
        return tuple(_value(args[0], v, f"{key}[{i}]", source, bench) for i, v in enumerate(value))
    if origin is dict and isinstance(value, dict):
        return {k: _value(args[1], v, f"{key}.{k}", source, bench) for k, v in value.items()}
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp in (int, str, bool) and type(value) is tp:
        return value
    raise DataError(f"{source}: {key} is {value!r}, not {getattr(tp, '__name__', tp)}; give the JSON of hpcdl bench "
                    f"{bench} --json FILE")


@dataclasses.dataclass(frozen=True, slots=True)
class AllreduceRow:
    bytes: int
    time_us: float  # the slowest rank's
    backend: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class AllreduceMeta:
    world_size: int


@dataclasses.dataclass(frozen=True, slots=True)
class AllreduceReport(_Report):
    benchmark: typing.ClassVar[str] = "allreduce"
    meta: AllreduceMeta
    rows: tuple[AllreduceRow, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class SyncHook:
    ms: float  # median DDP sync of the gradient set
    mb_sent: float  # MiB each rank sends per step


@dataclasses.dataclass(frozen=True, slots=True)
class SyncReport(_Report):
    benchmark: typing.ClassVar[str] = "sync"
    model: str
    parameters: int
    hooks: dict[str, SyncHook]

    def hook_seconds_per_byte(self, hook: str, source: str = "the report") -> float:
        """The hook's own work per gradient byte: its sync time less the plain sync's scaled to the hook's
        wire bytes (the plain sync taken as all wire), at least 0."""
        for name in ("none", hook):
            if name not in self.hooks:
                raise DataError(f"{source}: hooks.{name} is missing; run hpcdl bench sync --hooks none,{hook} "
                                f"--json FILE")
        none, this = self.hooks["none"], self.hooks[hook]
        wire_s = none.ms * this.mb_sent / none.mb_sent / 1e3
        return max(0.0, this.ms / 1e3 - wire_s) / (self.parameters * 4)


@dataclasses.dataclass(frozen=True, slots=True)
class StepSetup:
    tuning_batch: int
    ranks_per_node: int


@dataclasses.dataclass(frozen=True, slots=True)
class StepTuning:
    images_per_s: dict[str, float]  # "tuned", "untuned"


@dataclasses.dataclass(frozen=True, slots=True)
class StepCurve:
    points: tuple[tuple[float, ...], ...]  # (the node's batch, images/s)


@dataclasses.dataclass(frozen=True, slots=True)
class StepReport(_Report):
    benchmark: typing.ClassVar[str] = "step"
    config: StepSetup
    tuning: StepTuning | None = None
    curve: StepCurve | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ScalingMeta:
    ranks_per_node: int
    gradient_bytes: float


@dataclasses.dataclass(frozen=True, slots=True)
class StepTimes:
    mean: float  # ms


@dataclasses.dataclass(frozen=True, slots=True)
class Phases:  # ms
    forward: float
    backward: float
    optimizer: float
    comm_wait: float


@dataclasses.dataclass(frozen=True, slots=True)
class ScalingPoint:
    mode: str
    ranks: int
    nodes: int
    batch_per_rank: int
    global_batch: int
    images_per_s: float
    step_ms: StepTimes
    phases_ms: Phases


@dataclasses.dataclass(frozen=True, slots=True)
class ScalingReport(_Report):
    benchmark: typing.ClassVar[str] = "scaling"
    meta: ScalingMeta
    points: tuple[ScalingPoint, ...]
