import pytest

from hpcdl.dist.affinity import plan_cpus
from hpcdl.dist.backend import ccl_environment, ccl_status, choose_backend
from hpcdl.dist.env import discover
from hpcdl.errors import ConfigError


def test_auto_falls_back_to_gloo_and_says_why():
    ok, why = ccl_status()
    choice = choose_backend("auto")
    assert choice.name == ("ccl" if ok else "gloo")
    assert why in choice.reason


@pytest.mark.skipif(ccl_status()[0], reason="oneCCL bindings are installed here")
def test_ccl_requested_without_bindings_says_how_to_install():
    with pytest.raises(ConfigError, match="Intel's wheel index"):
        choose_backend("ccl")


def test_mpi_selects_the_mpi4py_group_and_names_the_library():
    choice = choose_backend("mpi")
    assert choice.name == "mpi4py" and "mpi4py" in choice.reason and "MPICH" in choice.reason


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ConfigError, match="auto, gloo, ccl, mpi"):
        choose_backend("nccl")


def test_ccl_variables_without_an_mpi_launcher():
    env = discover({"SLURM_JOB_ID": "1", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
                    "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2",
                    "MASTER_ADDR": "h"})
    plan = plan_cpus(local_rank=1, local_size=2, comm_threads=2, task_cpus=set(range(24, 48)), online_cpus=48)
    got = ccl_environment(env, plan, {"CCL_WORKER_COUNT": "4"})
    assert got == {"CCL_WORKER_AFFINITY": "46,47", "CCL_PROCESS_LAUNCHER": "none",
                   "CCL_LOCAL_RANK": "1", "CCL_LOCAL_SIZE": "2"}  # the user's CCL_WORKER_COUNT stays


def test_ccl_variables_under_mpiexec_leave_the_launcher_alone():
    env = discover({"PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"})
    plan = plan_cpus(local_rank=0, local_size=1, comm_threads=1, task_cpus={0, 1, 2, 3}, online_cpus=4)
    assert ccl_environment(env, plan, {}) == {"CCL_WORKER_COUNT": "1", "CCL_WORKER_AFFINITY": "3"}
