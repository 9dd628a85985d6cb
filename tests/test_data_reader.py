"""The reader: samplers across 2 ranks, the dataset after fork, transforms, staging."""

import io
import json
import multiprocessing
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, DistributedSampler

from hpcdl.bench.reports import DataReport
from hpcdl.data.dataset import PADDING_LABEL, ShardDataset
from hpcdl.data.pack import PackConfig, pack
from hpcdl.data.sampler import DistributedShardSampler, Sample
from hpcdl.data.stage import stage
from hpcdl.data.synthetic import generate
from hpcdl.data.transforms import Augment, DecodeOnly, EvalTransform, normalize_batch
from hpcdl.errors import ConfigError, DataError

SIZES = [7, 13, 5, 11, 9, 6, 12]  # unequal shards, 63 images: the awkward case


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("reader")
    gen = generate(str(root / "src"), classes=3, per_class=10, size=(150, 110))
    pack(PackConfig(src=gen.root, out=str(root / "out"), shard_size="64K", workers=1))
    return root


def samplers(mode, world=2, **kw):
    return [DistributedShardSampler(SIZES, num_replicas=world, rank=r, mode=mode, **kw) for r in range(world)]


def epoch(sampler, e):
    sampler.set_epoch(e)
    return list(sampler)


def test_global_mode_is_distributed_sampler():
    dataset = list(range(sum(SIZES)))
    for rank, s in enumerate(samplers("global", seed=5)):
        ref = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=5)
        ref.set_epoch(3)
        assert epoch(s, 3) == list(ref)


@pytest.mark.parametrize("mode", ["global", "shard"])
def test_two_ranks_split_an_epoch(mode):
    ranks = samplers(mode, seed=1)
    first = [epoch(s, 0) for s in ranks]
    assert len(first[0]) == len(first[1]) == ranks[0].num_samples == ranks[1].num_samples
    counts = Counter(first[0] + first[1])
    assert set(counts) == set(range(sum(SIZES)))  # covered
    padding = len(first[0]) + len(first[1]) - sum(SIZES)
    assert sum(c - 1 for c in counts.values()) == padding < (2 if mode == "global" else max(SIZES))  # disjoint but for padding
    assert [epoch(s, 1) for s in ranks] != first
    batches = [len(list(DataLoader(list(range(100)), batch_size=4, sampler=s))) for s in ranks]
    assert batches[0] == batches[1]
    if mode == "shard":  # a rank reads whole shards, and only its own
        starts = np.cumsum([0] + SIZES)
        shard_of = lambda i: int(np.searchsorted(starts, i, side="right")) - 1
        owned = [{shard_of(i) for i in set(f)} for f in first]
        assert not owned[0] & owned[1]
        for r in range(2):
            assert sum(SIZES[s] for s in owned[r]) == len(set(first[r]))


@pytest.mark.parametrize("mode", ["global", "shard"])
def test_evaluation_counts_every_image_once(mode):
    ranks = samplers(mode, shuffle=False)
    seen = [epoch(s, 0) for s in ranks]
    assert len(seen[0]) == len(seen[1])
    assert all(isinstance(i, Sample) and i.epoch == 0 for s in seen for i in s)
    real = [i for s in seen for i in s if not i.padding]
    assert sorted(real) == list(range(sum(SIZES)))


@pytest.mark.parametrize("mode", ["global", "shard"])
def test_mid_epoch_state_round_trip_resumes_exactly(mode):
    a = samplers(mode, seed=3)[1]
    a.set_epoch(2)
    full = list(a)
    it = iter(a)
    head = [next(it) for _ in range(11)]
    ahead = [next(it) for _ in range(5)]  # a loader's read-ahead: not trained, so not in the state
    assert a.advance(11) == head and [s.epoch for s in head] == [2] * 11
    state = a.state_dict()
    b = samplers(mode, seed=3)[1]
    b.load_state_dict(state)
    b.set_epoch(2)  # what a trainer calls after loading: it must not rewind
    assert len(b) == len(full) - 11
    assert head + list(b) == full and list(b)[:5] == ahead
    list(a)  # running the iterator dry moves nothing: only advance does
    assert a.state_dict() == state and a.fraction_done() == 11 / len(full)
    with pytest.raises(ValueError, match="cannot advance"):
        a.advance(len(full))
    with pytest.raises(ConfigError, match="num_replicas"):
        samplers(mode, world=3, seed=3)[0].load_state_dict(state)


def _train(ranks, steps, batch):
    """What ``steps`` global steps of ``batch`` per rank train, in order (one global step after another), and
    each rank's sampler state after them."""
    its = [iter(r) for r in ranks]
    order = [next(it) for _ in range(steps) for it in its for _ in range(batch)]
    for r in ranks:
        r.advance(steps * batch)
    return order, [r.state_dict() for r in ranks]


@pytest.mark.parametrize("mode", ["global", "shard"])
def test_a_resume_on_fewer_and_more_ranks_trains_each_unseen_sample_once(mode):
    """96 images, global batch 16: 8 ranks for 2 steps, then 4 ranks for 1, then 2 ranks to the epoch's end,
    then 4 again: every image of the epoch once. In global mode the order is the uninterrupted run's."""
    sizes = [12] * 8
    make = lambda world: [DistributedShardSampler(sizes, world, r, mode, seed=5) for r in range(world)]
    first = make(8)
    for r in first:
        r.set_epoch(1)
    seen, states = _train(first, 2, 2)
    second = make(4)
    for r, s in zip(second, states):
        r.load_state_dict(s, remap=True)  # each rank loads rank 0's copy in a trainer; any rank's is the same
        r.set_epoch(1)
    assert len(second[0]) == (96 - 32) // 4
    more, states = _train(second, 1, 4)
    third = make(2)
    for r in third:
        r.load_state_dict(states[0], remap=True)
        r.set_epoch(1)
    rest = [list(r) for r in third]
    seen += more + [i for j in range(len(rest[0])) for i in (rest[0][j], rest[1][j])]
    assert sorted(seen) == list(range(96)) and all(i.epoch == 1 for i in seen)
    if mode == "global":
        whole = make(1)[0]
        whole.set_epoch(1)
        blocks = lambda order: [sorted(order[k:k + 16]) for k in range(0, 96, 16)]
        assert blocks(seen) == blocks(list(whole))  # each global step: the same block of the permutation
    cut = make(2)[0]  # the third run, cut again after 2 steps of 2
    cut.load_state_dict(states[0], remap=True)
    cut.set_epoch(1)
    cut.advance(4)
    again = make(4)
    for r in again:
        r.load_state_dict(cut.state_dict(), remap=True)
        r.set_epoch(1)
    assert [len(r) for r in again] == [(96 - 32 - 16 - 8) // 4] * 4 and again[0].state_dict()["cuts"] == [[8, 4], [4, 4], [2, 4]]
    with pytest.raises(ConfigError, match="here the same number of ranks"):
        make(4)[0].load_state_dict(cut.state_dict())
    for r in again:  # the cut epoch over, the next is whole again
        r.advance(len(r))
        r.set_epoch(2)
    assert again[0].cuts == [] and again[0].position == 0 and len(epoch(again[0], 2)) == 24


def test_sampler_refuses_what_cannot_work():
    with pytest.raises(ConfigError, match="shard per rank"):
        DistributedShardSampler([5, 5], num_replicas=3, rank=0, mode="shard")
    with pytest.raises(ConfigError, match="mode"):
        DistributedShardSampler([5], mode="random")


def test_dataloader_workers_after_fork_read_the_right_pixels(packed):
    ds = ShardDataset(str(packed / "out"), DecodeOnly())
    keys = _keys(packed / "out")
    ds[0]  # opens a shard in the parent before the workers fork: they must not use that handle
    assert ds.files_opened == 1
    loader = DataLoader(ds, batch_size=None, num_workers=2, sampler=DistributedShardSampler(ds.shard_sizes))
    checked = 0
    for (index, _), (image, label) in zip(loader.sampler.indices(), loader):
        source = np.asarray(Image.open(packed / "src" / keys[index]).convert("RGB"))
        assert np.array_equal(image.numpy(), source), keys[index]
        assert keys[index].startswith(ds.classes[label]["wnid"])
        checked += 1
    assert checked == len(ds) == 30


def _keys(root: Path) -> list[str]:
    from hpcdl.data.format import Manifest, open_h5

    keys = []
    for s in Manifest.load(str(root / "manifest.json")).shards:
        with open_h5(str(root / s.file)) as f:
            keys += list(f["keys"].asstr()[:])
    return keys


def test_padding_is_labelled_so_evaluation_does_not_count_it(packed):
    ds = ShardDataset(str(packed / "out"))
    ranks = [DistributedShardSampler(ds.shard_sizes, num_replicas=4, rank=r, shuffle=False) for r in range(4)]
    labels = [[ds[i][1] for i in s] for s in ranks]  # 30 images over 4 ranks: 8 each, 2 repeats
    assert [len(lab) for lab in labels] == [8] * 4
    assert sum(lab.count(PADDING_LABEL) for lab in labels) == 2
    assert sorted(lab for r in labels for lab in r if lab >= 0) == sorted(ds[i][1] for i in range(30))


def test_transforms_match_torchvision_geometry():
    rgb = np.random.default_rng(0).integers(0, 255, (375, 500, 3), dtype=np.uint8)
    rgb[:, :250] = 0  # a left half that is black: a flip shows up
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "JPEG", quality=95)
    data = buf.getvalue()
    val = EvalTransform()(data)
    import torchvision.transforms as T

    ref = T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()])(Image.open(io.BytesIO(data)))
    assert val.shape == (224, 224, 3)
    assert (val.permute(2, 0, 1).float() - ref.float()).abs().mean() < 3
    crops = [Augment("imagenet")(data) for _ in range(40)]
    assert all(c.shape == (224, 224, 3) and c.dtype == torch.uint8 for c in crops)
    batch = normalize_batch(torch.stack(crops), channels_last=True)
    assert batch.shape == (40, 3, 224, 224) and batch.is_contiguous(memory_format=torch.channels_last)
    assert abs(float(batch.mean())) < 2


def _stage(root, dest, local_rank, q):
    try:
        q.put(stage(root, dest, local_rank, timeout_s=60))
    except DataError as exc:
        q.put(exc)


def test_staging_copies_once_and_the_other_local_rank_waits(packed, tmp_path):
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_stage, args=(str(packed / "out"), str(tmp_path), r, q)) for r in (1, 0)]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join()
    assert results == [str(tmp_path / "out")] * 2
    staged = ShardDataset(str(tmp_path / "out"), verify="full")
    assert len(staged) == 30
    first = os.stat(tmp_path / "out" / staged.manifest.shards[0].file).st_mtime_ns
    stage(str(packed / "out"), str(tmp_path), 0)  # a later job on the node reuses the copy
    assert os.stat(tmp_path / "out" / staged.manifest.shards[0].file).st_mtime_ns == first


@pytest.mark.slow
def test_bench_data_counts_files_opened_per_epoch(tmp_path):
    from hpcdl.bench import run
    from hpcdl.bench.data import format_report

    report = run("data", images=48, classes=4, rounds=2, batch_size=8, json_path=str(tmp_path / "r.json"),
                 crop=64, recipes="imagenet; light, rot90", per_core_images=8)
    rows = {r.reader: r for r in report.rows}
    assert rows["ImageFolder"].files_opened_per_epoch == 48 == rows["ImageFolder"].files_opened_next_epochs / 1
    assert 1 <= rows["shard reader"].files_opened_per_epoch <= report.shards * 2
    assert rows["shard reader"].files_opened_next_epochs == 0  # the workers keep their shards open
    assert rows["bare decode"].files_opened_per_epoch == 0
    assert all(r.images_per_s_per_worker > 0 for r in rows.values())
    assert "shard reader / ImageFolder" in format_report(report)
    # one core: every decoder, and each recipe through each decode path, side by side
    assert {"pillow", "pillow draft", "torchvision"} <= set(report.decoders) and report.per_core_images == 8
    assert [r.spec for r in report.recipes] == ["imagenet", "light, rot90"]
    for r in report.recipes:
        rates = r.images_per_s_per_core
        assert set(rates) == {"pillow", "torchvision"} and r.fastest == max(rates, key=rates.get)
        assert r.default_over_fastest == pytest.approx(rates[r.default] / rates[r.fastest])
    assert "light, rot90" in format_report(report)
    assert DataReport.from_json(str(tmp_path / "r.json")) == report  # the JSON holds the whole report
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["images_packed"] == 48 and written["benchmark"] == "data" and written["config"]["images"] == 48


def test_stage_command_prints_the_staged_root(packed, tmp_path):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "hpcdl", "stage", str(packed / "out"), str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(tmp_path / "out")
    assert len(ShardDataset(run.stdout.strip(), verify="full")) == 30
    # the verdict on standard error, standard output the staged root alone ($(hpcdl stage ... | head -1) in a script)
    assert "stage: 1 node(s) each copy" in run.stderr and "give --epochs" in run.stderr, run.stderr


@pytest.mark.parametrize("nodes, epochs, says", [
    (1600, 90, "staging costs more than it saves here (1600 nodes >= 90 epochs)"),
    (90, 90, "costs more than it saves here (90 nodes >= 90 epochs)"),
    (32, 90, "staging saves 8526.0 GB of direct reads"),  # (90 - 32) x 147 GB
    (1, 3, "staging saves 294.0 GB of direct reads"),
    (8, 0, "give --epochs to weigh staging against direct reads"),
])
def test_stage_says_when_it_costs_the_shared_filesystem_more_than_it_saves(nodes, epochs, says):
    """Each node copies the whole dataset: nodes x its bytes from the shared filesystem, against one copy for the
    node cache and one an epoch for direct reads. At as many nodes as epochs, staging reads more than direct reads."""
    from hpcdl.data.stage import verdict

    said = verdict(147_000_000_000, nodes, epochs)
    assert says in said and f"{nodes * 147.0:.1f} GB in all" in said, said


def test_seeded_augmentation_ignores_workers_and_resume_point(packed):
    ds = ShardDataset(str(packed / "out"), Augment("imagenet", 48), seed=11)

    def run(workers, sampler):
        return [x for x, _ in DataLoader(ds, batch_size=4, sampler=sampler, num_workers=workers)]

    def sampler_at(epoch):
        s = DistributedShardSampler(ds.shard_sizes, seed=3)
        s.set_epoch(epoch)
        return s

    serial, parallel = run(0, sampler_at(1)), run(2, sampler_at(1))
    assert all(torch.equal(a, b) for a, b in zip(serial, parallel)) and len(serial) == 8
    other_epoch = run(0, sampler_at(2))
    assert not all(torch.equal(a, b) for a, b in zip(serial, other_epoch))
    s = sampler_at(1)
    s.load_state_dict({**s.state_dict(), "position": 12})  # resume after 3 batches of 4
    resumed = run(2, s)
    assert len(resumed) == 5 and all(torch.equal(a, b) for a, b in zip(serial[3:], resumed))


def test_a_read_the_filesystem_fails_names_the_file_as_storage_not_damage(packed, monkeypatch):
    """ENXIO or EIO from a read (a MooseFS chunk server or a Lustre OST down) is a StorageError naming the shard and
    the filesystem, not the damage that says to repack; a real stopped server gives it in test_pfs.py, this fake
    os.pread (named so) gives it here on demand. Another OSError keeps its own type."""
    import errno

    from hpcdl.errors import StorageError

    ds = ShardDataset(str(packed / "out"))
    real = os.pread
    for code, kind in ((errno.ENXIO, StorageError), (errno.EIO, StorageError), (errno.EBADF, OSError)):
        def fake_pread(fd, n, offset, code=code):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(os, "pread", fake_pread)
        with pytest.raises(kind) as raised:
            ds[0]
        monkeypatch.setattr(os, "pread", real)
        if kind is StorageError:
            said = str(raised.value)
            assert said.startswith(ds.paths[0]) and "not known damage to the shard" in said and f"errno {code}" in said
            assert "repack" not in said
        else:
            assert not isinstance(raised.value, DataError)
    assert ds[0][1] == ds[0][1]  # reads again once the filesystem answers
