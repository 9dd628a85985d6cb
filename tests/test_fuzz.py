"""Fuzzed inputs: the packer takes any bytes. ``HPCDL_FUZZ_N`` (default 8) scales the random mutations per
corpus file; docs/reliability.md has a longer run's figures."""

import io
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from conftest import PYTHON
from fuzz_inputs import CONFIG_DOCS, CONFIG_VALUES, config_mutants, corpus, mutants
from PIL import Image

from hpcdl.config import dump_yaml
from hpcdl.presets import PRESETS, get_preset, load_yaml, resolve
from hpcdl.data.images import Encoding, Rejected, prepare
from hpcdl.data.sources import MAX_INPUT_BYTES
from hpcdl.errors import ConfigError
from hpcdl.schema import flatten, to_dict

N = int(os.environ.get("HPCDL_FUZZ_N", "8"))
NO_ROOT_READ = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]  # root that obeys chmod


def test_every_mutant_is_packed_or_rejected_never_a_crash():
    enc = Encoding(short_side=32)
    tried, crashed, slowest, outcomes = 0, [], (0.0, ""), {"ok": 0, "rejected": 0}
    for name, data in mutants(corpus(), n=N):
        tried += 1
        start = time.perf_counter()
        try:
            stored, size, _ = prepare(data, enc)
            assert Image.open(io.BytesIO(stored)).format == "JPEG" and min(size) <= 32
            outcomes["ok"] += 1
        except Rejected as exc:
            outcomes["rejected"] += 1
            assert not name.startswith("bomb") or "exceeds limit" in str(exc), (name, exc)
        except Exception as exc:  # a crash: what the packer would have died of
            crashed.append(f"{name}: {type(exc).__name__}: {exc}")
        slowest = max(slowest, (time.perf_counter() - start, name))
    print(f"fuzz: {tried} inputs tried, {len(crashed)} crashed, {outcomes}, slowest {slowest[0]:.3f} s "
          f"({slowest[1]})", file=sys.stderr)
    assert tried >= 300 and not crashed, crashed[:10]
    assert slowest[0] < 5, slowest


def test_a_pack_of_fuzzed_and_hostile_files_finishes_lists_every_input_and_verifies(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    fuzzed, good = src / "n00000000", src / "n00000001"
    fuzzed.mkdir(parents=True)
    good.mkdir()
    names = []
    for i, (name, data) in enumerate(mutants(corpus(), n=2)):
        (fuzzed / f"m{i:04d}.JPEG").write_bytes(data)
        names.append(name)
    for i in range(6):
        (good / f"g{i}.JPEG").write_bytes(corpus()["baseline.jpg"])
    hostile = {
        "dangling.JPEG": lambda p: p.symlink_to(tmp_path / "no-such-file"),
        "fifo.JPEG": lambda p: os.mkfifo(p),  # a plain open() of it blocks until a writer comes: forever
        "huge.JPEG": lambda p: (p.touch(), os.truncate(p, MAX_INPUT_BYTES + 1)),  # sparse: takes no disk
        "no_permission.JPEG": lambda p: (p.write_bytes(corpus()["baseline.jpg"]), p.chmod(0)),
    }
    for name, make in hostile.items():
        make(fuzzed / name)
    (fuzzed / "a_folder.JPEG").mkdir()  # a directory with an image's name: walked into, not read
    run = subprocess.run([*NO_ROOT_READ, PYTHON, "-m", "hpcdl", "pack", str(src), str(out), "--short-side", "32",
                          "--shard-size", "64K", "--workers", "2"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    rejected = {r["path"].split("/")[-1]: r["reason"] for r in manifest["rejected"]}
    packed = sum(s["count"] for s in manifest["shards"])
    assert packed + len(rejected) == len(names) + 6 + len(hostile)  # every input: packed or rejected
    assert rejected["dangling.JPEG"].startswith("unreadable: No such file")
    assert rejected["fifo.JPEG"] == "unreadable: not a regular file"
    assert "more than any image hpcdl packs" in rejected["huge.JPEG"]
    assert rejected["no_permission.JPEG"] == "unreadable: Permission denied"
    assert {r.split(":")[0] for r in rejected.values()} <= {"unreadable", "truncated or corrupt", "not an image",
                                                            "empty file"}, set(rejected.values())
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    verify = subprocess.run([PYTHON, "-m", "hpcdl", "verify", str(out), "--full"], capture_output=True, text=True)
    assert verify.returncode == 0 and ": OK (sha256 of every shard checked)" in verify.stderr, verify.stdout[-2000:]


@pytest.mark.slow
def test_an_input_slower_than_the_image_timeout_is_rejected_and_the_pack_goes_on(tmp_path):
    src, out = tmp_path / "src" / "n00000000", tmp_path / "out"
    src.mkdir(parents=True)
    noise = np.random.default_rng(0).integers(0, 256, (3000, 3000, 3), dtype=np.uint8)
    Image.fromarray(noise).save(src / "slow.JPEG", "PNG")  # 27 MB of noise: about 0.25 s to decode here
    (src / "fast.JPEG").write_bytes(corpus()["baseline.jpg"])
    run = subprocess.run([PYTHON, "-m", "hpcdl", "pack", str(tmp_path / "src"), str(out), "--workers", "1",
                          "--image-timeout", "0.1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(r["path"], r["reason"]) for r in manifest["rejected"]] == [
        ("n00000000/slow.JPEG", "took longer than 0.1 s to read and decode (--image-timeout)")]
    assert sum(s["count"] for s in manifest["shards"]) == 1


@pytest.mark.slow
def test_every_mutated_preset_yaml_builds_or_names_the_key():
    """Each preset's YAML with one key deleted, retyped, renamed, moved or nested: a config, or a
    ConfigError naming the file; never another exception. 50 x HPCDL_FUZZ_N mutants, spread over the
    presets (all 12,348 with HPCDL_FUZZ_N=250)."""
    import random
    import tempfile

    every = [(name, what, m) for name in PRESETS
             for what, m in config_mutants(yaml.safe_load(dump_yaml(get_preset(name))))]
    chosen = random.Random(0).sample(every, min(len(every), 50 * N)) + [("doc", d, d) for d in CONFIG_DOCS]
    built, crashed = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "my.yaml")
        for preset, what, m in chosen:
            with open(path, "w") as f:
                f.write(m if isinstance(m, str) else yaml.safe_dump(m))
            try:
                load_yaml(path)
                built += 1
            except ConfigError as exc:
                assert str(exc).startswith(path), exc
            except Exception as exc:
                crashed.append(f"{preset}: {what}: {type(exc).__name__}: {exc}")
    print(f"config fuzz: {len(chosen)} YAML files tried of {len(every)}, {built} built, {len(crashed)} crashed",
          file=sys.stderr)
    assert not crashed, crashed[:10]


@pytest.mark.slow
def test_every_set_override_builds_or_names_the_key():
    """--set KEY=VALUE for every key of two presets and awkward values, and malformed --set items."""
    tried, crashed = 0, []
    for name in ("demo_tiny_lars", "resnet50_b32k_lars"):
        keys = list(flatten(to_dict(get_preset(name))))
        items = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k in keys for v in CONFIG_VALUES[:10]]
        items += ["=3", "loop", "loop.=1", "loop..x=1", "nope.deeper=1", "loop.backend.x=1", "data=3"]
        for item in items:
            tried += 1
            try:
                resolve(name, [item])
            except ConfigError as exc:
                assert item.partition("=")[0].split(".")[0] in str(exc) or "--set" in str(exc), (item, exc)
            except Exception as exc:
                crashed.append(f"{name} --set {item}: {type(exc).__name__}: {exc}")
    print(f"--set fuzz: {tried} overrides tried, {len(crashed)} crashed", file=sys.stderr)
    assert not crashed, crashed[:10]
