"""Backend ccl's runtime and failures: the pinned runtime as installed, each way a runtime can be wrong, and a
rank killed in the middle of a oneCCL all-reduce."""

import signal
import subprocess
import sys
import time
import zipfile

import pytest

from conftest import IN_CI, PYTHON, REPO, start_long_sweep
from hpcdl.dist import ccl_runtime


def hpcdl(*args, env=None):
    import os

    return subprocess.run([PYTHON, "-m", "hpcdl", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="session")
def old_oneccl(tmp_path_factory):
    """libccl.so.1 of oneCCL 2021.14, a real release from before the C API, from the registry."""
    folder = tmp_path_factory.mktemp("oneccl-2021.14")
    run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder),
                          "oneccl-cpu==2021.14.0"], capture_output=True, text=True)
    wheels = list(folder.glob("*.whl"))
    if run.returncode or not wheels:
        (pytest.fail if IN_CI else pytest.skip)(f"pip could not download oneccl-cpu 2021.14.0: {run.stderr[-500:]}")
    (folder / "lib").mkdir()
    with zipfile.ZipFile(wheels[0]) as zf:
        (folder / "lib" / "libccl.so.1").write_bytes(zf.read("oneccl_cpu-2021.14.0.data/data/lib/libccl.so.1"))
    return folder


def test_the_runtime_is_the_pinned_one_and_its_header_gives_the_enums(ccl):
    root = ccl.library.parent.parent
    ccl_runtime.verify(root)  # raises on any file whose sha256 differs
    assert ccl_runtime.enums(root / "include/oneapi/ccl/v2/types.h") == ccl_runtime.ENUMS
    info = hpcdl("ccl", "info")
    assert info.returncode == 0 and f"oneCCL 2022.2.0 from {ccl.library}" in info.stdout


def test_a_damaged_runtime_is_refused(ccl, tmp_path):
    copy = tmp_path / "runtime"
    import shutil

    shutil.copytree(ccl.library.parent.parent, copy)
    with open(copy / "lib" / "libccl_legacy_cpu.so", "r+b") as f:
        f.write(b"\0")
    run = hpcdl("ccl", "info", env={"HPCDL_CCL_HOME": str(copy)})
    assert run.returncode == 2 and "libccl_legacy_cpu.so is not the pinned file" in run.stderr
    assert "hpcdl ccl install --force" in run.stderr


@pytest.mark.parametrize("env, message", [
    ({"HPCDL_CCL_LIB": "/nonexistent/libccl.so.2"}, "/nonexistent/libccl.so.2 (named by HPCDL_CCL_LIB) does not exist"),
    ({"HPCDL_CCL_HOME": "/nonexistent/runtime"}, "no runtime found: HPCDL_CCL_LIB is not set, CCL_ROOT is not set, "
                                                 "and hpcdl's runtime /nonexistent/runtime is not installed"),
    ({"HPCDL_LIBFABRIC": "/nonexistent/libfabric.so.1"}, "oneCCL needs libfabric, its transport library"),
])
def test_a_missing_runtime_or_libfabric_is_a_clear_error(ccl, env, message):
    run = hpcdl("ccl", "info", env=env)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_a_oneccl_without_the_c_api_is_named(ccl, old_oneccl):
    as_lib = hpcdl("ccl", "info", env={"HPCDL_CCL_LIB": str(old_oneccl / "lib" / "libccl.so.1")})
    assert as_lib.returncode == 2 and "has no onecclGetVersion" in as_lib.stderr, as_lib.stderr
    assert "a oneCCL without the C API" in as_lib.stderr
    as_root = hpcdl("ccl", "info", env={"CCL_ROOT": str(old_oneccl)})
    assert as_root.returncode == 2 and "a oneCCL without the C API, older than 2021.17" in as_root.stderr
    # the same error stops a job before any rank waits for another
    bench = hpcdl("bench", "allreduce", "--backend", "ccl", env={"CCL_ROOT": str(old_oneccl)})
    assert bench.returncode == 2 and "older than 2021.17" in bench.stderr


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_in_a_ccl_allreduce_ends_every_rank_within_the_timeout(ccl, tmp_path, victim):
    timeout_s = 10
    procs = start_long_sweep(tmp_path, timeout_s, "--backend", "ccl")  # then in a oneCCL call that never completes
    procs[victim].send_signal(signal.SIGKILL)
    start = time.time()
    survivor = 1 - victim
    try:
        code = procs[survivor].wait(timeout=timeout_s + 20)
    finally:
        procs[survivor].kill()
    elapsed = time.time() - start
    log = (tmp_path / f"rank{survivor}.log").read_text()
    assert code not in (0, None) and procs[victim].wait() != 0
    last = log.strip().splitlines()[-1]
    assert f"rank {victim}" in last and "lost" in last and "oneCCL allreduce" in last, log[-2000:]
    # oneCCL cannot abort the call: the watchdog fails it at the timeout, then the heartbeats name the rank
    assert elapsed < timeout_s + 5, elapsed
    assert "Segmentation fault" not in log and "terminated with signal" not in log


def test_a_process_that_leaves_without_destroying_its_groups_exits_with_its_status(ccl, tmp_path):
    """oneCCL hangs at exit with a live communicator; the communication thread destroys what is left."""
    from conftest import free_port, rank_env

    code = ("import torch, torch.distributed as dist\nfrom hpcdl.dist.process_group import init_distributed, set_timeout\n"
            "from datetime import timedelta\nctx = init_distributed('ccl')\nset_timeout(ctx, timedelta(seconds=30))\n"
            "t = torch.ones(2)\ndist.all_reduce(t)\nraise SystemExit(3)\n")
    run = subprocess.run([PYTHON, "-c", code], env={**rank_env(0, 1, free_port()), "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 3, run.stderr[-2000:]
