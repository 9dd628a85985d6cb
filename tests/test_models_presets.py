"""Models, presets and the optimizer benchmarks' behaviour (not their speed)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from hpcdl import names
from hpcdl.errors import ConfigError
from hpcdl.models import MODELS, build_model
from hpcdl.models.alexnet_bn import AlexNetBN
from hpcdl.optim.factory import build_optimizer
from hpcdl.optim.schedule import LRSchedule
from hpcdl.presets import PRESETS, get_preset, mlperf_lars_lr

ALEXNET_BN = [("conv1", nn.Conv2d), ("relu1", nn.ReLU), ("pool1", nn.MaxPool2d), ("bn1", nn.BatchNorm2d),
              ("conv2", nn.Conv2d), ("relu2", nn.ReLU), ("pool2", nn.MaxPool2d), ("bn2", nn.BatchNorm2d),
              ("conv3", nn.Conv2d), ("relu3", nn.ReLU), ("bn3", nn.BatchNorm2d),
              ("conv4", nn.Conv2d), ("relu4", nn.ReLU), ("bn4", nn.BatchNorm2d),
              ("conv5", nn.Conv2d), ("relu5", nn.ReLU), ("pool5", nn.MaxPool2d), ("flatten", nn.Flatten),
              ("fc6", nn.Linear), ("relu6", nn.ReLU), ("drop6", nn.Dropout),
              ("fc7", nn.Linear), ("relu7", nn.ReLU), ("drop7", nn.Dropout), ("fc8", nn.Linear)]


def test_alexnet_bn_has_the_documented_layer_sequence():
    model = AlexNetBN(num_classes=1000)
    assert [(n, type(m)) for n, m in model.named_children()] == ALEXNET_BN
    assert not any(isinstance(m, nn.LocalResponseNorm) for m in model.modules())
    assert (model.conv1.kernel_size, model.conv1.stride, model.conv1.out_channels) == ((11, 11), (4, 4), 96)
    assert [model.fc6.in_features, model.fc6.out_features, model.fc8.out_features] == [9216, 4096, 1000]
    weights = torch.cat([m.weight.flatten() for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))])
    assert abs(weights.std().item() - 0.01) < 5e-4 and abs(weights.mean().item()) < 5e-4
    assert model(torch.zeros(2, 3, 227, 227)).shape == (2, 1000)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_builds_and_runs(name):
    model = build_model(name, num_classes=7)
    size = 64 if name != "alexnet_bn" else MODELS[name].crop
    assert model(torch.zeros(1, 3, size, size)).shape == (1, 7)
    assert not any("rank" in n for n, _ in model.named_modules())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_resolves(name):
    cfg = get_preset(name)
    assert cfg.name == name and cfg.model.name in MODELS
    assert cfg.per_rank_batch * cfg.ranks == cfg.global_batch
    d = cfg.derived()
    assert 0 <= d["warmup_steps"] < d["total_steps"] and d["peak_lr"] > 0
    opt = build_optimizer(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), cfg.optimizer)
    sched = LRSchedule(opt, cfg.schedule)
    first = cfg.schedule.warmup_start_lr if d["warmup_steps"] else d["peak_lr"]
    assert opt.param_groups[0]["lr"] == pytest.approx(first)  # the schedule set step 0's lr
    if cfg.schedule.decay != "poly_caffe":  # Caffe's poly counts from step 0, so it is below peak here
        assert sched.cfg.lr(d["warmup_steps"]) == pytest.approx(d["peak_lr"])


def test_presets_show_prints_the_derived_numbers():
    out = subprocess.run([sys.executable, "-m", "hpcdl", "presets", "show", "resnet50_b32k_lars"],
                         capture_output=True, text=True, check=True).stdout
    assert "peak lr 31.2" in out and "warmup 25 epochs = 1000 steps" in out
    assert "steps per epoch 40 (1,281,167 / 32,768 = 39.1, rounded up" in out
    listing = subprocess.run([sys.executable, "-m", "hpcdl", "presets"], capture_output=True, text=True).stdout
    assert all(name in listing for name in PRESETS)
    bad = subprocess.run([sys.executable, "-m", "hpcdl", "presets", "show", "resnet51"], capture_output=True, text=True)
    assert bad.returncode == 2 and "resnet50_b32k_lars" in bad.stderr


def test_mlperf_lr_rule_and_stampede2_variants():
    assert mlperf_lars_lr(32768) == (31.2, 25.0) and mlperf_lars_lr(16384) == (25.0, 5.0)
    assert mlperf_lars_lr(8192) == (10.0, 5.0)
    assert get_preset("alexnet_bn_b32k_skx1024").per_rank_batch == 32
    assert get_preset("resnet50_b32k_lars_knl2048").per_rank_batch == 16
    skx = get_preset("resnet50_b32k_lars_skx1600")
    assert (skx.per_rank_batch, skx.global_batch) == (20, 32000)
    assert skx.schedule.peak_lr == pytest.approx(31.2 * 32000 / 32768)
    with pytest.raises(ConfigError, match="preset"):
        get_preset("nope")


@pytest.mark.slow
def test_bench_optim_times_each_optimizer_on_the_same_model():
    from hpcdl.bench import run
    from hpcdl.bench.optim import cases, format_report

    report = run("optim", model="tiny_cnn", steps=2, rounds=2)
    assert set(report.ms_per_step) == set(cases()) == {*names.OPTIMIZER_TABLE, "lars (caffe)"}
    assert report.ratio_to_sgd["sgd"] == 1.0
    assert report.parameters == sum(p.numel() for p in build_model("tiny_cnn").parameters())
    assert "vs sgd" in format_report(report)


def test_bench_large_batch_runs_as_one_slurm_job_on_two_ranks_with_its_budget_table_and_plot(slurm, tmp_path):
    """The harness's small form: every optimizer at two batches (16, and 256: 18% of the digits), two lrs, one
    seed, 2 epochs, dealt over the 2 ranks of one job; the budget is printed before the table."""
    from conftest import PYTHON, load_json, sbatch_wait

    from hpcdl.bench.largebatch import reference_lr
    from hpcdl.launch import job_request
    from hpcdl.launch.sbatch import render_sbatch

    optimizers = ("sgd", "nesterov", "lars", "lamb", "adamw", "schedulefree", "muon")
    script = tmp_path / "lb.sbatch"
    script.write_text(render_sbatch(
        job_request(profile="local", nodes=1, tasks_per_node=2, time="10", python=PYTHON, output=f"{tmp_path}/%j.out"),
        ["bench", "large-batch", "--optimizers", ",".join(optimizers), "--batches", "16,256", "--epochs", "2",
         "--seeds", "1", "--lr-factors", "0.5,2", "--json", f"{tmp_path}/lb.json", "--plot", f"{tmp_path}/lb.png"]))
    job = sbatch_wait(script, timeout=400)
    out = (tmp_path / f"{job}.out").read_text()
    report = load_json(tmp_path / "lb.json")
    assert report["ranks"] == 2 and report["runs"] == 7 * 2 * 2 and report["classes"] == 10
    assert out.index("budget: 7 optimizers x 2 batches x 2 lrs x 1 seeds = 28 runs") < out.index("best validation")
    cells = {(c["optimizer"], c["batch"]): c for c in report["cells"]}
    assert set(cells) == {(o, b) for o in optimizers for b in (16, 256)}
    for (o, b), c in cells.items():
        assert c["lrs"] == pytest.approx([reference_lr(o, b) * f for f in (0.5, 2)]) and c["best_lr"] in c["lrs"]
        assert c["mean"] == max(c["means"]) and len(c["accuracy"]) == 1
    assert cells["sgd", 16]["mean"] > 50 and cells["lars", 16]["mean"] > 50  # they learn: the digits are real
    assert (tmp_path / "lb.png").stat().st_size > 10_000
    assert "muon" in out and "batch 256: best" in out


def test_large_batch_cells_pick_the_best_lr_by_its_mean_and_count_a_diverged_run_as_zero():
    import math

    from hpcdl.bench.configs import LargeBatchBench
    from hpcdl.bench.largebatch import _cells, runs_of

    runs = runs_of(LargeBatchBench(optimizers="adamw", batches="32", lr_factors="1,4", seeds=2))
    assert [(r.lr / runs[0].lr, r.seed) for r in runs] == [(1, 0), (1, 1), (4, 0), (4, 1)]
    cell, = _cells(runs, {0: 80.0, 1: 90.0, 2: 99.0, 3: math.nan}, 1000)
    assert cell.best_lr == runs[0].lr and cell.mean == 85.0 and cell.means == (85.0, 49.5) and cell.diverged == 1
    assert cell.steps_per_epoch == 32 and cell.accuracy == (80.0, 90.0)
    with pytest.raises(ConfigError, match="--optimizers"):
        runs_of(LargeBatchBench(optimizers="adam"))


def test_criterion_smooths_labels_and_ignores_evaluation_padding():
    from hpcdl.train.step import criterion

    cfg = get_preset("resnet50_b32k_lars")
    loss = criterion(cfg.label_smoothing)
    logits = torch.tensor([[4.0, 0.0, 0.0], [0.0, 4.0, 0.0]])
    smoothed = loss(logits, torch.tensor([0, 1]))
    plain = nn.functional.cross_entropy(logits, torch.tensor([0, 1]))
    assert cfg.label_smoothing == 0.1 and smoothed > plain
    assert loss(logits, torch.tensor([0, -1])) == pytest.approx(loss(logits[:1], torch.tensor([0])).item())


def test_the_imagenet22k_preset_shows_its_citations_and_plans_with_its_classes(tmp_path):
    show = subprocess.run([sys.executable, "-m", "hpcdl", "presets", "show", "resnet101_imagenet22k_ibm"],
                          capture_output=True, text=True, check=True).stdout
    assert "arXiv:1708.02188" in show and "33.8%" in show and "Not stated in what we could read" in show
    assert "decay multistep x0.1 at epochs 22, 45, 60" in show and "7,500,000 / 8,192" in show
    cfg = get_preset("resnet101_imagenet22k_ibm")
    assert (cfg.num_classes, cfg.model.name, cfg.global_batch, cfg.crop) == (21841, "resnet101", 8192, 224)
    plan = subprocess.run([sys.executable, "-m", "hpcdl", "plan", "--preset", "resnet101_imagenet22k_ibm", "--nodes",
                           "64,256", "--profile", "stampede3-spr"], capture_output=True, text=True,
                          env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert plan.returncode == 0, plan.stderr
    grads = 4 * sum(p.numel() for p in build_model("resnet101", 21841).parameters())
    assert f"model resnet101 with 21,841 classes: {grads / 1e6:.1f} MB of gradients" in plan.stdout
    assert "global batch 8192, 67 epochs of 7,500,000 images" in plan.stdout
    assert [line.split()[0] for line in plan.stdout.splitlines() if line.split()[:1] in (["64"], ["256"])][:2] == ["64", "256"]


def test_the_nesterov_preset_cites_nado_et_al_and_the_plan_counts_each_optimizers_state():
    show = subprocess.run([sys.executable, "-m", "hpcdl", "presets", "show", "resnet50_b32k_nesterov"],
                          capture_output=True, text=True, check=True).stdout
    assert "arXiv:2102.06356" in show and "total 2,512 steps" in show and "optimizer nesterov (mlperf" in show
    weights = 4 * sum(p.numel() for p in build_model("resnet50").parameters())
    for how, optimizer, copies in ((["--preset", "resnet50_b32k_nesterov"], "nesterov", 1),
                                   (["--batch", "32768", "--optimizer", "schedulefree"], "schedulefree", 2)):
        plan = subprocess.run([sys.executable, "-m", "hpcdl", "plan", *how, "--nodes", "64", "--profile",
                               "stampede3-spr"], capture_output=True, text=True)
        assert plan.returncode == 0, plan.stderr
        assert f"optimizer {optimizer}'s state {copies * weights / 1e6:.0f} MB ({copies} tensor per weight)" in plan.stdout
        assert f"checkpoint {(1 + copies) * weights / 1e6:.0f} MB" in plan.stdout


def test_animal_mnist_is_written_from_its_package_packed_and_the_harness_trains_on_the_packed_dataset(tmp_path):
    """datasets/animal_mnist's recipe (20 images a class), hpcdl pack, then bench large-batch on the packed
    folder: the images decoded at --crop, every class present, Schedule-Free's BN statistics taken at x."""
    from conftest import PYTHON, REPO, hpcdl, load_json

    wrote = subprocess.run([PYTHON, str(REPO / "datasets" / "animal_mnist" / "write.py"), str(tmp_path / "src"),
                            "--per-class", "20"], capture_output=True, text=True)
    assert wrote.returncode == 0, wrote.stderr
    assert "wrote 160 train and 40 val images of 10 animals" in wrote.stdout
    for split in ("train", "val"):
        packed = hpcdl("pack", tmp_path / "src" / split, tmp_path / "packed" / split, "--tree", "folder")
        assert packed.returncode == 0, packed.stderr
    bench = hpcdl("bench", "large-batch", "--data", tmp_path / "packed", "--crop", "28", "--optimizers",
                  "sgd,schedulefree", "--batches", "16,64", "--epochs", "2", "--seeds", "1", "--lr-factors", "1",
                  "--json", tmp_path / "lb.json")
    assert bench.returncode == 0, bench.stderr[-3000:]
    report = load_json(tmp_path / "lb.json")
    assert (report["train_images"], report["val_images"], report["classes"]) == (160, 40, 10)
    assert report["data"].endswith("(28x28)") and len(report["cells"]) == 4
    assert all(0 <= c["mean"] <= 100 for c in report["cells"])
    missing = hpcdl("bench", "large-batch", "--data", tmp_path / "packed" / "train")
    assert missing.returncode != 0 and "no train/ in it" in missing.stderr
