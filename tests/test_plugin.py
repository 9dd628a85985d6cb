"""hpcdl's groups as torch.distributed plugins, under a script that imports torch only (tests/plain_ddp.py):
found through the entry points under torchrun and under srun on two Slurm nodes, every collective exact,
and DDP reaching gloo's weights."""

import json
import os
import subprocess
from importlib.metadata import entry_points

import pytest
from conftest import PYTHON, REPO, free_port, sbatch_wait

from hpcdl.bench.reports import PluginImports, PluginReport

SCRIPT = REPO / "tests" / "plain_ddp.py"
LIGHTNING = REPO / "tests" / "plain_lightning.py"
BIN = os.path.dirname(PYTHON)
POINT_TO_POINT = ("send_recv", "batch_isend_irecv")  # refused by hpcdl's groups, with the reason


def launcher_env() -> dict[str, str]:
    """This environment less the launcher variables pytest may run under."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "PMI_", "GROUP_"))}


# torch 2.14's opt-in torchcomms path. torch takes it only where torchcomms imports and owns the backend
# (distributed_c10d._torchcomms_handles_backend); on PyPI torchcomms is a placeholder (0.0.1, no module
# content), so here the variable must change nothing.
TORCHCOMMS = {"TORCH_DISTRIBUTED_USE_TORCHCOMMS": "1"}


def torchrun(tmp_path, backend: str, n: int = 2, extra_env: dict | None = None,
             tag: str = "") -> subprocess.CompletedProcess:
    port = free_port()
    return subprocess.run([f"{BIN}/torchrun", "--nproc-per-node", str(n), f"--master-port={port}", str(SCRIPT), backend,
                           str(tmp_path / f"{backend.replace(':', '-')}{tag}.json")], capture_output=True, text=True,
                          timeout=240, env={**launcher_env(), "PATH": f"{BIN}:{os.environ['PATH']}", **(extra_env or {})},
                          cwd=tmp_path)


def result(tmp_path, backend: str) -> dict:
    return json.loads((tmp_path / f"{backend.replace(':', '-')}.json").read_text())


def check_against_gloo(found: dict, gloo: dict, second_init: str) -> None:
    """Every collective exact (the script asserts values) or refused with the reason; gloo's weights; a second
    ``init_process_group`` after ``destroy_process_group`` ``second_init`` ("ok", or "skipped" under torchrun)."""
    assert found["hpcdl_before_init"] is False and found["hpcdl_after_init"] is True  # only the entry point loaded it
    assert found["world"] == gloo["world"] == 2
    assert found["collectives"]["second_init"] == gloo["collectives"]["second_init"] == second_init
    refused = {k: v for k, v in found["collectives"].items() if v != "ok" and k != "second_init"}
    assert set(refused) == set(POINT_TO_POINT), refused
    for name in POINT_TO_POINT:
        assert "(point-to-point) is not supported" in refused[name] and "new_group(backend='gloo')" in refused[name]
    assert {k for k, v in gloo["collectives"].items() if v != "ok" and k != "second_init"} == {"premul_sum", "int_avg"}
    assert found["weights"] == gloo["weights"]


def test_pip_install_declares_the_entry_points():
    found = {e.name: e.value for e in entry_points(group="torch.distributed.backends")}
    assert found["oneccl"] == "hpcdl.distributed.group.plugin:oneccl"
    assert found["mpi4py"] == "hpcdl.distributed.group.plugin:mpi4py"


@pytest.mark.timeout(600)  # four 2-rank torchrun starts in a row: 262 s in CI's parallel pass (2026-11-28)
def test_a_torch_only_script_under_torchrun(ccl, tmp_path):
    for backend, env, tag in (("gloo", None, ""), ("oneccl", None, ""), ("cpu:oneccl", None, ""),
                              ("oneccl", TORCHCOMMS, "-torchcomms")):
        run = torchrun(tmp_path, backend, extra_env=env, tag=tag)
        assert run.returncode == 0, f"{backend} {env}: {run.stderr[-3000:]}"
    gloo = result(tmp_path, "gloo")
    for backend in ("oneccl", "cpu:oneccl", "oneccl-torchcomms"):
        check_against_gloo(result(tmp_path, backend), gloo, "skipped")


def test_the_mpi_group_under_torchrun_says_to_use_an_mpi_launcher(mpiexec, tmp_path):
    run = torchrun(tmp_path, "mpi4py")
    assert run.returncode != 0
    assert "start the job with mpiexec or srun --mpi" in run.stderr, run.stderr[-3000:]


def test_a_torch_only_script_under_srun_on_two_nodes(two_nodes, mpiexec, ccl, tmp_path):
    """``srun hpcdl exec python script.py``: torch's env:// variables from Slurm's; one job, three backends."""
    steps = "\n".join(f"srun --mpi=pmi2 {BIN}/hpcdl exec {PYTHON} {SCRIPT} {b} {tmp_path}/{b}.json || exit 1"
                      for b in ("gloo", "oneccl", "mpi4py"))
    script = tmp_path / "plain.sbatch"
    script.write_text(f"#!/bin/bash\n{steps}\n")
    sbatch_wait(script, "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", f"--output={tmp_path}/out",
                f"--chdir={tmp_path}", "--time=5", env=launcher_env(), timeout=280)
    gloo = result(tmp_path, "gloo")
    for backend in ("oneccl", "mpi4py"):
        check_against_gloo(result(tmp_path, backend), gloo, "ok")


def test_lightning_ddp_on_hpcdls_groups_under_srun_on_two_nodes(two_nodes, mpiexec, ccl, tmp_path):
    """Lightning's own Slurm detection and ``DDPStrategy(process_group_backend=...)``; MASTER_ADDR exported
    because the local Slurm's node names do not resolve (its nodes are all this host)."""
    steps = "\n".join(f"srun --mpi=pmi2 {PYTHON} {LIGHTNING} {b} {tmp_path}/{b}.json || exit 1"
                      for b in ("gloo", "oneccl", "mpi4py"))
    steps += (f"\nTORCH_DISTRIBUTED_USE_TORCHCOMMS=1 srun --mpi=pmi2 {PYTHON} {LIGHTNING} oneccl "
              f"{tmp_path}/oneccl-torchcomms.json || exit 1")
    script = tmp_path / "lightning.sbatch"
    script.write_text(f"#!/bin/bash\nexport MASTER_ADDR=127.0.0.1\n{steps}\n")
    sbatch_wait(script, "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", f"--output={tmp_path}/out",
                f"--chdir={tmp_path}", "--time=5", env=launcher_env(), timeout=280)
    gloo = result(tmp_path, "gloo")
    for backend in ("oneccl", "mpi4py", "oneccl-torchcomms"):
        found = result(tmp_path, backend)
        assert (found["torch_backend"], found["world"]) == (backend.removesuffix("-torchcomms"), 2)
        assert found["val_loss"] == gloo["val_loss"] and found["weights"] == gloo["weights"]


@pytest.mark.slow
def test_a_missing_runtime_is_a_clear_error_at_init(tmp_path):
    env = {**launcher_env(), "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "HPCDL_CCL_LIB": str(tmp_path / "nowhere" / "libccl.so.2")}
    run = subprocess.run([PYTHON, "-c", "import torch.distributed as d; d.init_process_group('oneccl')"],
                         capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert run.returncode != 0
    assert "torch.distributed backend 'oneccl' (hpcdl's plugin) cannot run here" in run.stderr, run.stderr[-2000:]
    assert "nowhere/libccl.so.2 (named by HPCDL_CCL_LIB) does not exist" in run.stderr


@pytest.mark.parametrize("argv, message", [([], "name the command to run"),
                                           (["no-such-program-here"], "cannot run 'no-such-program-here'")])
def test_hpcdl_exec_refuses_a_bad_command(argv, message):
    run = subprocess.run([f"{BIN}/hpcdl", "exec", *argv], capture_output=True, text=True, env=launcher_env(),
                         timeout=60)
    assert run.returncode != 0 and message in run.stderr


def test_hpcdl_exec_sets_torchs_variables_from_the_launcher():
    env = {**launcher_env(), "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29999"}
    run = subprocess.run([f"{BIN}/hpcdl", "exec", "--", PYTHON, "-c",
                          "import os; print(' '.join(os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', "
                          "'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')))"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["1", "2", "1", "2", "127.0.0.1", "29999"]


def test_bench_plugin_measures_both_paths_with_hpcdl_absent_before_init(mpiexec, ccl, default_port, tmp_path):  # plain mpiexec
    """``hpcdl bench plugin``: the plugin path's processes had no hpcdl before init_process_group, and every
    backend's sweep on both paths reduced exactly (the figures: docs/performance.md)."""
    env = {**launcher_env(), "PATH": f"{BIN}:{os.environ['PATH']}"}
    run = subprocess.run([PYTHON, "-m", "hpcdl", "bench", "plugin", "--max-bytes", "64", "--seconds-per-size", "0.01",
                          "--rounds", "1", "--json", str(tmp_path / "plugin.json")], capture_output=True, text=True,
                         env=env, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    report = PluginReport.from_json(str(tmp_path / "plugin.json"))
    assert report.plugin_imports == PluginImports(hpcdl_before_init=False, hpcdl_after_init=True)
    cells = {(r.path, r.backend, r.bytes) for r in report.rows if r.correct}
    assert cells == {(p, b, n) for p in ("hpcdl", "plugin") for b in ("gloo", "mpi4py", "oneccl")
                     for n in (4, 8, 16, 32, 64)}
    assert "plugin/hpcdl time, geometric mean over sizes: gloo" in run.stdout


def test_bench_plugin_refuses_an_unknown_launcher_before_starting_anything():
    run = subprocess.run([PYTHON, "-m", "hpcdl", "bench", "plugin", "--launcher", "torchrun"], capture_output=True,
                         text=True, env=launcher_env(), timeout=60)
    assert run.returncode == 2 and "--launcher='torchrun' is unknown; choose one of mpiexec, srun" in run.stderr
