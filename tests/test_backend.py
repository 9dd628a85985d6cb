import subprocess
import sys

import pytest

from hpcdl.distributed.affinity import plan_cpus
from hpcdl.distributed.backend import AUTO_ORDER, BACKENDS, Backend, ccl_environment, choose_backend, interface_to
from hpcdl.distributed.mpi.runtime import mpi_environment
from hpcdl.distributed.ranks.env import discover
from hpcdl.errors import ConfigError


def test_auto_picks_ccl_when_its_runtime_loads_and_gloo_otherwise(ccl):
    row, choice = choose_backend("auto")
    assert row.name == "ccl" and choice.name == "oneccl" and "auto: oneCCL 2022.2.0" in choice.reason
    row, choice = choose_backend("auto", environ={}, ccl_lib="/nonexistent")
    assert row.name == "gloo" and "not ccl: oneCCL: /nonexistent (named by loop.ccl_lib) does not exist" in choice.reason


@pytest.mark.parametrize("name, library", [("gloo", "gloo"), ("mpi", "MPICH"), ("ccl", "oneCCL 2022.2.0")])
def test_every_row_checks_and_names_its_library(name, library, ccl, mpiexec):
    # a fresh process each: a process that loaded oneCCL first cannot load the mpich wheel's MPI (docs/communication.md)
    code = f"from hpcdl.distributed.backend import choose_backend; r, c = choose_backend({name!r}); print(r.torch_name, c.reason)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"{BACKENDS[name].torch_name} requested: ") and library in run.stdout
    assert set(AUTO_ORDER) <= set(BACKENDS)


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ConfigError, match="auto, gloo, mpi, ccl"):
        choose_backend("nccl")


def _slurm_env(nodes: int, tasks_per_node: int, rank: int, master: str = "127.0.0.1"):
    return discover({"SLURM_JOB_ID": "1", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % tasks_per_node),
                     "SLURM_NODEID": str(rank // tasks_per_node), "SLURM_STEP_NUM_TASKS": str(nodes * tasks_per_node),
                     "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node}(x{nodes})",
                     "MASTER_ADDR": master})


def test_ccl_variables_on_one_node_use_shm_and_no_offload():
    plan = plan_cpus(local_rank=1, local_size=2, comm_threads=0, task_cpus=set(range(24, 48)), online_cpus=48)
    got = ccl_environment(_slurm_env(1, 2, 1), plan, {"CCL_LOG_LEVEL": "info"})
    assert got == {"CCL_WORKER_OFFLOAD": "0", "CCL_PROCESS_LAUNCHER": "none", "CCL_ATL_TRANSPORT": "ofi",
                   "CCL_LOCAL_RANK": "1", "CCL_LOCAL_SIZE": "2", "FI_PROVIDER": "shm", "CCL_ATL_SHM": "1",
                   "CCL_KVS_IFACE": "lo"}  # the user's CCL_LOG_LEVEL stays


def test_ccl_variables_across_nodes_use_tcp_on_the_rendezvous_interface():
    plan = plan_cpus(local_rank=0, local_size=2, comm_threads=0, task_cpus={0, 1}, online_cpus=4)
    got = ccl_environment(_slurm_env(2, 2, 2), plan, {})
    assert (got["FI_PROVIDER"], got["CCL_ATL_SHM"], got["FI_TCP_IFACE"], got["CCL_KVS_IFACE"]) == ("tcp", "1", "lo", "lo")
    site = ccl_environment(_slurm_env(2, 2, 2), plan, {"FI_PROVIDER": "psm3"})  # a site's module exported it
    assert "FI_PROVIDER" not in site and "FI_TCP_IFACE" not in site
    profile = ccl_environment(_slurm_env(2, 2, 2), plan, {"HPCDL_FI_PROVIDER": "psm2"})  # what the sbatch script exports
    assert profile["FI_PROVIDER"] == "psm2" and "FI_TCP_IFACE" not in profile
    assert ccl_environment(_slurm_env(1, 2, 0), plan, {"HPCDL_FI_PROVIDER": "psm2"})["FI_PROVIDER"] == "shm"  # one node


def test_sbatch_scripts_carry_the_profiles_fabric_provider():
    from hpcdl.launch.request import job_request
    from hpcdl.launch.sbatch import render_sbatch

    script = render_sbatch(job_request(profile="frontera-clx", nodes=2, tasks_per_node=2), ["train", "x.yaml"])
    assert 'export HPCDL_FI_PROVIDER="${HPCDL_FI_PROVIDER:-verbs;ofi_rxm}"' in script
    assert "HPCDL_FI_PROVIDER=" not in render_sbatch(job_request(profile="generic"), ["train", "x.yaml"])


def test_ccl_workers_when_offload_is_on_are_pinned_to_the_plans_communication_cpus():
    plan = plan_cpus(local_rank=1, local_size=2, comm_threads=2, task_cpus=set(range(24, 48)), online_cpus=48)
    got = ccl_environment(_slurm_env(1, 2, 1), plan, {"CCL_WORKER_OFFLOAD": "1"})
    assert got["CCL_WORKER_COUNT"] == "2" and got["CCL_WORKER_AFFINITY"] == "46,47"
    assert BACKENDS["ccl"].comm_threads({"CCL_WORKER_OFFLOAD": "1"}) == 1 and BACKENDS["ccl"].comm_threads({}) == 0


def test_interface_to_an_unresolvable_address_is_none():
    assert interface_to("127.0.0.1") == "lo" and interface_to("no-such-host.invalid") is None


def test_pypis_mpich_under_srun_takes_the_netmod_whose_address_fits_slurms_pmi_lines(mpiexec):
    """The pip ``mpich`` (installed here by ``make venv``) under ``srun --mpi=pmi2``: libfabric's netmod; the
    user's choice wins, and nothing changes outside an srun step with PMI."""
    srun = {"PMI_FD": "11", "SLURM_STEP_ID": "0"}
    assert mpi_environment(srun) == {"MPIR_CVAR_CH4_NETMOD": "ofi"}
    assert mpi_environment({**srun, "MPIR_CVAR_CH4_NETMOD": "ucx"}) == {}
    assert mpi_environment({"PMI_FD": "11"}) == {}  # mpiexec's own PMI server reads long lines
    assert mpi_environment({"SLURM_STEP_ID": "0"}) == {}  # srun without --mpi=pmi2


def test_a_row_names_its_check_and_a_check_that_does_not_import_is_that_rows_error(monkeypatch):
    """A row's check and register are "module:function" (a callable is refused when the row is made); a check whose
    module does not import is a ConfigError naming the row, which auto passes over as it does an absent library."""
    with pytest.raises(TypeError, match='backend foo: its check is named as "module:function"'):
        Backend("foo", "foo", lambda lib: "foo")
    broken = Backend("ccl", "oneccl", "hpcdl.distributed.no_such_module:describe")
    with pytest.raises(ConfigError, match="backend ccl: its check hpcdl.distributed.no_such_module:describe does not "
                                          "import: No module named 'hpcdl.distributed.no_such_module'"):
        broken.available()
    monkeypatch.setitem(BACKENDS, "ccl", broken)
    row, choice = choose_backend("auto", environ={})
    assert row.name == "gloo" and "not ccl: backend ccl: its check" in choice.reason, choice.reason
