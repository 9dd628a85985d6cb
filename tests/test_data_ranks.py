"""The reader across real processes: 2 gloo ranks in both sampler modes, and the packer as a Slurm array."""

import json
import os
import subprocess
from collections import Counter

import pytest
from conftest import PYTHON, REPO, free_port, rank_env, sbatch_wait

from hpcdl.data.pack import PackConfig, pack
from hpcdl.data.synthetic import generate
from hpcdl.data.verify import verify


@pytest.fixture(scope="module")
def unequal_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    gen = generate(str(root / "src"), classes=3, per_class=9, size=(96, 72))
    pack(PackConfig(src=gen.root, out=str(root / "out"), shard_size="64K", workers=1))
    return root / "out"


@pytest.mark.ranks
@pytest.mark.parametrize("mode", ["global", "shard"])
def test_two_gloo_ranks_read_disjoint_equal_epochs(unequal_shards, mode, tmp_path):
    port = free_port()
    procs = [subprocess.Popen([PYTHON, str(REPO / "tests" / "read_ranks.py"), str(unequal_shards), mode, str(tmp_path)],
                              env=rank_env(r, 2, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    total = json.loads((unequal_shards / "manifest.json").read_text())["num_images"]
    for e in range(2):
        a, b = ranks[0][e], ranks[1][e]
        assert a["steps"] == b["steps"] > 0 and len(a["indices"]) == len(b["indices"])
        counts = Counter(a["indices"] + b["indices"])
        assert set(counts) == set(range(total))
        assert sum(counts.values()) - total == len(a["indices"]) * 2 - total  # repeats are only the padding
    assert ranks[0][0]["indices"] != ranks[0][1]["indices"]


def test_imagenet1k_recipe_packs_as_a_slurm_array(slurm, tmp_path):
    gen = generate(str(tmp_path / "ILSVRC2012"), classes=4, per_class=6, tree="imagenet", val_per_class=3,
                   size=(160, 120), quirks=True)
    out = tmp_path / "packed"
    env = {**os.environ, "HPCDL": f"{PYTHON} -m hpcdl", "PACK_ARGS": "--short-side 96 --shard-size 64K --workers 1",
           "PYTHONPATH": str(REPO)}
    sbatch_wait(REPO / "datasets" / "imagenet1k" / "pack.sbatch", "--array=0-1",
                f"--output={tmp_path}/pack-%A_%a.out", f"--chdir={tmp_path}", env=env, args=(gen.root, str(out)))
    logs = "".join(p.read_text() for p in tmp_path.glob("pack-*.out"))
    train = json.loads((out / "train" / "manifest.json").read_text())
    val = json.loads((out / "val" / "manifest.json").read_text())
    assert train["options"]["parts"] == 2 and len(list((out / "train" / "parts").iterdir())) == 2, logs
    assert train["num_images"] == 4 * 6 + 3 and train["summary"]["rejected"] == 7
    assert val["num_images"] == 12 and val["classes"] == train["classes"]
    assert train["classes"][2]["name"] == "class 2"
    assert verify(str(out / "train"), full=True) == [] and verify(str(out / "val"), full=True) == []


def test_mpi_ranks_pack_their_parts_and_merge(mpiexec, tmp_path):
    gen = generate(str(tmp_path / "src"), classes=4, per_class=5, size=(96, 72))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "OMPI_", "MPI_"))}
    run = subprocess.run([mpiexec, "-n", "2", PYTHON, "-m", "hpcdl", "pack", gen.root, str(tmp_path / "out"),
                          "--workers", "1", "--shard-size", "64K"], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    parts = sorted(p.name for p in (tmp_path / "out" / "parts").iterdir())
    assert parts == ["part-0000-of-0002.json", "part-0001-of-0002.json"]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["num_images"] == 20 and manifest["options"]["parts"] == 2
    assert verify(str(tmp_path / "out"), full=True) == []
