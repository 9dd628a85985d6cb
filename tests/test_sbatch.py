import re
import subprocess
import time

import pytest
from conftest import HOSTILE, PYTHON, REPO, sbatch_wait

from hpcdl.errors import ConfigError
from hpcdl.launch.request import job_request
from hpcdl.launch.sbatch import READY_SCRIPTS, render_sbatch


def script_for(**params) -> str:
    return render_sbatch(job_request(**params), ["bench", "allreduce"])


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_survive_bash(tmp_path, value):
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(job_request(job_name=value, output=f"{tmp_path}/{value}-%j.out",
                                                python=f"/opt/{value}/python"),
                                    ["bench", "allreduce", "--json", f"{value}.json"]))
    subprocess.run(["bash", "-n", str(script)], check=True)
    # bash sees the srun line's arguments exactly as given:
    body = script.read_text().replace("srun --kill-on-bad-exit=1", "printf '%s\\n'")
    body = body.replace("tuning=$(", "tuning=$(true ").replace('eval "$tuning"', "")
    out = subprocess.run(["bash", "-c", body], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "1",
                              "SLURM_JOB_NODELIST": "n1", "SLURM_NTASKS": "1"}).stdout.splitlines()
    assert out[-7:] == [f"/opt/{value}/python", "-m", "hpcdl", "bench", "allreduce", "--json", f"{value}.json"]


@pytest.mark.parametrize("field", ["job_name", "output", "account"])
def test_newline_is_refused_naming_the_field(field):
    with pytest.raises(ConfigError, match=f"{field}=.*newline"):
        job_request(**{field: "a\n0"})


@pytest.mark.parametrize("params,fragment", [
    (dict(profile="stampede2-skx", tasks_per_node=4, cpus_per_task=16), "= 64 CPUs.*48 cores"),
    (dict(profile="stampede2-skx", time="2-00:00:01"), "exceeds the 2-00:00:00 limit"),
    (dict(profile="stampede2-knl", time="49:00:00"), "exceeds"),
    (dict(profile="frontera-clx", nodes=1024), "exceeds the 512 nodes.*large"),
    (dict(profile="local", tasks_per_node=64), "cores"),
    (dict(nodes=0), "nodes=0"),
    (dict(time="soon"), "not a time"),
    (dict(allocator="hoard"), "choose one of"),
    (dict(profile="frontera-clx", nodes=510, spares=4), "nodes=510 \\+ spares=4 exceeds the 512 nodes"),
    (dict(spares=-1), "spares=-1"),
])
def test_impossible_requests_are_rejected_with_the_fix(params, fragment):
    with pytest.raises(ConfigError, match=fragment):
        job_request(**params)


def test_backslash_in_output_path_is_refused_but_kept_in_a_job_name():
    with pytest.raises(ConfigError, match="backslash"):
        job_request(output="a\\b/%j.out")
    assert '#SBATCH --job-name="a\\\\b"' in script_for(job_name="a\\b")


def test_unknown_profile_lists_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        job_request(profile="stampede3")
    for name in ("stampede2-skx", "stampede2-knl", "frontera-clx", "generic", "local"):
        assert name in str(err.value)


def test_unknown_parameter_lists_every_valid_one_with_its_default():
    with pytest.raises(ConfigError) as err:
        job_request(gpus=4)
    assert "gpus" in str(err.value) and "tasks_per_node (default 1)" in str(err.value)


def test_cli_rejects_before_submitting():
    run = subprocess.run([PYTHON, "-m", "hpcdl", "submit", "--profile", "stampede2-skx", "--time", "72:00:00",
                          "--", "bench", "allreduce"], capture_output=True, text=True)
    assert run.returncode == 2 and "exceeds the 2-00:00:00 limit" in run.stderr and "submitted" not in run.stderr


def test_spares_allocate_more_nodes_and_the_supervisor_starts_the_training_step():
    train = ["train", "demo_tiny_lars"]
    text = render_sbatch(job_request(profile="generic", nodes=4, spares=2, tasks_per_node=2), train)
    assert "#SBATCH --nodes=6" in text and "#SBATCH --no-kill" in text and "srun --kill-on-bad-exit" not in text
    assert ('"$HPCDL_PYTHON" -m hpcdl supervise --spares 2 --max-restarts 3 --tasks-per-node 2 -- "$HPCDL_PYTHON" '
            '-m hpcdl train demo_tiny_lars') in text
    # each spare serves a restart: --spares 4 with 3 restarts left one unusable
    assert "--spares 4 --max-restarts 4 " in render_sbatch(job_request(profile="generic", nodes=4, spares=4), train)
    restarts = render_sbatch(job_request(profile="generic", nodes=4, max_restarts=5), train)
    assert "#SBATCH --nodes=4" in restarts and "--spares 0 --max-restarts 5" in restarts
    plain = render_sbatch(job_request(profile="generic", nodes=4), train)
    assert "--no-kill" not in plain and 'srun --kill-on-bad-exit=1 "$HPCDL_PYTHON" -m hpcdl train' in plain
    for command in (["sbatch", "--spares", "1", "--", "bench", "allreduce"],
                    ["submit", "--spares", "1", "--", "train", "demo_tiny_lars"]):
        run = subprocess.run([PYTHON, "-m", "hpcdl", *command], capture_output=True, text=True)
        assert run.returncode == 2 and "--spares" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_the_supervisor_keeps_the_global_batch_and_finds_the_lost_ranks_nodes():
    from hpcdl.launch.nodes import fit_nodes, lost_nodes
    from hpcdl.launch.supervisor import Supervisor

    assert [fit_nodes(n, 2, 60) for n in (6, 5, 4, 3, 1)] == [6, 5, 3, 3, 1]
    assert fit_nodes(4, 2, 7) == 0
    used = ["n11", "n13", "n14"]
    result = {"lost": [2, 3], "lost_where": {"2": "host vm (Slurm node n14), pid 5", "3": "host vm (Slurm node n14), pid 6"}}
    assert lost_nodes(result, used, 2) == ["n14"]
    assert lost_nodes({"lost": [0], "lost_where": {}, "rank0_lost": True}, used, 2) == ["n11"]  # its store went too
    with pytest.raises(Exception, match="leaves no node"):
        Supervisor(rank_command=["x"], run_dir="/tmp", global_batch=8, nodes=["n1", "n2"], tasks_per_node=1, spares=2)


def test_defaults_fill_the_node():
    text = script_for(profile="stampede2-knl", nodes=2, tasks_per_node=4)
    assert "#SBATCH --cpus-per-task=17" in text and "#SBATCH --partition=normal" in text
    assert "MCDRAM" in text


@pytest.mark.parametrize("name", sorted(READY_SCRIPTS))
def test_committed_scripts_match_the_generator(name):
    params, command = READY_SCRIPTS[name]
    assert (REPO / "slurm" / name).read_text() == render_sbatch(job_request(**params), command), \
        "regenerate with: make slurm-scripts"


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_reach_slurm_literally(slurm, tmp_path, value):
    """sbatch's own parser reads the #SBATCH lines back to the same job name and output path."""
    out_dir = tmp_path / value
    out_dir.mkdir()
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(job_request(profile="local", job_name=value, output=f"{out_dir}/%j.out",
                                                python=PYTHON, time="5:00"),
                                    ["env"]))
    # 'hpcdl env' prints JSON; the job must run it, with the name and output that were asked for.
    job = sbatch_wait(script)
    # scontrol, not sacct: slurmdbd stores '"' in job names as '`'.
    shown = subprocess.run(["scontrol", "show", "job", "--oneliner", job], capture_output=True, text=True).stdout
    assert re.search(r"JobName=(.*) UserId=", shown).group(1) == value
    assert '"launcher": "slurm"' in (out_dir / f"{job}.out").read_text()


def test_stage_env_starts_the_ranks_from_a_node_local_copy(two_nodes, tmp_path):
    """hpcdl sbatch --stage-env on 2 nodes: the environment is packed once beside itself, each node unpacks it
    into its own folder, each rank's interpreter runs from its node's copy and imports what the environment holds
    (hpcdl, copied into it) from that copy, and the copies are gone at the end. The venv is a small one of the
    test's own: the suite's is 6 GB of CUDA wheels, so torch and the other packages are reached through a .pth
    file into the suite's site-packages, which stays on the shared filesystem here as it would not in a venv that
    holds its packages."""
    import json
    import shutil
    import site
    import sys

    venv = tmp_path / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    packages = next(venv.glob("lib/python3*/site-packages"))
    shutil.copytree(REPO / "hpcdl", packages / "hpcdl", ignore=shutil.ignore_patterns("__pycache__"))
    (packages / "hpcdl-test.pth").write_text(f"{site.getsitepackages()[0]}\n")
    script, nodes = tmp_path / "staged.sbatch", tmp_path / "node-local"
    made = subprocess.run([PYTHON, "-m", "hpcdl", "sbatch", "--profile", "local", "--nodes", "2", "--time", "5",
                           "--stage-env", "--python", str(venv / "bin" / "python"), "--output", f"{tmp_path}/%j.out",
                           "--write", str(script), "--", "env"], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    env = {**{k: v for k, v in __import__("os").environ.items() if not k.startswith("SLURM_")},
           "HPCDL_STAGE_DIR": str(nodes)}
    outputs = []
    for _ in range(2):
        job = sbatch_wait(script, f"--chdir={tmp_path}", env=env)
        outputs.append((job, (tmp_path / f"{job}.out").read_text()))
    (job, first), (_, second) = outputs
    ranks = [json.loads(line) for line in first.splitlines() if line.startswith("{")]
    assert len(ranks) == 2, first
    stage = nodes / f"hpcdl-env-{job}"
    assert sorted(r["prefix"] for r in ranks) == [str(stage / "n1"), str(stage / "n2")], first
    assert all(r["python"].startswith(r["prefix"] + "/bin/") for r in ranks)
    assert all(r["hpcdl"].startswith(r["prefix"] + "/lib/") for r in ranks), ranks  # not REPO: the node's copy
    assert "packing" in first and "packing" not in second  # the archive is reused until the venv changes
    assert (tmp_path / "venv.hpcdl-env.tar").exists()
    assert not list(stage.iterdir()) if stage.exists() else True  # each node removed its copy


def test_the_supervisors_probe_finds_a_node_without_slurmd_by_its_refused_connection(slurm, monkeypatch):
    """The supervisor asks a suspect node's slurmd for a connection before it asks Slurm for a one-task step
    (which, on a node whose slurmd is gone, srun retries for MessageTimeout): a refused connection is the answer,
    and no srun is started for that node. The addresses are Slurm's own; n26 (partition wide, idle during this
    tier) has its slurmd stopped, then started again."""
    import socket

    from hpcdl.launch import probe
    from hpcdl.launch import supervisor as module

    addresses = probe.slurmd_addresses(["n1", "n3", "n26", "nowhere"])
    assert addresses["n1"] == ("127.0.0.1", 7001) and addresses["n3"] == ("10.77.0.3", 7003)  # slurm/local's
    assert "nowhere" not in addresses
    supervisor = module.Supervisor(rank_command=["x"], run_dir="/tmp", global_batch=8, nodes=["n25", "n26"],
                                   tasks_per_node=1, spares=0)
    started, popen = [], subprocess.Popen

    def recorded(argv, *args, **kwargs):
        started.append(argv)
        return popen(argv, *args, **kwargs)

    subprocess.run(["pkill", "-f", "slurmd -N n26$"], check=True)
    try:
        for _ in range(50):  # until its port is closed
            try:
                socket.create_connection(addresses["n26"], timeout=1).close()
            except ConnectionRefusedError:
                break
            time.sleep(0.1)
        monkeypatch.setattr(module.subprocess, "Popen", recorded)
        assert supervisor._probe(["n26"]) == ["n26"]
        assert not [argv for argv in started if "--nodelist=n26" in argv], started
    finally:
        monkeypatch.undo()
        subprocess.run(["/usr/sbin/slurmd", "-N", "n26"], check=False)
    deadline = time.monotonic() + 60
    while "idle" not in subprocess.run(["sinfo", "-h", "-n", "n26", "-o", "%T"], capture_output=True,
                                       text=True).stdout and time.monotonic() < deadline:
        subprocess.run(["scontrol", "update", "nodename=n26", "state=resume"], capture_output=True)
        time.sleep(1)


def test_each_start_of_a_supervised_job_has_rescue_folders_of_its_own(tmp_path, monkeypatch):
    """A requeue keeps the job id: attempt 1 after it named its rescue folder as attempt 1 before it (job-a1), and
    read the old result.json as its own. Now the start (SLURM_RESTART_COUNT) is in the name, and a folder already
    there is never taken."""
    from hpcdl.launch.supervisor import Supervisor

    names = []
    for count in ("0", "1"):
        monkeypatch.setenv("SLURM_RESTART_COUNT", count)
        sup = Supervisor(rank_command=["x"], run_dir=str(tmp_path), global_batch=8, nodes=["n1", "n2"],
                         tasks_per_node=1, job="77")
        names.append(sup._attempt_name(1))
    assert names == ["77-r0-a1", "77-r1-a1"]
    (tmp_path / "jit" / "77-r1-a1").mkdir(parents=True)
    again = sup._attempt_name(1)
    assert again.startswith("77-r1-a1-") and not (tmp_path / "jit" / again).exists()


def test_a_rescue_naming_a_node_outside_the_step_does_not_end_the_supervisor(slurm, tmp_path, monkeypatch):
    """After a requeue the old rescue's result named a lost node of the old allocation: _diagnose probed it, found
    it dead and removed it from the active list, where it was not (list.remove(x): x not in list), and the batch
    script died. Only the step's own nodes are suspects now: here the step's n1 answers (real srun), and the
    unknown node is ignored. The probe runs inside an allocation of n1, as the supervisor's runs inside its job:
    outside one, its srun asked for n1 anew and queued behind the other Slurm tests' jobs (they run side by side:
    no xdist group holds, docs/contributing.md), and n1 read as lost in two clean-clone CI runs."""
    from hpcdl.launch.supervisor import Supervisor

    granted = subprocess.run(["salloc", "--no-shell", "--nodes=1", "--nodelist=n1", "--time=5", "--job-name=probe-n1"],
                             capture_output=True, text=True, timeout=280)  # waits in the queue for n1
    job = re.search(r"Granted job allocation (\d+)", granted.stderr)
    assert job, granted.stderr
    monkeypatch.setenv("SLURM_JOB_ID", job.group(1))
    try:
        sup = Supervisor(rank_command=["x"], run_dir=str(tmp_path), global_batch=8, nodes=["n1", "n2"],
                         tasks_per_node=1, spares=1, job="77", probe_timeout_s=60.0)  # the busy CI machine's srun
        old = {"lost": [1], "lost_where": {"1": "host vm (Slurm node nowhere), pid 5"}, "step": 3, "checkpoint": None,
               "reports": [{"rank": 0, "time": time.time(), "reason": "lost rank 1: heartbeat stopped"}]}
        event = sup._diagnose(4, old, ["n1"], time.time(), time.time())
    finally:
        subprocess.run(["scancel", job.group(1)], check=False)
    assert event["lost_nodes"] == [] and sup.active == ["n1"] and sup.spare == ["n2"], event


def test_a_start_failed_by_a_silent_dead_node_blames_that_node_not_the_ranks_that_reported(tmp_path, monkeypatch):
    """A node that dies during the rendezvous (before any rescue exists) says nothing: srun reports no task exit
    for it, while its peers' ranks exit 1. Only the nodes that reported were probed and counted a failed start, so
    the dead node stayed and, after a second such start, every healthy node was dropped as 'failed 2 starts'.
    Every node of the step is probed now, and a start whose failure a lost node explains counts against no other.
    The probe's answers are a fake (killing a slurmd is test_the_supervisors_probe_finds_...'s)."""
    from hpcdl.launch.supervisor import Supervisor

    sup = Supervisor(rank_command=["x"], run_dir=str(tmp_path), global_batch=8, nodes=["n1", "n2", "n3", "n4", "n5"],
                     tasks_per_node=1, spares=1, job="78")
    dead = {"n4"}
    monkeypatch.setattr(sup, "_probe", lambda nodes: [n for n in nodes if n in dead])
    monkeypatch.setattr(sup, "_probe_python", lambda nodes: dict.fromkeys(nodes))
    for attempt in range(2):
        use = list(sup.active)
        sup._task_exits, sup._ended_at = [(n, "Exited with exit code 1", time.monotonic()) for n in ("n1", "n2", "n3")], None
        event = sup._diagnose(1, None, use, time.time(), time.time(), trained=False)
        if attempt == 0:
            assert event["lost_nodes"] == ["n4"] and event["spares_taken"] == {"n4": "n5"}, event
            assert not sup.failed_starts, sup.failed_starts
        dead = set()
    assert sup.active == ["n1", "n2", "n3", "n5"], (sup.active, sup.failed_starts)


def test_the_supervisors_watchdog_ends_a_step_whose_train_log_stops(tmp_path):
    """No rank reports when every rank hangs (a filesystem stall, the whole step stopped): nothing ended such a step.
    The watchdog's bound, from the ranks' own timeouts: loop.startup_timeout_s + loop.timeout_s until this start's
    first record in train.jsonl, then max(2 x loop.timeout_s, 3 x the longest gap between records)."""
    from hpcdl.launch.progress import StepLog
    from hpcdl.launch.supervisor import Supervisor

    sup = Supervisor(rank_command=["x"], run_dir=str(tmp_path), global_batch=8, nodes=["n1"], tasks_per_node=1,
                     startup_s=1.0, stall_s=1.0)
    log = tmp_path / "train.jsonl"
    progress = StepLog(str(log))
    assert sup._stuck(progress) is None
    time.sleep(2.2)
    assert "this start trained no step" in sup._stuck(progress)
    for _ in range(3):  # a record every 0.25 s: the bound is then 2 x stall_s (3 x the longest gap is less)
        with log.open("a") as f:
            f.write('{"kind": "step"}\n')
        assert sup._stuck(progress) is None
        time.sleep(0.25)
    assert sup._stuck(progress) is None
    time.sleep(max(2 * sup.stall_s, 3 * progress.longest) + 0.2)
    assert "the watchdog: no record in train.jsonl" in sup._stuck(progress)


def test_the_watchdog_sees_an_evaluation_grow_train_jsonl(tmp_path):
    """A long evaluation wrote nothing to train.jsonl until its end: past the watchdog's bound the supervisor ended
    a healthy step as 'every rank hangs', again at each restart. Now rank 0 writes an "evaluating" record at its
    start and every every_s while it evaluates (the readers of train.jsonl filter by kind)."""
    import json

    import torch

    from hpcdl.launch.progress import StepLog
    from hpcdl.train.evaluate import evaluate
    from hpcdl.train.metrics import RunLog

    runlog = RunLog(str(tmp_path), rank=0, total_steps=1, start_step=0, log_every=1, tensorboard=False)
    progress = StepLog(str(tmp_path / "train.jsonl"))
    progress.idle_s()
    seen = []

    def slow_batches():
        for _ in range(4):
            time.sleep(0.1)
            seen.append(progress.idle_s())  # the watchdog's reading as the evaluation goes on
            yield torch.randn(2, 3), torch.tensor([0, 1])

    evaluate(torch.nn.Linear(3, 2), slow_batches(), progress=runlog.evaluating, every_s=0.15)
    runlog.close()
    assert progress.grew and max(seen) < 0.35, seen  # without the records: idle 0.1, 0.2, 0.3, 0.4 s
    records = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert records[0] == {"kind": "evaluating", "batches": 0, "time": records[0]["time"]} and len(records) >= 2


def test_the_orphan_wait_for_result_ends_with_the_writers_stale_claim(tmp_path):
    """The first node lost and the rescue's write failed (disk full): each survivor waited RESULT_WAIT_S (600 s) for
    a result.json that never came. Now the wait ends when the writer's claim is stale, as the rescue's own wait."""
    import os

    from hpcdl.runs import orphan
    from hpcdl.runs.orphan import CLAIM_STALE_S

    claim = tmp_path / "writer"
    claim.touch()
    old = time.time() - CLAIM_STALE_S - 5
    os.utime(claim, (old, old))
    start = time.monotonic()
    assert orphan._wait_for_result(str(tmp_path)) is None
    assert time.monotonic() - start < 3
