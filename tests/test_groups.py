"""hpcdl's own process groups on real processes: the mpi4py group (``--backend mpi``) and the oneCCL group
(``--backend ccl``), every collective and dtype hpcdl uses, DDP keeping replicas identical, under each
launcher, and a late peer failing the collective within the timeout."""

import json
import os
import subprocess
import time

import pytest
from conftest import PYTHON, REPO, free_port, mpi_run, rank_env, sbatch_wait

SUMS = [1, 3, 5, 7, 9, 11]  # 2 ranks: rank r contributes arange(6) + r
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "int16")
EXPECTED = {
    **{f"sum torch.{d}": SUMS for d in DTYPES},
    **{f"{op} torch.{d}": want for op, want in (("max", [3, 6, 9]), ("min", [2, 4, 6]), ("product", [6, 24, 54]))
       for d in ("float32", "bfloat16", "int64")},
    **{f"avg torch.{d}": 3.0 for d in ("float32", "float16", "float64")},
    "sum strided": [3.0, 11.0, 19.0],
    **{f"broadcast torch.{d}": [2, 2, 2] for d in ("bfloat16", "float16", "int64", "float32")},
    "allgather": [[0, 0], [1, 1]], "allgather single fp16": [0.5, 0.5, 1.5, 1.5], "objects": [{"rank": 0}, {"rank": 1}],
    "subgroup all": 1.0, "mixed paths": [[2.0, 3.0], [2.0, 1.0], [2.0]],  # all-reduce, broadcast from 0, barrier
    "interleaved": [1.0, 3.0, 5.0, 7.0, 9.0, 11.0], "future": [1.0, 1.0, 1.0],
    **{f"allgather in place {n}": [[0.25, 1.25], [1.25, 2.25], True] for n in (2, 2**20)},
}
TORCH_NAME = {"mpi": "mpi4py", "ccl": "oneccl", "store": "hpcdl-store"}


def check_ranks(out, backend: str) -> list[dict]:
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for found in ranks:
        assert found["backend"] == TORCH_NAME[backend]
        assert {k: found[k] for k in EXPECTED} == EXPECTED
    assert ranks[0]["reduce to 0"] == [3.0] * 4 and ranks[1]["subgroup alone"] == 5.0
    assert ranks[0]["reduce_scatter"] == [0.0, 3.0] and ranks[1]["reduce_scatter"] == [6.0, 9.0]
    assert ranks[0]["reduce_scatter list"] == [10.0, 10.0] and ranks[1]["reduce_scatter list"] == [12.0, 12.0]
    assert ranks[0]["weights sha256"] == ranks[1]["weights sha256"]
    return ranks


def srun_ranks(tmp_path, backend: str, *shape: str) -> list[dict]:
    script = tmp_path / "group.sbatch"
    script.write_text(f"#!/bin/bash\nsrun --mpi=pmi2 {PYTHON} {REPO / 'tests' / 'group_ranks.py'} {tmp_path} {backend}\n")
    sbatch_wait(script, *shape, f"--output={tmp_path}/out", f"--chdir={tmp_path}",
                env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "via slurm" in (tmp_path / "out").read_text()
    return check_ranks(tmp_path, backend)


@pytest.mark.parametrize("backend", ["mpi", "ccl"])
def test_group_under_mpiexec(backend, mpiexec, ccl, tmp_path):
    run = mpi_run(mpiexec, REPO / "tests" / "group_ranks.py", tmp_path, backend)
    assert run.returncode == 0, run.stderr[-3000:]
    check_ranks(tmp_path, backend)
    assert f"backend {TORCH_NAME[backend]} (requested: " in run.stderr


def test_mpi_group_under_srun(slurm, tmp_path):
    srun_ranks(tmp_path, "mpi", "--nodes=1", "--ntasks=2")


MPI_INIT_STUCK = """
import os, time
from datetime import timedelta
if os.environ["SLURM_PROCID"] == "1":
    time.sleep(300)  # never reaches MPI_Init: a stand-in for a rank whose node died at start-up
from hpcdl.distributed.group.lifecycle import init_distributed
init_distributed("mpi", timeout=timedelta(seconds=5))
"""


def test_mpi_init_that_does_not_return_ends_the_rank_within_the_timeout(slurm, tmp_path):
    """Rank 0's MPI_Init waits for rank 1, which never calls it, holding the interpreter's lock: no Python
    thread can act, faulthandler's can. The rank exits 1 after the 5 s start-up timeout with its stack, and
    srun --kill-on-bad-exit ends the other (a real hang of PMI's fence, not a fake)."""
    start = time.monotonic()
    run = subprocess.run(["srun", "--nodes=1", "--ntasks=2", "--mpi=pmi2", "--kill-on-bad-exit=1", "--time=5",
                          PYTHON, "-c", MPI_INIT_STUCK], capture_output=True, text=True, cwd=tmp_path, timeout=240,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    elapsed = time.monotonic() - start
    assert run.returncode != 0 and "Timeout (0:00:05)!" in run.stderr, run.stderr[-3000:]
    assert "in load_mpi" in run.stderr and "task 0: Exited with exit code 1" in run.stderr, run.stderr[-3000:]
    assert elapsed < 120, elapsed  # imports on a busy box, then 5 s; not rank 1's 300 s nor the 5-minute limit


def plain_ranks(tmp_path, backend: str) -> tuple[list[dict], list[str]]:
    port = free_port()
    procs = [subprocess.Popen([PYTHON, REPO / "tests" / "group_ranks.py", tmp_path, backend], cwd=tmp_path,
                              env={**rank_env(r, 2, port), "PYTHONPATH": str(REPO)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:]
    return check_ranks(tmp_path, backend), outs


@pytest.mark.slow
def test_a_backend_of_one_file_and_one_table_row_passes_every_check(tmp_path):
    """tests/store_backend.py: the threaded base plus six primitives over the rendezvous store."""
    plain_ranks(tmp_path, "store")


def test_ccl_group_as_plain_processes(ccl, tmp_path):
    ranks, outs = plain_ranks(tmp_path, "ccl")
    assert f"oneCCL 2022.2.0 from {ccl.library}" in outs[0]
    assert ranks[0]["env"]["FI_PROVIDER"] == "shm" and ranks[0]["env"]["CCL_WORKER_OFFLOAD"] == "0"
    assert all(r["c_comm_thread calls"] > 20 for r in ranks), [r["c_comm_thread calls"] for r in ranks]  # the small ones
    assert [r["large ones there"] for r in ranks] == [1, 1]  # the 4 MB one through the Python thread too
    assert "FastBackend" in ranks[0]["group class"], ranks[0]["group class"]  # issued from C++ (ccl_backend.cpp)


@pytest.mark.parametrize("shape, provider", [(("--nodes=1", "--ntasks=2"), "shm"),
                                             (("--nodes=2", "--ntasks=2", "--ntasks-per-node=1"), "tcp")])
def test_ccl_group_under_srun(shape, provider, two_nodes, ccl, tmp_path):
    ranks = srun_ranks(tmp_path, "ccl", *shape)
    assert {r["env"]["FI_PROVIDER"] for r in ranks} == {provider}
    if provider == "tcp":  # the interface that reaches the rendezvous address, for the data and oneCCL's store
        assert ranks[0]["env"]["FI_TCP_IFACE"] == ranks[0]["env"]["CCL_KVS_IFACE"]


@pytest.mark.parametrize("backend", ["mpi", "ccl"])
def test_a_stuck_collective_fails_within_the_timeout_naming_the_rank(backend, mpiexec, ccl, tmp_path):
    run = mpi_run(mpiexec, REPO / "tests" / "timeout_ranks.py", tmp_path, backend)
    assert run.returncode == 0, run.stderr[-3000:]
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    library = {"mpi": "MPI", "ccl": "oneCCL"}[backend]
    assert f"rank 0: {library} allreduce of 3 elements (torch.float32) did not complete within 0:00:02" in rank0["error"]
    assert rank0["after_s"] < 6


LEAVING = """
import json, os, sys, time
from hpcdl.distributed.group.lifecycle import init_distributed, leave_together
ctx = init_distributed("gloo")
late, within = float(sys.argv[1]), float(sys.argv[2])
started = time.monotonic()
if ctx.rank == 2:
    time.sleep(late)
together = leave_together(ctx, within) if ctx.rank != 2 or late < within else None  # or never comes
print(json.dumps({"rank": ctx.rank, "together": together, "waited": time.monotonic() - started}), flush=True)
os._exit(0)  # as hpcdl's main leaves on an error (leave_now): a store call left on a thread aborts finalization
"""


@pytest.mark.ranks
def test_ranks_that_stop_on_one_error_leave_together_and_alone_after_the_bound(tmp_path):
    """leave_together, the way out of an error every rank raised (hpcdl.train.finish.leaving_together), on 3 real
    ranks: with rank 2 there 3 s late, ranks 0 and 1 wait for it, and every rank learns that all are there; with
    rank 2 never coming (the error is the others' alone), they go after the 4 s bound, not at rank 2's exit."""
    script = tmp_path / "leaving.py"
    script.write_text(LEAVING)

    def start(late: float, within: float) -> list[dict]:
        port = free_port()
        procs = [subprocess.Popen([PYTHON, script, str(late), str(within)], cwd=tmp_path,
                                  env={**rank_env(r, 3, port), "PYTHONPATH": str(REPO)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(3)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], outs
        return [json.loads(out.strip().splitlines()[-1]) for out in outs]

    ranks = start(late=3.0, within=30.0)
    assert [r["together"] for r in ranks] == [True, True, True], ranks
    # each rank's clock starts when its own rendezvous returns, which on rank 0 (the store's host) may be a few ms
    # after rank 2's: a CI run measured rank 0's wait as 2.9997 s
    assert all(r["waited"] >= 2.9 for r in ranks[:2]) and all(r["waited"] < 25 for r in ranks), ranks
    ranks = start(late=12.0, within=4.0)
    assert [r["together"] for r in ranks[:2]] == [False, False], ranks
    assert all(3.9 <= r["waited"] < 11.0 for r in ranks[:2]), ranks
