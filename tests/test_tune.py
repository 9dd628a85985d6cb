"""``hpcdl tune --measure``: short trials choose the node layout, refuse what the node cannot hold, confirm the
winner, and write a layout that ``hpcdl sbatch --layout`` turns into the job. Speed figures are in
docs/performance.md; here TinyCNN keeps the trials short."""

from __future__ import annotations

import json
import os
import re

import pytest
from conftest import PYTHON, REPO, SIMULATED_CPUS, hpcdl, sbatch_wait

from hpcdl.bench.tune import Topology, Trial, node_topology, rank_counts, refusal
from hpcdl.presets import resolve
from hpcdl.errors import ConfigError
from hpcdl.launch import job_request
from hpcdl.launch.layout import NodeLayout, load_layout, train_overrides

TRIALS = ["--model", "tiny_cnn", "--batch", "8", "--crop", "32", "--steps", "1", "--confirm-rounds", "1"]


def _rows(stdout: str) -> list[tuple[float, str]]:
    table = stdout.split("layout (ranks x cores each", 1)[1]
    return [(float(m.group(1)), m.group(2)) for m in re.finditer(r"^\s+([\d.]+)\s+[\d.]+\s+(\d+ x .+)$", table, re.M)]


def test_bf16_is_tried_only_where_the_cpu_has_it_natively_and_the_table_says_why_not():
    """The Slurm test's simulated Sapphire Rapids tries bf16; a CPU without avx512_bf16 or AMX skips it, and the
    table says so (this EPYC's case, or any AVX2 machine's)."""
    from hpcdl.bench.tune import TuneResult, skipped_choices
    from hpcdl.cli.system import format_layouts

    assert skipped_choices({"avx2", "avx512f", "avx512_bf16"}) == {} and skipped_choices({"amx_bf16"}) == {}
    skipped = skipped_choices({"avx2", "avx512f"})
    result = TuneResult(topology=Topology(cores=2, sockets=1, numa=1), memory_mb=4096, trials=(), refused={},
                        skipped=skipped, confirm=None, winner=Trial(ranks=2), winner_images_per_s=1.0, batch_per_rank=8)
    assert "  skipped bf16: the CPU has no avx512_bf16 or amx_bf16: bf16 is emulated" in format_layouts(result)


def test_a_layout_the_node_cannot_hold_is_refused_with_the_reason():
    topo = Topology(cores=2, sockets=1, numa=1)
    assert refusal(Trial(ranks=4), topo, 20000, {}) == "4 ranks on 2 cores"
    why = refusal(Trial(ranks=2, batch=512), topo, 4096, {2: (300.0, 10.0)})  # 2 x (300 + 5120) MB > 85% of 4 GB
    assert why.startswith("about 10.6 GB for 2 ranks at batch 512") and "85% of the node's 4.0 GB" in why
    assert refusal(Trial(ranks=2, batch=8), topo, 4096, {2: (300.0, 10.0)}) is None


def test_topology_from_a_fake_sysfs_tree(tmp_path):
    """A fake sysfs (files written here) with 2 sockets of 2 NUMA domains each; the process sees 8 of its CPUs."""
    for cpu in range(16):
        (tmp_path / f"cpu/cpu{cpu}/topology").mkdir(parents=True)
        (tmp_path / f"cpu/cpu{cpu}/topology/physical_package_id").write_text(str(cpu // 8))
    for node in range(4):
        (tmp_path / f"node/node{node}").mkdir(parents=True)
        (tmp_path / f"node/node{node}/cpulist").write_text(f"{node * 4}-{node * 4 + 3}")
    assert node_topology(set(range(16)), str(tmp_path)) == Topology(cores=16, sockets=2, numa=4)
    assert node_topology(set(range(8)), str(tmp_path)) == Topology(cores=8, sockets=1, numa=2)
    assert rank_counts(Topology(cores=16, sockets=2, numa=4)) == [1, 2, 4, 8]


def _layout(tmp_path, **changes) -> str:
    fields = dict(ranks_per_node=2, cpus_per_task=1, precision="bf16", channels_last=False, allocator="glibc",
                  batch_per_rank=16, images_per_s=12.5, model="resnet50", node={"host": "n1"}) | changes
    path = tmp_path / "layout.json"
    path.write_text(NodeLayout(**fields).to_json())
    return str(path)


def test_the_job_request_and_the_train_command_take_the_layout(tmp_path):
    req = job_request(profile="local", layout=_layout(tmp_path))
    assert (req.tasks_per_node, req.cpus_per_task, req.allocator) == (2, 1, "glibc")
    argv = train_overrides(["train", "demo_tiny_lars", "--set", "loop.precision=fp32"], load_layout(req.layout))
    assert resolve(argv[1], [a for a in argv[2:] if a != "--set"]).loop.precision == "fp32"  # the user's --set wins
    argv = train_overrides(["train", "demo_tiny_lars"], load_layout(req.layout))
    cfg = resolve(argv[1], [a for a in argv[2:] if a != "--set"])
    assert cfg.loop.precision == "bf16" and cfg.loop.channels_last == "false"
    assert train_overrides(["bench", "allreduce"], load_layout(req.layout)) == ["bench", "allreduce"]


@pytest.mark.parametrize("content, message", [
    ("{not json", "cannot read it as JSON"),
    ('{"format": "other"}', "not a node layout"),
    ('{"format": "hpcdl-node-layout/1", "ranks_per_node": 2}', "missing field(s) allocator"),
])
def test_a_bad_layout_file_is_named_with_the_fix(content, message, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=re.escape(f"--layout {path}: {message}")):
        load_layout(str(path))
    with pytest.raises(ConfigError, match=re.escape("field ranks_per_node is 0")):
        load_layout(_layout(tmp_path, ranks_per_node=0))


def test_measured_on_the_slurm_node_then_used_by_the_next_sbatch(slurm, data, tmp_path):
    """tune --measure as a job on the local Slurm's node, its CPU simulated as an AMX Xeon so that bf16 is among the
    trials whatever CPU runs this; the layout it writes shapes the training job after it."""
    layout = tmp_path / "layout.json"
    script = tmp_path / "tune.sbatch"
    made = hpcdl("sbatch", "--profile", "local", "--time", 10, "--job-name", "tune", "--python", PYTHON,
                 "--output", f"{tmp_path}/tune-%j.out", "--write", script, "--", "tune", "--measure", *TRIALS,
                 "--write", layout)
    assert made.returncode == 0, made.stderr
    env = {**os.environ, "PYTHONPATH": str(REPO), "HPCDL_SIMULATE_CPU_FLAGS": SIMULATED_CPUS["simulated Sapphire Rapids (AMX)"]}
    job = sbatch_wait(script, f"--chdir={tmp_path}", env=env, timeout=600)
    out = (tmp_path / f"tune-{job}.out").read_text()
    assert "winner:" in out and f"wrote {layout}" in out and ", bf16, " in out, out
    chosen = load_layout(str(layout))
    # every trial printed, the fastest written (one measure: a second one outside Slurm cost 110 CPU-s of CI)
    rows = _rows(out)
    node = re.search(r"node: (\d+) cores, (\d+) sockets, (\d+) NUMA domains", out)
    topology = Topology(cores=int(node.group(1)), sockets=int(node.group(2)), numa=int(node.group(3)))
    assert {int(name.split(" x ")[0]) for _, name in rows} == set(rank_counts(topology))
    assert chosen.ranks_per_node * chosen.cpus_per_task == topology.cores and chosen.model == "tiny_cnn"
    at_batch = [(v, n) for v, n in rows if n.endswith("batch 8")]
    winner = next(v for v, n in at_batch if n == re.search(r"winner: (.+?);", out).group(1))
    confirmed = "the runner-up was faster here and wins" in out
    assert confirmed or winner == max(v for v, _ in at_batch)  # the trials' best, unless the confirming run overturned it
    assert "confirming run, 1 alternating rounds:" in out and "skipped bf16" not in out
    assert {n.rsplit("batch ", 1)[1] for _, n in rows} == {"4", "8", "16"}
    train = tmp_path / "train.sbatch"
    run = tmp_path / "run"
    made = hpcdl("sbatch", "--profile", "local", "--layout", layout, "--time", 5, "--python", PYTHON,
                 "--output", f"{tmp_path}/train-%j.out", "--write", train, "--", "train", "demo_tiny_lars",
                 "--set", f"data.train={data / 'train'}", "--set", "data.val=", "--set", f"run_dir={run}",
                 "--set", f"global_batch={8 * chosen.ranks_per_node}", "--set", "crop=32", "--set", "epochs=4",
                 "--set", "loop.max_steps=2", "--set", "data.workers=0")
    assert made.returncode == 0, made.stderr
    text = train.read_text()
    assert f"#SBATCH --ntasks-per-node={chosen.ranks_per_node}" in text
    assert f"#SBATCH --cpus-per-task={chosen.cpus_per_task}" in text and f"Node layout from {layout}" in text
    assert f"loop.precision={chosen.precision}" in text and f"HPCDL_ALLOCATOR:-{chosen.allocator}" in text
    job = sbatch_wait(train, f"--chdir={tmp_path}", env=env, timeout=300)
    log = (tmp_path / f"train-{job}.out").read_text()
    assert f"world size {chosen.ranks_per_node}" in log and f"precision {chosen.precision} (requested" in log, log
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
