"""Evaluation over 2 gloo ranks counts every image once, on a set whose size is odd."""

import json
import subprocess

import pytest
from conftest import PYTHON, REPO, free_port, rank_env

from hpcdl.data.pack import PackConfig, pack
from hpcdl.data.synthetic import generate


@pytest.fixture(scope="module")
def odd_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    gen = generate(str(root / "src"), classes=3, per_class=7, size=(200, 150))  # 21 images, several shards
    pack(PackConfig(src=gen.root, out=str(root / "out"), shard_size="64K", workers=1))
    return root / "out"


def run(root, mode, out, world):
    script = [PYTHON, str(REPO / "tests" / "eval_ranks.py"), str(root), mode, str(out)]
    if world == 1:
        env = {k: v for k, v in rank_env(0, 1, 0).items() if k not in ("RANK", "WORLD_SIZE")}
        subprocess.run(script, check=True, env=env, timeout=120)
        return
    port = free_port()
    procs = [subprocess.Popen(script, env=rank_env(r, world, port)) for r in range(world)]
    assert [p.wait(timeout=120) for p in procs] == [0] * world


@pytest.mark.ranks
@pytest.mark.parametrize("mode", ["global", "shard"])
def test_two_ranks_count_each_image_once(odd_set, mode, tmp_path):
    run(odd_set, mode, tmp_path / "one.json", 1)
    run(odd_set, mode, tmp_path / "two.json", 2)
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert one["images"] == two["images"] == 21
    assert two["top1"] == pytest.approx(one["top1"]) and two["top5"] == pytest.approx(one["top5"])
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
