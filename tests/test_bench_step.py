"""``hpcdl bench step`` measures what it says (its speed figures are in docs/performance.md, not here)."""

import json
import os
import subprocess

import pytest
from conftest import PYTHON, SIMULATED_CPUS

from hpcdl.distributed.affinity import allocator_env
from hpcdl.train.precision import choose_precision
from hpcdl.utils import cpu_flags


@pytest.mark.slow
def test_bench_step_compares_both_pairs_and_tunes_only_the_tuned_side(tmp_path):
    report = tmp_path / "step.json"
    run = subprocess.run([PYTHON, "-m", "hpcdl", "bench", "step", "--model", "tiny_cnn", "--batch", "8", "--crop", "32",
                          "--steps", "2", "--rounds", "2", "--tuning-model", "tiny_cnn", "--tuning-batch", "8",
                          "--tuning-crop", "32", "--tuning-steps", "2", "--tuning-rounds", "1", "--curve-batches", "4",
                          "--only", "overhead,tuning", "--json", str(report)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "hpcdl / bare loop:" in run.stdout and "tuned / untuned:" in run.stdout
    r = json.loads(report.read_text())
    assert set(r["overhead"]["ms_per_step"]) == {"bare loop", "hpcdl"} and r["overhead"]["ratio"] > 0
    setup = r["tuning"]["setup"]
    assert setup["untuned"]["allocator"].startswith("glibc defaults")
    assert setup["tuned"]["allocator"].startswith(allocator_env("auto")[0])
    assert setup["tuned"]["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)  # 2 ranks split the CPUs
    curve = r["curve"]["points"]  # the node's batch: 2 ranks x the per-rank batch (one point: each is a node round)
    assert [b for b, _ in curve] == [8] and all(v > 0 for _, v in curve)
    assert "batch     8" in run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("cpu", [None, "simulated Sapphire Rapids (AMX)"])
def test_precision_table_measures_both_precisions_against_their_gemm_and_checks_auto(cpu, tmp_path):
    """fp32 and bf16 side by side with each one's GEMM rate; torch.compile of auto's pick on the real CPU (a
    simulated one skips it: compiling takes most of a minute). Where the flags are simulated, auto follows them
    and the table says whether the measurement agrees: on a CPU without native bf16, it does not."""
    report = tmp_path / "step.json"
    env = {**os.environ, **({"HPCDL_SIMULATE_CPU_FLAGS": SIMULATED_CPUS[cpu]} if cpu else {})}
    run = subprocess.run([PYTHON, "-m", "hpcdl", "bench", "step", "--model", "tiny_cnn", "--batch", "8", "--crop", "32",
                          "--steps", "1", "--precision-rounds", "1", "--only", "precision", "--json", str(report),
                          *([] if cpu is None else ["--no-compile"])], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    p = json.loads(report.read_text())["precision"]
    auto = "bf16" if cpu else choose_precision("auto")[0]
    assert p["auto"] == auto and p["memory_format"] == "channels_last" and p["flops_per_step"] > 0
    assert {"fp32", "bf16"} <= set(p["cases"]) and ((f"{auto}+compile" in p["cases"]) or "error" in p["compile"]
                                                    if cpu is None else p["compile"] is None)
    for name, row in p["cases"].items():
        assert row["gemm_gflops"] > 0 and row["of_gemm"] == pytest.approx(row["gflops"] / row["gemm_gflops"])
        assert row["gflops"] == pytest.approx(p["flops_per_step"] / row["ms_per_step"] / 1e6)
    fastest = min(p["cases"], key=lambda n: p["cases"][n]["ms_per_step"])
    assert p["auto_is_fastest"] == (fastest.split("+")[0].split()[0] == auto)
    assert f"{auto} contiguous" in p["cases"] and p["channels_last_over_contiguous"] > 0
    assert p["bf16_emulated"] == (not {"avx512_bf16", "amx_bf16"} & cpu_flags()) if cpu is None else not p["bf16_emulated"]
    assert f"loop.precision=auto chose {auto}" in run.stdout and "GEMM GFLOP/s" in run.stdout
    assert ("the fastest measured" if p["auto_is_fastest"] else "NOT the fastest measured") in run.stdout


@pytest.mark.slow
def test_a_named_model_is_measured_at_its_own_size_with_its_counted_flops(tmp_path):
    """timm's ViT takes only the 224 px it is defined for: --crop 0 (the default) gives it that."""
    from hpcdl.models.count import count

    report = tmp_path / "step.json"
    run = subprocess.run([PYTHON, "-m", "hpcdl", "bench", "step", "--model", "timm:vit_tiny_patch16_224", "--batch", "2",
                          "--steps", "1", "--precision-rounds", "1", "--only", "precision", "--no-compile",
                          "--json", str(report)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    r = json.loads(report.read_text())
    assert r["config"]["crop"] == 224 and "timm:vit_tiny_patch16_224 batch 2 at 224 px" in run.stdout
    counted = count("timm:vit_tiny_patch16_224")["train_flops"]  # per image, the planner's figure
    assert r["precision"]["flops_per_step"] == pytest.approx(2 * counted, rel=0.02)
    assert {"fp32", "bf16"} <= set(r["precision"]["cases"])


@pytest.mark.slow
def test_profile_splits_each_precision_s_step_into_classes_that_add_up(tmp_path):
    """--profile: fp32 and bf16, each class's share of the profiled wall time, the matrix class's rate; the
    table printed is the JSON's. A small model: where bf16 is emulated its one profiled step is slow, not wrong."""
    from hpcdl.bench.reports import StepReport
    from hpcdl.bench.step import format_report

    report = tmp_path / "step.json"
    run = subprocess.run([PYTHON, "-m", "hpcdl", "bench", "step", "--profile", "--model", "tiny_cnn", "--batch", "8",
                          "--crop", "32", "--steps", "2", "--json", str(report)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    read = StepReport.from_json(str(report))
    assert [b.precision for b in read.profile] == ["fp32", "bf16"] and read.precision is None
    for b in read.profile:
        assert list(b.classes) == ["matrix", "casts", "normalization", "element-wise", "optimizer", "framework"]
        assert sum(c.share for c in b.classes.values()) == pytest.approx(1.0, abs=0.02)
        assert b.classes["matrix"].calls > 0 and b.classes["optimizer"].ms > 0 and b.matrix_gflops > 0
    assert read.profile[1].classes["casts"].calls > read.profile[0].classes["casts"].calls  # autocast's
    assert "where a step goes: tiny_cnn bf16" in run.stdout and format_report(read) in run.stdout



@pytest.mark.ranks  # up to 3 processes that import torch at once
def test_a_node_s_ranks_time_the_same_stretch_and_a_failing_one_is_named():
    """node_round's children start their timed steps together and step until the last has finished, so the
    node's figure is what its ranks give at once; a child that fails brings its stderr and leaves nothing behind."""
    from hpcdl.bench.step import node_round

    spec = {"tuned": True, "model": "tiny_cnn", "batch": 4, "crop": 32, "steps": 100}
    r = node_round(spec, 3, dict(os.environ))  # timed as they came, imports 0.1-1 s apart leave short stretches apart
    assert r.images_per_s > 0 and 0.5 < r.together <= 1.0, r
    with pytest.raises(RuntimeError, match=r"(?s)bench step child .*no_such_model.* failed \(exit 1\):.*no_such_model"):
        node_round({**spec, "model": "no_such_model"}, 2, dict(os.environ))
    left = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "hpcdl.bench.step"], capture_output=True, text=True)
    assert left.stdout == "", left.stdout
