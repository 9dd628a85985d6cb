"""``hpcdl bench step`` measures what it says (its speed figures are in docs/performance.md, not here)."""

import json
import os
import subprocess

from conftest import PYTHON
from hpcdl.distributed.affinity import allocator_env


def test_bench_step_compares_both_pairs_and_tunes_only_the_tuned_side(tmp_path):
    report = tmp_path / "step.json"
    run = subprocess.run([PYTHON, "-m", "hpcdl", "bench", "step", "--model", "tiny_cnn", "--batch", "8", "--crop", "32",
                          "--steps", "2", "--rounds", "2", "--tuning-model", "tiny_cnn", "--tuning-batch", "8",
                          "--tuning-crop", "32", "--tuning-steps", "2", "--tuning-rounds", "1", "--curve-batches", "4,16",
                          "--json", str(report)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "hpcdl / bare loop:" in run.stdout and "tuned / untuned:" in run.stdout
    r = json.loads(report.read_text())
    assert set(r["overhead"]["ms_per_step"]) == {"bare loop", "hpcdl"} and r["overhead"]["ratio"] > 0
    setup = r["tuning"]["setup"]
    assert setup["untuned"]["allocator"].startswith("glibc defaults")
    assert setup["tuned"]["allocator"].startswith(allocator_env("auto")[0])
    assert setup["tuned"]["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)  # 2 ranks split the CPUs
    curve = r["curve"]["points"]  # the node's batch: 2 ranks x the per-rank batch
    assert [b for b, _ in curve] == [8, 32] and all(v > 0 for _, v in curve)
    assert "batch     8" in run.stdout and "batch    32" in run.stdout
