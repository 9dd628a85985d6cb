"""End to end on a real Slurm (slurm/local/up.sh here): sbatch, submitit, two nodes, mpiexec."""

import json
import os
import socket
import subprocess

import pytest
from conftest import PYTHON, REPO, load_json, sbatch_wait

from hpcdl.bench import run as run_benchmark
from hpcdl.bench.reports import AllreduceReport
from hpcdl.launch import job_request, submit
from hpcdl.launch.sbatch import render_sbatch
from hpcdl.schema import to_dict

QUICK = dict(max_bytes="64K", seconds_per_size=0.02, heartbeat=0.5)


def assert_correct(report: dict, ranks: int) -> None:
    assert report["meta"]["world_size"] == ranks
    assert report["rows"] and all(row["correct"] for row in report["rows"])
    assert sorted(r["rank"] for r in report["ranks"]) == list(range(ranks))


def test_committed_generic_script_runs_two_tasks(slurm, tmp_path):
    env = {**os.environ, "HPCDL_PYTHON": PYTHON}
    job = sbatch_wait(REPO / "slurm" / "generic.sbatch", f"--chdir={tmp_path}", f"--output={tmp_path}/%j.out", env=env)
    out = (tmp_path / f"{job}.out").read_text()
    assert "256MB" in out and "reduced values: all correct" in out, out
    report = load_json(tmp_path / f"allreduce-{job}.json")
    assert_correct(report, 2)
    assert {r["launcher"] for r in report["ranks"]} == {"slurm"}
    assert report["rows"][-1]["bytes"] == 256 << 20
    assert all("jemalloc" in r["allocator"] or "GLIBC" in r["allocator"] for r in report["ranks"])


def test_submitit_job_with_two_tasks(slurm, tmp_path):
    job = submit(run_benchmark, args=("allreduce",), kwargs=QUICK, profile="local", nodes=1, tasks_per_node=2, time="10",
                 job_name="submitit-allreduce", folder=str(tmp_path / "%j"))
    results = job.results()
    assert results[1] is None  # only rank 0 reports, its typed report
    assert isinstance(results[0], AllreduceReport)
    report = to_dict(results[0])
    assert_correct(report, 2)
    assert {r["launcher"] for r in report["ranks"]} == {"slurm"}
    assert "tuned" in report["ranks"][0]["allocator"] or "jemalloc" in report["ranks"][0]["allocator"]


def test_cli_submit_waits_and_prints_rank_0_output(slurm, tmp_path):
    run = subprocess.run([PYTHON, "-m", "hpcdl", "submit", "--profile", "local", "--tasks-per-node", "2", "--time",
                          "10", "--folder", str(tmp_path / "%j"), "--", "bench", "allreduce", "--max-bytes", "16K",
                          "--seconds-per-size", "0.02"], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    assert "allreduce on 2 ranks" in run.stdout and "reduced values: all correct" in run.stdout


@pytest.mark.slow
def test_submitit_local_executor_without_slurm(tmp_path):
    job = submit(run_benchmark, args=("allreduce",), kwargs=QUICK, cluster="local", tasks_per_node=2, time="10", folder=str(tmp_path / "%j"))
    typed = job.results()[0]
    assert isinstance(typed, AllreduceReport) and typed.provenance is not None
    report = to_dict(typed)
    assert_correct(report, 2)
    assert {r["launcher"] for r in report["ranks"]} == {"submitit-local"}


def test_two_node_job_meets_at_an_address_that_resolves(two_nodes, tmp_path):
    script = tmp_path / "two.sbatch"
    script.write_text(render_sbatch(job_request(profile="local", nodes=2, tasks_per_node=1, time="10", python=PYTHON,
                                                output=f"{tmp_path}/%j.out"),
                                    ["bench", "allreduce", "--max-bytes", "1M", "--seconds-per-size", "0.05",
                                     "--json", f"{tmp_path}/two-%j.json"]))
    job = sbatch_wait(script)
    report = load_json(tmp_path / f"two-{job}.json")
    assert_correct(report, 2)
    assert sorted(r["node_rank"] for r in report["ranks"]) == [0, 1]
    addr = {r["master_addr"] for r in report["ranks"]}
    assert len(addr) == 1
    socket.getaddrinfo(addr.pop(), None)  # resolves
    with pytest.raises(socket.gaierror):
        socket.getaddrinfo("n1", None)  # the node name alone would not have: Slurm's NodeAddr was used


def test_mpiexec_inside_an_allocation_gets_distinct_ranks(slurm, mpiexec, tmp_path):
    script = tmp_path / "mpi.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=1 --ntasks=2 --output={tmp_path}/%j.out --time=10
set -e
{mpiexec} -n 2 {PYTHON} -m hpcdl env > {tmp_path}/env.jsonl
{mpiexec} -n 2 {PYTHON} -m hpcdl bench allreduce --max-bytes 16K --seconds-per-size 0.02 --json {tmp_path}/mpi.json
""")
    sbatch_wait(script)
    envs = [json.loads(line) for line in (tmp_path / "env.jsonl").read_text().splitlines()]
    assert sorted(e["rank"] for e in envs) == [0, 1]
    assert {e["launcher"] for e in envs} == {"mpi-hydra"} and {e["world_size"] for e in envs} == {2}
    report = load_json(tmp_path / "mpi.json")
    assert_correct(report, 2)
    assert {r["launcher"] for r in report["ranks"]} == {"mpi-hydra"}


def test_local_executor_refuses_another_interpreter(tmp_path):
    from hpcdl.errors import ConfigError

    with pytest.raises(ConfigError, match="local executor runs tasks with this interpreter"):
        submit(run_benchmark, args=("allreduce",), cluster="local", python="/opt/other/python3", folder=str(tmp_path / "%j"))
    assert not any(tmp_path.iterdir())  # refused before anything was submitted
