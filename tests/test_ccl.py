"""Backend ccl's runtime and exit: the pinned runtime as installed, each way a runtime can be wrong, a process
that leaves with its groups alive, and the group's native pieces (their build, its record of a failure or not of a
transient one, its bounds, its publishing that never replaces a library, their link, the C++ side's callbacks). A rank
lost in a oneCCL all-reduce: test_allreduce."""

import ctypes
import errno
import fcntl
import json
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

import pytest
from conftest import IN_CI, PYTHON, REPO

from hpcdl.distributed.ccl import install, library


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


@pytest.fixture(scope="session")
def native_pieces():
    """Both native pieces, built once (or found) in the real cache the ranks of these tests use, before the first of
    them starts: their timeouts then time oneCCL, not a cold C++ compile (50 s on the 2-core VM, minutes under load),
    and no rank killed at its timeout leaves a compile behind."""
    from hpcdl.distributed.native import build

    return [build.ensure(piece) for piece in build.PIECES]


def test_the_runtime_is_the_pinned_one_and_its_header_gives_the_enums(ccl):
    root = ccl.library.parent.parent
    install.verify(root)  # raises on any file whose sha256 differs
    assert library.enums(root / "include/oneapi/ccl/v2/types.h") == library.ENUMS
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


def test_a_process_that_leaves_without_destroying_its_groups_exits_with_its_status(ccl, native_pieces, tmp_path):
    """oneCCL hangs at exit with a live communicator; the communication thread destroys what is left."""
    from conftest import free_port, rank_env

    code = ("import torch, torch.distributed as dist\nfrom hpcdl.distributed.group.lifecycle import init_distributed, set_timeout\n"
            "from datetime import timedelta\nctx = init_distributed('ccl')\nset_timeout(ctx, timedelta(seconds=30))\n"
            "t = torch.ones(2)\ndist.all_reduce(t)\nraise SystemExit(3)\n")
    run = subprocess.run([PYTHON, "-c", code], env={**rank_env(0, 1, free_port()), "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 3, run.stderr[-2000:]


def test_an_abort_on_the_oneccl_thread_fails_the_collective_not_the_process(ccl, native_pieces):
    """oneCCL throws a C++ exception through its C API when its transport fails (a peer gone mid-message), and
    that ends in abort() on its thread. os.abort() on that thread stands in for it here: the real one needs a
    rank killed at the wrong moment, which test_allreduce's lost-rank tests meet only now and then."""
    _abort_stands_in("try:\n    group.thread.run_here(os.abort, group, 'stand-in call')\n"
                     "except dist.DistBackendError as exc:\n    print('failed:', exc, flush=True)\n")


def _abort_stands_in(code: str) -> None:
    """Run ``code`` in a one-rank oneCCL process (``group``: its group); it aborts a stand-in call on a thread
    that calls oneCCL and prints the Work's error. That error names the abort, and the process then leaves at
    once: the parked thread is a call that never returned, so oneCCL is not finalized."""
    from conftest import free_port, rank_env

    code = ("import ctypes, os, torch, torch.distributed as dist\n"
            "from hpcdl.distributed.group.lifecycle import init_distributed\n"
            "from hpcdl.distributed.group.python_backend import library_group\nctx = init_distributed('ccl')\n"
            f"group = library_group()\n{code}raise SystemExit(3)\n")
    run = subprocess.run([PYTHON, "-c", code], env={**rank_env(0, 1, free_port()), "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=60)
    assert "failed: rank 0: oneCCL stand-in call aborted inside oneCCL" in run.stdout, run.stdout + run.stderr[-2000:]
    assert run.returncode == 1 and "a collective never completed" in run.stderr, run.stderr[-2000:]


def test_stale_shm_files_do_not_stop_a_rank_and_a_dead_ranks_is_removed(ccl, native_pieces, tmp_path):
    """A rank killed outright leaves libfabric's /dev/shm/PID:UID:N behind; a later process with that PID
    failed with 'fi_enable(endpoint) fails with ret: -16' (libfabric takes it for a live one's), and each one
    holds 64 MB of the node's memory until the epilog. The stale files here are planted by a stand-in (junk
    where a killed rank's header would be: libfabric refuses both alike), since no test can choose the PID a
    process gets: one named with the rank's PID, one with a PID that has exited, one with a live process's."""
    from conftest import free_port, rank_env

    exited = subprocess.Popen(["true"])
    exited.wait()
    live = subprocess.Popen(["sleep", "120"])
    dead_file = Path(f"/dev/shm/{exited.pid}:{os.getuid()}:0")
    live_file = Path(f"/dev/shm/{live.pid}:{os.getuid()}:0")
    code = ("import os, torch, torch.distributed as dist\n"
            "from hpcdl.distributed.group.lifecycle import init_distributed\n"
            "from hpcdl.log import setup_logging\nsetup_logging(0, verbose=True)\n"
            "stale = f'/dev/shm/{os.getpid()}:{os.getuid()}:0'\n"
            "open(stale, 'wb').write(os.urandom(4096))\n"
            "ctx = init_distributed('ccl')\n"
            "t = torch.full((3,), float(ctx.rank + 1))\ndist.all_reduce(t)\n"
            "assert t.tolist() == [3.0] * 3, t\nprint('pid', os.getpid())\n")
    try:
        for path in (dead_file, live_file):
            path.write_bytes(os.urandom(4096))
        port = free_port()
        procs = [subprocess.Popen([PYTHON, "-c", code], env={**rank_env(r, 2, port), "PYTHONPATH": str(REPO)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
        outs = [p.communicate(timeout=90) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err[-3000:]
            pid = int(out.split()[-1])
            assert re.search(rf"removed [12] stale libfabric shm file\(s\).*{pid}:", err), err[-3000:]
            assert not list(Path("/dev/shm").glob(f"{pid}:*")), "a clean exit leaves no shm file"
        assert not dead_file.exists() and live_file.exists()
    finally:
        live.kill()
        live.wait()
        for path in (dead_file, live_file):
            path.unlink(missing_ok=True)


def test_install_assembles_a_runtime_that_loads_and_reuses_it(ccl, tmp_path):
    prefix = tmp_path / "runtime"
    first = hpcdl("ccl", "install", "--prefix", str(prefix))  # pip's cache makes the second download quick
    assert first.returncode == 0 and f"runtime in {prefix}" in first.stdout, first.stderr[-2000:]
    assert "export HPCDL_CCL_HOME=" in first.stdout and not list(tmp_path.glob(".oneccl-*"))  # no staging left
    again = hpcdl("ccl", "install", "--prefix", str(prefix))  # present: checked, not downloaded again
    assert again.returncode == 0
    info = hpcdl("ccl", "info", env={"HPCDL_CCL_HOME": str(prefix)})
    assert info.returncode == 0 and f"oneCCL 2022.2.0 from {prefix}/lib/libccl.so.2" in info.stdout, info.stderr


def test_an_abort_on_the_c_thread_fails_its_collective_not_the_process(ccl, native_pieces):
    """The same for a small collective on c_comm_thread's C thread: os.abort's C function queued there stands in for
    oneCCL's abort()."""
    _abort_stands_in("fast = group.thread.fast\nt = torch.ones(3)\ndist.all_reduce(t)\n"
                     "assert fast.issued() > 0 and fast.done(fast.issued() - 1), 'it did not take the C thread'\n"
                     "abort = ctypes.cast(ctypes.CDLL(None).abort, ctypes.c_void_p).value\n"
                     "ticket = fast.submit(abort, 6, 0, 0, 0, 0, 0, 0, 0, 0)\n"
                     "print('failed:', group._collect(ticket, 'stand-in call'), flush=True)\n")


def test_an_abort_on_the_c_thread_of_the_python_threads_call_fails_its_collective(ccl, native_pieces):
    """A call the Python comm thread hands to the C thread (a large collective, a communicator's creation or
    destruction: every oneCCL call is made there) aborts there: its item fails as if it had aborted on it."""
    _abort_stands_in("abort = ctypes.cast(ctypes.CDLL(None).abort, ctypes.c_void_p).value\n"
                     "assert group.ccl.runner is not None, 'no C thread'\n"
                     "try:\n    group.thread.run_here(lambda: group.ccl.runner.call(abort), group, 'stand-in call')\n"
                     "except dist.DistBackendError as exc:\n    print('failed:', exc, flush=True)\n")


def test_fastcomm_makes_library_calls_and_runs_python_on_its_one_thread(tmp_path):
    from hpcdl.distributed.native import build, c_comm_thread

    fast = c_comm_thread.FastComm(build.ensure("c_comm_thread", {"XDG_CACHE_HOME": str(tmp_path)}).path)
    libc = ctypes.CDLL(None)
    there = fast.call(ctypes.cast(libc.gettid, ctypes.c_void_p).value)
    assert there != threading.get_native_id()
    assert fast.run(threading.get_native_id) == there  # a ctypes callback: oneCCL's creation and destruction
    assert fast.call(ctypes.cast(libc.labs, ctypes.c_void_p).value, -7) == 7
    with pytest.raises(KeyError, match="raised there"):
        fast.run(lambda: {}["raised there"])


def test_c_comm_thread_is_built_once_per_key_and_a_failed_build_is_recorded_not_retried(tmp_path):
    from hpcdl.distributed.native import build

    env = {"XDG_CACHE_HOME": str(tmp_path)}
    path = build.ensure("c_comm_thread", env).path
    assert path.parent == tmp_path / "hpcdl" / "native" / build.key() and path.name == "libhpcdl_c_comm_thread.so"
    assert build.key().startswith(f"{platform.machine()}-torch{build.key_parts()['torch']}-")
    built = path.stat().st_mtime_ns
    assert path.stat().st_mode & 0o777 == 0o755  # others sharing the cache can load it (mkstemp makes 0600)
    assert build.ensure("c_comm_thread", env).path == path and path.stat().st_mtime_ns == built  # not built again
    failing = {"XDG_CACHE_HOME": str(tmp_path / "other"), "CC": "false"}
    failed = build.ensure("c_comm_thread", failing)
    assert failed.path is None and re.search(r"false could not build .*c_comm_thread\.c", failed.why), failed
    record = json.loads(failed.record.read_text())
    assert record["piece"] == "c_comm_thread" and record["key"] == build.key_parts() and record["why"] in failed.why
    stamp = failed.record.stat().st_mtime_ns
    again = build.ensure("c_comm_thread", {**failing, "CC": "cc"})  # a compiler now: a rank still does not retry
    assert again.path is None and failed.why in again.why and str(failed.record) in again.describe()
    assert failed.record.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in failed.record.parent.iterdir()) == [".lock", "c_comm_thread.failed.json"]  # no half file
    retried = build.build({**failing, "CC": "env cc"}, pieces=("c_comm_thread",))  # hpcdl ccl install's: it does
    assert retried[0].path is not None and retried[0].path.exists() and not failed.record.exists()  # $CC of 2 words
    inode = path.stat().st_ino
    assert build.build(env, pieces=("c_comm_thread",))[0].path == path and path.stat().st_ino == inode  # kept


@pytest.mark.parametrize("code", ["ENOSYS", "ENOLCK", "EOPNOTSUPP"])
def test_a_cache_whose_filesystem_does_not_lock_builds_under_a_lock_of_this_node(tmp_path, monkeypatch, caplog, code):
    """Lustre mounted without flock (ENOSYS), NFS without lockd (ENOLCK): flock on the cache's .lock fails. No
    filesystem here refuses flock on demand, so a fake flock refuses it on that one path (and only there)."""
    from hpcdl.distributed.native import build

    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    cache_lock, real_flock = build.folder(env) / ".lock", fcntl.flock

    def fake_flock_of_a_filesystem_without_locks(file, operation):
        if Path(file.name) == cache_lock:
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
        return real_flock(file, operation)

    monkeypatch.setattr(fcntl, "flock", fake_flock_of_a_filesystem_without_locks)
    (tmp_path / "node").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "node"))
    caplog.set_level(logging.INFO, logger="hpcdl.distributed.native")
    built = build.ensure("c_comm_thread", env)
    assert built.path is not None and built.path.exists(), built.describe()
    assert not build.record_path("c_comm_thread", env).exists()
    assert "the cache's filesystem does not lock; locked on this node instead" in caplog.text
    assert "cannot" not in caplog.text
    assert [p.name for p in (tmp_path / "node").iterdir()] == [f"hpcdl-native-{os.getuid()}-{build.key()}.lock"]
    (installed,) = build.build(env, pieces=("c_comm_thread",))  # hpcdl ccl install's way: the same lock
    assert installed.path == built.path


@pytest.mark.parametrize("owner, name, other", [
    ("torch", "compiled_with_cxx11_abi", lambda abi: lambda: not abi()),
    ("torch.version", "git_version", lambda _: "0" * 40),
    ("platform", "libc_ver", lambda _: lambda *args, **kwargs: ("glibc", "2.17")),
])
def test_the_cache_key_tells_apart_torch_builds_cxx_abis_and_libcs(monkeypatch, owner, name, other):
    """Two environments with one torch version but another C++ ABI or build, or nodes with another glibc, sharing a
    home: each has its own folder, so none loads the other's library."""
    import importlib

    from hpcdl.distributed.native import build

    module = importlib.import_module(owner)
    before = build.key()
    try:
        with monkeypatch.context() as patched:
            patched.setattr(module, name, other(getattr(module, name)))
            build.key_parts.cache_clear()
            build.key.cache_clear()
            changed = build.key()
    finally:
        build.key_parts.cache_clear()
        build.key.cache_clear()
    assert changed != before and build.key() == before


def test_install_keeps_a_built_library_that_does_not_load_and_names_the_folder_to_remove(tmp_path, monkeypatch,
                                                                                          caplog):
    """A library built on a login node with a newer glibc than the compute nodes' (here: garbage where it was) is kept:
    ranks of another node may have it mapped, and on NFSv3 unlinking or replacing it would kill them (SIGBUS). hpcdl
    ccl install names the folder to remove by hand. A C++ load check that does not finish (a stand-in that sleeps)
    is not a library that does not load: it is kept too, as not known."""
    from hpcdl.distributed.native import build

    env = {"XDG_CACHE_HOME": str(tmp_path)}
    path = build.ensure("c_comm_thread", env).path
    path.write_bytes(b"not a library that loads here")
    inode = path.stat().st_ino
    with pytest.raises(OSError):
        ctypes.CDLL(str(path))
    caplog.set_level(logging.WARNING, logger=build.__name__)
    (kept,) = build.build(env, pieces=("c_comm_thread",))
    assert kept.path == path and path.stat().st_ino == inode and path.read_bytes().startswith(b"not a library")
    assert "does not load here" in kept.why and f"remove {build.folder(env)} by hand" in kept.describe(), kept
    assert f"{path}: it does not load here" in caplog.text
    assert sorted(p.name for p in path.parent.iterdir()) == [".lock", build.C_LIBRARY]
    target = build.artifact("ccl_backend", env)
    target.parent.mkdir()
    target.write_bytes(b"an extension whose import hangs")
    monkeypatch.setattr(build, "CXX_IMPORT", "import time\ntime.sleep(60)")  # a stand-in for a hung load check
    monkeypatch.setattr(build, "IMPORT_TIMEOUT_S", 1)
    (unknown,) = build.build(env, pieces=("ccl_backend",))
    assert unknown.path == target and target.read_bytes() == b"an extension whose import hangs"
    assert "whether it loads here is not known; kept" in unknown.describe(), unknown


def test_a_library_that_does_not_load_names_its_folder_and_the_install(tmp_path, monkeypatch, caplog):
    """Each loader's warning names the folder to remove as well as hpcdl ccl install. Nothing is compiled: garbage
    stands for both libraries, and for ccl_backend a fake c_comm_thread.load stands for a C thread that loaded."""
    from hpcdl.distributed.native import build, c_comm_thread, ccl_backend

    env = {"XDG_CACHE_HOME": str(tmp_path)}
    for piece in build.PIECES:
        build.artifact(piece, env).parent.mkdir(parents=True, exist_ok=True)
        build.artifact(piece, env).write_bytes(b"built for another glibc")
    for module in (c_comm_thread, ccl_backend):
        monkeypatch.setattr(module, "_TRIED", False)
        monkeypatch.setattr(module, "_LOADED", None)
    caplog.set_level(logging.WARNING)
    assert c_comm_thread.load(env) is None
    monkeypatch.setattr(c_comm_thread, "load", lambda environ: "fake: a C thread that loaded")
    assert ccl_backend.load(env) is None
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 2 and "does not load or start" in said[0] and "does not import" in said[1], said
    for message in said:
        assert "hpcdl ccl install on this node" in message and f"remove {build.folder(env)}" in message, message


FAKE_CXX_BUILD = """
import json, os, pathlib, sys
args = json.loads(sys.argv[1])
staging = pathlib.Path(args["build_directory"])
assert not (staging.parent / (args["name"] + ".so")).exists(), "the final path exists while it is being built"
assert os.getcwd() == str(staging), "the child runs in the rank's folder, where a torch/ or json.py would shadow"
(staging / (args["name"] + ".so")).write_bytes(b"whole, from a stand-in for cpp_extension")
"""
FAKE_NINJA_FAILURE = """
print("Error building extension 'hpcdl_ccl_backend_x': [1/2] c++ -MMD -MF ccl_backend.o.d -O2 -c ccl_backend.cpp")
print("FAILED: ccl_backend.o")
print("ccl_backend.cpp:12:5: error: 'fc_wait' was not declared in this scope")
print("    fc_wait(ticket, 200, &rc);\\n" * 40, end="")
print("ninja: build stopped: subcommand failed.")
raise SystemExit(1)
"""


def test_the_cpp_extension_is_built_apart_and_linked_into_place_whole(tmp_path, monkeypatch):
    """A rank that finds the extension must not read it while the linker writes it: it is built in a folder of its
    own (the child's working folder too) and hard-linked into place, readable by all. A stand-in for cpp_extension's
    child (FAKE_CXX_BUILD) writes it, so that nothing is compiled but the C library. What killed builds left is removed
    once an hour old. A failed build records the compiler's error, not only ninja's last line (FAKE_NINJA_FAILURE)."""
    from hpcdl.distributed.native import build

    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    target = build.artifact("ccl_backend", env)
    old, young = target.parent / ".build-killed", target.parent / ".build-running"
    for leftover in (old, young):
        leftover.mkdir(parents=True)
        (leftover / target.name).write_bytes(b"whole, from a build that was killed")
    old_tmp = build.folder(env) / f".{build.C_LIBRARY}.killed"
    old_tmp.write_bytes(b"half")
    for leftover in (old, old_tmp):
        os.utime(leftover, (0, os.stat(leftover).st_mtime - 7200))
    monkeypatch.setattr(build, "CXX_BUILD", FAKE_CXX_BUILD)
    monkeypatch.setattr(build, "PY_BACKEND_HEADER", build.SOURCES["ccl_backend"])  # any file: a torch 2.14's header
    (built,) = build.build(env, pieces=("ccl_backend",))
    assert built.path == target and target.read_bytes().startswith(b"whole, from a stand-in"), built.describe()
    assert target.stat().st_mode & 0o777 == 0o755 and target.stat().st_nlink == 1  # the staging name is gone
    assert sorted(p.name for p in target.parent.iterdir()) == [young.name, target.name]  # the young one may run
    assert not old_tmp.exists()
    monkeypatch.setattr(build, "CXX_BUILD", FAKE_NINJA_FAILURE)
    failing = {"XDG_CACHE_HOME": str(tmp_path / "other")}
    failed = build.ensure("ccl_backend", failing)
    assert failed.path is None and failed.record is not None, failed.describe()
    assert "ccl_backend.cpp:12:5: error: 'fc_wait' was not declared in this scope" in failed.why, failed.why
    assert failed.why.endswith("ninja: build stopped: subcommand failed.") and len(failed.why) < 1300, failed.why
    assert json.loads(failed.record.read_text())["why"] == failed.why
    assert list(build.artifact("ccl_backend", failing).parent.iterdir()) == []


@pytest.mark.parametrize("child, words", [
    ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "killed by signal 9"),
    ("print('ld: final link failed: No space left on device')\nraise SystemExit(1)", "No space left on device"),
    ("print('cc1plus: fatal error: ccl_backend.o: Disk quota exceeded')\nraise SystemExit(1)", "Disk quota exceeded"),
], ids=["a signal", "a full disk", "a full quota"])
def test_a_build_that_another_try_may_mend_is_not_recorded(tmp_path, monkeypatch, child, words):
    """A compile killed by a signal (the OOM killer, a rank's launcher), a full disk or quota: said as not built this
    time, not recorded, and the next process builds it. Stand-ins for cpp_extension's child fail so, then succeed."""
    from hpcdl.distributed.native import build

    env = {"XDG_CACHE_HOME": str(tmp_path)}
    monkeypatch.setattr(build, "PY_BACKEND_HEADER", build.SOURCES["ccl_backend"])
    monkeypatch.setattr(build, "CXX_BUILD", child)
    failed = build.ensure("ccl_backend", env)
    assert failed.path is None and failed.transient and failed.record is None, failed.describe()
    assert failed.describe().startswith("not built this time (transient): ") and words in failed.why, failed.why
    assert "not recorded" in failed.retry() and not build.record_path("ccl_backend", env).exists()
    monkeypatch.setattr(build, "CXX_BUILD", FAKE_CXX_BUILD)
    assert build.ensure("ccl_backend", env).path == build.artifact("ccl_backend", env)  # the next one builds it


FAKE_CC_THAT_HANGS = """#!/bin/sh
sleep 300 &
echo $! > "{pid_file}"
wait
"""


def test_a_compile_past_its_timeout_is_ended_with_what_it_started_and_not_recorded(tmp_path, monkeypatch):
    """A compile that never finishes (FAKE_CC_THAT_HANGS, $CC of two words, which starts a process of its own) is
    ended at the C build's timeout, with the process it started, and is not recorded: another try may pass."""
    from hpcdl.distributed.native import build

    script, pid_file = tmp_path / "fake_cc_that_hangs.sh", tmp_path / "started.pid"
    script.write_text(FAKE_CC_THAT_HANGS.format(pid_file=pid_file))
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "CC": f"sh {script}"}
    monkeypatch.setattr(build, "C_TIMEOUT_S", 1)
    failed = build.ensure("c_comm_thread", env)
    assert failed.transient and f"sh {script} did not build" in failed.why and "within 1 s" in failed.why, failed
    assert _gone(int(pid_file.read_text())), "the compiler's own child outlived the build"
    assert sorted(p.name for p in build.folder(env).iterdir()) == [".lock"]  # no record, no temporary file


def test_a_lock_held_past_the_wait_is_not_used_this_time_and_not_recorded(tmp_path, monkeypatch):
    """Another process builds (here: this one holds the key's lock on another open file): a rank waits as long as
    that build may take, then goes on without the piece, and records nothing."""
    from hpcdl.distributed.native import build

    env = {"XDG_CACHE_HOME": str(tmp_path)}
    monkeypatch.setitem(build.TIMEOUT_S, "c_comm_thread", 1)
    build.folder(env).mkdir(parents=True)
    with open(build.folder(env) / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        waited = build.ensure("c_comm_thread", env)
    assert waited.transient and re.fullmatch(r"another process has been building .+ for 1 s; not used this time",
                                             waited.why), waited.why
    assert sorted(p.name for p in build.folder(env).iterdir()) == [".lock"]
    assert build.ensure("c_comm_thread", env).path is not None  # the lock free: built


def test_a_cache_that_cannot_be_read_is_not_used_and_does_not_raise(tmp_path, monkeypatch):
    """The lock-free look for a built library meets an NFS handle gone stale (or EACCES): the piece is not used, and
    nothing escapes into the rank's init_process_group. A fake path refuses stat as such a handle does."""
    from hpcdl.distributed.native import build

    class FakePathOnAStaleNfsHandle(type(Path())):
        def exists(self, **kwargs):
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(self))

    real = build.artifact
    monkeypatch.setattr(build, "artifact", lambda piece, environ: FakePathOnAStaleNfsHandle(real(piece, environ)))
    built = build.ensure("c_comm_thread", {"XDG_CACHE_HOME": str(tmp_path)})
    assert built.path is None and os.strerror(errno.ESTALE) in built.why, built


def test_a_published_library_is_never_replaced(tmp_path):
    """Two nodes that each build (their caches' filesystem does not lock) publish by hard link: the second finds the
    first one's whole file and keeps it, so that the inode ranks of the first node mapped stays (on NFSv3 a rename
    onto it would delete it, and they would die of SIGBUS)."""
    from hpcdl.distributed.native import cache

    target, first, second = tmp_path / "lib.so", tmp_path / ".lib.so.first", tmp_path / ".lib.so.second"
    first.write_bytes(b"the first node's")
    second.write_bytes(b"the second node's")
    first.chmod(0o600)
    cache.publish(first, target)
    inode = target.stat().st_ino
    cache.publish(second, target)
    assert target.stat().st_ino == inode and target.read_bytes() == b"the first node's"
    assert target.stat().st_mode & 0o777 == 0o755


DIES_WITH_ITS_PARENT = """
import os, subprocess, sys
child = sys.argv[1] + "import subprocess, time\\n" \\
    "compiler = subprocess.Popen(['sleep', '300'])\\nprint(os.getpid(), compiler.pid, flush=True)\\ntime.sleep(300)\\n"
subprocess.Popen([sys.executable, "-c", child, str(os.getpid())], start_new_session=True)
import time
time.sleep(300)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_the_cpp_child_and_what_it_started_end_with_the_process_that_started_it():
    """A rank killed by its launcher during a C++ build: its child (build.DIE_WITH_PARENT first, as in CXX_BUILD)
    ends, and the processes it started with it (a sleep stands in for ninja), so that no compile runs on unowned."""
    from hpcdl.distributed.native import build

    parent = subprocess.Popen([sys.executable, "-c", DIES_WITH_ITS_PARENT, build.DIE_WITH_PARENT],
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
    finally:
        parent.kill()
        parent.wait()
    assert len(pids) == 2 and all(_gone(pid) for pid in pids), pids


def _gone(pid: int, within_s: float = 10) -> bool:
    """Whether process ``pid`` has ended (or is a zombie nobody reaps yet) within ``within_s``."""
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_the_cpp_calls_back_exactly_the_protocols_methods_and_the_group_has_them():
    """ccl_backend.cpp calls the Python group by name (BackendCallbacks): a rename on one side only fails here."""
    from hpcdl.distributed.ccl.group import CCLProcessGroup
    from hpcdl.distributed.native import ccl_backend

    assert ccl_backend.callbacks_called() == ccl_backend.callback_names() == {"ticket_overdue", "ticket_error",
                                                                              "ticket_future"}
    ccl_backend.check_callbacks(CCLProcessGroup)
    renamed = ccl_backend.SOURCE.read_text().replace('"ticket_error"', '"failure_words"')
    with pytest.raises(TypeError, match="calls failure_words, which BackendCallbacks lacks.*lists ticket_error, which"):
        ccl_backend.check_callbacks(CCLProcessGroup, renamed)
    without = type("Without", (CCLProcessGroup,), {"ticket_future": None})
    with pytest.raises(TypeError, match="Without has no method ticket_future"):
        ccl_backend.check_callbacks(without)
    other = type("Other", (CCLProcessGroup,), {"ticket_overdue": lambda self, ticket, what: None})
    with pytest.raises(TypeError, match=r"Other.ticket_overdue takes \['self', 'ticket', 'what'\]"):
        ccl_backend.check_callbacks(other)


LOAD_ORDER = """
from hpcdl.distributed.native import build, c_comm_thread, ccl_backend
built = build.ensure("ccl_backend")
assert built.path is not None, built.describe()
module = ccl_backend._import(built.path)  # first: nothing has opened the C thread's library yet
assert c_comm_thread.load() is not None
files = {tuple(line.split()[3:6]) for line in open("/proc/self/maps") if build.C_LIBRARY in line}
print(len({(device, inode) for _, device, inode in files}), module.FastBackend.__name__)
"""


def test_the_cpp_extension_links_the_c_thread_so_load_order_does_not_matter(ccl, native_pieces):
    """ccl_backend.cpp's fc_* calls are a link dependency of the extension: imported before c_comm_thread's loader
    opened the C library, it still loads (Python opens extensions with RTLD_NOW: an unresolved fc_* would fail
    here), and the process maps that library once, so that both sides share its one queue and thread."""
    run = subprocess.run([PYTHON, "-c", LOAD_ORDER], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    if "not built" in run.stderr and not IN_CI:
        pytest.skip(f"the native pieces do not build here: {run.stderr[-500:]}")
    assert run.returncode == 0 and run.stdout.split() == ["1", "FastBackend"], run.stderr[-3000:]


NO_COMPILER_RANK = """
import json, os, torch, torch.distributed as dist
from hpcdl.distributed.group.lifecycle import init_distributed, shutdown
from hpcdl.distributed.group.python_backend import library_group
from hpcdl.log import setup_logging
setup_logging(int(os.environ["RANK"]))
ctx = init_distributed("ccl")
small, large = torch.full((3,), float(ctx.rank + 1)), torch.ones(1 << 18)  # the C thread's size, and a larger one
dist.all_reduce(small)
dist.all_reduce(large)
group = library_group()
print(json.dumps({"small": small.tolist(), "large": large[0].item(), "c thread": group.thread.fast is not None,
                  "classes": [c.__name__ for c in type(group).__mro__]}), flush=True)
shutdown(ctx)
"""


def test_without_a_compiler_oneccl_works_and_no_rank_retries_the_build(ccl, tmp_path):
    """Issue 45: 'hpcdl ccl install' on a machine with no compiler: oneCCL works, the native pieces say once why they
    are not used, no rank retries the build. No compiler is reachable: PATH holds only python, CC and CXX unset."""
    from conftest import free_port, rank_env

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(PYTHON)
    env = {"PATH": str(tmp_path / "bin"), "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(REPO),
           "HPCDL_CCL_HOME": str(install.home())}  # the runtime make venv installed: checked, not downloaded
    run = subprocess.run([PYTHON, "-m", "hpcdl", "ccl", "install"], capture_output=True, text=True, timeout=120,
                         env={**_without_compiler(os.environ), **env})
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"c_comm_thread: not built: no C compiler .*; not used: oneCCL goes through Python, and no rank "
                     r"retries the build \(to retry the build: hpcdl ccl install\)", run.stdout), run.stdout
    assert "ccl_backend: not built: it links to c_comm_thread, which is not built: no C compiler" in run.stdout
    (native,) = (tmp_path / "cache" / "hpcdl" / "native").iterdir()
    before = {p.name: p.stat().st_mtime_ns for p in native.iterdir()}
    assert set(before) == {".lock", "c_comm_thread.failed.json", "ccl_backend.failed.json"}, before
    port = free_port()
    procs = [subprocess.Popen([PYTHON, "-c", NO_COMPILER_RANK], env={**_without_compiler(rank_env(r, 2, port)), **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        found = json.loads(out.splitlines()[-1])
        assert found["small"] == [3.0] * 3 and found["large"] == 2.0 and not found["c thread"], found
        assert "FastBackend" not in found["classes"], found
        said = [line for line in err.splitlines() if "c_comm_thread: not used" in line]
        assert len(said) == 1 and "no C compiler" in said[0] and "to retry the build: hpcdl ccl install" in said[0], err
        assert err.count("ccl_backend: not used") == 1, err
    assert {p.name: p.stat().st_mtime_ns for p in native.iterdir()} == before  # no rank built, locked or recorded


def _without_compiler(environ) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in ("CC", "CXX")}
