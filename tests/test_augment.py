"""Augmentation as config, normalization from the data, the contact sheet and the confusion matrix."""

from __future__ import annotations

import io
import json
import math
import random
import subprocess

import numpy as np
import pytest
import torch
from conftest import PYTHON, hpcdl
from PIL import Image

from hpcdl.presets import resolve
from hpcdl.data import recipe
from hpcdl.data.transforms import Augment, BatchMix, EvalTransform
from hpcdl.errors import ConfigError

NO_TORCH = ("import sys\nfrom hpcdl.presets import resolve\nfrom hpcdl.errors import ConfigError\n"
            "try:\n    resolve('demo_tiny_lars', sys.argv[1:])\nexcept ConfigError as e:\n    print(e)\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\n")


def jpeg(w: int, h: int, seed: int = 0) -> bytes:
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    a[: h // 2] //= 3  # an asymmetric picture: a flip or a turn changes it
    out = io.BytesIO()
    Image.fromarray(a).save(out, "JPEG", quality=92)
    return out.getvalue()


@pytest.mark.parametrize("override, message", [
    ("data.augment=rotate", "data.augment[0]: 'rotate' is not an augmentation step or recipe; choose a recipe "
                            "(imagenet, light, none) or steps from resized_crop, pad_crop"),
    ("data.augment=hflip(q=1)", "data.augment[0]: hflip has no parameter 'q'; its parameters: p=0.5"),
    ("data.augment=pad_crop(pad=2)", "data.augment[0]: pad_crop(pad=2) must be a number in [0, 0.5]"),
    ("data.augment=randaugment(num_ops=1.5)", "randaugment(num_ops=1.5) must be a whole number in [1, 10]"),
    ("data.augment=light, resized_crop", "pad_crop, resized_crop all size the image"),
    ("data.mean=[0.5, 0.5]", "data.mean=[0.5, 0.5] has 2 values; give one per channel (3)"),
    ("data.std=[0.2, 0.2, 0]", "data.std=[0.2, 0.2, 0.0]: values are in 0..1 units (pixel / 255) and above 0"),
    ("data.normalize=z", "data.normalize='z' is unknown; choose one of auto, dataset, imagenet, model"),
    ("data.decoder=cv2", "data.decoder='cv2' is unknown; choose one of pillow, torchvision"),
])
def test_a_bad_recipe_or_statistic_is_refused_on_the_login_node_without_torch(override, message):
    done = subprocess.run([PYTHON, "-c", NO_TORCH, override] + (["data.mean=[0.4, 0.4, 0.4]"] if "std" in override else []),
                          capture_output=True, text=True, timeout=60)
    assert message in done.stdout, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("no torch")


def test_a_config_holds_the_recipe_expanded_and_reads_it_back():
    cfg = resolve("demo_tiny_lars", ["data.augment=light, rot90, color_jitter(brightness=0.2), mixup"])
    assert cfg.data.augment == ("pad_crop(pad=0.125)", "rot90(p=0.75)",
                                "color_jitter(brightness=0.2, contrast=0.4, saturation=0.4, hue=0)", "mixup(alpha=0.2)")
    assert resolve("demo_tiny_lars", [f"data.augment={json.dumps(list(cfg.data.augment))}"]).data == cfg.data
    assert recipe.expand("rot90") == ("center_crop", "rot90(p=0.75)")  # a sizing step goes first
    # the ImageNet presets keep their recipe and statistics; 4/3 survives the round trip exactly
    for name in ("resnet50_b32k_lars", "alexnet_bn_b32k", "resnet50_b8k_goyal", "resnet50_mlperf_cpu"):
        data = resolve(name).data
        assert recipe.parse(data.augment)[0].params["max_ratio"] == 4 / 3 and data.normalize == "imagenet"
        assert [str(s) for s in recipe.parse(data.augment)] == list(recipe.expand("imagenet"))


def reference_train_transform(data: bytes, rng: random.Random, size: int, scale) -> torch.Tensor:
    """The transform every preset trained with before data.augment existed (hpcdl 0.1, transforms.py)."""
    from hpcdl.data.transforms import crop_params

    im = Image.open(io.BytesIO(data))
    w, h = im.size
    top, left, ch, cw = crop_params(w, h, scale, (3 / 4, 4 / 3), rng)
    im.draft("RGB", (math.ceil(w * size / cw), math.ceil(h * size / ch)))
    im = im if im.mode == "RGB" else im.convert("RGB")
    sx, sy = im.width / w, im.height / h
    im = im.resize((size, size), Image.Resampling.BILINEAR, box=(left * sx, top * sy, (left + cw) * sx, (top + ch) * sy))
    if rng.random() < 0.5:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.array(im))


def test_the_imagenet_recipe_is_the_former_transform_pixel_for_pixel():
    for i, (w, h) in enumerate([(341, 256), (256, 300), (500, 375), (64, 64)]):
        data = jpeg(w, h, i)
        for k in range(12):
            for spec, size, scale in (("imagenet", 224, (0.08, 1.0)), ("resized_crop(min_scale=0.25), hflip", 64, (0.25, 1.0))):
                new = Augment(spec, size)(data, random.Random(f"0:{k}:{i}"))
                assert torch.equal(new, reference_train_transform(data, random.Random(f"0:{k}:{i}"), size, scale))


@pytest.mark.slow
@pytest.mark.parametrize("decoder", ["pillow", "torchvision"])
def test_each_step_draws_from_the_samples_rng_and_keeps_the_shape(decoder):
    data = jpeg(80, 60)
    plain = Augment("none", 48, decoder=decoder)(data)
    assert plain.shape == (48, 48, 3) and plain.dtype == torch.uint8
    every = "light, hflip, vflip, rot90, color_jitter, grayscale, randaugment, trivialaugment, erasing"
    t = Augment(every, 48, decoder=decoder)
    draws = [t(data, random.Random(seed)) for seed in range(6)]
    assert all(d.shape == (48, 48, 3) for d in draws)
    assert torch.equal(draws[0], t(data, random.Random(0)))  # the same (seed, epoch, index): the same image
    assert len({d.numpy().tobytes() for d in draws}) == 6
    assert torch.equal(Augment("none, hflip(p=1)", 48, decoder=decoder)(data), plain.flip(1))
    assert torch.equal(Augment("none, vflip(p=1)", 48, decoder=decoder)(data), plain.flip(0))
    turned = [Augment("none, rot90(p=1)", 48, decoder=decoder)(data, random.Random(s)) for s in range(12)]
    assert {t.numpy().tobytes() for t in turned} == {plain.rot90(k).numpy().tobytes() for k in (1, 2, 3)}
    shifted = [Augment("light", 48, decoder=decoder)(data, random.Random(s)) for s in range(8)]
    pad = round(0.125 * 48)
    for s in shifted:  # a shifted copy of the plain crop, zeros where it moved in from the padding
        matches = [(dx, dy) for dx in range(-pad, pad + 1) for dy in range(-pad, pad + 1)
                   if torch.equal(s[max(dy, 0):48 + min(dy, 0), max(dx, 0):48 + min(dx, 0)],
                                  plain[max(-dy, 0):48 - max(dy, 0), max(-dx, 0):48 - max(dx, 0)])]
        assert matches
    gray = Augment("imagenet", 32, decoder=decoder, channels=1)(data, random.Random(0))
    assert gray.shape == (32, 32, 1)
    assert EvalTransform(56, 48, decoder=decoder)(data).shape == (48, 48, 3)


def test_mixup_and_cutmix_mix_the_batch_and_its_labels():
    torch.manual_seed(0)
    mix = BatchMix(recipe.parse("none, mixup(alpha=1), cutmix"), num_classes=5)
    assert mix and not BatchMix(recipe.parse("imagenet"), 5)
    images, labels = torch.randn(8, 3, 16, 16), torch.arange(8) % 5
    for _ in range(4):
        mixed, soft = mix(images.clone(), labels)
        assert mixed.shape == images.shape and soft.shape == (8, 5)
        assert torch.allclose(soft.sum(1), torch.ones(8))
        assert (soft.gather(1, labels[:, None]) >= soft.gather(1, labels.roll(1)[:, None]) - 1).all()
        assert not torch.equal(mixed, images)


def test_pack_measures_the_channel_statistics_and_class_counts(tmp_path):
    from hpcdl.config import DataConfig
    from hpcdl.data.format import Manifest
    from hpcdl.data.pack import PackConfig, pack
    from hpcdl.data.recipe import channel_stats
    from hpcdl.data.show import summary

    colors = {"red": (200, 20, 40), "teal": (10, 150, 160)}
    for name, n in (("red", 10), ("teal", 1)):
        (tmp_path / "src" / name).mkdir(parents=True)
        for i in range(n):
            Image.new("RGB", (40, 30), colors[name]).save(tmp_path / "src" / name / f"{i}.jpg", quality=95)
    m = pack(PackConfig(src=str(tmp_path / "src"), out=str(tmp_path / "out"), workers=1))
    want = (10 * np.array(colors["red"]) + np.array(colors["teal"])) / 11 / 255
    spread = np.sqrt((10 * (np.array(colors["red"]) / 255 - want) ** 2 + (np.array(colors["teal"]) / 255 - want) ** 2) / 11)
    assert np.allclose(m.stats["mean"], want, atol=0.01) and np.allclose(m.stats["std"], spread, atol=0.01)
    assert m.stats["class_counts"] == [10, 1] and m.stats["size"] == {"height": [30, 30, 30], "width": [40, 40, 40]}
    mean, std, why = channel_stats(DataConfig(), m.stats, "out")
    assert mean == tuple(m.stats["mean"]) and "measured by hpcdl pack on 11 images" in why
    lines, warnings = summary(str(tmp_path / "out"), m)
    assert [line.split() for line in lines[-2:]] == [["red", "10"], ["teal", "1"]]
    assert warnings == ["strong class imbalance: red has 10 images, teal 1 (10x); accuracy will favour the large "
                        "classes: look at the per-class accuracy of each evaluation (RUN_DIR/eval), or rebalance the data"]
    assert channel_stats(DataConfig(normalize="imagenet"), m.stats, "out")[0] == (0.485, 0.456, 0.406)
    # a dataset packed before the stats existed: training asks for them, and pack --stats adds them
    path = tmp_path / "out" / "manifest.json"
    body = json.loads(path.read_text())
    del body["stats"]
    path.write_text(json.dumps(body))
    with pytest.raises(ConfigError, match=f"run 'hpcdl pack --stats {tmp_path / 'out'}', or set data.normalize"):
        channel_stats(DataConfig(), Manifest.load(str(path)).stats, str(tmp_path / "out"))
    done = hpcdl("pack", "--stats", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert Manifest.load(str(path)).stats == m.stats


@pytest.mark.slow
def test_show_prints_the_counts_and_draws_every_class(data, tmp_path):
    from hpcdl.data.show import contact_sheet

    done = hpcdl("show", str(data / "train"), "--crop", "32", "--augment", "light, rot90", "--per-class", "2",
                 "--draws", "3", "--out", str(tmp_path / "sheet.png"))
    assert done.returncode == 0, done.stderr
    counts = [line.split() for line in done.stdout.splitlines() if line.startswith("    ")]
    assert len(counts) == 10 and all(c[1] == "24" for c in counts)
    assert "20 images of 10 classes, the stored image and 3 draws of pad_crop(pad=0.125), rot90(p=0.75) at crop 32" in done.stdout
    sheet = contact_sheet(str(data / "train"), str(tmp_path / "again.png"), recipe.parse("light"), 32, per_class=2, draws=3)
    assert sheet.classes == [c for c in sorted(set(sheet.classes)) for _ in range(2)] and len(set(sheet.classes)) == 10
    image = np.asarray(Image.open(sheet.path).convert("RGB"))
    assert image.shape[0] == 20 + sheet.rows * (sheet.cell + 4)
    left = image.shape[1] - sheet.columns * (sheet.cell + 4)
    for r in range(sheet.rows):  # every cell holds a picture; the gaps between them stay white
        for c in range(sheet.columns):
            y, x = 20 + r * (sheet.cell + 4), left + c * (sheet.cell + 4)
            assert (image[y:y + sheet.cell // 2, x:x + sheet.cell // 2] != 255).any(), (r, c)
            assert (image[y + sheet.cell:y + sheet.cell + 4, x:x + sheet.cell] == 255).all()
    imbalanced = hpcdl("show", str(data / "val"), "--crop", "32", "--draws", "0", "--out", str(tmp_path / "v.png"))
    assert imbalanced.returncode == 0 and "warning" not in imbalanced.stderr  # 3 and 2 images: not strong


def test_the_confusion_image_shows_the_matrix_it_claims(tmp_path):
    from hpcdl.train import confusion

    matrix = np.array([[5, 0, 1], [2, 3, 0], [0, 0, 4]])
    body = confusion.write(str(tmp_path), 7, matrix, ["cat", "dog", "bird"])
    assert body["accuracy"] == [pytest.approx(100 * 5 / 6, abs=1e-3), 60.0, 100.0]
    assert body["worst_pairs"][0] == {"true": "dog", "predicted": "cat", "count": 2, "of": 5}
    image = np.asarray(Image.open(tmp_path / "eval" / body["image"]["file"]).convert("RGB")).astype(int)
    (ox, oy), cell = body["image"]["origin"], body["image"]["cell"]
    for i in range(3):
        for j in range(3):
            r, g, b = image[oy + i * cell + cell - 4, ox + j * cell + cell - 4]  # away from the count's digits
            if matrix[i, j] == 0:
                assert (r, g, b) == (255, 255, 255), (i, j)
            elif i == j:
                assert b == 255 and r < 200, (i, j)  # blue: right
            else:
                assert r == 255 and g < 255, (i, j)  # red: wrong
    assert json.loads((tmp_path / "eval" / "step-000000007.json").read_text())["confusion"] == matrix.tolist()


def test_pack_reads_a_csv_of_paths_and_labels(tmp_path):
    from hpcdl.data.format import Manifest
    from hpcdl.data.pack import PackConfig, pack

    (tmp_path / "img").mkdir()
    for i in range(5):
        Image.new("RGB", (20, 20), (40 * i, 0, 0)).save(tmp_path / "img" / f"{i}.jpg")
    rows = ["path,label", "img/0.jpg,10", "img/1.jpg,2", f"{tmp_path}/img/2.jpg,10", "img/3.jpg,2", "img/4.jpg,10",
            "img/missing.jpg,2"]
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    m = pack(PackConfig(src=str(tmp_path / "list.csv"), out=str(tmp_path / "out"), tree="csv", workers=1))
    assert [c["wnid"] for c in m.classes] == ["2", "10"]  # numeric labels sort as numbers
    assert m.stats["class_counts"] == [2, 3] and [r["path"] for r in m.rejected] == ["img/missing.jpg"]
    assert Manifest.load(str(tmp_path / "out" / "manifest.json")).num_images == 5
    (tmp_path / "bad.csv").write_text("img/0.jpg,1\nimg/1.jpg\n")
    done = hpcdl("pack", str(tmp_path / "bad.csv"), str(tmp_path / "out2"), "--tree", "csv")
    assert done.returncode != 0 and f"{tmp_path / 'bad.csv'}:2: ['img/1.jpg'] is not 'path,label'" in done.stderr


@pytest.mark.slow
def test_one_channel_data_trains_on_one_channel_with_mixed_batches(data, tmp_path):
    from hpcdl.models import build_model

    for name in ("tiny_cnn", "resnet18", "alexnet_bn"):
        model = build_model(name, 10, in_channels=1)
        first = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
        assert first.in_channels == 1
    assert build_model("tiny_cnn", 10, in_channels=1)(torch.zeros(2, 1, 32, 32)).shape == (2, 10)
    with pytest.raises(ConfigError, match=r"data.mean=\[0.5, 0.5, 0.5\] has 3 values; give one per channel \(1\)"):
        resolve("demo_tiny_lars", ["data.channels=1", "data.mean=[0.5, 0.5, 0.5]", "data.std=[0.2, 0.2, 0.2]"])
    run = tmp_path / "run"
    done = hpcdl("train", "demo_tiny_lars", "--set", "global_batch=16", "--set", "crop=32", "--set", "data.eval_resize=36",
                 "--set", f"data.train={data / 'train'}", "--set", f"data.val={data / 'val'}", "--set", f"run_dir={run}",
                 "--set", "data.channels=1", "--set", "data.normalize=dataset", "--set", "loop.max_steps=2",
                 "--set", "data.workers=0", "--set", "data.augment=light, rot90, mixup, cutmix",
                 "--set", "data.decoder=torchvision")
    assert done.returncode == 0, done.stderr
    assert "(gray)" in done.stderr and "pad_crop(pad=0.125), rot90(p=0.75), mixup(alpha=0.2), cutmix(alpha=1)" in done.stderr
    losses = [r["loss"] for r in map(json.loads, (run / "train.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)  # soft labels through the criterion
    weights = torch.load(run / "checkpoints" / "ckpt-000000002.pt", weights_only=True)["model"]
    assert weights["features.0.weight"].shape[1] == 1
