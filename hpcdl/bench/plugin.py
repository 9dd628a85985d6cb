"""``hpcdl bench plugin``: ``hpcdl bench allreduce``'s sweep through torch's entry points (a script that
imports only torch before ``init_process_group``) against hpcdl's own start-up, in one run.

Run it where the ranks can start (a login shell with ``mpiexec``, or inside an allocation with ``srun``),
not under a launcher: it starts both paths itself, alternated, ``--rounds`` times each.

- hpcdl's path: ``LAUNCHER hpcdl bench allreduce --backends ...``: rank discovery, the CPU plan (threads and
  affinity), the backend table's variables, and the groups registered by hpcdl.
- The plugin path: ``LAUNCHER hpcdl exec python plugin_worker.py``: ``hpcdl exec`` sets torch's env://
  variables and replaces itself by a script that imports only torch, whose ``init_process_group("gloo")``
  and ``new_group(backend="mpi4py" | "oneccl")`` find hpcdl's groups through the entry points
  (:mod:`hpcdl.distributed.group.plugin`); the script keeps torch's own thread count, as a user's would.

Both measure with the same code (:func:`hpcdl.bench.allreduce._measure`), so a difference is the start-up's.
Each row keeps the best of its rounds; the table gives the plugin path's time over hpcdl's per size.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hpcdl.bench.configs import LAUNCHERS
from hpcdl.bench.configs import PluginBench as Config
from hpcdl.bench.reports import AllreduceReport, PluginMeta, PluginReport, PluginRow, PluginWorkerReport
from hpcdl.distributed.backend import BACKENDS
from hpcdl.errors import ConfigError, DataError, LaunchError
from hpcdl.schema import from_dict
from hpcdl.utils import format_bytes

__all__ = ["Config", "format_report", "run"]

WORKER = Path(__file__).with_name("plugin_worker.py")


def run(cfg: Config, job) -> PluginReport:
    """Both paths, alternated ``cfg.rounds`` times; the best time of each (path, backend, size)."""
    launch = [*LAUNCHERS[cfg.launcher], str(cfg.ranks)]
    if not shutil.which(launch[0]):
        raise ConfigError(f"--launcher {cfg.launcher}: {launch[0]} is not on PATH")
    torch_names = [BACKENDS[n].torch_name for n in cfg.wanted()]
    sweep = cfg.sweep()
    best: dict[tuple, PluginRow] = {}
    imports = None
    threads = {}
    with tempfile.TemporaryDirectory(prefix="hpcdl-bench-plugin-") as tmp:
        config = Path(tmp, "sweep.json")
        config.write_text(json.dumps({"min_bytes": sweep.min_bytes, "max_bytes": sweep.max_bytes,
                                      "seconds_per_size": sweep.seconds_per_size}))
        for round_ in range(cfg.rounds):
            for path in ("hpcdl", "plugin"):
                out = Path(tmp, f"{path}-{round_}.json")
                if path == "hpcdl":
                    cmd = [*launch, sys.executable, "-m", "hpcdl", "bench", "allreduce", "--backends",
                           ",".join(cfg.wanted()), "--min-bytes", str(sweep.min_bytes), "--max-bytes",
                           str(sweep.max_bytes), "--seconds-per-size", str(sweep.seconds_per_size), "--json", str(out)]
                else:
                    cmd = [*launch, sys.executable, "-m", "hpcdl", "exec", sys.executable, str(WORKER),
                           ",".join(torch_names), str(config), str(out)]
                _launch(cmd, path)
                if path == "hpcdl":
                    found = AllreduceReport.from_json(str(out))
                    threads[path] = found.ranks[0].threads
                else:
                    found = from_dict(PluginWorkerReport, json.loads(out.read_text()), "", error=DataError,
                                      source=str(out), fix=f"{WORKER.name} and this hpcdl differ: reinstall hpcdl")
                    imports, threads[path] = found.imports, found.threads
                for row in found.rows:
                    key = (path, row.backend, row.bytes)
                    if key not in best or row.time_us < best[key].time_us:
                        best[key] = PluginRow(path=path, **dataclasses.asdict(row))
    return PluginReport(meta=PluginMeta(ranks=cfg.ranks, launcher=cfg.launcher, backends=tuple(torch_names),
                                        rounds=cfg.rounds, threads=threads),
                        plugin_imports=imports, rows=tuple(best.values()), ratio=_ratios(best, torch_names))


def _launch(cmd: list[str], path: str) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        raise LaunchError(f"bench plugin: the {path} path failed ({' '.join(cmd)}, exit {run.returncode}):\n"
                          f"{run.stderr[-3000:]}")


def _ratios(best: dict[tuple, PluginRow], backends: list[str]) -> dict[str, float]:
    """Per backend, the geometric mean over sizes of the plugin path's time over hpcdl's."""
    out = {}
    for backend in backends:
        logs = [math.log(best["plugin", backend, size].time_us / row.time_us)
                for (path, b, size), row in best.items() if path == "hpcdl" and b == backend]
        out[backend] = math.exp(sum(logs) / len(logs))
    return out


def format_report(report: PluginReport) -> str:
    meta, backends = report.meta, report.meta.backends
    by = {(r.path, r.backend, r.bytes): r for r in report.rows}
    imports = report.plugin_imports
    lines = [f"# allreduce on {meta.ranks} ranks ({meta.launcher}), hpcdl's start-up vs torch's entry points, "
             f"best of {meta.rounds} alternated launches each",
             f"# plugin path: hpcdl imported before init_process_group: {imports.hpcdl_before_init}, after the "
             f"groups: {imports.hpcdl_after_init}; torch threads per rank: hpcdl {meta.threads['hpcdl']}, "
             f"plugin {meta.threads['plugin']}",
             f"{'size':>10} " + " ".join(f"{b + ' hpcdl':>14} {b + ' plugin':>15} {'ratio':>6}" for b in backends)]
    for size in sorted({r.bytes for r in report.rows}):
        cells = []
        for b in backends:
            ours, theirs = by["hpcdl", b, size].time_us, by["plugin", b, size].time_us
            cells.append(f"{ours:>14.1f} {theirs:>15.1f} {theirs / ours:>5.2f}x")
        lines.append(f"{format_bytes(size):>10} " + " ".join(cells))
    lines.append("# plugin/hpcdl time, geometric mean over sizes: "
                 + ", ".join(f"{b} {r:.3f}x" for b, r in report.ratio.items()))
    bad = [f"{r.path} {r.backend} {format_bytes(r.bytes)}" for r in report.rows if not r.correct]
    lines.append(f"# reduced values: {'all correct' if not bad else 'WRONG at ' + ', '.join(bad)}")
    return "\n".join(lines)


def check(report: PluginReport) -> str | None:
    """Why the run failed: a wrong value, or a plugin path that had hpcdl loaded before its groups existed."""
    if not all(r.correct for r in report.rows):
        return "allreduce produced wrong values; see the last line"
    if report.plugin_imports.hpcdl_before_init:
        return "the plugin path imported hpcdl before init_process_group: it did not measure the plugin path"
    return None
