"""A lost rank or node inside a supervised job (hpcdl sbatch --spares K / --max-restarts R): the survivors save
the step they completed, the supervisor swaps a dead node for a spare or restarts on the same nodes, and the
run goes on in the same job with each sample of every epoch trained once. Real Slurm, real processes; a node
is "lost" as a whole: its slurmd, the step's slurmstepd there and its ranks, SIGKILLed (then its slurmd is
started again, as a rebooted node would come back, for the tests after)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import PYTHON, hpcdl, processes_of, same_states, sbatch_wait

from hpcdl.distributed.ranks.hostlist import expand_hostlist

IMAGES, BATCH = 240, 60  # 4 steps an epoch on 1 to 4 ranks (the 4-node + 2-spare jobs set 48: 4 x 12 or 8 x 6)


def script_for(tmp_path: Path, data: Path, run: Path, *, nodes: int, tasks: int, partition: str, name: str,
               spares: int = 0, restarts: int = 3, extra: tuple[str, ...] = ()) -> Path:
    script = tmp_path / f"{name}.sbatch"
    made = hpcdl("sbatch", "--profile", "local", "--partition", partition, "--nodes", nodes, "--spares", spares,
                 "--max-restarts", restarts, "--tasks-per-node", tasks, "--time", 20, "--job-name", name,
                 "--output", f"{tmp_path}/{name}-%j.out", "--python", PYTHON, "--write", script, "--",
                 "train", "demo_tiny_lars", "--set", f"data.train={data / 'train'}", "--set", f"data.val={data / 'val'}",
                 "--set", f"run_dir={run}", "--set", f"global_batch={BATCH}", "--set", "crop=32",
                 "--set", "data.eval_resize=36", "--set", "loop.log_every=1", "--set", "loop.record_samples=true",
                 "--set", "loop.eval_every=0", "--set", "checkpoint.every_minutes=0", *extra)
    assert made.returncode == 0, made.stderr
    return script


def submit(script: Path, tmp_path: Path, env: dict | None = None) -> str:
    return subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", str(script)], capture_output=True, text=True,
                          check=True, env=env).stdout.strip().split(";")[0]


FAKE_SITE = """# A fake, planted by tests/test_spares.py: the Python of a node named by a file broken-NODE beside this one
# fails at start-up (content 'python': always; 'train': hpcdl train only), as on a node that answers srun but
# cannot train (a broken module, a full /tmp). Imported by site.py through PYTHONPATH.
import os, sys
_node = os.environ.get("SLURMD_NODENAME", "")
_mark = os.path.join(os.path.dirname(os.path.abspath(__file__)), "broken-" + _node)
if _node and os.path.exists(_mark) and open(_mark).read().strip() in ("python", "train" if "train" in sys.argv else "-"):
    sys.exit(f"fake: node {_node} cannot start Python (planted by tests/test_spares.py)")
"""


def broken_python_env(tmp_path: Path) -> tuple[dict, Path]:
    """The job's environment with the fake above on PYTHONPATH, and the folder where a test names broken nodes."""
    site = tmp_path / "fake-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAKE_SITE)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}, site


def steps(run: Path) -> list[dict]:
    path = run / "train.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if '"kind": "step"' in line] \
        if path.exists() else []


def wait_for_step(run: Path, count: int, out: Path, after: float = 0.0, timeout: float = 240) -> dict:
    """The first step record numbered ``count`` or more, logged after ``after`` (time.time())."""
    deadline = time.monotonic() + timeout
    while True:
        done = [s for s in steps(run) if s["step"] >= count and s["time"] >= after]
        if done:
            return done[0]
        assert time.monotonic() < deadline, out.read_text()[-4000:] if out.exists() else "no output"
        time.sleep(0.1)


def kill_node(job: str, node: str, whole: bool = False) -> float:
    """SIGKILL node ``node``: its slurmd, the job's step daemon there and the ranks (``whole``: and the batch script,
    the supervisor, and their daemon: the job's first node); returns time.time()."""
    tasks = processes_of(job, node, step_only=not whole)
    stepds = set()
    for pid in tasks:
        try:
            stepds.add(int(Path(f"/proc/{pid}/stat").read_text().split()[3]))
        except OSError:
            pass
    slurmd = subprocess.run(["pgrep", "-f", f"slurmd -N {node}$"], capture_output=True, text=True).stdout.split()
    assert tasks and slurmd, (node, tasks, slurmd)
    # the daemons first: a batch script killed before its step daemon is reported to slurmctld, which ends the job
    # (the test of the first node lost then found no requeue: the survivor was ended with it)
    daemons = sorted(stepds, key=lambda pid: _comm(pid) != "slurmstepd")
    for pid in [*map(int, slurmd), *daemons, *tasks]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return time.time()


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def rank_pid(job: str, rank: int) -> int:
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or b"hpcdl\0train" not in (proc / "cmdline").read_bytes():
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in env and f"SLURM_PROCID={rank}".encode() in env:
            return int(proc.name)
    raise AssertionError(f"rank {rank} of job {job} not found")


def bring_back(nodes: list[str]) -> None:
    """Start the killed nodes' slurmd again and wait until Slurm has them idle."""
    for node in nodes:
        if not subprocess.run(["pgrep", "-f", f"slurmd -N {node}$"], capture_output=True).stdout:
            subprocess.run(["/usr/sbin/slurmd", "-N", node], check=False)
    deadline = time.monotonic() + 120
    while True:
        states = dict(line.split() for line in subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True,
                                                              text=True).stdout.splitlines())
        if all(states.get(n) == "idle" for n in nodes) or time.monotonic() > deadline:
            return
        subprocess.run(["scontrol", "update", f"nodename={','.join(nodes)}", "state=resume"], capture_output=True)
        time.sleep(1)


def job_state(job: str) -> str:
    deadline = time.monotonic() + 60  # the accounting lags behind the job (slurmdbd)
    while not (state := subprocess.run(["sacct", "-n", "-X", "-j", job, "-o", "State,ExitCode", "-P"],
                                       capture_output=True, text=True).stdout.strip()).startswith(("FAILED", "COMPLETED")):
        assert time.monotonic() < deadline, state
        time.sleep(1)
    return state


def scontrol_job(job: str) -> dict:
    shown = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True).stdout
    return dict(f.split("=", 1) for f in shown.split() if "=" in f)


def wait_for_job(job: str, out: Path, timeout: float = 400, requeued: bool = False) -> None:
    """Until the job's batch script has ended (COMPLETING counts: a node the test killed holds the job there until
    it answers again, which is after this wait); ``requeued``: until the job's requeued run has ended, which passes
    through COMPLETING and PENDING on its way."""
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", *(() if requeued else ("COMPLETING",)))
    deadline = time.monotonic() + timeout
    while scontrol_job(job).get("JobState") not in ended:
        assert time.monotonic() < deadline, out.read_text()[-4000:]
        time.sleep(1)


def samples(run: Path) -> Counter:
    return Counter(tuple(map(int, line.split()[:2])) for f in (run / "samples").iterdir()
                   for line in f.read_text().splitlines())


def check_each_sample_once(run: Path, whole_epochs: int) -> None:
    seen = samples(run)
    assert max(seen.values()) == 1, [k for k, v in seen.items() if v > 1][:10]
    for epoch in range(whole_epochs):
        assert sorted(i for e, i in seen if e == epoch) == list(range(IMAGES)), epoch


def lose_nodes(job: str, run: Path, out: Path, kills: int, every: int, killed: list[str]) -> list[dict]:
    """Kill the second node of the step in flight ``kills`` times, ``every`` steps into each start; per loss:
    the node, the kill's time, the first step after it (None after the last). ``killed`` gets each node before its
    kill, for the caller's clean-up when a wait fails."""
    losses = []
    for n in range(kills):
        last = losses[-1]["next"]["step"] if losses else 0
        wait_for_step(run, last + every, out, after=losses[-1]["at"] if losses else 0.0)
        active = json.loads((run / "supervisor.json").read_text())["active"] if (run / "supervisor.json").exists() \
            else None
        used = sorted(active or expand_hostlist(subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"],
                                                               capture_output=True, text=True).stdout.strip()),
                      key=lambda x: int(x[1:]))
        victim = used[1]
        killed.append(victim)
        at = kill_node(job, victim)
        loss = {"node": victim, "at": at}
        losses.append(loss)
        if n < kills - 1 or kills == 1:
            loss["next"] = wait_for_step(run, 0, out, after=at + 1.0)
            print(f"loss {n + 1}: node {victim} killed after step {logged_before(run, at)}; the next step "
                  f"({loss['next']['step']}) "
                  f"trained {loss['next']['time'] - at:.1f} s after the kill")
    return losses


def logged_before(run: Path, at: float) -> int:
    """The last step rank 0 logged before time ``at`` (time.time())."""
    return max(s["step"] for s in steps(run) if s["time"] <= at)


def check_restarts(run: Path, losses: list[dict], spares: list[str | None]) -> dict:
    sup = json.loads((run / "supervisor.json").read_text())
    assert len(sup["restarts"]) >= len(spares), sup
    for loss, event, spare in zip(losses, sup["restarts"], spares):
        assert event["lost_nodes"] == [loss["node"]], (event, loss)
        assert event["spares_taken"] == ({loss["node"]: spare} if spare else {}), event
        # the lost work: at most the step in flight; the next start trains the step after the saved one. The
        # bound is the last step rank 0 logged before the kill's time, not the one the test read before it looked
        # up the node's processes: on the busy CI machine, two steps completed in between (a gloo run, saved 8
        # of "logged 6"). Rank 0 logs a step before it starts the next, so a step completed before the kill but
        # logged after it is the one in flight.
        done = logged_before(run, loss["at"])
        assert done <= event["saved_step"] <= done + 1, (event, loss, done)
        if "next" in loss:
            assert loss["next"]["step"] == event["saved_step"] + 1, (event, loss)
    return sup


@pytest.mark.timeout(900)
def test_a_lost_node_of_four_is_replaced_by_a_spare_twice_then_the_job_goes_on_on_three_and_gives_up_after_three(
        wide, data, tmp_path):
    """gloo, 4 nodes + 2 spares, 1 rank each, global batch 48 (5 steps an epoch), the loader's default read-ahead
    (data.workers=4), in one job: a node lost mid-epoch three times (a spare, the other spare, then 3 nodes: 3 ranks
    of 16 images), and a fourth time past --max-restarts 3, which ends the job naming the newest checkpoint. A new
    job resumes it on 2 nodes of 2 ranks and finishes: every replica identical, each sample of every epoch trained
    once across the five starts. One rank a node, on gloo: with 2 ranks a node on oneCCL (starts of 8, 8, 8 and 6
    ranks) it was the scale tier's longest test (4.2 to 5 min of CI's 40); the test below loses a node of 2
    oneCCL ranks."""
    run = tmp_path / "run"
    extra = ("--set", "loop.backend=gloo", "--set", "epochs=6",
             "--set", "data.workers=4", "--set", "global_batch=48")
    script = script_for(tmp_path, data, run, nodes=4, tasks=1, partition="wide", name="spares", spares=2, extra=extra)
    job = submit(script, tmp_path)
    out = tmp_path / f"spares-{job}.out"
    nodes: list[str] = []
    try:
        losses = lose_nodes(job, run, out, kills=4, every=4, killed=nodes)
        wait_for_job(job, out)
    finally:
        subprocess.run(["scancel", job], check=False)
        bring_back(nodes)
    text = out.read_text()
    allocated = expand_hostlist(text.split(f"hpcdl: job {job} on 6 node(s) (")[1].split(")")[0])
    spares = allocated[4:]
    sup = check_restarts(run, losses, [spares[0], spares[1], None])
    assert f"node {nodes[0]} lost, spare {spares[0]} takes its place" in text, text[-4000:]
    assert f"node {nodes[2]} lost, no spare left" in text and re.search(r": 3 rank\(s\) on n\d", text)
    assert sup["outcome"] == "gave up" and "--max-restarts 3" in sup["why"], sup
    assert job_state(job).startswith("FAILED"), text[-3000:]
    newest = sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1]
    assert f"Newest checkpoint: {newest}" in text
    # a new job goes on from it, on 2 nodes, to the end
    again = script_for(tmp_path, data, run, nodes=2, tasks=2, partition="wide", name="again", extra=extra)
    sbatch_wait(again, f"--chdir={tmp_path}", timeout=400)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["replicas"] == "identical on 4 ranks (sha256 of the weights)"
    check_each_sample_once(run, whole_epochs=6)
    numbers = [s["step"] for s in steps(run)]
    assert sorted(set(numbers)) == list(range(1, 6 * 5 + 1))
    assert len(numbers) - len(set(numbers)) <= 4  # each loss trained at most the step in flight again


@pytest.mark.timeout(600)
def test_a_lost_node_of_two_oneccl_ranks_is_replaced_by_a_spare_within_the_job(wide, data, ccl, tmp_path):
    """oneCCL (the default backend), 4 nodes + 2 spares, 2 ranks each: one node lost mid-epoch, both its ranks; the
    same job goes on on a spare to the end, with the time from the kill to the next step printed, every replica
    identical and each sample once. The first spare answers srun but its Python fails at start-up (a fake,
    FAKE_SITE): the supervisor's probe at its start (the ranks' Python importing hpcdl's trainer) finds it, and it
    is skipped and named for the second. Before, the supervisor took it, its start failed before any rescue existed,
    and the job restarted on it to its budget. The data comes through the node cache (data.cache=node): the lost
    node's agent goes with it, the spare's starts empty, and each sample is still trained once. The optimizer is
    sharded (optimizer.shard): the just-in-time checkpoint is whole, the lost ranks' share of the state from the
    periodic checkpoint of step 4."""
    run = tmp_path / "run"
    script = script_for(tmp_path, data, run, nodes=4, tasks=2, partition="wide", name="node", spares=2,
                        extra=("--set", "loop.backend=ccl", "--set", f"loop.ccl_lib={ccl.library.parent}",
                               "--set", "epochs=3", "--set", "global_batch=48",
                               "--set", "data.cache=node", "--set", "optimizer.shard=true",
                               "--set", "checkpoint.every_steps=4"))
    env, fake = broken_python_env(tmp_path)
    (fake / "broken-n15").write_text("python")
    script.write_text(script.read_text().replace("#SBATCH --nodes=6", "#SBATCH --nodes=6\n#SBATCH --nodelist=n[11-16]"))
    job = submit(script, tmp_path, env=env)
    out = tmp_path / f"node-{job}.out"
    nodes: list[str] = []
    try:
        losses = lose_nodes(job, run, out, kills=1, every=6, killed=nodes)
        wait_for_job(job, out)
    finally:
        subprocess.run(["scancel", job], check=False)
        bring_back(nodes)
    text = out.read_text()
    skipped, spare = expand_hostlist(text.split(f"hpcdl: job {job} on 6 node(s) (")[1].split(")")[0])[4:]
    assert skipped == "n15" and "spare n15 skipped: its Python cannot start the ranks" in text, text[-4000:]
    assert "fake: node n15 cannot start Python" in json.loads((run / "supervisor.json").read_text())["spares_skipped"]["n15"]
    check_restarts(run, losses, [spare])
    [result] = [json.loads(p.read_text()) for p in (run / "jit").glob("*/result.json")]
    account = result["optimizer_state"]  # the saved step, 6 or 7: no periodic checkpoint of its own
    assert result["written"] and account["checkpoint"].endswith("ckpt-000000004.pt"), result
    assert account["from_checkpoint"] > 0 and account["current"] > 0 and account["fresh"] == 0, account
    assert f"node {nodes[0]} lost, spare {spare} takes its place" in text and "from the first report of the loss" in text
    assert job_state(job).startswith("COMPLETED"), text[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["replicas"] == "identical on 8 ranks (sha256 of the weights)" and summary["steps"] == 15
    check_each_sample_once(run, whole_epochs=3)
    assert re.search(r"data cache, epoch \d's start, since the last: 4 node\(s\)", text), text[-4000:]


@pytest.mark.timeout(600)
def test_a_killed_rank_and_a_stopped_one_restart_on_the_same_nodes_from_a_valid_just_in_time_checkpoint(
        two_nodes, data, tmp_path):
    """gloo, 2 nodes x 1 rank, --max-restarts 2: rank 1 SIGKILLed (its node healthy), then the restarted rank 1
    SIGSTOPped (no error anywhere: rank 0's watch finds its heartbeat stopped). Each time the job goes on on
    the same nodes; the first just-in-time checkpoint equals, bit for bit, the periodic checkpoint a fault-free
    job writes at the same step. Then the time limit's signal (USR2, sent by hand): the ranks checkpoint and the
    job requeues itself; in the requeued start n2's Python fails in start-up (a fake, FAKE_SITE) twice, and the
    supervisor drops n2 (never a third start on it) and finishes on n1. Before, the requeued start's rescue
    folders were the first start's (job-a1, job-a2), read as its own; and a node that failed its starts was used
    until the budget was spent."""
    run, reference = tmp_path / "run", tmp_path / "reference"
    extra = ("--set", "loop.backend=gloo", "--set", "epochs=6", "--set", "data.workers=4", "--set", "global_batch=16",
             "--set", "data.reserve_cores=0",  # the same threads in every start: bitwise comparable
             "--set", "checkpoint.keep=8")  # the first just-in-time checkpoint is still there at the end
    script = script_for(tmp_path, data, run, nodes=2, tasks=1, partition="debug", name="rank", restarts=2, extra=extra)
    env, fake = broken_python_env(tmp_path)
    job = submit(script, tmp_path, env=env)
    out = tmp_path / f"rank-{job}.out"
    try:
        wait_for_step(run, 6, out)
        os.kill(rank_pid(job, 1), signal.SIGKILL)
        killed = time.time()
        first = wait_for_step(run, 0, out, after=killed + 1.0)
        wait_for_step(run, first["step"] + 5, out)
        os.kill(rank_pid(job, 1), signal.SIGSTOP)
        stopped = time.time()
        second = wait_for_step(run, 0, out, after=stopped + 1.0, timeout=120)
        print(f"kill -9: next step {first['time'] - killed:.1f} s after; SIGSTOP: {second['time'] - stopped:.1f} s")
        sup = json.loads((run / "supervisor.json").read_text())  # the requeued start writes its own
        (fake / "broken-n2").write_text("train")
        subprocess.run(["scancel", "--signal=USR2", job], check=True)  # the time limit's signal
        wait_for_job(job, out, requeued=True)
    finally:
        subprocess.run(["scancel", job], check=False)
    text = out.read_text()
    assert job_state(job).startswith("COMPLETED"), text[-3000:]
    assert [e["lost_nodes"] for e in sup["restarts"]] == [[], []], sup
    assert [e["healthy_suspects"] for e in sup["restarts"]] == [["n2"], ["n2"]], sup
    assert "answer: the same nodes again" in text and "lost rank 1 (host" in text and "no step completed for" in text
    # the requeued start: its own rescue folders; n2 failed two starts and was dropped, the run finished on n1
    after = json.loads((run / "supervisor.json").read_text())
    assert after["start"] == 2 and after["failed_starts"] == {"n2": 2} and after["active"] == ["n1"], after
    assert [e["trained"] for e in after["restarts"]] == [False, False], after
    assert f"step {job}-r1-a3: 1 rank(s) on n1" in text and "node n2 failed 2 starts in start-up, not used again" in text
    assert json.loads((run / "summary.json").read_text())["replicas"].startswith("identical on 1 ranks")
    check_each_sample_once(run, whole_epochs=6)
    # the first just-in-time checkpoint against a fault-free run's periodic checkpoint of the same step
    import torch

    saved = sup["restarts"][0]["saved_step"]
    jit = torch.load(sup["restarts"][0]["checkpoint"], map_location="cpu", weights_only=True)
    assert jit["counters"]["step"] == saved and jit["jit"]["lost"] == [1] and jit["rng"][1] is None
    plain = script_for(tmp_path, data, reference, nodes=2, tasks=1, partition="debug", name="reference",
                       extra=(*extra, "--set", f"loop.max_steps={saved}"))
    sbatch_wait(plain, f"--chdir={tmp_path}", timeout=300)
    ref = torch.load(reference / "checkpoints" / f"ckpt-{saved:09d}.pt", map_location="cpu", weights_only=True)
    if jit["sampler"]["epoch"] == ref["sampler"]["epoch"] + 1:
        # saved at an epoch's last step (it happened in CI): the rescue's boundary was taken as the epoch turned and
        # names the next epoch's start, the fault-free run's checkpoint of that step the epoch's end: one place
        s = ref["sampler"]
        assert jit["sampler"]["position"] == 0 and s["position"] * s["num_replicas"] >= s["total"], (jit["sampler"], s)
        jit["sampler"] = {**jit["sampler"], "epoch": s["epoch"], "position": s["position"]}
    for part in ("model", "optimizer", "schedule", "sampler"):
        assert same_states(jit[part], ref[part]) == [], part


@pytest.mark.timeout(300)
def test_the_first_node_lost_requeues_the_job_which_resumes_from_the_survivors_checkpoint(wide, data, tmp_path):
    """gloo, 2 nodes x 1 rank, supervised: the first node (the batch script, the supervisor, rank 0, its slurmd and
    step daemons) SIGKILLed mid-epoch. The survivor saves the step just in time, finds the supervisor's beat stopped
    and requeues the job within 60 s of its result (before: the job stayed RUNNING with no process until its time
    limit). The node comes back (as after a reboot); the requeued job's rescue folders are its own, it resumes from
    the survivor's checkpoint and finishes: replicas identical, each sample of every epoch trained once."""
    run = tmp_path / "run"
    script = script_for(tmp_path, data, run, nodes=2, tasks=1, partition="wide", name="first", restarts=1,
                        extra=("--set", "loop.backend=gloo", "--set", "epochs=3"))
    job = submit(script, tmp_path)
    out = tmp_path / f"first-{job}.out"
    first = None
    try:
        wait_for_step(run, 3, out)
        first = expand_hostlist(scontrol_job(job)["NodeList"])[0]
        at = kill_node(job, first, whole=True)
        folder = run / "jit" / f"{job}-r0-a1"
        deadline = time.monotonic() + 120
        while not (folder / "orphan.json").exists():
            assert time.monotonic() < deadline, out.read_text()[-4000:]
            time.sleep(0.2)
        bring_back([first])
        wait_for_job(job, out, timeout=180, requeued=True)  # COMPLETING until the node answers, PENDING, the run
    finally:
        subprocess.run(["scancel", job], check=False)
        if first:
            bring_back([first])
    text = out.read_text()
    result = json.loads((folder / "result.json").read_text())
    orphan = json.loads((folder / "orphan.json").read_text())
    print(f"first node {first} killed; the survivor's result {result['time'] - at:.1f} s after, the requeue "
          f"{orphan['time'] - result['time']:.1f} s after that")
    assert result["lost"] == [0] and result["checkpoint"] and orphan["action"] == "requeue", (result, orphan)
    assert orphan["time"] - result["time"] < 60
    shown = scontrol_job(job)
    assert shown["JobState"] == "COMPLETED" and shown["Restarts"] == "1", shown
    assert f"step {job}-r1-a1:" in text, text[-4000:]  # the survivor's log went with srun, on the lost node
    assert json.loads((run / "supervisor.json").read_text())["start"] == 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["replicas"].startswith("identical on 2 ranks"), summary
    check_each_sample_once(run, whole_epochs=3)
    assert sorted({s["step"] for s in steps(run)}) == list(range(1, 13))
