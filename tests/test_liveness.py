"""Liveness that does not hang on rank 0: rank 0 serves the rendezvous store the heartbeats go through, and a
stopped rank 0 is a server that accepts a request and never answers it (a TCPStore client's timeout bounds its
connection and its waits for a key, not that). Every probe's request is bounded; a stopped or killed rank 0 is
found by the others like any rank, from the start's first step on, and the survivors save the last step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import PYTHON, free_port
from test_spares import check_each_sample_once, job_state, script_for, steps, submit, wait_for_job, wait_for_step

from hpcdl.distributed.ranks.env import RankEnv


def _store_server(port: int) -> subprocess.Popen:
    """A process serving a TCPStore on ``port``, as rank 0 does, with rank 1's heartbeat key in it."""
    code = ("import time; from datetime import timedelta; import torch.distributed as d\n"
            f"s = d.TCPStore('127.0.0.1', {port}, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)\n"
            "s.set('hpcdl/hb/1', '1'); s.set('ready', '1'); time.sleep(120)\n")
    server = subprocess.Popen([PYTHON, "-c", code])
    import torch.distributed as dist

    dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)).wait(["ready"])
    return server


def _rank_1(port: int) -> RankEnv:
    return RankEnv(launcher="test", rank=1, world_size=2, local_rank=0, local_size=1, node_rank=0, nodes=1,
                   master_addr="127.0.0.1", master_port=port, hostname="here", job_id=None, restart_count=0)


@pytest.mark.ranks
def test_a_probe_of_a_stopped_rank_0s_store_says_so_within_its_deadline():
    """Before the bound, the probe's request to the stopped server never returned (the watch thread and the
    oneCCL watchdog waited for ever: issue 44's hang of ten minutes)."""
    from hpcdl.distributed.group.liveness import Heartbeat

    port = free_port()
    server = _store_server(port)
    try:
        env = _rank_1(port)
        beat = Heartbeat(env, interval_s=0.4)
        server.send_signal(signal.SIGSTOP)
        found, started = {}, time.monotonic()
        probe = threading.Thread(target=lambda: found.update(watch=beat.watch(), lost=beat.lost_ranks(),
                                                            who=beat.who(0)), daemon=True)
        probe.start()
        probe.join(30)
        assert not probe.is_alive(), "a probe of a stopped store did not return within 30 s"
        assert found == {"watch": None, "lost": None, "who": "host unknown"}, found
        # three probes, each bounded by its deadline (5 s): connection, two reads
        assert time.monotonic() - started < 3 * 2 * beat.deadline_s + 5
    finally:
        server.kill()
        server.wait()
        if "beat" in locals():
            beat.stop()  # its thread would beat on against the dead store for the worker's life


@pytest.mark.ranks
def test_the_heartbeat_beats_on_after_a_failed_request():
    """A failed request (the store busy past the client's timeout, once) used to end the heartbeat thread for
    good: the others then named this rank lost at their next stall."""
    from hpcdl.distributed.group.liveness import Heartbeat

    port = free_port()
    server = _store_server(port)
    try:
        env = _rank_1(port)
        beat = Heartbeat(env, interval_s=0.2)
        failed = {"n": 0}
        add = beat._store.add

        def fails_once(key, value):  # a fake: the one failed request a real store gives only under load
            if not failed["n"]:
                failed["n"] += 1
                raise RuntimeError("fake: the store timed out once")
            return add(key, value)

        beat._store = type("Once", (), {"add": staticmethod(fails_once), "timeout": beat._store.timeout})()
        sent = beat.use.heartbeat
        time.sleep(2.0)
        assert failed["n"] == 1 and beat.use.heartbeat >= sent + 3, (failed, sent, beat.use.heartbeat)
    finally:
        server.kill()
        server.wait()
        if "beat" in locals():
            beat.stop()


def test_a_waiter_polls_the_heartbeats_without_blocking_one_probe_at_a_time():
    """A probe lasts a window or two of the heartbeats. The oneCCL wait ran it inline (no timeout checked
    meanwhile) and the watchdog started one every 6 s whether the last had ended or not (two probes of one slow
    store counted it twice: 'rank 0's store no longer answers')."""
    from hpcdl.distributed.group.comm_thread import Liveness

    release, calls = threading.Event(), []

    def slow_probe():
        calls.append(time.monotonic())
        release.wait(10)
        return "heartbeat stopped on rank 3"

    liveness = Liveness(slow_probe, after_s=0.2)
    assert liveness.poll(0.1) is None and not calls  # not past after_s
    started = time.monotonic()
    assert liveness.poll(0.3) is None
    for _ in range(10):  # polled every 0.1 s while the probe runs: none blocks, no second probe starts
        time.sleep(0.1)
        assert liveness.poll(0.4) is None
    assert time.monotonic() - started < 5 and len(calls) == 1, calls
    release.set()
    deadline = time.monotonic() + 5
    while (found := liveness.poll(time.monotonic() - started + 0.3)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert found == "heartbeat stopped on rank 3"
    # a wait that began after that probe started does not take its finding: it asks anew
    assert liveness.poll(0.25) is None
    time.sleep(0.1)
    assert len(calls) == 2


def _env(rank: int, world: int, port: int) -> RankEnv:
    return RankEnv(launcher="test", rank=rank, world_size=world, local_rank=0, local_size=1, node_rank=rank,
                   nodes=world, master_addr="127.0.0.1", master_port=port, hostname="here", job_id=None,
                   restart_count=0)


@pytest.mark.ranks
def test_a_probe_names_a_stopped_heartbeat_not_one_held_up_by_the_store_or_for_one_window(caplog, monkeypatch):
    """The store's clock, not the wall's: CI's 32 ranks on 2 cores saw rank 0's store held up 6 s by the
    rendezvous, every counter still at once, and a probe of one 5 s window named rank 0, then rank 24, lost:
    the job ended with status 4. A probe names a rank whose counter stood still while its own rank's went on by
    three beats, and the watch only a rank that stood still in both of its windows; rank 0, while the store it
    serves answers, only after its grace (a 16-rank rehearsal's rank 0 starved 20 s was taken for lost)."""
    from hpcdl.distributed.group.liveness import Heartbeat

    port = free_port()
    server = _store_server(port)
    beats: dict[int, Heartbeat] = {}
    try:
        beats = {r: Heartbeat(_env(r, 4, port), interval_s=0.4) for r in range(4)}
        # the store stalls (SIGSTOP of its process) for 2.5 s, longer than a window, shorter than a request's
        # deadline, right after the probe's first read: every counter stands still together
        bounded, reads = beats[1]._bounded, []

        def stalls_after_the_first_read(request):
            value = bounded(request)
            if not reads:
                server.send_signal(signal.SIGSTOP)
                threading.Timer(2.5, server.send_signal, (signal.SIGCONT,)).start()
            reads.append(time.monotonic())
            return value

        beats[1]._bounded = stalls_after_the_first_read
        assert beats[1]._measure([0, 2, 3]) == [] and len(reads) >= 3, reads
        del beats[1]._bounded

        beats[3].stop()  # rank 3 stops: the rank before it names it, rank 1 (ring 0 and 2) finds nothing
        assert beats[2].watch() == [3]
        assert beats[1].watch() == []

        # rank 3 beats again after the watch's first window: still in one window only, no loss
        measure, windows = beats[2]._measure, []

        def resumes_after_the_first_window(ranks):
            found = measure(ranks)
            if not windows:
                def beat_on():
                    while len(windows) < 2:
                        beats[2]._store.add("hpcdl/hb/3", 1)
                        time.sleep(0.2)
                threading.Thread(target=beat_on, daemon=True).start()
            windows.append(found)
            return found

        beats[2]._measure = resumes_after_the_first_window
        assert beats[2].watch() == [] and windows[0] == [3] and windows[1] == [], windows
        del beats[2]._measure

        # rank 1 stops as well (a node of two lost): the ring's rank 3 names the loss, rank 1 is read once more
        beats[1].stop()
        assert beats[2].watch() == [1, 3]

        # rank 0's heartbeat stops while the store answers: where rank 0 serves the store, its process lives (its
        # threads starved): not named within its grace, and said; named after it (rank 0 hung); under torchrun (the
        # agent serves the store) named at once
        beats[0].stop()
        beats[2].rank0_grace_s = 4.0  # a minute in a job; a probe's window here is about 1 s
        with caplog.at_level("WARNING", logger="hpcdl.distributed.group.liveness"):
            assert beats[2].watch() == [1, 3]
        assert "rank 2: rank 0's heartbeat has stood still for" in caplog.text
        time.sleep(4.0)
        assert beats[2].watch() == [0, 1, 3]
        beats[2].rank0_grace_s = 600.0
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        assert beats[2]._measure([0, 1, 3]) == [0, 1, 3]
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")

        # rank 2's own heartbeat stopped too (its thread starved): its counter is the probe's clock, and a probe
        # that has none names no one, after ten intervals, and says why
        beats[2].stop()
        with caplog.at_level("WARNING", logger="hpcdl.distributed.group.liveness"):
            assert beats[2]._measure([3]) == []
        assert "rank 2: its own heartbeat did not reach rank 0's store" in caplog.text
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()
        for beat in beats.values():
            beat.stop()


# -- must-show: a stopped, then a killed rank 0 in a supervised job of 4 nodes + 1 spare ------------------------------

def _freeze(pid: int, sig: int) -> list[int]:
    """Send ``sig`` to ``pid`` and its children (the loader's workers); returns them."""
    group = [pid, *map(int, subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split())]
    for p in group:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    return group


def _rank_0_pid(job: str) -> int:
    """Rank 0 of the job's newest training step (the batch script and the supervisor have SLURM_PROCID=0 too; rank
    0's loader workers have its command line and environment, and where pids wrap around a worker can come first in
    /proc: rank 0 is the one whose parent is none of them)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes() if proc.name.isdigit() else b""
            if b"hpcdl\0train" not in args or b"python" not in args.split(b"\0")[0]:  # not srun, which has both
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
            status = (proc / "status").read_text()
            started = int((proc / "stat").read_text().rpartition(")")[2].split()[19])
        except (OSError, ValueError, IndexError):
            continue
        if f"SLURM_JOB_ID={job}".encode() in env and b"SLURM_PROCID=0" in env and \
                any(e.startswith(b"HPCDL_ATTEMPT=") for e in env):
            found[int(proc.name)] = (int(status.split("PPid:")[1].split()[0]), started)
    ranks = [pid for pid, (parent, _) in found.items() if parent not in found]
    if ranks:
        return max(ranks, key=lambda pid: found[pid][1])
    raise AssertionError(f"rank 0 of job {job} not found")


def _rescue_after(run: Path, at: float, out: Path, timeout: float = 120) -> dict:
    """The rescue result written after ``at`` (time.time())."""
    deadline = time.monotonic() + timeout
    while True:
        for path in (run / "jit").glob("*/result.json") if (run / "jit").exists() else []:
            result = json.loads(path.read_text())
            if result["time"] > at:
                return result
        assert time.monotonic() < deadline, out.read_text()[-4000:] if out.exists() else "no output"
        time.sleep(0.2)


def _rank_0_stopped_then_killed(data: Path, tmp_path: Path, backend: tuple[str, ...], name: str) -> None:
    """One job, 4 nodes + 1 spare, 1 rank each, 3 epochs of 4 steps, a periodic checkpoint every 5 steps: rank 0
    (with its loader's workers) SIGSTOPped at step 3 of the first start (no checkpoint on disk yet), then rank 0
    SIGKILLed at step 3 of the restart (after the periodic checkpoint of step 5). Each time the survivors save
    the last step within 60 s, the job goes on in its allocation, and it ends with every replica identical and
    each sample of every epoch trained once."""
    run = tmp_path / "run"
    script = script_for(tmp_path, data, run, nodes=4, tasks=1, partition="wide", name=name, spares=1, restarts=2,
                        extra=(*backend, "--set", "epochs=3", "--set", "data.workers=2",
                               "--set", "checkpoint.every_steps=5"))
    job = submit(script, tmp_path)
    out = tmp_path / f"{name}-{job}.out"
    frozen: list[int] = []
    try:
        wait_for_step(run, 3, out)
        frozen = _freeze(_rank_0_pid(job), signal.SIGSTOP)
        stopped = time.time()
        first = _rescue_after(run, stopped, out)
        assert first["rank0_lost"] and first["time"] - stopped < 60, first
        logged = max(s["step"] for s in steps(run) if s["time"] <= stopped)
        assert logged <= first["step"] <= logged + 1, (first, logged)  # at most the step rank 0 had not logged
        restart = wait_for_step(run, first["step"] + 1, out, after=stopped + 1.0)
        wait_for_step(run, first["step"] + 3, out, after=restart["time"])
        assert (run / "checkpoints" / "ckpt-000000005.pt").exists()
        _freeze(_rank_0_pid(job), signal.SIGKILL)
        killed = time.time()
        second = _rescue_after(run, killed, out)
        assert second["rank0_lost"] and second["time"] - killed < 60, second
        print(f"{name}: stopped rank 0 saved step {first['step']} {first['time'] - stopped:.1f} s after; killed rank 0 "
              f"saved step {second['step']} {second['time'] - killed:.1f} s after", file=sys.stderr)
        wait_for_job(job, out)
    finally:
        subprocess.run(["scancel", job], check=False)
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = out.read_text()
    assert job_state(job).startswith("COMPLETED"), text[-3000:]
    sup = json.loads((run / "supervisor.json").read_text())
    assert [e["saved_step"] for e in sup["restarts"]] == [first["step"], second["step"]], sup
    summary = json.loads((run / "summary.json").read_text())
    assert summary["replicas"].startswith("identical on 4 ranks") and summary["steps"] == 12, summary
    check_each_sample_once(run, whole_epochs=3)


@pytest.mark.timeout(600)
def test_rank_0_stopped_then_killed_on_gloo_the_survivors_save_and_the_job_goes_on(wide, data, tmp_path):
    _rank_0_stopped_then_killed(data, tmp_path, ("--set", "loop.backend=gloo"), "rank0-gloo")


@pytest.mark.timeout(600)
def test_rank_0_stopped_then_killed_on_oneccl_the_survivors_save_and_the_job_goes_on(wide, data, ccl, tmp_path):
    _rank_0_stopped_then_killed(data, tmp_path, ("--set", "loop.backend=ccl",
                                                 "--set", f"loop.ccl_lib={ccl.library.parent}"), "rank0-ccl")


# -- launchers: mpiexec ends every rank at a rank's death unless told not to ----------------------------------------

def _hydra(mpiexec: str, *args: str, n: int) -> list[str]:
    return [mpiexec, *args, "-n", str(n)]


def _mpi_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_", "PMI_"))}
    env["MASTER_PORT"] = str(free_port())
    return env


@pytest.mark.parametrize("flags, warned", [((), True), (("-disable-auto-cleanup",), False)])
def test_hpcdl_reads_whether_mpiexec_ends_every_rank_at_a_rank_s_death(mpiexec, flags, warned):
    code = ("from hpcdl.distributed.ranks.env import discover, launcher_ends_survivors\n"
            "print(launcher_ends_survivors(discover()))")
    run = subprocess.run([*_hydra(mpiexec, *flags, n=1), PYTHON, "-c", code], capture_output=True, text=True,
                         env=_mpi_env(), timeout=60)
    assert run.returncode == 0, run.stderr
    assert ("mpiexec -disable-auto-cleanup" in run.stdout) == warned, run.stdout


def test_under_mpiexec_disable_auto_cleanup_a_killed_rank_leaves_the_survivor_to_save(mpiexec, data, tmp_path):
    """2 ranks under MPICH's mpiexec -disable-auto-cleanup, one per proxy as on two nodes, rank 1 SIGKILLed at step
    3: rank 0 saves step 3 and exits 4 (without the flag mpiexec ended rank 0 at once, exit 9, nothing saved;
    with it, MPICH 5.0.2's proxy still ends the ranks of the killed one's own node)."""
    run = tmp_path / "run"
    hydra = _hydra(mpiexec, "-disable-auto-cleanup", "-hosts", "localhost,127.0.0.1", "-ppn", "1", n=2)
    cmd = [*hydra, PYTHON, "-m", "hpcdl", "train", "demo_tiny_lars",
           "--set", f"data.train={data / 'train'}", "--set", f"data.val={data / 'val'}", "--set", f"run_dir={run}",
           "--set", "global_batch=24", "--set", "crop=32", "--set", "data.eval_resize=36", "--set", "loop.log_every=1",
           "--set", "loop.eval_every=0", "--set", "checkpoint.every_minutes=0", "--set", "loop.backend=gloo",
           "--set", "data.workers=0"]
    out = tmp_path / "mpiexec.out"
    with open(out, "w") as log:  # two proxies: "2 nodes" to hpcdl, which then needs the rendezvous host
        env = {**_mpi_env(), "MASTER_ADDR": "127.0.0.1"}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        wait_for_step(run, 3, out, timeout=120)
        victim = next(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _rank_of(p, proc.pid) == 1)
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    text = out.read_text()
    result = _rescue_after(run, killed, out, timeout=1)
    assert result["step"] >= 3 and result["checkpoint"] and result["lost"] == [1], result
    assert code != 0 and "rank 0 stops (status 4)" in text and "ends every rank at once" not in text, text[-3000:]


def _rank_of(proc: Path, launcher: int) -> int | None:
    """The PMI_RANK of a process under the mpiexec ``launcher`` (its grandchild), else None."""
    try:
        parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        grand = int(Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[1])
        if grand != launcher:
            return None
        env = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
    except (OSError, ValueError):
        return None
    return int(env[b"PMI_RANK"]) if b"PMI_RANK" in env else None
