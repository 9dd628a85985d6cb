"""Shared fixtures: real processes, a real Slurm, a real MPI. Nothing here fakes a component."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
IN_CI = os.environ.get("CI") == "true"
# Values that must reach Slurm and bash literally. A newline, and a backslash in an output path, are
# refused instead (see test_sbatch): Slurm cannot carry them.
HOSTILE = ["a 0", 'a"=0"', "a'; echo foo", "$HOME `x` $(id)"]


# The tiers: what a test needs, read off the fixtures it asks for (pytest.ini declares the marks). A test
# that starts ranks of its own without one of these fixtures carries @pytest.mark.ranks in its file.
NEEDS = {"slurm": "slurm", "two_nodes": "slurm", "fabric": "slurm", "shared_fs": "slurm", "wide": "scale", "mpiexec": "mpi", "ccl": "ccl"}
# Tests that share a finite resource run one after another on one xdist worker (--dist loadgroup): the
# local Slurm's nodes n1 n2 (partition debug) and n3 n4 (the shaped partition fabric, whose rate a test
# measures), and the launchers' default rendezvous port (default_port). The rest spread over the workers.
# Under pytest 9.2 with pytest-xdist 3.8 these groups do not hold (pytest-xdist#1386): the tests that must not
# share the port or the link take a lock as well (held); the Slurm tests queue in Slurm, their waits allow for it.
GROUPS = {"fabric": "fabric", "wide": "wide", "slurm": "slurm", "two_nodes": "slurm", "default_port": "default_port"}


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups off the marks (it ran first: no groups)
def pytest_collection_modifyitems(config, items):
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        for fixture in names & NEEDS.keys():
            item.add_marker(NEEDS[fixture])
        group = next((GROUPS[f] for f in GROUPS if f in names), None)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
        if "wide" in names:  # a job on the wide partition is a Slurm job too
            item.add_marker("slurm")
        if not any(item.get_closest_marker(m) for m in ("slurm", "mpi", "ccl", "ranks", "slow", "alone", "scale", "exclusive")):
            item.add_marker("unit")


class _Usage:
    """The machine's busy cores while pytest ran (from /proc/stat: Slurm's job steps are not pytest's
    children, so pytest's own rusage misses them), and each test's wall time and its process's CPU time, for
    --cpu-log FILE (one JSON line a test, appended by every xdist worker)."""

    def __init__(self):
        self.start = (time.monotonic(), self.cpu_seconds())

    @staticmethod
    def cpu_seconds() -> float:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait

    def line(self) -> str:
        wall, cpu = time.monotonic() - self.start[0], self.cpu_seconds() - self.start[1]
        return f"{wall / 60:.1f} min, the machine's {os.cpu_count()} CPUs busy {cpu / wall:.2f} on average"


def pytest_addoption(parser):
    parser.addoption("--cpu-log", default=None, help="append each test's wall and CPU seconds to this JSONL file")


def pytest_configure(config):
    config._hpcdl_usage = _Usage()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    log = item.config.getoption("--cpu-log")
    if not log:
        yield
        return
    start, t0, r0 = time.time(), time.monotonic(), _rusage()
    yield
    cpu = _rusage() - r0
    with open(log, "a") as f:  # start and pid: to match process accounting's records (docs/contributing.md)
        f.write(json.dumps({"test": item.nodeid, "start": round(start, 2), "pid": os.getpid(),
                            "wall": round(time.monotonic() - t0, 2), "cpu": round(cpu, 2),
                            "marks": sorted({m.name for m in item.iter_markers()} - {"parametrize"})}) + "\n")


def _rusage() -> float:
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                resource.getrusage(resource.RUSAGE_CHILDREN)))


def pytest_terminal_summary(terminalreporter, config):
    if not hasattr(config, "workerinput"):
        terminalreporter.write_line(f"pytest took {config._hpcdl_usage.line()}")


def _process_cpu() -> dict[tuple[int, str], tuple[float, str]]:
    """Each process's CPU seconds so far and its command, keyed by pid and start time (a reused pid is another
    process), from /proc; a process gone meanwhile is skipped."""
    tick, found = os.sysconf("SC_CLK_TCK"), {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
                try:
                    command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    command = ""
                found[(int(entry.name), fields[19])] = ((int(fields[11]) + int(fields[12])) / tick,
                                                        command[:120] or stat.split()[1])
    return found


def busy_elsewhere(seconds: float = 2.0) -> tuple[float, list[str]]:
    """The CPUs kept busy over ``seconds`` (the whole machine's, from /proc/stat: short-lived processes and the
    hypervisor's steal count too; this process sleeps), and the processes busiest meanwhile."""
    before, busy = _process_cpu(), _Usage.cpu_seconds()
    time.sleep(seconds)
    busy, after = (_Usage.cpu_seconds() - busy) / seconds, _process_cpu()
    used = sorted(((cpu - before.get(key, (0.0,))[0], key[0], command) for key, (cpu, command) in after.items()),
                  reverse=True)
    return busy, [f"pid {pid} {u / seconds:.2f} CPUs: {c}" for u, pid, c in used[:5] if u > 0]


QUIET_WAIT_S = 120


@pytest.fixture(autouse=True)
def quiet_machine(request):
    """A test marked alone compares timings: it starts once no Slurm job of this user is queued or running and
    the machine keeps under a quarter of a CPU busy, waiting up to QUIET_WAIT_S (a scale-tier job still ending,
    say; the test's timeout allows for the wait); after that it fails naming what was busy, because its figures
    would measure it. (The project's CI of ddb483b: bench step read 34% slow, bench scaling on the same box a
    minute later as usual.)"""
    if not request.node.get_closest_marker("alone"):
        return
    deadline, why = time.monotonic() + QUIET_WAIT_S, []
    while time.monotonic() < deadline:
        why = []
        if shutil.which("squeue"):
            try:
                queue = subprocess.run(["squeue", "-h", "--me", "-o", "%i %j %T"], capture_output=True, text=True,
                                       timeout=30)
                why = [f"Slurm job {j}" for j in queue.stdout.splitlines() if j.strip()] if queue.returncode == 0 \
                    else [f"squeue failed: {queue.stderr.strip()}"]
            except subprocess.TimeoutExpired:
                why = ["squeue did not answer in 30 s"]
        busy, top = busy_elsewhere()
        if busy > 0.25:
            why += [f"{busy:.2f} CPUs busy", *top]
        if not why:
            return
    pytest.fail(f"the machine did not quiet down in {QUIET_WAIT_S} s for a test that compares timings:\n  "
                + "\n  ".join(why))


def missing(component: str, why: str):
    """In CI a missing component fails the test; elsewhere it skips with the reason."""
    if IN_CI:
        pytest.fail(f"{component} is required in CI but {why}")
    pytest.skip(f"{component}: {why}")


@pytest.fixture(scope="session", autouse=True)
def no_shm_left_behind():
    """A oneCCL rank that a test kills outright leaves libfabric's 64 MB /dev/shm/PID:UID:N behind (a rank
    that exits removes its own, and the next rank's first communicator those of dead PIDs): remove what is
    left at the end, as a rank would."""
    yield
    from hpcdl.distributed.ccl.group import remove_shm_files

    remove_shm_files()


@pytest.fixture(scope="session")
def slurm():
    if not shutil.which("sbatch"):
        missing("Slurm", "sbatch is not on PATH (make test starts a local Slurm when run as root)")
    try:
        subprocess.run(["sinfo", "-h"], check=True, capture_output=True, timeout=20)
    except (subprocess.SubprocessError, OSError) as exc:
        missing("Slurm", f"sinfo does not answer ({exc}); run 'bash slurm/local/up.sh' as root")
    return True


@pytest.fixture(scope="session")
def two_nodes(slurm):
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True).stdout.split("\n")
    up = [line for line in out if line.split()[1:2] and line.split()[1] in ("idle", "mixed", "allocated")]
    if len(up) < 2:
        missing("two Slurm nodes", f"sinfo shows {out!r}")
    return True


@pytest.fixture(scope="session")
def wide(slurm):
    """The local Slurm's partition wide: 16 idle nodes that share this host's cores (slurm/local/up.sh)."""
    out = subprocess.run(["sinfo", "-h", "-N", "-p", "wide", "-o", "%N %T"], capture_output=True, text=True).stdout
    up = [line for line in out.splitlines() if line.split()[1:2] and line.split()[1] in ("idle", "mixed", "allocated")]
    if len(up) < 16:  # allocated: a job of an earlier test still leaving; the next one queues behind it
        missing("the wide partition", f"sinfo -p wide shows {out!r}; bash slurm/local/up.sh starts it")
    return 16


@pytest.fixture(scope="session")
def mpiexec():
    exe = Path(PYTHON).parent / "mpiexec"
    if not exe.exists():
        missing("MPI", f"{exe} is missing; make venv installs the mpich wheel")
    return str(exe)


def mpi_run(mpiexec: str, *args, n: int = 2, timeout: float = 120) -> subprocess.CompletedProcess:
    """``mpiexec -n N PYTHON ARGS...`` as a job of its own: without the launcher variables pytest runs under, and
    with a port of its own (plain mpiexec gives its ranks nothing to derive one from; tests run side by side)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_", "PMI_"))}
    env["MASTER_PORT"] = str(free_port())
    return subprocess.run([mpiexec, "-n", str(n), PYTHON, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout)


# test rendezvous ports: above slurmd's (7000 + x) and MooseFS's (9419-9422), below the Slurm job steps' (15000-29999,
# hpcdl/distributed/ranks/env.py) and the kernel's ephemeral range (32768-60999), where no connect() takes its port
PORTS, BLOCK = (10000, 15000), 400
_next_port = [0]


def free_port() -> int:
    """A port for a test's rendezvous that nothing takes before its rank 0 binds it: from a block of this pytest
    process's own (xdist worker gwN: block N of 12, from a random place in it), in ``PORTS``, checked free. A port
    bind(0) gave (the ephemeral range) could be taken by any connection another test opened before rank 0 bound it:
    CI's rank 0 failed once with EADDRINUSE (2026-11-29)."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    low = PORTS[0] + BLOCK * (worker % ((PORTS[1] - PORTS[0]) // BLOCK))
    if not _next_port[0]:
        _next_port[0] = int.from_bytes(os.urandom(2), "little") % BLOCK
    for _ in range(BLOCK):
        port, _next_port[0] = low + _next_port[0] % BLOCK, _next_port[0] + 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"free_port: no free port in {low}-{low + BLOCK - 1}")


@contextlib.contextmanager
def held(resource: str):
    """This machine's ``resource`` (the default port, the shaped link) for one test at a time, across xdist workers
    and pytest runs: a lock file under /tmp. The xdist groups (GROUPS) do not hold under pytest 9.2 with
    pytest-xdist 3.8 (pytest-xdist#1386: the group suffix goes into a node ID pytest no longer reads), so a test
    that must not share its resource takes this lock as well."""
    from filelock import FileLock

    with FileLock(os.path.join(tempfile.gettempdir(), f"hpcdl-tests-{resource}.lock")):
        yield


@pytest.fixture
def default_port() -> int:
    """The launchers' default rendezvous port (29500: plain mpiexec, torchrun without --master-port), once free. The
    tests that take it run one after another (held); a process outside them holding it for a minute fails the test
    in CI (skips elsewhere)."""
    from hpcdl.distributed.ranks.env import DEFAULT_PORT

    with held("default-port"):
        deadline = time.monotonic() + 60  # the store of the previous test may still be closing
        while True:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore binds: TIME_WAIT holds nothing
                try:
                    s.bind(("", DEFAULT_PORT))
                    break
                except OSError as exc:
                    if time.monotonic() > deadline:
                        missing("the default port", f"{DEFAULT_PORT} is taken on this machine ({exc}): find its "
                                f"holder with 'ss -ltnp sport = :{DEFAULT_PORT}'")
            time.sleep(1.0)
        yield DEFAULT_PORT


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """torch's env:// variables, as torchrun or a user sets them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "OMPI_", "MPI_"))}
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
    return env


def start_ranks(world: int, args: list[str], tmp_path: Path) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for r in range(world):
        log = open(tmp_path / f"rank{r}.log", "w")
        procs.append(subprocess.Popen([PYTHON, "-m", "hpcdl", *args], env=rank_env(r, world, port),
                                      stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path))
    return procs


def start_long_sweep(tmp_path: Path, timeout_s: float, *extra: str) -> list[subprocess.Popen]:
    """2 ranks in a 1 MB all-reduce loop that would run for minutes, returned once they are inside it (after
    the start-up timeout was shortened to ``timeout_s``): for killing or freezing one of them."""
    procs = start_ranks(2, ["bench", "allreduce", *extra, "--min-bytes", "1M", "--max-bytes", "1M",
                            "--seconds-per-size", "600", "--max-iters", "1000000", "--heartbeat", "0.5",
                            "--timeout", str(timeout_s)], tmp_path)
    deadline = time.time() + 60
    while "collective timeout now" not in (tmp_path / "rank0.log").read_text():
        assert time.time() < deadline and procs[0].poll() is None, (tmp_path / "rank0.log").read_text()
        time.sleep(0.2)
    time.sleep(1.0)  # well inside the timed loop
    return procs


def processes_of(job: str, node: str, step_only: bool = True) -> list[int]:
    """The job's processes that Slurm node ``node`` started (their environment says so); ``step_only``: not the
    batch script's (the supervisor runs there, on the first node)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in env and f"SLURMD_NODENAME={node}".encode() in env and \
                (not step_only or any(e.startswith(b"HPCDL_ATTEMPT=") for e in env)):
            found.append(int(proc.name))
    return found


# The states of a job that has ended (Slurm's IS_JOB_FINISHED); a requeued one shows REQUEUED, then PENDING.
_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
          "DEADLINE"}


def sbatch_wait(script: Path, *extra: str, env: dict | None = None, timeout: int = 240, args: tuple = ()) -> str:
    """Submit with sbatch options ``extra`` and script arguments ``args``, wait for the end, return the job
    id; raise with the output on failure. A job still queued or running when the wait ends (this timeout, or
    pytest's) is cancelled: a hung job would otherwise hold the nodes every later test waits for.

    The job is looked at every 0.5 s with scontrol, as ``sbatch --wait`` would without its back-off: it sleeps
    2, 8, then 32 s between looks (src/sbatch/sbatch.c, _job_wait; MinJobAge 600), so a job of 12 s came back
    after 42 and one of 45 s after 74, time a serial tier of many jobs waited for nothing."""
    tag = f"pytest-{os.getpid()}-{time.monotonic_ns()}"
    sub = subprocess.run(["sbatch", "--parsable", f"--comment={tag}", *extra, str(script), *args],
                         capture_output=True, text=True, env=env, timeout=60)
    if sub.returncode != 0:
        raise AssertionError(f"sbatch failed ({sub.returncode}): {sub.stdout}\n{sub.stderr}")
    job, tasks, ended = sub.stdout.strip().split(";")[0], [], False
    deadline = time.monotonic() + timeout
    try:
        while not ended:
            time.sleep(0.5)
            shown = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30)
            tasks = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in shown.stdout.splitlines()]
            ended = bool(tasks) and all(t.get("JobState") in _ENDED for t in tasks)  # an array: each task's line
            if not ended and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"sbatch job {job} ({script})", timeout)
    finally:
        if not ended:
            _cancel_tagged(tag)
    failed = [t for t in tasks if t.get("JobState") != "COMPLETED"]
    if failed:
        raise AssertionError("; ".join(f"job {t.get('JobId')} ended {t.get('JobState')} (exit code "
                                       f"{t.get('ExitCode')}, reason {t.get('Reason')})" for t in failed)
                             + "".join(_job_output(t) for t in failed))
    return job


def same_states(a, b) -> list[str]:
    """The paths at which two nested state dicts differ (tensors bit for bit, other values by ==): [] when the
    same; a difference of keys is reported as the keys."""
    import torch

    x, y = _flatten_tensors(a), _flatten_tensors(b)
    if x.keys() != y.keys():
        return sorted(x.keys() ^ y.keys())
    return [k for k in x if not (torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) and torch.is_tensor(y[k])
                                 else x[k] == y[k])]


def _flatten_tensors(tree, prefix="") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten_tensors(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in _flatten_tensors(sub, f"{prefix}{i}.").items()}
    return {prefix: tree}


def _job_output(task: dict, lines: int = 60) -> str:
    """The last lines of a job's output file (scontrol's StdOut: the --output of the command line or of the
    script's #SBATCH lines, %j filled in), for the failure's message: a job that failed says why there."""
    path = Path(task.get("StdOut", "") or "/nonexistent")
    text = path.read_text(errors="replace") if path.is_file() else "(not written)"
    return f"\n--- job {task.get('JobId')}'s output, {path}:\n" + "\n".join(text.splitlines()[-lines:])


def _cancel_tagged(tag: str) -> None:
    jobs = subprocess.run(["squeue", "-h", "-o", "%i %k"], capture_output=True, text=True, timeout=30).stdout
    ids = [line.split()[0] for line in jobs.splitlines() if line.split()[1:] == [tag]]
    if ids:
        subprocess.run(["scancel", *ids], timeout=30)


# CPUs whose features the tests make hpcdl's detection report (HPCDL_SIMULATE_CPU_FLAGS): the rules that
# follow the flags are tested on each, whatever CPU the suite runs on. Named as simulations.
SIMULATED_CPUS = {
    "simulated Sapphire Rapids (AMX)": "sse4_2 avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8",
    "simulated Cooper Lake (AVX-512 bf16, no AMX)": "sse4_2 avx2 fma avx512f avx512_bf16",
    "simulated Skylake/Ice Lake (AVX-512, no bf16)": "sse4_2 avx2 fma avx512f avx512bw avx512_vnni",
    "simulated EPYC Zen 3 (AVX2 only)": "sse4_2 avx2 fma",
}


def hpcdl(*args, cwd=None, timeout=300, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m hpcdl ARGS`` as a command of its own: without the launcher variables pytest runs under."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "PMI_"))}
    env.update(extra_env or {})
    return subprocess.run([PYTHON, "-m", "hpcdl", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=env)


def load_json(path: Path) -> dict:
    for _ in range(50):  # the shared filesystem here is local, but be patient like on Lustre
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.1)
    raise AssertionError(f"{path} was not written")


def built_once(tmp_path_factory, worker_id: str, name: str, build) -> Path:
    """A session's dataset, built by ``build(root)`` once for every xdist worker of the run: the first worker to
    ask builds it under a lock in the run's shared temporary folder, the others wait and read it (each built its
    own before: the demo's set cost 63 CPU-s a build, four times in CI). Tests read it, never write it."""
    from filelock import FileLock

    if worker_id == "master":  # no xdist: the folder above basetemp is shared with earlier runs
        root = tmp_path_factory.mktemp(name)
        build(root)
        return root
    root = tmp_path_factory.getbasetemp().parent / name
    with FileLock(f"{root}.lock"):
        if not (root / ".built").exists():
            shutil.rmtree(root, ignore_errors=True)  # a build that died half-way
            root.mkdir(exist_ok=True)
            build(root)
            (root / ".built").touch()
    return root


@pytest.fixture(scope="session")
def data(tmp_path_factory, worker_id) -> Path:
    """Packed synthetic JPEGs for the training tests: 240 training images in 10 classes, in several shards,
    and 29 validation images (an odd number)."""
    from hpcdl.data.pack import PackConfig, pack
    from hpcdl.data.synthetic import generate

    def build(root: Path) -> None:
        train = generate(str(root / "src-train"), classes=10, per_class=24, size=(80, 64), seed=1)
        val = generate(str(root / "src-val"), classes=10, per_class=3, size=(80, 64), seed=2)
        os.unlink(os.path.join(val.root, "n90000009", sorted(os.listdir(os.path.join(val.root, "n90000009")))[0]))
        pack(PackConfig(src=train.root, out=str(root / "train"), shard_size="64K", workers=1))
        pack(PackConfig(src=val.root, out=str(root / "val"), shard_size="64K", workers=1))

    return built_once(tmp_path_factory, worker_id, "train-data", build)


@pytest.fixture(scope="session")
def ccl():
    """hpcdl's oneCCL runtime (make venv runs 'hpcdl ccl install'); in CI its absence fails."""
    from hpcdl.distributed.ccl.library import find_runtime
    from hpcdl.errors import ConfigError

    try:
        return find_runtime()
    except ConfigError as exc:
        missing("oneCCL", str(exc))



@pytest.fixture(scope="session")
def demo_data(tmp_path_factory, worker_id) -> Path:
    """The demo's dataset (``make demo``): 10 synthetic classes, 150 training and 25 validation images each,
    packed at short side 72."""
    from hpcdl.data.images import Encoding
    from hpcdl.data.pack import PackConfig, pack
    from hpcdl.data.synthetic import generate

    def build(root: Path) -> None:
        for split, per_class, seed in (("train", 150, 1), ("val", 25, 2)):
            src = generate(str(root / f"src-{split}"), classes=10, per_class=per_class, seed=seed)
            pack(PackConfig(src=src.root, out=str(root / split), shard_size="1MB", encoding=Encoding(short_side=72),
                            workers=2))

    return built_once(tmp_path_factory, worker_id, "demo-data", build)


FABRIC_STATE = Path(os.environ.get("HPCDL_SLURM_STATE", "/var/tmp/hpcdl-slurm"))


@pytest.fixture(scope="session")
def fabric(slurm) -> float:
    """The local Slurm's shaped partition (slurm/local/fabric.sh): nodes n3 and n4 up; its rate in bytes/s."""
    out = subprocess.run(["sinfo", "-h", "-N", "-p", "fabric", "-o", "%N %T"], capture_output=True, text=True).stdout
    up = [line for line in out.splitlines() if line.split()[1:2] and line.split()[1] in ("idle", "mixed", "allocated")]
    rate = FABRIC_STATE / "hpcdl-fab0.rate"
    if len(up) < 2 or not rate.exists():
        missing("the shaped fabric (partition fabric)", f"sinfo -p fabric shows {out!r} and {rate} "
                f"{'exists' if rate.exists() else 'is missing'}; slurm/local/up.sh starts it as root")
    text = rate.read_text().strip()
    number, unit = text[:-3].rstrip("kmgt"), text[:-3][len(text[:-3].rstrip("kmgt")):]
    return float(number) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[unit] / 8


@pytest.fixture(scope="session")
def shared_fs(fabric) -> Path:
    """The local cluster's shared filesystem (slurm/local/pfs.sh): MooseFS mounted at $STATE/scratch on the host,
    and on n3 and n4 by a client in each node's network namespace (so that their reads cross their own links)."""
    mount = FABRIC_STATE / "scratch"
    mounts = Path("/proc/self/mounts").read_text()
    clients = {node: [p for p in subprocess.run(["ip", "netns", "pids", f"h{node[1:]}"], capture_output=True,
                                                text=True).stdout.split()
                      if Path(f"/proc/{p}/comm").exists() and Path(f"/proc/{p}/comm").read_text().strip() == "mfsmount"]
               for node in ("n3", "n4")}
    if not (FABRIC_STATE / "pfs" / "up").exists() or f" {mount} fuse " not in mounts or not all(clients.values()):
        missing("the shared filesystem", f"{FABRIC_STATE / 'pfs' / 'up'} "
                f"{'exists' if (FABRIC_STATE / 'pfs' / 'up').exists() else 'is missing'}, {mount} is "
                f"{'' if f' {mount} fuse ' in mounts else 'not '}mounted here, the nodes' clients: {clients}; "
                "slurm/local/up.sh starts it as root")
    return mount


@pytest.fixture
def fabric_link(fabric) -> float:
    """The shaped link for this test alone (held): a job measuring its rate beside one training across it measured
    0.84x the rate in CI."""
    with held("fabric-link"):
        yield fabric
