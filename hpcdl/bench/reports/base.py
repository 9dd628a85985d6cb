"""What every report carries: the machine and command it was measured with, and how it is read back."""

from __future__ import annotations

import dataclasses
import json
import typing

from hpcdl.errors import DataError
from hpcdl.schema import from_dict

__all__ = ["Machine", "Provenance", "Report"]


@dataclasses.dataclass(frozen=True, slots=True)
class Machine:
    cpu: str
    cores: int  # the CPUs this process may run on
    logical_cpus: int
    flags: tuple[str, ...]  # the ISA flags that matter (avx*, amx*, fma, sse4*)


@dataclasses.dataclass(frozen=True, slots=True)
class Provenance:
    """Where and how a report was measured (:func:`hpcdl.bench.runner.provenance`)."""

    command: tuple[str, ...]
    hpcdl: str
    commit: str | None
    machine: Machine
    host: str
    job_id: str | None
    time: str


class Report:
    """A benchmark report: ``benchmark`` names it; read one with :meth:`from_json` or :meth:`from_dict`."""

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
        return from_dict(cls, data, "", error=DataError, strict=False, source=source,
                         fix=f"give the JSON of hpcdl bench {cls.benchmark} --json FILE (one from an older hpcdl: "
                             "measure it again)")
