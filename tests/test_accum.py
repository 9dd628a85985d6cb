"""Gradient accumulation at an epoch's end: a last step of fewer micro-batches than loop.accum_steps exchanges
the gradients at its own last micro-batch and divides by what it trained, on real gloo ranks."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from conftest import PYTHON, REPO, free_port, rank_env, start_ranks

from hpcdl.data.pack import PackConfig, pack
from hpcdl.data.sampler import DistributedShardSampler
from hpcdl.data.synthetic import generate

from hpcdl.presets import get_preset
from hpcdl.train.resume import Saved, plan_resume
from hpcdl.train.step import step_shape


def test_a_step_ends_with_the_epoch_on_every_rank_alike():
    assert step_shape(4, 3, None) == (4, 12)  # hpcdl bench: whole steps
    assert step_shape(4, 3, 20) == (4, 12)
    assert step_shape(4, 3, 8) == (3, 8)  # 3, 3 and 2 images: the last micro-batch exchanges
    assert step_shape(4, 2, 2) == (1, 2)  # the epoch's last micro-batch, short or not, alone
    assert step_shape(2, 5, 5) == (1, 5)


@pytest.mark.ranks
@pytest.mark.parametrize("mode", ["global", "shard"])
def test_an_epochs_short_last_step_keeps_the_replicas_equal_and_divides_by_what_it_trained(mode, tmp_path):
    """2 ranks, 39 samples, micro-batches of 3, accum 4: each epoch's last step has 3 micro-batches (3, 3, 2
    images), the shard sampler's deal padded to the fuller rank. After every step the replicas are bitwise equal
    and the update is SGD's on the mean loss over every rank's images of the step."""
    port = free_port()
    procs = [subprocess.Popen([PYTHON, str(REPO / "tests" / "accum_ranks.py"), mode, str(tmp_path)],
                              env=rank_env(r, 2, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["steps"] and [s["micro"] for s in ranks[0]["steps"]] == [s["micro"] for s in ranks[1]["steps"]]
    per_rank = ranks[0]["per_rank"]
    for epoch in (0, 1):
        micro = [s["micro"] for s in ranks[0]["steps"] if s["epoch"] == epoch]
        assert sum(map(sum, micro)) == per_rank and all(len(m) == 4 for m in micro[:-1])
        assert len(micro[-1]) < 4, micro  # the case: a short last step
    for rank in ranks:
        for s in rank["steps"]:
            assert s["replicas_equal"], s
            assert s["from_reference"] < 1e-5, s


def test_a_resume_on_one_rank_runs_the_saved_micro_batch_on_this_jobs_per_rank_batch():
    """A 4-rank checkpoint (accum 2, micro-batch 3, global batch 24) resumed by one process under the demo preset,
    whose config says 2 ranks: 24 per rank in 8 micro-batches of 3 (it was refused: 'the per-rank batch 12 does
    not split into loop.accum_steps=8 micro-batches')."""
    cfg = get_preset("demo_tiny_lars")
    cfg = dataclasses.replace(cfg, global_batch=24, loop=dataclasses.replace(cfg.loop, accum_steps=2))
    assert cfg.ranks == 2
    sampler = {"epoch": 0, "position": 12, "num_replicas": 4, "cuts": []}
    plan = plan_resume(Saved("ckpt-000000007.pt", 4, 24, 2, False, sampler, False), 1, cfg)
    now = plan.applied(cfg)
    assert (now.ranks, now.per_rank_batch, now.loop.accum_steps, now.micro_batch) == (1, 24, 8, 3)
    assert "loop.accum_steps 2 -> 8 keeps the micro-batch of 3 images" in plan.lines[0]


@pytest.fixture(scope="module")
def data246(tmp_path_factory) -> Path:
    """246 training images (divides by no rank count here) in 6 classes, 11 shards of 6 to 25."""
    root = tmp_path_factory.mktemp("data246")
    train = generate(str(root / "src"), classes=6, per_class=41, size=(80, 64), seed=4)
    pack(PackConfig(src=train.root, out=str(root / "train"), shard_size="64K", workers=1))
    return root / "train"


# Each leg: (ranks, the step it stops after; None: the schedule's end). The chain 4 -> 2 -> 3 -> 1 -> 4 ranks of
# issue 44 with both samplers, and a same-count resume (2 -> 2) of an epoch already resumed and cut; the global sampler's epochs take 11 steps (2 epochs: 22), the shard sampler's 11 or
# more (it pads each rank to the fullest), so its run has 3 epochs and stops at step 26, past epoch 1's end.
LEGS = {"global": ((4, 4), (2, 7), (2, 9), (3, 14), (1, 18), (4, None)),
        "shard": ((4, 4), (2, 7), (2, 9), (3, 14), (1, 18), (4, 26))}
# global: 2 epochs, the run's end; shard: 3 epochs, cut at 26. Epochs 0 and 1 are checked whole in both modes.
EPOCHS = {"global": 2, "shard": 3}


@pytest.mark.ranks
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["global", "shard"])
def test_a_chain_of_cuts_to_other_rank_counts_with_accumulation_trains_each_sample_once(data246, mode, tmp_path):
    """Global batch 24 over 246 images in micro-batches of 3 (loop.accum_steps=2 on 4 ranks), the default
    data.workers=4, whose read-ahead (4 batches a worker) reaches far past every cut below, so each checkpoint is
    written inside that window. Cut at step 4 (4 ranks), 7 and 9 (2 ranks: accum 4), 14 (3 ranks, into epoch 1: the
    micro-batch of 3 does not divide 8, accum stays 2: micro-batch 4), 18 (1 rank: accum 6), then on 4 ranks to the
    run's end (global) or step 26 (shard). Epochs end in short steps (epoch 0 on 3 ranks: 11 per rank, 8 and then
    3). The global run sends chunk_sparse gradients, whose residuals follow the ranks. Each leg ends with the replica
    check (exit 2 when they differ); each rank records the samples it trains: epochs 0 and 1 hold each of the 246
    samples, repeated only as the sampler's padding. Before the fixes the 1-rank leg was refused (the per-rank
    batch 12 ...) and the replicas diverged. This chain took over the read-ahead chain of test_train (240 images
    at accumulation 1: 4 -> 2 -> 2 -> 1 -> 4 -> 2 ranks; accumulation 1 -> 2 on a resume is test_scale's cut
    chain's). At the end, 5 ranks are refused: 24 does not split over 5, and a resume keeps the global batch."""
    extra = ["--set", "data.val=", "--set", "checkpoint.every_minutes=0", "--set", "loop.record_samples=true",
             "--set", "data.workers=4", "--set", "global_batch=24", "--set", "loop.accum_steps=2",
             "--set", f"epochs={EPOCHS[mode]}", "--set", "crop=32", "--set", f"data.sampler={mode}",
             "--set", "loop.backend=gloo", "--set", "data.reserve_cores=0"]  # data.workers: the default (the demo's is 1)
    if mode == "global":
        extra += ["--set", "sync.hook=chunk_sparse", "--set", "sync.chunk=256", "--set", "sync.dense_warmup_epochs=0.1"]
    run = tmp_path / "run"
    for world, steps in LEGS[mode]:
        where = tmp_path / f"w{world}-{steps or 'end'}"
        where.mkdir()
        args = ["train", "demo_tiny_lars", "--set", f"data.train={data246}", "--set", f"run_dir={run}",
                "--set", "loop.log_every=1", *(["--set", f"loop.max_steps={steps}"] if steps else []), *extra]
        procs = start_ranks(world, args, where)
        assert [p.wait(timeout=240) for p in procs] == [0] * world, (where / "rank0.log").read_text()[-3000:]
        log = (where / "rank0.log").read_text()
        assert f"replicas: identical on {world} ranks" in log, log[-3000:]
    log2, log1 = ((tmp_path / w / "rank0.log").read_text() for w in ("w2-7", "w1-18"))
    assert "written by 4 ranks, on 2: global batch 24 = 2 x 12 per rank (was 4 x 6)" in log2, log2[-3000:]
    assert "loop.accum_steps 2 -> 4 keeps the micro-batch of 3 images" in log2
    again = (tmp_path / "w2-9" / "rank0.log").read_text()
    assert "resuming from" in again and "written by" not in again, again[-3000:]  # the same ranks: no plan to apply
    assert "written by 3 ranks, on 1" in log1 and "loop.accum_steps 2 -> 6 keeps the micro-batch of 4 images" in log1
    if mode == "global":
        # 4 steps of 24 on 4 ranks trained 96 of 248 (246 padded to 4 x 62): 152 left, 2 of them padding
        assert "epoch 0 goes on with the 152 samples not yet trained, 76 per rank" in log2, log2[-3000:]
        assert "chunk_sparse residuals: old rank r's to rank r mod 2, scaled by 2/4" in log2
    sizes = [s["count"] for s in json.loads((data246 / "manifest.json").read_text())["shards"]]
    lines = [line.split()[:3] for f in sorted((run / "samples").iterdir()) for line in f.read_text().splitlines()]
    first = {}  # each epoch's first step
    for epoch, _, step in lines:
        first[int(epoch)] = min(first.get(int(epoch), int(step)), int(step))
    assert first[0] == 1 and 10 <= first[1] <= 14, first  # epoch 1 starts in the 3-rank leg (steps 10 to 14)
    starts = [1] + [steps + 1 for _, steps in LEGS[mode][:-1]]  # each leg's first step
    for epoch, world in ((0, 4), (1, 3)):
        sampler = DistributedShardSampler(sizes, world, 0, mode, seed=get_preset("demo_tiny_lars").data.seed)
        sampler.set_epoch(epoch)
        # repeats allowed: the padding that evens out the ranks the epoch starts on, and for each leg that resumes
        # it mid-way, what evens out that leg's ranks over the rest (at most ranks - 1)
        end = first.get(epoch + 1, 10 ** 6)
        cuts = sum(w - 1 for (w, _), start in zip(LEGS[mode], starts) if first[epoch] < start < end)
        seen = Counter(int(i) for e, i, _ in lines if int(e) == epoch)
        assert set(seen) == set(range(246)), epoch
        assert sum(seen.values()) - len(seen) <= world * sampler.num_samples - 246 + cuts, (epoch, sum(seen.values()))
    steps = [json.loads(line)["step"] for line in (run / "train.jsonl").read_text().splitlines() if '"kind": "step"' in line]
    summary = json.loads((run / "summary.json").read_text())
    end = 22 if mode == "global" else 26
    assert summary["outcome"] == "finished" and summary["steps"] == end and steps == list(range(1, end + 1)), summary
    if mode == "global":  # 24 does not split over 5 ranks: every rank refuses, naming the counts that do
        refused = tmp_path / "refused"
        refused.mkdir()
        args = ["train", "demo_tiny_lars", "--set", f"data.train={data246}", "--set", f"run_dir={run}", *extra]
        assert [p.wait(timeout=240) for p in start_ranks(5, args, refused)] == [2] * 5
        assert "global_batch=24 does not split over 5 ranks, and a resume keeps the global batch" in \
            (refused / "rank0.log").read_text()
