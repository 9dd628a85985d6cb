"""``hpcdl bench scaling`` on the local Slurm's two nodes, and the checks made before any rank works."""

from __future__ import annotations

import pytest
from conftest import PYTHON, load_json, sbatch_wait

from hpcdl.bench.reports import ScalingReport
from hpcdl.bench.scaling import Config as ScalingBenchConfig
from hpcdl.bench.scaling import figure, format_report
from hpcdl.errors import ConfigError
from hpcdl.launch import job_request
from hpcdl.launch.sbatch import render_sbatch

QUICK = ["--model", "resnet18", "--crop", "32", "--batch", "4", "--steps", "2", "--rounds", "2", "--threads", "1"]


def _scaling_job(tmp_path, nodes: int, tasks_per_node: int, *extra: str) -> dict:
    script = tmp_path / "scaling.sbatch"
    script.write_text(render_sbatch(
        job_request(profile="local", nodes=nodes, tasks_per_node=tasks_per_node, time="10", python=PYTHON,
                    output=f"{tmp_path}/%j.out"),
        ["bench", "scaling", *QUICK, *extra, "--json", f"{tmp_path}/scaling-%j.json", "--plot", f"{tmp_path}/scaling-%j.png"]))
    job = sbatch_wait(script)
    report = load_json(tmp_path / f"scaling-{job}.json")
    report["job"] = job
    return report


def test_two_nodes_one_task_each_give_the_table_json_and_plot(two_nodes, tmp_path):
    report = _scaling_job(tmp_path, nodes=2, tasks_per_node=1)
    points = {(p["mode"], p["ranks"]): p for p in report["points"]}
    assert set(points) == {("weak", 1), ("weak", 2), ("strong", 1), ("strong", 2)}
    assert points["weak", 2]["nodes"] == 2 and points["weak", 1]["nodes"] == 1
    assert report["meta"]["ranks_per_node"] == 1 and report["meta"]["threads"] == 1
    assert [points["weak", k]["global_batch"] for k in (1, 2)] == [4, 8]  # weak: the per-rank batch holds
    assert [points["strong", k]["batch_per_rank"] for k in (1, 2)] == [8, 4]  # strong: the global batch holds
    for p in report["points"]:
        assert p["steps"] == 4  # 2 rounds x 2 steps
        assert p["images_per_s"] == pytest.approx(p["global_batch"] / p["step_ms"]["mean"] * 1e3)
        assert p["step_ms"]["p50"] <= p["step_ms"]["p90"] <= p["step_ms"]["p99"]
        assert 0 <= p["exposed_comm_share"] < 1
    for mode in ("weak", "strong"):
        one, two = points[mode, 1], points[mode, 2]
        assert one["efficiency"] == 1 and one["exposed_comm_share"] < 0.01  # one rank: no DDP, no all-reduce
        assert two["efficiency"] == pytest.approx(two["images_per_s"] / (2 * one["images_per_s"] / one["ranks"]))
        assert two["phases_ms"]["comm_wait"] > one["phases_ms"]["comm_wait"]
    out = (tmp_path / f"{report['job']}.out").read_text()
    assert "# scaling: resnet18 at 32 px on 2 ranks (2 node(s), 1 per node)" in out
    for line in format_report(ScalingReport.from_dict(report)).splitlines()[1:]:
        assert line in out  # the table printed is the table in the JSON, read back through its type
    assert (tmp_path / f"scaling-{report['job']}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_node_two_tasks_with_a_hook_and_the_plot_shows_the_table(slurm, tmp_path):
    report = _scaling_job(tmp_path, 1, 2, "--hook", "fp16")
    assert report["meta"]["ranks_per_node"] == 2 and {p["nodes"] for p in report["points"]} == {1}
    assert report["meta"]["hook"] == "fp16" and "hook fp16" in (tmp_path / f"{report['job']}.out").read_text()
    fig = figure(ScalingReport.from_dict(report))
    left, right = fig.axes
    for mode in ("weak", "strong"):
        pts = sorted((p for p in report["points"] if p["mode"] == mode), key=lambda p: p["ranks"])
        lines = {line.get_label(): line for line in left.lines + right.lines}
        assert list(lines[f"{mode} (measured)"].get_xdata()) == [1, 2]
        assert list(lines[f"{mode} (measured)"].get_ydata()) == [p["images_per_s"] for p in pts]
        assert list(lines[f"{mode} ideal"].get_ydata()) == [p["ideal_images_per_s"] for p in pts]
        assert list(lines[mode].get_ydata()) == [p["efficiency"] * 100 for p in pts]


def test_rank_counts_and_batches_are_checked_before_any_work():
    assert ScalingBenchConfig().counts(6) == [1, 2, 4, 6]
    assert ScalingBenchConfig(ranks=(4, 1, 2)).counts(4) == [1, 2, 4]
    with pytest.raises(ConfigError, match=r"--ranks asks for \[8\] ranks but the job has 4"):
        ScalingBenchConfig(ranks=(1, 8)).points(4)
    with pytest.raises(ConfigError, match="a global batch of 30 does not split over 4 ranks"):
        ScalingBenchConfig(global_batch=30).points(4)
    with pytest.raises(ConfigError, match="--modes"):
        ScalingBenchConfig(modes=("weak", "sideways"))
    with pytest.raises(ConfigError, match="--hook='hierarchical' is unknown; choose one of none, fp16, bf16, chunk_sparse"):
        ScalingBenchConfig(hook="hierarchical")  # a point's first k ranks do not split by node: bench sync times it
    assert ScalingBenchConfig(batch=8).points(6)[-1] == ("strong", 6, 8)  # default global: 8 x 6, split over 6
