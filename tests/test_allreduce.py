"""The allreduce benchmark over real gloo processes, and what happens when a rank dies."""

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, free_port, mpi_run, rank_env, start_long_sweep, start_ranks

from hpcdl.bench.reports import SyncReport

QUICK = ["bench", "allreduce", "--max-bytes", "64K", "--seconds-per-size", "0.02", "--heartbeat", "0.5"]


@pytest.mark.ranks
def test_two_ranks_reduce_correctly_and_report(tmp_path):
    procs = start_ranks(2, QUICK + ["--json", "out-%j.json"], tmp_path)
    assert [p.wait(timeout=120) for p in procs] == [0, 0], (tmp_path / "rank0.log").read_text()
    report = json.loads((tmp_path / "out-local.json").read_text())
    assert [r["bytes"] for r in report["rows"]] == [4 << k for k in range(15)]
    assert all(r["correct"] for r in report["rows"])
    assert all(r["busbw_GBps"] == pytest.approx(r["algbw_GBps"]) for r in report["rows"])  # 2(n-1)/n = 1
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    log = (tmp_path / "rank0.log").read_text()
    assert "busbw(GB/s)" in log and "reduced values: all correct" in log


@pytest.mark.ranks
def test_torchrun_launch(default_port, tmp_path):  # torchrun without --master-port
    run = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "hpcdl", *QUICK,
                          "--dtype", "int64", "--json", "tr.json"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "tr.json").read_text())
    assert {r["launcher"] for r in report["ranks"]} == {"torchrun"} and report["meta"]["dtype"] == "int64"
    assert all(r["correct"] for r in report["rows"])


@pytest.mark.ranks
@pytest.mark.parametrize("backend", ["gloo", "ccl"])
@pytest.mark.parametrize("victim,how", [(1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGSTOP)])
def test_lost_rank_is_named_and_the_survivor_exits_within_the_timeout(request, tmp_path, backend, victim, how):
    if backend == "ccl":
        request.getfixturevalue("ccl")
    timeout_s = 10
    procs = start_long_sweep(tmp_path, timeout_s, "--backend", backend)
    survivor = 1 - victim
    procs[victim].send_signal(how)
    start = time.time()
    try:
        code = procs[survivor].wait(timeout=timeout_s + 10)
    finally:
        procs[victim].kill()
        procs[victim].wait()
        for path in Path("/dev/shm").glob(f"{procs[victim].pid}:*"):  # what a killed rank leaves behind
            path.unlink()
    elapsed = time.time() - start
    log = (tmp_path / f"rank{survivor}.log").read_text()
    assert code not in (0, None)
    last = log.strip().splitlines()[-1]
    assert f"rank {victim}" in last and "lost" in log, log[-2000:]
    # A dead peer is noticed at once by gloo, a frozen one when the collective times out (oneCCL notices
    # neither: its call never returns, the watchdog fails it at the timeout); either way the survivor is
    # gone before timeout + diagnosis (2.5 heartbeats) + start-up slack.
    assert elapsed < timeout_s + 5, elapsed
    if backend == "ccl":  # named with the operation, and no crash in oneCCL's destructors on the way out
        assert "oneCCL allreduce" in last and "Segmentation fault" not in log and "terminated with signal" not in log
        # leaving without finalizing oneCCL, the survivor still removed libfabric's 64 MB shm file
        assert not list(Path("/dev/shm").glob(f"{procs[survivor].pid}:*"))


def test_bad_arguments_exit_2_with_the_flag_named(tmp_path):
    run = subprocess.run([PYTHON, "-m", "hpcdl", "bench", "allreduce", "--min-bytes", "1M", "--max-bytes", "4K"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "--min-bytes" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.ranks
@pytest.mark.parametrize("raised, expected", [
    ("RuntimeError('mat1 and mat2 shapes cannot be multiplied')", "RuntimeError: mat1 and mat2 shapes"),
    ("torch.distributed.DistBackendError('timed out')", "a collective failed on rank 0 while every rank's heartbeat"),
])
def test_fail_fast_names_collective_failures_and_lets_other_errors_through(tmp_path, raised, expected):
    """A model's own RuntimeError, with every rank alive, must not be reported as a lost rank."""
    code = ("import torch.distributed\n"
            "from hpcdl.distributed.group.lifecycle import init_distributed\nfrom hpcdl.distributed.group.liveness import fail_fast\n"
            "ctx = init_distributed('gloo', heartbeat_s=0.2)\n"
            f"with fail_fast(ctx.heartbeat):\n    raise {raised}\n")
    run = subprocess.run([PYTHON, "-c", code], env={**rank_env(0, 1, free_port()), "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and expected in run.stderr, run.stderr
    assert ("RankLostError" in run.stderr) == raised.startswith("torch")


def test_backends_side_by_side_in_one_run(mpiexec, ccl, tmp_path):
    """--backends: one group per backend beside a gloo default group, each size on each in turn, one report."""
    path = tmp_path / "allreduce.json"
    run = mpi_run(mpiexec, "-m", "hpcdl", "bench", "allreduce", "--backends", "gloo,mpi,ccl", "--max-bytes", "1K",
                  "--seconds-per-size", "0.01", "--json", path, timeout=180)
    assert run.returncode == 0, run.stderr
    report = json.loads(path.read_text())
    assert report["meta"]["backends"] == ["gloo", "mpi4py", "oneccl"] and all(r["correct"] for r in report["rows"])
    assert [r["backend"] for r in report["rows"][:3]] == ["gloo", "mpi4py", "oneccl"] and len(report["rows"]) == 3 * 9
    assert "side by side" in run.stdout and "oneccl/gloo" in run.stdout
    # a fit per backend, or the reason there is none: up to 1 KB the times need not grow with size, and the
    # sweep stands either way
    fits = report["fit"]
    assert set(fits) == {"gloo", "mpi4py", "oneccl"} and all(("busbw_GBps" in f) != ("none" in f) for f in fits.values())
    assert run.stdout.count("# fit (") == 3
    assert report["provenance"]["command"][-2:] == ["--json", str(path)] and report["config"]["max_bytes"] == 1024
    path = tmp_path / "sync.json"
    run = mpi_run(mpiexec, "-m", "hpcdl", "bench", "sync", "--backends", "gloo,mpi", "--model", "tiny_cnn", "--rounds",
                  "1", "--scaling-steps", "0", "--hooks", "none,fp16", "--latency-iters", "10", "--json", path,
                  timeout=180)
    assert run.returncode == 0, run.stderr
    report = SyncReport.from_json(str(path))
    assert list(report.by_backend) == ["gloo", "mpi4py"] and set(report.of("mpi4py").hooks) == {"none", "fp16"}
    assert "side by side, tiny_cnn's gradients: gloo, mpi4py" in run.stdout
