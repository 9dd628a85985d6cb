"""Rank discovery from each launcher's variables (the values the real launchers set, as recorded from
srun, mpiexec and torchrun on this machine); the real launchers are exercised in test_slurm.py."""

import logging

import pytest

from hpcdl.distributed.ranks.env import discover, rendezvous_port
from hpcdl.errors import ConfigError

SRUN_TWO_NODES = {"SLURM_JOB_ID": "41", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
                  "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2",
                  "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "localhost,n2",
                  "SLURM_JOB_NODELIST": "localhost,n2", "SLURM_NTASKS": "4"}
# mpiexec (MPICH hydra) inside a 1-node sbatch allocation: hydra's proxy ran as a 1-task srun step.
MPIEXEC_IN_SBATCH = {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                     "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NUM_NODES": "1",
                     "SLURM_JOB_NODELIST": "localhost", "PMI_RANK": "1", "PMI_SIZE": "2",
                     "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}


def test_slurm_step():
    env = discover(SRUN_TWO_NODES)
    assert (env.launcher, env.rank, env.world_size) == ("slurm", 3, 4)
    assert (env.local_rank, env.local_size, env.node_rank, env.nodes) == (1, 2, 1, 2)
    assert env.master_addr == "localhost" and env.job_id == "41"


def test_mpi_variables_win_over_slurms_inside_an_allocation():
    env = discover(MPIEXEC_IN_SBATCH)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_size) == ("mpi-hydra", 1, 2, 1, 2)
    assert env.master_addr == "localhost"  # still taken from the allocation's node list


def test_open_mpi_derives_node_rank_from_block_placement():
    env = discover({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                    "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "c401"})
    assert (env.launcher, env.node_rank, env.nodes, env.master_addr) == ("openmpi", 1, 2, "c401")


def test_torchrun():
    env = discover({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                    "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "h0", "MASTER_PORT": "29400",
                    "TORCHELASTIC_RUN_ID": "x", **SRUN_TWO_NODES})
    assert (env.launcher, env.rank, env.node_rank, env.master_addr, env.master_port) == ("torchrun", 2, 1, "h0", 29400)


def test_batch_step_is_one_process_and_says_so(caplog):
    with caplog.at_level(logging.WARNING):
        env = discover({"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"})
    assert (env.launcher, env.rank, env.world_size) == ("single", 0, 1)
    assert "without srun" in caplog.text


def test_port_is_shared_by_the_step_and_changes_on_requeue():
    ports = {rendezvous_port({**SRUN_TWO_NODES, "SLURM_PROCID": str(r)}) for r in range(4)}
    assert len(ports) == 1
    requeued = {rendezvous_port({**SRUN_TWO_NODES, "SLURM_RESTART_COUNT": str(n)}) for n in range(1, 20)}
    assert ports.isdisjoint(requeued) and len(requeued) == 19
    assert all(15000 <= p < 30000 for p in ports | requeued)


def test_multinode_without_a_rendezvous_host_is_a_clear_error():
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        discover({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                  "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})


@pytest.mark.parametrize("bad,fragment", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "outside 0..1"),
    ({"RANK": "0"}, "WORLD_SIZE is missing"),
])
def test_inconsistent_variables_name_the_variable(bad, fragment):
    with pytest.raises(ConfigError, match=fragment):
        discover(bad)


def test_unresolvable_node_name_falls_back_to_slurms_node_addr(slurm):
    # n1 is a name only Slurm knows here (NodeHostname=this host, NodeAddr=127.0.0.1).
    env = discover({**SRUN_TWO_NODES, "SLURM_STEP_NODELIST": "n[1-2]"})
    assert env.master_addr == "127.0.0.1"
