"""Models, presets and the optimizer benchmarks' behaviour (not their speed)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from hpcdl.presets import PRESETS, get_preset, mlperf_lars_lr
from hpcdl.errors import ConfigError
from hpcdl.models import MODELS, build_model
from hpcdl.models.alexnet_bn import AlexNetBN
from hpcdl.optim.factory import build_optimizer
from hpcdl.optim.schedule import LRSchedule

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
    from hpcdl.bench.optim import CASES, format_report

    report = run("optim", model="resnet18", steps=2, rounds=2)
    assert set(report.ms_per_step) == set(CASES) and report.ratio_to_sgd["sgd"] == 1.0
    assert report.parameters == sum(p.numel() for p in build_model("resnet18").parameters())
    assert "vs sgd" in format_report(report)


@pytest.mark.slow
def test_bench_large_batch_trains_the_three_recipes():
    from hpcdl.bench import run

    report = run("large-batch", epochs=3, seeds=1)
    rows = {r.recipe: r for r in report.rows}
    assert report.train_images == 1437 and report.val_images == 360
    assert rows["large-batch SGD (linear scaling)"].batch == 1437 // 8
    assert rows["large-batch SGD (linear scaling)"].peak_lr == pytest.approx(0.02 * 179 / 4)
    assert rows["small-batch SGD"].mean > 80  # it learns: the digits are real and separable


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
