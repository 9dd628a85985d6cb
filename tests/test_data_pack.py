"""The packer and verify, on real JPEG trees written by the synthetic generator."""

import io
import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
from conftest import PYTHON, REPO
from PIL import Image

from hpcdl.data.format import Manifest, open_h5
from hpcdl.data.images import Encoding
from hpcdl.data.pack import PackConfig, detect_part, pack
from hpcdl.data.synthetic import generate, wnid
from hpcdl.data.verify import verify
from hpcdl.errors import ConfigError, DataError

SMALL = (160, 120)


def hpcdl(*args, check=True, **kw):
    run = subprocess.run([PYTHON, "-m", "hpcdl", *map(str, args)], capture_output=True, text=True, **kw)
    if check and run.returncode != 0:
        raise AssertionError(f"hpcdl {args} exited {run.returncode}:\n{run.stdout}\n{run.stderr}")
    return run


def packed_images(root):
    """key -> (stored bytes, label, (h, w), original (h, w)) for every image in every shard."""
    m = Manifest.load(os.path.join(root, "manifest.json"))
    out = {}
    for s in m.shards:
        with open_h5(os.path.join(root, s.file)) as f:
            offsets, labels, keys, sizes = f["offsets"][:], f["labels"][:], f["keys"].asstr()[:], f["sizes"][:]
            orig_sizes = f["orig_sizes"][:]
            for i, key in enumerate(keys):
                assert key not in out, f"{key} packed twice"
                out[key] = (f["images"][offsets[i]:offsets[i + 1]].tobytes(), int(labels[i]), tuple(sizes[i]),
                            tuple(orig_sizes[i]))
    return m, out


def pixels(data_or_path):
    src = io.BytesIO(data_or_path) if isinstance(data_or_path, bytes) else data_or_path
    return np.asarray(Image.open(src).convert("RGB"), dtype=np.int16)


def blur_diff(a, b, k=4):
    """Mean absolute difference of 4x4 block means: JPEG's loss on noise averages out, real errors do not."""
    h, w = (min(a.shape[0], b.shape[0]) // k) * k, (min(a.shape[1], b.shape[1]) // k) * k
    pool = lambda x: x[:h, :w].reshape(h // k, k, w // k, k, 3).mean((1, 3))
    return np.abs(pool(a) - pool(b)).mean()


def test_round_trip_keeps_bytes_labels_and_mixes_classes(tmp_path):
    gen = generate(str(tmp_path / "src"), classes=4, per_class=12, size=SMALL)
    m = pack(PackConfig(src=gen.root, out=str(tmp_path / "out"), shard_size="64K", workers=2))
    manifest, images = packed_images(tmp_path / "out")
    assert m.complete and manifest.num_images == gen.count == len(images) and not manifest.rejected
    assert [c["wnid"] for c in manifest.classes] == [wnid(c) for c in range(4)]
    for key, (data, label, size, _) in images.items():
        source = tmp_path / "src" / key
        assert data == source.read_bytes(), f"{key}: the original bytes were not kept"
        assert key.startswith(manifest.classes[label]["wnid"] + "/")
        assert size == Image.open(source).size[::-1]
    assert len(manifest.shards) > 2
    for s in manifest.shards:
        with open_h5(os.path.join(tmp_path / "out", s.file)) as f:
            assert f.attrs["format_version"] == 2 and f.attrs["num_classes"] == 4
            if s.count >= 4:
                assert len(set(f["labels"][:])) > 1, f"{s.file} holds a single class: no shuffle before sharding"
    assert verify(str(tmp_path / "out"), full=True) == []


def test_short_side_resizes_and_reencodes(tmp_path):
    gen = generate(str(tmp_path / "src"), classes=2, per_class=4)  # ImageNet-sized, about 500x375
    pack(PackConfig(src=gen.root, out=str(tmp_path / "out"), encoding=Encoding(short_side=128, quality=92), workers=1))
    _, images = packed_images(tmp_path / "out")
    for key, (data, _, (h, w), original) in images.items():
        sw, sh = Image.open(tmp_path / "src" / key).size
        assert original == (sh, sw)
        assert min(h, w) == 128 and abs(w / h - sw / sh) < 0.02
        reference = pixels(tmp_path / "src" / key)
        resized = np.asarray(Image.fromarray(reference.astype(np.uint8)).resize((w, h), Image.Resampling.LANCZOS),
                             dtype=np.int16)
        assert blur_diff(pixels(data), resized) < 3


def test_every_quirk_is_packed_or_rejected_with_its_reason(tmp_path):
    gen = generate(str(tmp_path / "src"), classes=3, per_class=4, quirks=True, size=SMALL)
    red = tmp_path / "src" / wnid(1) / "solid_red_cmyk.JPEG"
    Image.new("RGB", (64, 48), (220, 20, 30)).convert("CMYK").save(red, "JPEG", quality=95)
    run = hpcdl("pack", gen.root, tmp_path / "out", "--workers", 2, "--shard-size", "128K")
    manifest, images = packed_images(tmp_path / "out")
    rejected = {r["path"].split("/", 1)[1]: r["reason"] for r in manifest.rejected}
    assert rejected.keys() == {"quirk_truncated.JPEG", "quirk_header_cut.JPEG", "quirk_corrupt.JPEG", "quirk_empty.JPEG",
                               "quirk_not_image.JPEG", "quirk_unreadable.JPEG", "quirk_bad_name_\\xff\\xfe.JPEG"}
    assert rejected["quirk_truncated.JPEG"].startswith("truncated or corrupt")
    assert rejected["quirk_header_cut.JPEG"].startswith("truncated or corrupt")  # was an OSError out of a worker
    assert rejected["quirk_empty.JPEG"] == "empty file"
    assert rejected["quirk_not_image.JPEG"].startswith("not an image")
    assert rejected["quirk_corrupt.JPEG"].startswith(("not an image", "truncated or corrupt"))
    assert rejected["quirk_unreadable.JPEG"].startswith("unreadable")
    assert rejected["quirk_bad_name_\\xff\\xfe.JPEG"] == "file name is not valid UTF-8"
    assert "7 inputs rejected" in run.stderr and "img/s, ETA" in run.stderr
    assert manifest.num_images == 3 * 4 + 3 + 1
    for quirk in ("png_named_jpeg", "cmyk", "grayscale"):
        data, label, _, _ = images[f"{wnid(0)}/quirk_{quirk}.JPEG"]
        stored = Image.open(io.BytesIO(data))
        assert (stored.format, stored.mode, label) == ("JPEG", "RGB", 0)
        assert blur_diff(pixels(data), pixels(gen.quirks[quirk])) < 3, quirk
    gray = pixels(images[f"{wnid(0)}/quirk_grayscale.JPEG"][0])
    assert np.abs(gray[..., 0] - gray[..., 2]).max() <= 2
    red_pixels = pixels(images[f"{wnid(1)}/solid_red_cmyk.JPEG"][0]).reshape(-1, 3).mean(0)
    assert np.abs(red_pixels - (220, 20, 30)).max() < 12, f"CMYK decoded naively: {red_pixels}"
    assert verify(str(tmp_path / "out"), full=True) == []


@pytest.mark.ranks
def test_killed_pack_resumes_to_a_complete_dataset(tmp_path):
    gen = generate(str(tmp_path / "src"), classes=4, per_class=30, quirks=True)
    out = tmp_path / "out"
    args = ["pack", gen.root, out, "--short-side", "200", "--workers", "1", "--shard-size", "64K"]
    proc = subprocess.Popen([PYTHON, "-m", "hpcdl", *map(str, args)], stderr=subprocess.PIPE, text=True)
    progress = out / "parts" / "part-0000-of-0001.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if progress.exists() and len(json.loads(progress.read_text())["shards"]) >= 3:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the pack finished before it could be killed"
    assert not (out / "manifest.json").exists()
    kept = json.loads(progress.read_text())["shards"]
    first_mtime = os.stat(out / kept[0]["file"]).st_mtime_ns
    assert hpcdl("pack", *args[1:], check=False).returncode == 2  # without --resume: refused, says why
    run = hpcdl(*args, "--resume")
    assert f"{kept[-1]['stop']} already packed" in run.stderr
    assert os.stat(out / kept[0]["file"]).st_mtime_ns == first_mtime
    assert hpcdl("verify", out, "--full").returncode == 0
    manifest, images = packed_images(out)
    sources = {f"{d}/{f}" for d in os.listdir(gen.root) for f in os.listdir(os.path.join(gen.root, d))}
    rejected = {r["path"] for r in manifest.rejected}
    assert len(rejected) == 7 and not rejected & images.keys()
    assert images.keys() | {r for r in rejected if "bad_name" not in r} == {s for s in sources if "bad_name" not in s}
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    gen = generate(str(root / "src"), classes=3, per_class=8, size=SMALL)
    pack(PackConfig(src=gen.root, out=str(root / "good"), shard_size="64K", workers=1))
    return root


def _damage(root, kind):
    bad = root / kind
    shutil.copytree(root / "good", bad)
    shard = sorted(bad.glob("*.h5"))[1]
    data = bytearray(shard.read_bytes())
    if kind == "truncated":
        shard.write_bytes(data[:len(data) * 2 // 3])
    elif kind == "flipped":
        data[len(data) // 2] ^= 0xFF  # in the middle of the image bytes
        shard.write_bytes(bytes(data))
    else:
        shard.unlink()
    return bad, shard


@pytest.mark.parametrize("kind", ["truncated", "flipped", "missing"])
def test_damage_is_named_by_verify_and_by_the_reader(damaged, kind):
    from hpcdl.data.dataset import ShardDataset
    from hpcdl.errors import DataError

    bad, shard = _damage(damaged, kind)
    run = hpcdl("verify", bad, "--full", check=False)
    assert run.returncode == 1 and str(shard) in run.stdout, run.stdout + run.stderr
    with pytest.raises(DataError, match=str(shard)):
        ShardDataset(str(bad), verify="full")
    if kind == "flipped":  # quick start-up checks pass; the read of the damaged image names it
        ds = ShardDataset(str(bad))
        with pytest.raises(DataError, match=f"{shard}: image \\d+ \\(n\\d+/n\\d+_\\d+\\.JPEG\\) fails its CRC32"):
            for i in range(len(ds)):
                ds[i]
    else:
        with pytest.raises(DataError, match=str(shard)):
            ShardDataset(str(bad))


def _flip_in(shard, dataset: str, at: int = 0) -> None:
    """Flip the low bit of byte ``at`` of a contiguous dataset (``None``: byte ``at`` of the file)."""
    offset = 0
    if dataset:
        with open_h5(str(shard)) as f:
            offset = f[dataset].id.get_offset()
    data = bytearray(shard.read_bytes())
    data[offset + at] ^= 0x01
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("kind, message", [
    ("image byte", r"image 3 \(n\d+/\w+\.JPEG\) fails its CRC32"),
    ("label", r"image 2 \(n\d+/\w+\.JPEG\) fails its CRC32"),  # still a valid class: only the CRC sees it
    ("offset", r"image \d \(n\d+/\w+\.JPEG\) fails its CRC32"),
    ("crc32", r"image 1 \(n\d+/\w+\.JPEG\) fails its CRC32"),
    ("HDF5 signature", "not a readable hpcdl shard"),
    ("truncated", "not a readable hpcdl shard|fails its CRC32"),
    ("missing", "cannot open the shard"),
    ("manifest count", "its index does not match the manifest's 7 images"),
])
def test_the_reader_without_start_up_checks_names_damage_when_it_reads_it(damaged, tmp_path, kind, message):
    """verify='none' (no start-up checks): every kind of damage still stops the read that meets it, naming
    the shard (and the image), instead of returning a wrong image or label."""
    from hpcdl.data.dataset import ShardDataset

    bad = tmp_path / "bad"
    shutil.copytree(damaged / "good", bad)
    shard = sorted(bad.glob("*.h5"))[1]
    with open_h5(str(shard)) as f:
        offsets = f["offsets"][:]
    if kind == "image byte":
        _flip_in(shard, "images", int(offsets[3]) + 100)
    elif kind == "label":
        _flip_in(shard, "labels", 2 * 8)  # int64 little-endian: the low byte of label 2
    elif kind == "offset":
        _flip_in(shard, "offsets", 2 * 8 + 1)  # offsets[2] moves by 256 bytes
    elif kind == "crc32":
        _flip_in(shard, "crc32", 1 * 4)
    elif kind == "HDF5 signature":
        _flip_in(shard, None, 1)
    elif kind == "truncated":
        shard.write_bytes(shard.read_bytes()[:shard.stat().st_size * 2 // 3])
    elif kind == "missing":
        shard.unlink()
    else:
        manifest = json.loads((bad / "manifest.json").read_text())
        manifest["shards"][1]["count"] -= 1
        (bad / "manifest.json").write_text(json.dumps(manifest))
    ds = ShardDataset(str(bad), verify="none")
    with pytest.raises(DataError, match=f"{shard}: ({message})"):
        for i in range(len(ds)):
            ds[i]


def test_version_1_shards_are_still_read(damaged, tmp_path):
    """A dataset packed before the label joined the checksum (format 1) reads as before."""
    import h5py

    from hpcdl.data.dataset import ShardDataset
    from hpcdl.data.format import crc32, sha256_file

    old = tmp_path / "v1"
    shutil.copytree(damaged / "good", old)

    for shard in old.glob("*.h5"):
        with h5py.File(shard, "r+", locking=False) as f:
            offsets, images = f["offsets"][:], f["images"][:]
            f["crc32"][:] = [crc32(images[offsets[i]:offsets[i + 1]]) for i in range(len(offsets) - 1)]
            f.attrs["format_version"] = 1
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["format_version"] = 1
    for s in manifest["shards"]:
        s["bytes"], s["sha256"] = (old / s["file"]).stat().st_size, sha256_file(str(old / s["file"]))
    (old / "manifest.json").write_text(json.dumps(manifest))
    new, ds = ShardDataset(str(damaged / "good")), ShardDataset(str(old), verify="full")
    assert [ds[i] for i in range(len(ds))] == [new[i] for i in range(len(new))]
    assert verify(str(old), full=True) == []


def test_parts_pack_separately_and_merge(tmp_path):
    gen = generate(str(tmp_path / "src"), classes=5, per_class=6, tree="imagenet22k-tars", size=SMALL)
    out = str(tmp_path / "out")
    first = pack(PackConfig(src=gen.root, out=out, tree="imagenet22k-tars", part="1/2", workers=1))
    assert not first.complete or first.parts == 2
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    run = hpcdl("pack", gen.root, out, "--tree", "imagenet22k-tars", "--part", "0/2", "--workers", 1)
    assert "dataset holds 30 images" in run.stderr
    manifest, images = packed_images(out)
    assert len(images) == 30 and {s.file[:11] for s in manifest.shards} == {"shard-p0000", "shard-p0001"}
    for key, (_, label, _, _) in images.items():
        assert key.startswith(manifest.classes[label]["wnid"] + ".tar/")
    assert verify(out, full=True) == []


def test_a_holdout_splits_a_source_without_a_val_set_the_same_way_in_any_parts(tmp_path):
    """ImageNet-22K has no validation split: --holdout 0.25 --split train/val packs complementary sets."""
    gen = generate(str(tmp_path / "src"), classes=4, per_class=20, tree="imagenet22k-tars", size=SMALL)
    for split, parts in (("train", "0/1"), ("val", "0/1"), ("val", "1/2"), ("val", "0/2")):
        out = tmp_path / f"{split}-{parts[-1]}"
        run = hpcdl("pack", gen.root, out, "--tree", "imagenet22k-tars", "--holdout", 0.25, "--split", split,
                    "--part", parts, "--workers", 1, "--seed", len(parts))
        assert run.returncode == 0, run.stderr
    train, val = packed_images(tmp_path / "train-1")[1], packed_images(tmp_path / "val-1")[1]
    assert not train.keys() & val.keys() and len(train) + len(val) == 80 and 8 <= len(val) <= 32
    assert packed_images(tmp_path / "val-2")[1].keys() == val.keys()  # two parts, another seed: the same images
    refused = hpcdl("pack", gen.root, tmp_path / "x", "--tree", "imagenet22k-tars", "--holdout", 0.25, check=False)
    assert refused.returncode == 2 and "with --split train or val" in refused.stderr


def test_imagenet_val_labels_follow_sorted_file_order(tmp_path):
    gen = generate(str(tmp_path), classes=6, per_class=2, tree="imagenet", val_per_class=3, size=SMALL)
    pack(PackConfig(src=os.path.join(gen.root, "train"), out=str(tmp_path / "train-out"), tree="imagenet-train"))
    hpcdl("pack", gen.extra["dir"], tmp_path / "val-out", "--tree", "imagenet-val", "--val-labels",
          gen.extra["val_labels"], "--synsets", gen.extra["synsets"], "--names", tmp_path / "synset_words.txt")
    val, images = packed_images(tmp_path / "val-out")
    train = Manifest.load(str(tmp_path / "train-out" / "manifest.json"))
    assert [c["wnid"] for c in val.classes] == [c["wnid"] for c in train.classes]
    assert val.classes[3]["name"] == "class 3"
    assert len(images) == 18
    for key, (_, label, _, _) in images.items():
        assert val.classes[label]["wnid"] == gen.extra["truth"][key]


def test_bad_options_are_refused_with_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--max-side or --short-side"):
        Encoding(max_side=256, short_side=256)
    with pytest.raises(ConfigError, match="--shard-size"):
        PackConfig(src=".", out=".", shard_size="1K")
    with pytest.raises(ConfigError, match="--part"):
        detect_part("2/2")
    assert detect_part(None, {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "4", "SLURM_ARRAY_TASK_MAX": "11",
                              "SLURM_ARRAY_TASK_COUNT": "8"}) == (3, 8)
    with pytest.raises(ConfigError, match="contiguous"):
        detect_part(None, {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "8",
                           "SLURM_ARRAY_TASK_COUNT": "3"})
    run = hpcdl("pack", tmp_path, tmp_path / "out", "--tree", "imagenet-val", check=False)
    assert run.returncode == 2 and "--tree imagenet-val needs --val-labels" in run.stderr
    old = hpcdl("pack", tmp_path, tmp_path / "out", "--layout", "imagenet-val", check=False)  # the old spelling
    assert old.returncode == 2 and "--tree imagenet-val needs --val-labels" in old.stderr
    assert "warning: --layout is now --tree; --layout goes in the next release" in old.stderr


def test_the_generators_old_layout_flag_still_works_with_a_warning(tmp_path):
    """generate.py's --layout became --tree with pack's; scripts written before still run, for a release."""
    run = subprocess.run([PYTHON, REPO / "datasets" / "synthetic" / "generate.py", tmp_path / "src", "--classes", "2",
                          "--per-class", "2", "--val-per-class", "1", "--layout", "imagenet"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "--layout is now --tree; --tree imagenet is used" in run.stderr
    assert (tmp_path / "src" / "ILSVRC2012_validation_ground_truth.txt").exists()  # the imagenet tree's


def test_mpi_parts_need_no_rendezvous_address():
    hydra = {"MPI_LOCALRANKID": "1", "PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALNRANKS": "2"}  # no MASTER_ADDR
    assert detect_part(None, hydra) == (5, 8)
    assert detect_part(None, {}) == (0, 1)


def test_a_manifest_written_before_the_tree_rename_still_loads(tmp_path):
    """pack --layout became --tree, and the manifest's key with it: a dataset packed before reads as it was."""
    gen = generate(str(tmp_path / "src"), classes=2, per_class=2, size=SMALL)
    pack(PackConfig(src=gen.root, out=str(tmp_path / "out"), tree="folder", workers=1))
    path = tmp_path / "out" / "manifest.json"
    body = json.loads(path.read_text())
    body["layout"] = body.pop("tree")
    path.write_text(json.dumps(body))
    assert Manifest.load(str(path)).tree == "folder" and verify(str(tmp_path / "out")) == []
