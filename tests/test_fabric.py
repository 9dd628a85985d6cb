"""On the local Slurm's shaped fabric (slurm/local/fabric.sh): nodes n3 and n4 in their own network
namespaces, their links shaped by tc tbf. A job's ranks cross a real, rate-limited link."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, hpcdl, load_json, missing, sbatch_wait

from hpcdl.launch import job_request
from hpcdl.launch.sbatch import render_sbatch

FABRIC_SH = REPO / "slurm" / "local" / "fabric.sh"


@pytest.mark.slurm  # root: slurm/local/fabric.sh makes namespaces, a bridge and shaped links
def test_a_second_fabric_comes_up_shaped_and_goes_down_leaving_nothing(tmp_path):
    if os.geteuid() != 0:
        missing("root", "network namespaces and tc need it")
    env = {**os.environ, "FABRIC_BRIDGE": "hpcdl-fabt", "FABRIC_NET": "10.77.7", "FABRIC_NODES": "37 38",
           # nodes outside n3..n10 (up.sh's FABRIC_NODES), so that a running 8-node fabric keeps its own
           "HPCDL_SLURM_STATE": str(tmp_path)}

    def listing() -> str:
        return "".join(subprocess.run(cmd, capture_output=True, text=True).stdout
                       for cmd in (["ip", "netns", "list"], ["ip", "-br", "link"]))

    before = listing()
    up = subprocess.run(["bash", FABRIC_SH, "up", "300mbit"], env=env, capture_output=True, text=True, timeout=60)
    try:
        assert up.returncode == 0, up.stderr
        assert "h37" in listing() and "hpcdl-fabt" in listing()
        shaped = subprocess.run(["tc", "-n", "h38", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout
        assert "tbf" in shaped and "rate 300Mbit" in shaped, shaped
        hosts = Path("/etc/netns/h37/hosts").read_text()
        assert "10.77.7.37 n37" in hosts and "10.77.7.38 n38" in hosts
        bad = subprocess.run(["bash", FABRIC_SH, "rate", "fast"], env=env, capture_output=True, text=True)
        assert bad.returncode != 0 and "rate 'fast'" in bad.stderr and "1gbit" in bad.stderr
    finally:
        down = subprocess.run(["bash", FABRIC_SH, "down"], env=env, capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr
    assert listing() == before
    assert not Path("/etc/netns/h37").exists() and not (tmp_path / "hpcdl-fabt.rate").exists()


def test_two_nodes_over_the_shaped_link_measure_its_rate(fabric_link, tmp_path):
    """A 2-node job crosses the link; the best 8 and 16 MiB all-reduce runs at the shaped rate: at most 15% above it
    (loopback, unshaped, is ten times faster) and at most 20% below (CI's fresh clone measured 0.84x under the
    parallel tier's load, 0.957x idle: tbf's own shortfall). Each size gets 1 s: at 0.2 s a 16 MiB message (134 ms
    at the rate) had one or two tries, and the best of so few was stretched by the load.

    Not the fit over all sizes: tbf's bucket (2 ms at the rate) refills whenever the sender pauses, and under the
    other tests' load the pauses between iterations let a 1 MiB message pass a quarter of its bytes at once; the
    fit then tilted to a rate above the link's (148 and 150 MB/s in CI, 118 MB/s idle). At 8 MiB and up the
    bucket is at most 3% of a message, and the best of the iterations is the least stretched by the load."""
    script = tmp_path / "fabric.sbatch"
    script.write_text(render_sbatch(
        job_request(profile="local", nodes=2, tasks_per_node=1, time="5", python=PYTHON, partition="fabric",
                    output=f"{tmp_path}/%j.out"),
        ["bench", "allreduce", "--backend", "gloo", "--min-bytes", "1M", "--max-bytes", "16M", "--seconds-per-size",
         "1", "--json", f"{tmp_path}/fabric-%j-%N.json"]))
    job = sbatch_wait(script)
    report = load_json(tmp_path / f"fabric-{job}-n3.json")  # rank 0's node, by Slurm's name
    assert sorted(r["host"] for r in report["ranks"]) == ["n3", "n4"]
    assert all(row["correct"] for row in report["rows"])
    # 2 ranks: the bus bandwidth is the algorithm's, bytes over time
    best = max(row["bytes"] / (row["min_time_us"] * 1e-6) for row in report["rows"] if row["bytes"] >= 8 << 20)
    assert 0.8 <= best / fabric_link <= 1.15, (best, fabric_link, report["rows"], (tmp_path / f"{job}.out").read_text()[-2000:])


@pytest.mark.timeout(600)  # 254 s in CI's parallel pass (2026-11-28), queued behind the other fabric jobs
def test_a_hook_trains_to_the_target_across_the_shaped_link(fabric_link, demo_data, tmp_path):
    script = tmp_path / "hook.sbatch"
    made = hpcdl("sbatch", "--profile", "local", "--partition", "fabric", "--nodes", 2, "--tasks-per-node", 1,
                 "--time", 5, "--output", f"{tmp_path}/hook-%j.out", "--python", PYTHON, "--write", script, "--",
                 "train", "demo_tiny_lars", "--set", f"data.train={demo_data / 'train'}",
                 "--set", f"data.val={demo_data / 'val'}", "--set", f"run_dir={tmp_path / 'run'}",
                 "--set", "sync.hook=fp16", "--set", "loop.backend=gloo", "--set", "checkpoint.every_minutes=0",
                 "--set", "loop.stop_at_target=true")
    assert made.returncode == 0, made.stderr
    job = sbatch_wait(script, f"--chdir={tmp_path}", env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=540)
    out = (tmp_path / f"hook-{job}.out").read_text()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["best_top1"] >= 95 and summary["stopped_at_target"], (summary, out[-3000:])
    assert "comm hook fp16" in out and "2 node(s) (n[3-4])" in out and "host n3" in out, out[-3000:]
