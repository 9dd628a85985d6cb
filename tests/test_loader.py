"""The loader's cores sized from measured rates (hpcdl.train.loader_sizing; the workers: hpcdl.data.loader): the
rule, the probes, the workers' priority, and the plan hpcdl train prints. Throughput figures are bench feed's
(docs/performance.md)."""

from __future__ import annotations

import json
import multiprocessing
import os
import re

import pytest
import torch
from conftest import hpcdl

from hpcdl.bench.reports import FeedReport
from hpcdl.data.dataset import InMemory, ShardDataset
from hpcdl.data.loader import LOADER_NICE, _start_worker
from hpcdl.data.transforms import Augment
from hpcdl.errors import ConfigError
from hpcdl.models import build_model
from hpcdl.train.loader_sizing import loader_cost, size_loader, step_rate


@pytest.mark.parametrize("cost, rate, kept", [(0.002, 16.0, 0), (0.002, 499.0, 0), (0.002, 500.0, 1),
                                               (0.002, 2600.0, 5)])
def test_whole_cores_only_where_the_measured_need_fills_them(cost, rate, kept):
    sizing = size_loader("auto", 4, lambda: (cost, rate))
    assert sizing.reserved == kept and sizing.need == pytest.approx(cost * rate)
    assert f"{cost * rate:.2f} cores needed: {kept} kept" in sizing.describe()
    assert ("a fraction of a core" in sizing.why) == (kept == 0)


def test_no_probe_without_workers_or_with_a_count():
    def never():
        raise AssertionError("measured")

    assert size_loader("auto", 0, never).reserved == 0 and "data.workers=0" in size_loader("auto", 0, never).why
    assert size_loader("3", 2, never).reserved == 3


def test_reserve_cores_is_checked_naming_the_field():
    from hpcdl.config import DataConfig

    with pytest.raises(ConfigError, match="data.reserve_cores='some'"):
        DataConfig(reserve_cores="some")
    assert DataConfig(reserve_cores=2).reserve_cores == "2"  # as a YAML file gives it
    with pytest.raises(ConfigError, match="data.in_memory=-1"):
        DataConfig(in_memory=-1)


def test_step_probe_leaves_the_model_as_it_was():
    model = build_model("tiny_cnn", num_classes=10)
    model.train()
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    import contextlib

    rate = step_rate(model, torch.nn.CrossEntropyLoss(), x, y, contextlib.nullcontext)
    assert rate > 0 and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # batch-norm statistics too
    assert torch.equal(rng, torch.get_rng_state())


def test_loader_probe_reads_the_shards_on_a_copy(data):
    ds = ShardDataset(str(data / "train"), Augment("resized_crop(min_scale=0.5), hflip", 32))
    cost = loader_cost(ds, budget_s=0.05)
    assert 0 < cost < 1 and ds.files_opened == 0 and not ds._open
    memory = InMemory(ds, 8)
    assert len(memory) == len(ds) and len(memory.samples) == 8
    assert torch.equal(memory[3][0], memory[11][0]) and memory[3][1] == memory[11][1]


def _worker_nice(queue):
    _start_worker(0)
    queue.put((os.nice(0), torch.get_num_threads()))


def test_a_worker_runs_below_computes_priority_on_one_thread():
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    p = ctx.Process(target=_worker_nice, args=(queue,))
    p.start()
    nice, threads = queue.get(timeout=30)
    p.join(timeout=30)
    assert nice == os.nice(0) + LOADER_NICE and threads == 1


@pytest.mark.slow
@pytest.mark.parametrize("reserve", ["auto", "1"])
def test_train_prints_the_loader_sizing_and_plans_threads_around_it(reserve, data, tmp_path):
    run = tmp_path / "run"
    done = hpcdl("train", "demo_tiny_lars", "--set", "global_batch=16", "--set", "crop=32", "--set", "epochs=4",
                 "--set", f"data.train={data / 'train'}", "--set", "data.val=", "--set", f"run_dir={run}",
                 "--set", "loop.max_steps=3", "--set", "data.workers=2", "--set", f"data.reserve_cores={reserve}")
    assert done.returncode == 0, done.stderr
    cpus = len(os.sched_getaffinity(0))
    line = next(x for x in done.stderr.splitlines() if "loader: " in x)
    threads = int(re.search(r"(\d+) threads per rank", done.stderr).group(1))
    if reserve == "auto":  # TinyCNN's step is cheap to feed at first sight only: the rule holds whatever was measured
        need = float(re.search(r"= ([\d.]+) cores needed: (\d+) kept", line).group(1))
        kept = int(re.search(r"cores needed: (\d+) kept", line).group(1))
        assert kept == int(need) and "ms of a core per image" in line
    else:
        kept = 1
        assert "1 cores kept (data.reserve_cores=1)" in line
    assert threads == (cpus - kept if cpus > kept else cpus)
    steps = [json.loads(x) for x in (run / "train.jsonl").read_text().splitlines() if '"kind": "step"' in x]
    assert len(steps) == 3


@pytest.mark.slow
def test_bench_feed_compares_jpegs_with_the_same_step_from_memory(data, tmp_path):
    report = tmp_path / "feed.json"
    done = hpcdl("bench", "feed", "--data", data / "train", "--model", "tiny_cnn", "--batch", "8", "--crop", "32",
                 "--layouts", "1x2,2x1", "--precisions", "fp32", "--steps", "2", "--warmup", "1", "--rounds", "1",
                 "--workers", "0,2", "--json", report, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = FeedReport.from_json(str(report)).rows
    assert [(r.layout, r.precision) for r in rows] == [("1x2", "fp32"), ("2x1", "fp32")]
    for r in rows:
        assert set(r.ratios) == {"jpeg, 0 workers", "jpeg, 2 workers"}
        for case, ratio in r.ratios.items():
            assert ratio == pytest.approx(r.images_per_s[case] / r.images_per_s["memory"])
            assert 0 <= r.data_share[case] < 1 and len(r.runs[case]) == 1
        assert "cores needed:" in r.loader  # the 2 workers' sizing line
    assert "jpeg/memory" in done.stdout and "loader sizing (rank 0, the most workers)" in done.stdout
    with pytest.raises(ConfigError, match="--layouts '2by1'"):
        from hpcdl.bench.feed import Config

        Config(layouts=("2by1",))
    with pytest.raises(ConfigError, match="--workers 1,1"):
        Config(workers=(1, 1))
