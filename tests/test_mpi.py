"""The mpi4py process group (``--backend mpi``) on real MPI processes: every collective hpcdl uses, each
dtype, and DDP keeping replicas identical."""

import json
import os

from conftest import PYTHON, REPO, mpi_run

EXPECTED = {  # 2 ranks: rank r contributes arange(6) + r
    "sum torch.float32": [1.0, 3.0, 5.0, 7.0, 9.0, 11.0], "sum torch.float64": [1.0, 3.0, 5.0, 7.0, 9.0, 11.0],
    "sum torch.float16": [1.0, 3.0, 5.0, 7.0, 9.0, 11.0], "sum torch.bfloat16": [1.0, 3.0, 5.0, 7.0, 9.0, 11.0],
    "sum torch.int64": [1, 3, 5, 7, 9, 11], "max": 1.0, "avg": 3.0, "broadcast bf16": [1.0, 1.0, 1.0],
    "allgather": [[0, 0], [1, 1]], "objects": [{"rank": 0}, {"rank": 1}],
    "mixed paths": [[2.0, 3.0], [2.0, 1.0], [2.0]],  # all-reduce, broadcast from rank 0, barrier
}


def test_mpi_backend_collectives_and_ddp_under_mpiexec(mpiexec, tmp_path):
    run = mpi_run(mpiexec, REPO / "tests" / "mpi_ranks.py", tmp_path)
    assert run.returncode == 0, run.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for found in ranks:
        assert found["backend"] == "mpi4py"
        assert {k: found[k] for k in EXPECTED} == EXPECTED
    assert ranks[0]["reduce_scatter"] == [0.0, 3.0] and ranks[1]["reduce_scatter"] == [6.0, 9.0]
    assert ranks[0]["weights sha256"] == ranks[1]["weights sha256"]
    assert "backend mpi4py (requested: mpi4py" in run.stderr


def test_mpi_backend_under_srun(slurm, tmp_path):
    from conftest import sbatch_wait

    script = tmp_path / "mpi.sbatch"
    script.write_text(f"#!/bin/bash\nsrun --mpi=pmi2 {PYTHON} {REPO / 'tests' / 'mpi_ranks.py'} {tmp_path}\n")
    sbatch_wait(script, "--nodes=1", "--ntasks=2", f"--output={tmp_path}/out", f"--chdir={tmp_path}",
                env={**os.environ, "PYTHONPATH": str(REPO)})
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all({k: found[k] for k in EXPECTED} == EXPECTED for found in ranks)
    assert ranks[0]["weights sha256"] == ranks[1]["weights sha256"]
    assert "via slurm" in (tmp_path / "out").read_text()


def test_a_stuck_mpi_collective_fails_within_the_timeout_naming_the_rank(mpiexec, tmp_path):
    run = mpi_run(mpiexec, REPO / "tests" / "mpi_timeout_ranks.py", tmp_path)
    assert run.returncode == 0, run.stderr
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert "rank 0: MPI allreduce of 3 elements (torch.float32) did not complete within 0:00:02" in rank0["error"]
    assert rank0["after_s"] < 6
