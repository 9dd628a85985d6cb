"""``hpcdl plan``: its fits, its validation against the published runs, and its CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest
from conftest import PYTHON, load_json, sbatch_wait

from hpcdl.bench.reports import AllreduceReport, ScalingReport, StepReport
from hpcdl.errors import ConfigError, DataError
from hpcdl.launch import job_request
from hpcdl.launch.profiles import get_profile
from hpcdl.launch.sbatch import render_sbatch
from hpcdl.model_facts import model_facts
from hpcdl.plan.cost import BatchCurve, Link, StepModel
from hpcdl.plan.measured import calibrate, link_from_allreduce
from hpcdl.plan.planner import PlanInputs, figure, plan
from hpcdl.plan.published import PUBLISHED
from hpcdl.plan.validate import FITTED, carried_compute, validate

# The rows the model misses, and why (docs/scaling.md, "Validation"). Each is a strict xfail: a change that
# brings one within its bound fails here until the docs and this list are updated.
MISSES = {
    "resnet50-skx1024": ("You et al.'s node ran at 80 img/s at 64 images, SURFsara's at 98.5 on the same node and "
                         "batch: software, not a term that varies across rows"),
    "resnet50-knl2048": ("the fixed per-step work on KNL would have to be about 0.75x the SKX node's, where the nominal "
                         "peaks give 1.06x: the fixed work does not follow the peak"),
}


@pytest.fixture(scope="module")
def validation() -> dict[str, dict]:
    return {r["name"]: r for r in validate()}


def test_two_rows_alone_set_the_compute(validation):
    assert [n for n, r in validation.items() if r["calibration"]] == list(FITTED) and len(FITTED) == 2
    assert all(validation[n]["error"] == pytest.approx(0, abs=1e-9) for n in FITTED)
    skx = [r for r in validation.values() if r["processor"] == "Xeon Platinum 8160" and r["model"] == "resnet50"]
    node = carried_compute(model_facts("resnet50"), get_profile("stampede2-skx"))
    assert node.fixed_s > 0 and node.per_image_s > 0
    # one fixed + per-image pair for every row of that node and model, no per-row factor
    assert all(r["compute_images_s_per_node"] == pytest.approx(node.images_s(r["batch_per_node"])) for r in skx)


@pytest.mark.parametrize("name", [r.name for r in PUBLISHED if r.name not in FITTED])
def test_each_published_row_within_its_bound(validation, name):
    row = validation[name]
    assert row["bound"] == (0.15 if row["model"] == "resnet50" and row["minutes"] else 0.25)
    if name in MISSES:
        pytest.xfail(f"{name}: {row['error']:+.1%} against {row['bound']:.0%}: {MISSES[name]}")
    assert abs(row["error"]) <= row["bound"]


@pytest.mark.parametrize("name", sorted(MISSES))
def test_the_misses_stay_documented(validation, name):
    """A row listed as a miss that comes within its bound must leave MISSES (and docs/scaling.md's table)."""
    row = validation[name]
    assert abs(row["error"]) > row["bound"], f"{name} is now within its bound: update MISSES and docs/scaling.md"


def test_validate_cli_prints_every_row_with_prediction_and_error(tmp_path):
    out = subprocess.run([PYTHON, "-m", "hpcdl", "plan", "--validate", "--json", str(tmp_path / "v.json")],
                         capture_output=True, text=True, check=True).stdout
    for r in PUBLISHED:
        line = next(line for line in out.splitlines() if line.startswith(r.name + " "))
        assert (f"{r.minutes:.1f} min" if r.minutes else f"{r.images_per_s:,.0f}/s") in line
        assert "%" in line
    assert len(json.loads((tmp_path / "v.json").read_text())) == len(PUBLISHED)


def test_link_fit_recovers_the_link_it_was_made_from():
    alpha, bw, p = 20e-6, 3e9, 4
    rows = [{"bytes": n, "time_us": (2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bw) * 1e6} for n in
            (4, 1 << 10, 1 << 16, 1 << 20, 1 << 24)]
    link = link_from_allreduce(AllreduceReport.from_dict({"meta": {"world_size": p}, "rows": rows}))
    assert link.latency_s == pytest.approx(alpha, rel=1e-6) and link.bandwidth_bytes_s == pytest.approx(bw, rel=1e-6)


def test_link_fit_reads_one_backend_of_a_side_by_side_report():
    p, rows = 2, []
    for backend, bw in (("gloo", 1e9), ("oneccl", 3e9)):
        rows += [{"backend": backend, "bytes": n, "time_us": (2 * (p - 1) * 1e-5 + n / bw) * 1e6}
                 for n in (1 << 16, 1 << 20, 1 << 24)]
    report = AllreduceReport.from_dict({"meta": {"world_size": p}, "rows": rows})
    assert link_from_allreduce(report).bandwidth_bytes_s == pytest.approx(1e9, rel=1e-6)  # the first backend's
    assert link_from_allreduce(report, "oneccl").bandwidth_bytes_s == pytest.approx(3e9, rel=1e-6)
    with pytest.raises(DataError, match="ar.json: no rows of backend 'mpi4py'; it measured gloo, oneccl"):
        link_from_allreduce(report, "mpi4py", "ar.json")


def test_the_plan_knows_a_hooks_wire_bytes_and_its_own_work(tmp_path):
    """fp16 halves the bytes on the wire; bench sync's figures give its work: 460 ms against 880 ms of plain
    DDP for half the bytes is 20 ms of its own, for ResNet-50's gradient set (25.6M parameters)."""
    sync = tmp_path / "sync.json"
    figures = {"model": "resnet50", "tensors": 161, "parameters": 25_557_032, "buckets": 5, "world_size": 2,
               "backend": "oneccl", "ms": {}, "latency_us": {},
               "hooks": {"none": {"ms": 880.0, "mb_sent": 97.5}, "fp16": {"ms": 460.0, "mb_sent": 48.75}}}
    sync.write_text(json.dumps({"benchmark": "sync", "by_backend": {"oneccl": figures}}))
    base = dict(model="resnet50", profile="stampede2-skx", throughput="98.5", ranks_per_node=1)
    dense, _ = PlanInputs(**base).build()
    fp16, notes = PlanInputs(**base, hook="fp16", sync_json=str(sync)).build()
    d, h = dense.terms(64, 64 * 64), fp16.terms(64, 64 * 64)
    assert h["allreduce_bandwidth_s"] == pytest.approx(d["allreduce_bandwidth_s"] / 2)
    assert h["hook_s"] == pytest.approx(0.020 * 102_228_128 / (25_557_032 * 4))
    assert any("its own work 20.0 ms per step" in line for line in notes)
    sparse, _ = PlanInputs(**base, hook="chunk_sparse").build()
    assert sparse.wire_fraction == pytest.approx(0.1 + 1 / 32768) and sparse.messages == 2 * dense.messages
    with pytest.raises(ConfigError, match="hierarchical needs the node's own link"):  # the hook is the algorithm
        PlanInputs(**base, hook="hierarchical").build()
    with pytest.raises(ConfigError, match="--hook none has none to measure"):
        PlanInputs(**base, sync_json=str(sync)).build()
    with pytest.raises(DataError, match="no figures of backend 'gloo'; it measured oneccl"):
        PlanInputs(**base, hook="fp16", sync_json=str(sync), allreduce_backend="gloo").build()
    sync.write_text(json.dumps({"benchmark": "sync", "by_backend": {"oneccl": {**figures, "hooks": {
        "none": {"ms": 880.0, "mb_sent": 97.5}}}}}))
    with pytest.raises(DataError, match="hooks.fp16 of backend oneccl is missing; run hpcdl bench sync --hooks none,fp16"):
        PlanInputs(**base, hook="fp16", sync_json=str(sync)).build()
    sync.write_text(json.dumps({"benchmark": "sync", **figures}))  # the layout of an older hpcdl
    with pytest.raises(DataError, match="by_backend"):
        PlanInputs(**base, hook="fp16", sync_json=str(sync)).build()


def _scaling_report(model: StepModel, per_rank: int, counts=(1, 2, 4)) -> ScalingReport:
    """What bench scaling would measure of a job that behaves exactly like ``model`` (one rank per node)."""
    points = []
    for k in counts:
        t = model.terms(k, per_rank * k)
        compute = t["compute_s"] * 1e3
        points.append({"mode": "weak", "ranks": k, "nodes": k, "batch_per_rank": per_rank, "global_batch": per_rank * k,
                       "images_per_s": t["images_s"], "step_ms": {"mean": t["step_s"] * 1e3},
                       "phases_ms": {"forward": compute / 3, "backward": compute * 2 / 3, "optimizer": 0.0,
                                     "comm_wait": t["exposed_s"] * 1e3}})
    return ScalingReport.from_dict({"meta": {"ranks_per_node": 1, "gradient_bytes": model.gradient_bytes},
                                    "points": points})


def test_step_reports_of_several_nodes_give_the_slowest_node(tmp_path):
    """A job steps at its slowest node's pace: --step-json a,b takes, at every batch, the least throughput."""
    def step_report(name: str, tuned: float, curve: list) -> str:
        path = tmp_path / f"step-{name}.json"
        path.write_text(json.dumps({"benchmark": "step", "config": {"tuning_batch": 8, "ranks_per_node": 1},
                                    "tuning": {"images_per_s": {"tuned": tuned, "untuned": tuned / 2}},
                                    "curve": {"points": curve}}))
        return str(path)

    n3 = step_report("n3", 8.0, [[16, 10.0]])
    n4 = step_report("n4", 7.0, [[16, 11.0], [32, 12.0]])
    model, notes = PlanInputs(model="resnet50", profile="stampede2-skx", step_json=f"{n3},{n4}", ranks_per_node=1).build()
    assert model.throughput.points == ((8, 7.0), (16, 10.0), (32, 10.0))  # n3 holds 10 beyond its last point
    assert f"compute from the slowest node of {n3}, {n4}" in notes
    alone, notes = PlanInputs(model="resnet50", profile="stampede2-skx", step_json=n4, ranks_per_node=1).build()
    assert alone.throughput.points == ((8, 7.0), (16, 11.0), (32, 12.0)) and f"compute from {n4}" in notes


def test_calibrate_recovers_compute_and_overlap():
    net = Link(latency_s=50e-6, bandwidth_bytes_s=0.25e9)  # slow enough that backward cannot hide it all
    truth = StepModel(gradient_bytes=100e6, throughput=BatchCurve(((16, 20.0),)), network=net, overlap=0.4)
    cal = calibrate(_scaling_report(truth, 16), net)
    assert cal.throughput(16) == pytest.approx(20.0)
    assert cal.overlap == pytest.approx(0.4) and cal.backward_share == pytest.approx(2 / 3)
    for p in cal.points:
        assert p["model_images_s"] == pytest.approx(p["measured_images_s"])
    fast = Link(50e-6, 100e9)
    hidden = calibrate(_scaling_report(dataclasses.replace(truth, network=fast), 16), fast)
    assert hidden.overlap < 0.4  # all of it hidden: the measurement bounds the overlap only from below


def test_plan_rows_and_the_plot_agree(tmp_path):
    facts = model_facts("resnet50")
    assert facts.gradient_bytes == 25_557_032 * 4 and facts.buckets == 5  # 1 MB first bucket, then 25 MB ones
    model = StepModel(gradient_bytes=facts.gradient_bytes, throughput=BatchCurve(((64, 98.5),)),
                      network=Link(1e-6, 12.5e9), ranks_per_node=2, messages=facts.buckets)
    rows = plan(model, [256, 512, 1024], 32768, 90, 1_281_167)
    for r in rows:
        assert r["steps_per_epoch"] == 40 and r["time_to_train_s"] == pytest.approx(90 * 40 * r["step_s"])
        assert r["allreduce_latency_s"] == pytest.approx(5 * 2 * (r["ranks"] - 1) * 1e-6)
    left, right = figure(rows, "t").axes
    assert list(left.lines[0].get_ydata()) == [r["time_to_train_s"] / 60 for r in rows]
    assert list(right.lines[0].get_ydata()) == [r["efficiency"] * 100 for r in rows]


def test_plan_cli_writes_table_json_and_png(tmp_path):
    run = subprocess.run([PYTHON, "-m", "hpcdl", "plan", "--model", "resnet50", "--nodes", "256,512,1024,1600,2048",
                          "--profile", "stampede2-skx", "--batch", "32768", "--epochs", "90", "--throughput", "64:98.5",
                          "--json", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png")],
                         capture_output=True, text=True, check=True)
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [r["nodes"] for r in rows] == [256, 512, 1024, 1600, 2048]
    for r in rows:
        assert f"{r['time_to_train_s'] / 60:.1f}" in run.stdout
    assert "12.50 GB/s (profile stampede2-skx)" in run.stdout
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("inputs, message", [
    (dict(throughput="98.5", step_json="x.json"), "give the per-node compute one way"),
    (dict(throughput="64:lots", profile="stampede2-skx"), "--throughput '64:lots'"),
    (dict(throughput="98.5", algorithm="hierarchical", profile="stampede2-skx"), "needs the node's own link"),
    (dict(throughput="98.5"), "profile generic has no network latency and bandwidth; measure them with hpcdl bench"),
])
def test_plan_inputs_are_checked(inputs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PlanInputs(model="resnet50", **inputs).build()


def test_without_a_compute_source_the_plan_carries_the_published_one(validation):
    model, notes = PlanInputs(model="resnet50", profile="stampede2-skx").build()
    for name in ("resnet50-skx1024", "resnet50-skx1600"):  # at their batches per node: 64 and 41
        row = validation[name]
        assert model.throughput(row["batch_per_node"]) == pytest.approx(row["compute_images_s_per_node"], rel=2e-3)
    assert any("carried from the published surfsara-64 and surfsara-448 runs" in line for line in notes)
    with pytest.raises(ConfigError, match="profile local has no nominal peak"):
        carried_compute(model_facts("resnet50"), get_profile("local"))


def test_plan_cli_names_a_missing_report(tmp_path):
    run = subprocess.run([PYTHON, "-m", "hpcdl", "plan", "--nodes", "2", "--batch", "64", "--profile", "stampede2-skx",
                          "--step-json", str(tmp_path / "nope.json")], capture_output=True, text=True)
    assert run.returncode == 2 and f"{tmp_path / 'nope.json'}: cannot read it as an hpcdl bench step report" in run.stderr


@pytest.mark.alone  # compares a prediction with timings: nothing else may run beside it
@pytest.mark.timeout(600)  # conftest's quiet_machine may wait 120 s before it starts
def test_plan_from_bench_step_and_allreduce_predicts_what_bench_scaling_measures(slurm, tmp_path):
    """This machine as one node of 2 ranks, ResNet-50 at 8 images a rank (docs/scaling.md): the plan from the
    node's compute (bench step) and the link (bench allreduce on the node's 2 ranks) against bench scaling's
    2-rank throughput, at most 20% below it: the runs are minutes apart, and this VM's compute moves 7-21%
    between runs (docs/scaling.md, "The planner on the fabric"), so a tighter bound tests the box, not the
    model. At most 40% above: the model has no term for the communication's CPU on the cores that compute,
    and on the 2-core Ice Lake Xeon the DDP step's forward and backward run 12-17% slower than one rank's
    alone (bench scaling --ranks 1,2 --threads 1 side by side), so the plan read 26-34% high in four runs
    (docs/scaling.md, "Check on this machine"). The figures themselves come from the benchmarks."""
    def job(name: str, command: list[str]) -> None:
        script = tmp_path / f"{name}.sbatch"
        script.write_text(render_sbatch(job_request(profile="local", nodes=1, tasks_per_node=2, time="10",
                                                    python=PYTHON, output=f"{tmp_path}/{name}-%j.out"), command))
        sbatch_wait(script, timeout=600)

    subprocess.run([PYTHON, "-m", "hpcdl", "bench", "step", "--only", "curve", "--curve-batches", "8",
                    "--tuning-model", "resnet50", "--ranks-per-node", "2", "--tuning-steps", "2", "--tuning-rounds", "2",
                    "--json", str(tmp_path / "step.json")], check=True, capture_output=True)
    job("allreduce", ["bench", "allreduce", "--max-bytes", "64M", "--seconds-per-size", "0.1",
                      "--json", f"{tmp_path}/allreduce.json"])
    job("scaling", ["bench", "scaling", "--model", "resnet50", "--batch", "8", "--ranks", "2", "--modes", "weak",
                    "--steps", "3", "--rounds", "2", "--json", f"{tmp_path}/scaling.json"])
    subprocess.run([PYTHON, "-m", "hpcdl", "plan", "--model", "resnet50", "--nodes", "1", "--ranks-per-node", "2",
                    "--batch", "16", "--step-json", str(tmp_path / "step.json"), "--allreduce-json",
                    str(tmp_path / "allreduce.json"), "--json", str(tmp_path / "plan.json")], check=True,
                   capture_output=True)
    measured = load_json(tmp_path / "scaling.json")["points"][0]
    assert (measured["ranks"], measured["global_batch"]) == (2, 16)
    predicted = load_json(tmp_path / "plan.json")["rows"][0]["images_s"]
    print(f"plan {predicted:.3f} images/s, bench scaling {measured['images_per_s']:.3f}")
    rounds = load_json(tmp_path / "step.json")["curve"]["runs"]  # which side was off, when it fails
    assert 0.80 <= predicted / measured["images_per_s"] <= 1.40, (predicted, measured, rounds)


@pytest.mark.slow
def test_a_foreign_or_incomplete_report_is_named_with_its_missing_field(tmp_path):
    step = tmp_path / "step.json"
    step.write_text(json.dumps({"benchmark": "step", "config": {"tuning_batch": 8, "ranks_per_node": 2}}))
    broken = tmp_path / "allreduce.json"
    broken.write_text(json.dumps({"benchmark": "allreduce", "meta": {"world_size": 2}, "rows": [{"bytes": 4}]}))
    cases = {("--allreduce-json", step): f"{step}: this is an hpcdl bench step report; give the JSON of hpcdl bench "
                                         "allreduce --json FILE",
             ("--allreduce-json", broken): f"{broken}: rows[0].time_us is missing",
             ("--calibrate", step): f"{step}: this is an hpcdl bench step report",
             ("--step-json", tmp_path / "none.json"): "none.json: cannot read it as an hpcdl bench step report"}
    for (flag, path), message in cases.items():
        run = subprocess.run([PYTHON, "-m", "hpcdl", "plan", "--nodes", "2", "--batch", "256", "--profile", "stampede2-skx",
                              flag, str(path)],
                             capture_output=True, text=True)
        assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, (flag, run.stderr)
    assert StepReport.from_json(str(step)).tuning is None  # a report may lack what only some readers need


def test_bf16_plan_on_sapphire_rapids_and_refused_where_bf16_is_emulated():
    fp32, _ = PlanInputs(model="resnet50", profile="stampede3-spr").build()
    bf16, notes = PlanInputs(model="resnet50", profile="stampede3-spr", precision="bf16").build()
    spr = get_profile("stampede3-spr")
    # the per-image work runs bf16_step_speedup times faster; the fixed part stays, so large batches gain most
    assert 1.0 < bf16.throughput(512) / fp32.throughput(512) < spr.bf16_step_speedup
    assert bf16.throughput(512) / fp32.throughput(512) > bf16.throughput(8) / fp32.throughput(8)
    assert any("then bf16 at 2.1x fp32's per-image speed" in line for line in notes)
    for name in ("stampede3-skx", "stampede3-icx", "frontera-clx"):
        with pytest.raises(ConfigError, match=f"profile {name}'s CPUs have no avx512_bf16 or AMX"):
            PlanInputs(model="resnet50", profile=name, precision="bf16").build()
    with pytest.raises(ConfigError, match="already in the precision it ran"):
        PlanInputs(model="resnet50", profile="stampede3-spr", precision="bf16", throughput="500").build()


def test_profiles_list_the_machines_users_hold_with_their_sources():
    run = subprocess.run([PYTHON, "-m", "hpcdl", "profiles"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    blocks = {b.split()[0]: b for b in run.stdout.split("\n") if b and not b.startswith(" ")}
    assert {"stampede3-skx", "stampede3-icx", "stampede3-spr", "frontera-clx"} <= set(blocks)
    assert "(retired)" in blocks["stampede2-skx"] and "(retired)" in blocks["stampede2-knl"]
    for name in ("stampede3-skx", "stampede3-icx", "stampede3-spr", "frontera-clx"):
        p = get_profile(name)
        assert p.source and p.cores_per_node and p.partition and not p.retired, name
        assert f"source: {p.source}" in run.stdout
    spr = get_profile("stampede3-spr")
    assert spr.hbm_gb_per_node == 128 and "amx_bf16" in spr.cpu_flags and spr.peak_bf16_tflops > 10 * spr.peak_fp32_tflops
    assert "217.9 bf16 TFLOPS" in run.stdout and "bf16 emulated" in run.stdout


def test_startup_terms_follow_the_counts_they_are_made_of():
    from hpcdl.plan.startup_terms import StartupModel

    common = dict(ranks_per_node=2, python_files=2000, local_import_s=5.0, store_requests_per_s=20000,
                  fs_opens_per_s=50000, fs_read_bytes_s=1.5e9, fs_bandwidth_bytes_s=100e9, checkpoint_bytes=200e6,
                  env_bytes=6e9, network=Link(1e-6, 12.5e9))
    mesh = StartupModel(rendezvous_requests=(2.0, 4.0), **common)  # gloo: each rank asks about every other
    flat = StartupModel(rendezvous_requests=(2.0, 0.0), staged=True, **common)  # a constant per rank
    small, large = mesh.terms(256, 1.0), mesh.terms(1024, 1.0)
    assert small["imports_shared_fs_s"] == pytest.approx(5.0 + 512 * 2000 / 50000)
    assert large["rendezvous_s"] / small["rendezvous_s"] == pytest.approx(2048 * (2 + 4 * 2048) / (512 * (2 + 4 * 512)))
    assert flat.terms(1024, 1.0)["rendezvous_s"] / flat.terms(256, 1.0)["rendezvous_s"] == pytest.approx(4.0)
    assert flat.terms(256, 1.0)["imports_s"] == pytest.approx(5.0 + 256 * 6e9 / 100e9)  # one archive a node
    assert small["checkpoint_s"] == pytest.approx(200e6 / 1.5e9 + 9 * (1e-6 + 200e6 / 12.5e9))  # log2(512) steps
    assert small["restart_s"] == pytest.approx(small["startup_s"] + small["checkpoint_s"])
    assert small["startup_s"] == pytest.approx(small["imports_s"] + small["rendezvous_s"] + 1.0)


def test_plan_cli_prints_startup_and_restart_from_a_startup_report(tmp_path):
    """--startup-json replaces the built-in counts with the report's: 3,000 python files per rank, 10 s of imports
    and model on the smallest job, 2 + 0 N store requests per rank (a flat rendezvous) at 10,000/s. Each row's
    terms follow those counts, and the restart adds the checkpoint read once and broadcast, no more."""
    from hpcdl.bench.reports import CountFit, StartupReport, StartupRow, StoreCapacity
    from hpcdl.schema import to_dict

    row = StartupRow(2, "start", {"interpreter and imports": 7.5, "model": 2.5}, 12.0, {}, {}, 0, 0, 4, 8, 0, None)
    fits = (CountFit("python files per rank", 3000.0, 0.0), CountFit("rendezvous requests per rank", 2.0, 0.0))
    for rows, name in (((), "empty.json"), ((row,), "startup.json")):
        report = StartupReport(rows=rows, store=StoreCapacity(3200, 16, 10000.0, 2.0, 0.16), fits=fits)
        (tmp_path / name).write_text(json.dumps({"benchmark": "startup", **to_dict(report)}))
    # a report without rows: the imports on one node come from its smallest job, so it must have one
    plan = [PYTHON, "-m", "hpcdl", "plan", "--nodes", "256,1024,2048", "--batch", "32768", "--profile", "stampede2-skx"]
    run = subprocess.run([*plan, "--startup-json", str(tmp_path / "empty.json")], capture_output=True, text=True)
    assert run.returncode == 2 and "no rows" in run.stderr, run.stderr
    rows, notes = {}, {}
    for source, extra in (("report", ["--startup-json", str(tmp_path / "startup.json")]), ("built-in", [])):
        run = subprocess.run([*plan, *extra, "--json", str(tmp_path / f"{source}.json")], capture_output=True,
                             text=True, check=True)
        found = json.loads((tmp_path / f"{source}.json").read_text())
        rows[source], notes[source] = found["rows"], " ".join(found["notes"])
        assert "# start-up (ranks' start to first step)" in run.stdout
        assert all(f"{r['restart_s']:.1f}" in run.stdout for r in rows[source])
    assert f"start-up from {tmp_path / 'startup.json'}: 3,000 files per rank, imports 10.0 s on one node, 2 + 0 N " \
           "store requests per rank at 10,000/s" in notes["report"], notes["report"]
    for r, builtin in zip(rows["report"], rows["built-in"]):
        ranks = r["ranks"]
        assert r["imports_shared_fs_s"] == pytest.approx(10.0 + ranks * 3000 / 50000)  # the profile's 50,000 opens/s
        assert r["rendezvous_s"] == pytest.approx(ranks * 2.0 / 10000)  # flat: each rank's 2 requests at 10,000/s
        assert r["rendezvous_s"] < builtin["rendezvous_s"] / 10  # gloo's mesh: 2 + 4 N per rank
        assert r["restart_s"] - r["startup_s"] == pytest.approx(r["checkpoint_s"])
        assert r["checkpoint_s"] == pytest.approx(builtin["checkpoint_s"])  # the same model: the same checkpoint


def test_the_failure_table_follows_its_formulas_from_the_plans_own_terms(tmp_path):
    """hpcdl plan --node-mtbf-hours: each path's expected time to train is T0 (1 + C / tau) / (1 - L / M) with M the
    node MTBF over the nodes, C the checkpoint's write at one writer's bandwidth, R the plan's own restart, and L
    per path (a) tau / 2 + R + Q, (b) tau / 2 + R, (c) half a step + D + C + R; the intervals are Young's and Daly's."""
    import math

    from hpcdl.plan.failures import daly_interval

    out = subprocess.run([PYTHON, "-m", "hpcdl", "plan", "--profile", "stampede2-skx", "--nodes", "256,1024,2048",
                          "--batch", "32768", "--node-mtbf-hours", "2000", "--queue-wait-hours", "3",
                          "--checkpoint-minutes", "20", "--detect-s", "40", "--fs-read-gb-s", "0.5",
                          "--json", str(tmp_path / "p.json")], capture_output=True, text=True, check=True).stdout
    assert "# failures: node MTBF 2,000 h, periodic checkpoint every 20 min, queue wait 3 h" in out
    report = json.loads((tmp_path / "p.json").read_text())
    ckpt_bytes = model_facts("resnet50").gradient_bytes * 2  # the weights and one momentum buffer (startup model)
    for row in report["rows"]:
        f, n, t0 = row["failures_model"], row["nodes"], row["time_to_train_s"]
        m, tau, c, r, q = 2000 * 3600 / n, 20 * 60, ckpt_bytes / 0.5e9, row["restart_s"], 3 * 3600
        assert f["job_mtbf_s"] == pytest.approx(m) and f["checkpoint_write_s"] == pytest.approx(c, rel=0.05)
        c = f["checkpoint_write_s"]
        expect = lambda overhead, loss: t0 * (1 + overhead) / (1 - loss / m) if loss < m else math.inf  # noqa: E731
        assert f["requeue_s"] == pytest.approx(expect(c / tau, tau / 2 + r + q))
        assert f["allocation_s"] == pytest.approx(expect(c / tau, tau / 2 + r))
        assert f["jit_s"] == pytest.approx(expect(0, row["step_s"] / 2 + 40 + c + r))
        assert f["young_interval_s"] == pytest.approx(math.sqrt(2 * c * m))
        daly = f["daly_interval_s"]
        assert daly == pytest.approx(daly_interval(c, m)) and abs(daly - math.sqrt(2 * c * m)) < c + 0.1 * daly
        assert t0 < f["jit_s"] < f["allocation_s"] <= f["requeue_s"]  # each path cheaper than the one before
        line = next(x for x in out.splitlines() if x.split()[:1] == [str(n)] and len(x.split()) == 11)
        assert f"{f['jit_s'] / 3600:.2f}" in line and ("never" in line) == (f["requeue_s"] == math.inf)
    assert math.isinf(report["rows"][-1]["failures_model"]["requeue_s"])  # 3 h in the queue > 2048 nodes' MTBF
    # the expected time at the Daly interval is no worse than at a twice longer or shorter one
    for row in report["rows"]:
        f = row["failures_model"]
        from hpcdl.plan.failures import expected_time

        m, c, r = f["job_mtbf_s"], f["checkpoint_write_s"], row["restart_s"]
        at = lambda tau: expected_time(row["time_to_train_s"], c, tau, tau / 2 + r, m)  # noqa: E731
        assert at(f["daly_interval_s"]) <= min(at(2 * f["daly_interval_s"]), at(f["daly_interval_s"] / 2))


def test_the_optimizer_table_follows_its_formulas_replicated_and_sharded(tmp_path):
    """A rank's memory and the optimizer's time per step, replicated and sharded, from the plan's own inputs: the
    busiest rank's share 1/r until ResNet-50's largest tensor (9.2% of the weights) sets it, the all-gather a ring
    of r - 1 steps of that share (padded), the padding of it and of the reduce-scatter what sharding adds to the
    all-reduce they replace, the update from hpcdl bench optim's JSON scaled by the weights. On 2 ranks sharding
    LAMB saves time, nothing padded; on 1,024 the padding costs more than the update saves. That on oneCCL with
    sync.hook none; on gloo and under chunk_sparse the whole all-gather is added, under bf16 a part of it."""
    report = {"benchmark": "optim", "parameters": 10_000_000, "threads": 2, "ms_per_step": {"sgd": 10.0, "lamb": 50.0},
              "ratio_to_sgd": {"sgd": 1.0, "lamb": 5.0}}
    (tmp_path / "optim.json").write_text(json.dumps(report))
    command = [PYTHON, "-m", "hpcdl", "plan", "--model", "resnet50", "--optimizer", "lamb", "--nodes", "1,2,8,512",
               "--profile", "stampede2-skx", "--batch", "32768", "--throughput", "64:98.5",
               "--optim-json", str(tmp_path / "optim.json")]
    run = subprocess.run(command + ["--backend", "ccl", "--json", str(tmp_path / "p.json")], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    assert "# optimizer lamb, replicated against sharded" in run.stdout
    facts, profile = model_facts("resnet50"), get_profile("stampede2-skx")
    link, w = Link.of(profile), facts.gradient_bytes
    update = 50e-3 * (w / 4) / 10_000_000
    for row in json.loads((tmp_path / "p.json").read_text())["rows"]:
        t, ranks = row["optimizer"], row["nodes"] * profile.sockets
        share = max(1 / ranks, facts.largest * 4 / w)
        gather = (ranks - 1) * (link.latency_s + share * w / link.bandwidth_bytes_s)
        padding = 2 * (ranks - 1) * (share - 1 / ranks) * w / link.bandwidth_bytes_s  # what the default exchange adds
        assert t["ranks"] == ranks and t["share"] == pytest.approx(share)
        assert t["memory_replicated_bytes"] == pytest.approx(2 * w + 2 * w)  # LAMB: two moments
        # the gradients, the weights in the all-gather's padded shares, the state, the reduce-scatter's buffers
        assert t["memory_sharded_bytes"] == pytest.approx(w + ranks * share * w + share * 2 * w + (ranks + 1) * share * w)
        assert t["gather_s"] == pytest.approx(gather) and t["update_replicated_s"] == pytest.approx(update)
        assert t["added_s"] == pytest.approx(padding, abs=1e-12)
        assert t["saved_s"] == pytest.approx(update - share * update - padding)
        assert f"{t['saved_s'] * 1e3:.2f}" in run.stdout
    rows = {r["nodes"]: r["optimizer"] for r in json.loads((tmp_path / "p.json").read_text())["rows"]}
    assert rows[1]["saved_s"] > 0 > rows[512]["saved_s"] and rows[8]["share"] == rows[512]["share"] > 1 / 16
    assert rows[1]["added_s"] == 0 < rows[512]["added_s"]
    # on gloo (or under hierarchical, chunk_sparse) the gradients stay all-reduced: the whole all-gather is added;
    # under bf16 on oneCCL the fp32 all-gather replaces the 16-bit all-reduce's half: between the two
    # (and no reduce-scatter's buffers where the gradients are all-reduced, half of them in 16 bits)
    for extra, adds, kept in ((["--backend", "gloo"], lambda t: t["gather_s"], 0),
                              (["--backend", "ccl", "--hook", "chunk_sparse"], lambda t: t["gather_s"], 0),
                              (["--backend", "ccl", "--hook", "bf16"], lambda t: t["gather_s"] - (t["ranks"] - 1) * (
                                  link.latency_s + w / 2 / t["ranks"] / link.bandwidth_bytes_s) + (t["ranks"] - 1) * (
                                  t["share"] - 1 / t["ranks"]) * w / 2 / link.bandwidth_bytes_s, 0.5)):
        other = subprocess.run(command + extra + ["--json", str(tmp_path / "o.json")], capture_output=True, text=True)
        assert other.returncode == 0 and ("the whole all-gather" in other.stdout) == ("bf16" not in extra), other.stderr
        for t, plain in zip((r["optimizer"] for r in json.loads((tmp_path / "o.json").read_text())["rows"]),
                            (r["optimizer"] for r in json.loads((tmp_path / "p.json").read_text())["rows"])):
            if t["ranks"] > 1:
                assert t["added_s"] == pytest.approx(adds(t)), (extra, t)
                buffers = (t["ranks"] + 1) * t["share"] * w
                assert t["memory_sharded_bytes"] == pytest.approx(plain["memory_sharded_bytes"] - (1 - kept) * buffers)
            if t["share"] == 1 / t["ranks"] > 1 / 16:  # nothing padded (1 to 4 ranks): 16 bits add, gloo more
                assert plain["added_s"] == 0 < t["added_s"] <= t["gather_s"], (extra, plain, t)
            assert t["saved_s"] == pytest.approx(t["update_replicated_s"] - t["update_sharded_s"] - t["added_s"])
    # with the exchange's buffers 2 ranks already hold more than replicated; Schedule-Free is not sharded at all
    assert rows[1]["memory_sharded_bytes"] > rows[1]["memory_replicated_bytes"]
    free = subprocess.run([PYTHON, "-m", "hpcdl", "plan", "--model", "resnet50", "--optimizer", "schedulefree",
                           "--nodes", "2", "--profile", "stampede2-skx", "--batch", "32768", "--throughput", "64:98.5"],
                          capture_output=True, text=True)
    assert free.returncode == 0 and "Schedule-Free, not sharded (optimizer.shard refuses it)" in free.stdout, free.stderr
