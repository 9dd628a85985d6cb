"""Gradient sync through DDP and hpcdl's comm hooks, on gloo and MPI, under mpiexec and on the local Slurm."""

import json
import os
import subprocess

import pytest

from conftest import PYTHON, REPO

FP16_ROUNDING = 2 ** -10  # fp16 keeps 10 fraction bits; bf16 keeps 7
TOLERANCE = {"none": 0.0, "hierarchical": 1e-6, "fp16": 2 * FP16_ROUNDING, "bf16": 2 * 2 ** -7}


def _results(tmp_path, world):
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
@pytest.mark.parametrize("hook", ["none", "hierarchical", "fp16", "bf16"])
def test_replicas_stay_identical_and_sums_match_a_plain_allreduce(mpiexec, tmp_path, backend, hook):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    run = subprocess.run([mpiexec, "-n", "2", PYTHON, str(REPO / "tests" / "sync_ranks.py"), str(tmp_path), backend,
                          hook], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    ranks = _results(tmp_path, 2)
    assert ranks[0]["weights"] == ranks[1]["weights"]  # bitwise-identical replicas after 20 steps
    assert all(r["max_rel_error"] <= TOLERANCE[hook] for r in ranks), ranks


def test_hierarchical_on_two_nodes_matches_flat(two_nodes, tmp_path):
    from conftest import sbatch_wait

    for hook in ("none", "hierarchical"):
        out = tmp_path / hook
        out.mkdir()
        script = out / "sync.sbatch"
        script.write_text(f"#!/bin/bash\nsrun {PYTHON} {REPO / 'tests' / 'sync_ranks.py'} {out} gloo {hook}\n")
        sbatch_wait(script, "--nodes=2", "--ntasks-per-node=2", f"--output={out}/out", f"--chdir={out}",
                    env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=240)
    flat, hier = _results(tmp_path / "none", 4), _results(tmp_path / "hierarchical", 4)
    assert [r["nodes"] for r in hier] == [2, 2, 2, 2]  # two levels: 2 nodes x 2 ranks
    assert len({r["weights"] for r in hier}) == 1 and len({r["weights"] for r in flat}) == 1
    # With 4 ranks the ring sums bucket slices in another order than a per-tensor all-reduce: fp32 rounding.
    assert all(r["max_rel_error"] <= 1e-6 for r in hier + flat)


@pytest.mark.parametrize("wire", ["fp32", "fp16"])
def test_chunk_sparse_conserves_the_gradient(tmp_path, wire):
    from conftest import free_port, rank_env

    port = free_port()
    procs = [subprocess.Popen([PYTHON, str(REPO / "tests" / "sparse_ranks.py"), str(tmp_path), wire],
                              env={**rank_env(r, 2, port), "PYTHONPATH": str(REPO)}) for r in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    ranks = _results(tmp_path, 2)
    # applied updates + the final residuals = every gradient of every rank, within fp32 (fp16) rounding
    assert all(r["error"] <= (1e-6 if wire == "fp32" else 2e-3) for r in ranks), ranks
    sent = ranks[0]["sent"]
    assert sent[0] == 100_500  # the dense first step
    assert sent[1:] == [10 * 1000 + 101] * 5  # then 10 of the 101 chunks, and the 101 chunk norms


def test_bench_sync_reports_every_path(mpiexec, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    report = tmp_path / "sync.json"
    run = subprocess.run([mpiexec, "-n", "2", PYTHON, "-m", "hpcdl", "bench", "sync", "--backend", "mpi", "--model",
                          "resnet18", "--rounds", "2", "--scaling-model", "tiny_cnn", "--scaling-batch", "8",
                          "--scaling-steps", "2", "--json", str(report)], capture_output=True, text=True, env=env,
                         timeout=180)
    assert run.returncode == 0, run.stderr
    r = json.loads(report.read_text())
    assert set(r["ms"]) == {"per-tensor", "fused", "flat", "fused fp16", "raw mpi4py"}
    assert r["tensors"] == 62 and r["world_size"] == 2 and r["backend"] == "mpi4py"
    assert set(r["latency_us"]) == {"torch.distributed", "raw mpi4py"} and "fused / flat:" in run.stdout
    w = r["scaling"]
    assert w["ranks"] == 2 and w["s_per_step_1"] > 0 and w["s_per_step_n"] > 0 and "efficiency" in run.stdout
