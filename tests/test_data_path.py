"""``hpcdl plan``'s data path (hpcdl/plan/data_path.py): each term against its inputs, the choice of path, where the
filesystem's figures come from, and the table the command prints."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess

import pytest
from conftest import PYTHON

from hpcdl.errors import ConfigError
from hpcdl.launch.profiles import PROFILES, get_profile
from hpcdl.names import IMAGENET_TRAIN
from hpcdl.plan.cost import Link
from hpcdl.plan.data_path import DataPathInputs, DataPathModel, Figure, published_runs, resolve_figure
from hpcdl.plan.planner import PlanInputs

GB = 1e9


def model(**changes) -> DataPathModel:
    """1,000,000 images of 100 KB (100 GB) in 512 MiB shards, 2 workers a rank; the filesystem 50 GB/s and 40,000
    opens/s, 200 GB of node-local disk, 50 GB of memory a node for the cache, a 10 GB/s link."""
    base = DataPathModel(images=1_000_000, image_bytes=100e3, shard_bytes=512 * 2 ** 20, workers=2, profile="p",
                         bandwidth=Figure(50.0, "--fs-gb-s", "--fs-gb-s"),
                         opens=Figure(40000.0, "--fs-opens-per-s", "--fs-opens-per-s"),
                         local_disk=Figure(200.0, "--local-disk-gb", "--local-disk-gb"),
                         cache=Figure(50.0, "--cache-gb", "--cache-gb"), link_bytes_s=10 * GB,
                         stage_share=0.05, direct_share=0.2)
    return dataclasses.replace(base, **changes)


def terms(m: DataPathModel, nodes=100, ranks=200, images_s=20000.0, epoch_s=50.0, run_s=2000.0) -> dict:
    return m.terms(nodes, ranks, images_s, epoch_s, run_s)


def test_each_term_follows_its_inputs():
    m = model()
    d, s = 1e6 * 100e3, math.ceil(1e11 / (512 * 2 ** 20))
    t = terms(m)
    assert (t["dataset_bytes"], t["shards"]) == (d, s) == (1e11, 187)
    # the reads: one an image, images/s x bytes for the machine, that over N per node
    assert t["machine_bytes_s"] == pytest.approx(20000 * 100e3) and t["node_bytes_s"] == pytest.approx(20000 * 100e3 / 100)
    assert t["bandwidth_share"] == pytest.approx(2e9 / 50e9) and t["opens_share"] == pytest.approx(20000 / 40000)
    assert t["reads_s"] == t["peak_opens_s"] == 20000
    # an epoch's opens: each of W = 200 x 2 workers reads m = 2,500 images over S shards, opening S (1 - (1 - 1/S)^m)
    w = 400
    assert t["epoch_opens"] == pytest.approx(w * s * (1 - (1 - 1 / s) ** (1e6 / w)))
    assert t["mean_opens_s"] == pytest.approx(t["epoch_opens"] / 50)
    assert terms(m, ranks=20)["epoch_opens"] == pytest.approx(40 * s, rel=1e-6)  # 25,000 reads a worker: all S
    assert terms(m, ranks=200_000)["epoch_opens"] == pytest.approx(1e6, rel=0.01)  # 2.5 reads a worker: each an open
    # staging: N D over B, no faster than a node's link or its own copy; it fits when D <= L
    assert t["stage_s"] == pytest.approx(100 * d / 50e9) and t["stage_of_run"] == pytest.approx(200 / 2000)
    assert terms(m, nodes=1)["stage_s"] == pytest.approx(d / 10e9)  # one node: its link bounds it
    assert terms(dataclasses.replace(m, node_copy_bytes_s=0.5e9), nodes=1)["stage_s"] == pytest.approx(d / 0.5e9)
    assert t["fits"] and not terms(model(local_disk=Figure(99.0, "x", "--local-disk-gb")))["fits"]
    # the cache: D once over min(B, N link), no shorter than the epoch's compute; a node keeps D / N in its memory
    assert t["cache_first_epoch_s"] == pytest.approx(50.0)  # 2 s of reading inside a 50 s epoch
    assert terms(m, epoch_s=1.0)["cache_first_epoch_s"] == pytest.approx(d / 50e9)
    assert terms(m, nodes=2, epoch_s=1.0)["cache_first_epoch_s"] == pytest.approx(d / 20e9)  # 2 links < B
    assert t["cache_node_bytes"] == pytest.approx(d / 100) and t["cache_fits"]
    assert not terms(m, nodes=1)["cache_fits"]  # 100 GB on one node against its 50


@pytest.mark.parametrize("change, term, factor", [
    (dict(image_bytes=200e3), "machine_bytes_s", 2), (dict(image_bytes=200e3), "node_bytes_s", 2),
    (dict(image_bytes=200e3), "stage_s", 2), (dict(image_bytes=200e3), "bandwidth_share", 2),
    (dict(bandwidth=Figure(100.0, "f", "--fs-gb-s")), "stage_s", 0.5),
    (dict(bandwidth=Figure(100.0, "f", "--fs-gb-s")), "bandwidth_share", 0.5),
    (dict(opens=Figure(80000.0, "f", "--fs-opens-per-s")), "opens_share", 0.5),
])
def test_one_input_moves_its_terms_as_the_formula_says(change, term, factor):
    assert terms(model(**change))[term] == pytest.approx(factor * terms(model())[term])


def test_the_node_count_moves_staging_and_the_per_node_rate():
    m, t = model(), terms(model())
    assert terms(m, nodes=200)["stage_s"] == pytest.approx(2 * t["stage_s"])  # twice the copies over the same B
    assert terms(m, nodes=200)["node_bytes_s"] == pytest.approx(t["node_bytes_s"] / 2)
    assert terms(m, images_s=40000)["peak_opens_s"] == 2 * t["peak_opens_s"]


@pytest.mark.parametrize("change, run, path, says", [
    (dict(), dict(run_s=1e5), "stage", "of the run, and fits its 200 GB"),  # 200 s of a 27 h run
    (dict(local_disk=Figure(50.0, "x", "--local-disk-gb")), dict(run_s=1e5, images_s=2000), "direct",
     "100.0 GB does not fit the node's 50 GB; direct reads need 0% of the filesystem's 50 GB/s"),
    (dict(), dict(images_s=2000), "direct", "their opens peak at 2,000/s, 5% of its 40,000"),
    (dict(), dict(), "cache", "its first epoch takes 50.0 s, no more than its compute"),
    (dict(), dict(epoch_s=1.0), "cache", "its first epoch takes 2.0 s, 1.0 s more than its compute"),
    (dict(cache=Figure(0.5, "x", "--cache-gb")), dict(), "direct",
     "a node's share of the cache, 1.0 GB, does not fit its 0.5 GB either"),
    (dict(cache=Figure(None, "", "--cache-gb")), dict(), "?",
     "profile p states no memory per node: give --cache-gb to weigh the cache"),
    (dict(bandwidth=Figure(None, "", "--fs-gb-s")), dict(), "?", "profile p states no aggregate read bandwidth: give --fs-gb-s"),
    (dict(opens=Figure(None, "", "--fs-opens-per-s")), dict(), "?",
     "profile p states no metadata rate: give --fs-opens-per-s to weigh direct reads against the cache"),
    (dict(opens=Figure(None, "", "--fs-opens-per-s")), dict(run_s=1e5), "stage", "fits its 200 GB"),
])
def test_the_path_follows_the_rule(change, run, path, says):
    t = terms(model(**change), **run)
    assert t["path"] == path and says in t["reason"], t["reason"]


def test_figures_come_from_the_flag_else_the_profile_else_are_asked_for():
    frontera, skx = get_profile("frontera-clx"), get_profile("stampede2-skx")
    assert resolve_figure(None, frontera, "fs_gb_s", "--fs-gb-s") == Figure(60.0, "profile frontera-clx", "--fs-gb-s")
    assert resolve_figure(120, frontera, "fs_gb_s", "--fs-gb-s") == Figure(120.0, "--fs-gb-s", "--fs-gb-s")
    assert not resolve_figure(None, skx, "fs_gb_s", "--fs-gb-s").known  # Stampede2's guide states none
    assert resolve_figure(None, skx, "local_disk_gb", "--local-disk-gb").value == 144
    with pytest.raises(ConfigError, match="--fs-gb-s 0: must be more than 0"):
        resolve_figure(0, skx, "fs_gb_s", "--fs-gb-s")
    assert get_profile("stampede2-knl").local_disk_gb == 107 and get_profile("stampede3-spr").local_disk_gb == 150
    for p in PROFILES.values():  # every storage figure names its source
        if p.fs_gb_s or p.fs_opens_per_s or p.local_disk_gb:
            assert p.storage and p.storage_source, p.name


def test_startup_takes_the_profiles_bandwidth_and_assumes_only_where_none_is_known():
    step, _ = PlanInputs(profile="frontera-clx", throughput="100").build()
    startup, notes = PlanInputs(profile="frontera-clx", throughput="100").startup(step)
    assert startup.fs_bandwidth_bytes_s == 60e9 and "60 GB/s (profile frontera-clx) in all" in " ".join(notes)
    assert startup.fs_opens_per_s == 50000 and "50,000 opens/s (assumed)" in " ".join(notes)
    startup, notes = PlanInputs(profile="stampede2-skx", throughput="100", fs_gb_s=30).startup(step)
    assert startup.fs_bandwidth_bytes_s == 30e9 and "30 GB/s (--fs-gb-s)" in " ".join(notes)


@pytest.mark.parametrize("inputs, message", [
    (dict(stage_share=0), "--stage-share 0: give a share in (0, 1]"),
    (dict(direct_share=1.5), "--direct-share 1.5: give a share in (0, 1]"),
    (dict(image_kb=0), "--image-kb 0: must be more than 0"),
    (dict(shard_size="lots"), "--shard-size 'lots' is not a size"),
    (dict(stage_node_gb_s=-1), "--stage-node-gb-s -1: must be more than 0"),
    (dict(cache_gb=0), "--cache-gb 0: must be more than 0"),
])
def test_data_path_inputs_are_checked(inputs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        DataPathInputs(**inputs)


def test_a_dataset_of_unknown_size_is_not_priced_and_the_published_runs_are_imagenets():
    skx = get_profile("stampede2-skx")
    m, why = DataPathInputs().model(skx, 60, 50000, 12.5e9, 1000)
    assert m is None and "give --image-kb" in why
    m, _ = DataPathInputs(image_kb=20).model(skx, 60, 50000, 12.5e9, 1000)
    assert m.dataset_bytes == 20e6 and published_runs(m) == []
    m, _ = DataPathInputs().model(skx, 60, 50000, 12.5e9, IMAGENET_TRAIN, workers=6)
    assert m.workers == 6 and m.image_bytes == 110e3
    assert m.cache == Figure(48.0, "25% of profile stampede2-skx's 192 GB", "--cache-gb")  # data.cache_budget's 25%
    assert DataPathInputs(cache_gb=10).model(skx, 60, 50000, 12.5e9, IMAGENET_TRAIN)[0].cache.value == 10
    assert not DataPathInputs().model(get_profile("generic"), 60, 50000, 12.5e9, IMAGENET_TRAIN)[0].cache.known
    runs = {r["label"]: r for r in published_runs(m)}
    assert set(runs) == {"resnet50-skx1024", "resnet50-skx1600", "alexnet-cpu1024", "alexnet-skx2048"}
    assert runs["resnet50-skx1600"]["nodes"] == 800  # 1,600 processors, two a node
    assert runs["resnet50-skx1600"]["images_s"] == pytest.approx(90 * IMAGENET_TRAIN / (32 * 60))  # 60,055/s
    assert runs["alexnet-skx2048"]["images_s"] == pytest.approx(100 * IMAGENET_TRAIN / (11 * 60))  # 194,116/s


def plan_cli(tmp_path, *args) -> tuple[str, dict]:
    out = subprocess.run([PYTHON, "-m", "hpcdl", "plan", *args, "--json", str(tmp_path / "p.json")],
                         capture_output=True, text=True, check=True).stdout
    return out, json.loads((tmp_path / "p.json").read_text())


def test_plan_prints_the_data_path_of_the_stampede2_preset(tmp_path):
    """The table after the plan's: at each node count the staging time, the per-node rate, the peak opens and the
    path chosen, each as the JSON's terms give it, then the published runs on the same nodes and why."""
    nodes = ["--nodes", "256,1024,1600,2048", "--profile", "stampede2-skx"]
    out, report = plan_cli(tmp_path, "--preset", "resnet50_b32k_lars_skx1600", *nodes, "--fs-gb-s", "60",
                           "--fs-opens-per-s", "50000")
    assert "# data path (hpcdl/plan/data_path.py): 1,281,167 images x 110 KB = 140.9 GB in 263 shards" in out
    assert "the filesystem 60 GB/s (--fs-gb-s), 50,000 opens/s (--fs-opens-per-s); node-local disk 144 GB " \
           "(profile stampede2-skx)" in out
    lines = out.split("# data path")[1].splitlines()
    for row in report["rows"]:
        t = row["data_path"]
        line = next(x for x in lines if x.split()[:1] == [str(row["nodes"])] and x.split()[-1] == t["path"])
        for shown in (f"{t['stage_s'] / 60:.1f}", f"{t['node_bytes_s'] / 1e6:.1f}", f"{t['peak_opens_s']:,.0f}"):
            assert shown in line.split(), (shown, line)
        assert t["images_s"] == row["images_s"] and t["stage_s"] == pytest.approx(row["nodes"] * 140.9e9 / 60e9, rel=1e-3)
        assert t["path"] == "cache"  # staging is 16% of the run at 256 nodes; the opens peak at 64% of 50,000 and more
        assert f"# {row['nodes']}: cache: copying 140.9 GB to each node takes {t['stage_s'] / 60:.1f} min" in out
    assert [r["label"] for r in report["data_path_published"]] == ["resnet50-skx1024", "resnet50-skx1600",
                                                                   "alexnet-cpu1024", "alexnet-skx2048"]
    assert any(x.split()[:2] == ["800", "60,055"] and x.endswith("resnet50-skx1600") for x in lines)
    out, report = plan_cli(tmp_path, "--preset", "resnet50_b32k_lars_skx1600", *nodes)  # the guide states no B or M
    assert "# 256, 1024, 1600, 2048, resnet50-skx1024, resnet50-skx1600, alexnet-cpu1024, alexnet-skx2048: ?: profile " \
           "stampede2-skx states no aggregate read bandwidth or metadata rate: give --fs-gb-s, --fs-opens-per-s" in out
    assert all(r["data_path"]["stage_s"] is None and r["data_path"]["node_bytes_s"] > 0 for r in report["rows"])


def test_plan_prints_the_data_path_of_the_mlperf_sapphire_rapids_row(tmp_path):
    """Intel's MLPerf preset on Stampede3's Sapphire Rapids nodes: their 150 GB of /tmp hold ImageNet-1K's 140.9 GB,
    and at 16 nodes the copy is a small share of the run; VAST's bandwidth is not stated, so it is a flag."""
    out, report = plan_cli(tmp_path, "--preset", "resnet50_mlperf_cpu", "--profile", "stampede3-spr", "--precision",
                           "bf16", "--nodes", "16", "--fs-gb-s", "60")
    t = report["rows"][0]["data_path"]
    assert t["path"] == "stage" and t["fits"] and report["data_path_published"] == []
    assert "node-local disk 150 GB (profile stampede3-spr)" in out and "# 16: stage: copying 140.9 GB" in out
    assert t["stage_s"] == pytest.approx(max(16 * 140.9e9 / 60e9, 140.9e9 / Link.of(get_profile("stampede3-spr"))
                                             .bandwidth_bytes_s), rel=1e-3)
    out = subprocess.run([PYTHON, "-m", "hpcdl", "plan", "--profile", "stampede2-skx", "--nodes", "4", "--batch", "256",
                          "--train-images", "50000"], capture_output=True, text=True, check=True).stdout
    assert "# data path: not priced: give --image-kb, the mean size of the 50,000 stored training images" in out
