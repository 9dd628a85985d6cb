"""The local cluster's shared filesystem (slurm/local/pfs.sh): MooseFS, its metadata server and storage servers in
namespaces of their own on the fabric's bridge, mounted on the host and on the fabric's nodes. A dataset packed onto
it trains as it does from the local disk."""

import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from conftest import PYTHON, REPO, held, hpcdl, sbatch_wait

PFS_SH = REPO / "slurm" / "local" / "pfs.sh"


def _train_on_the_fabric(data: Path, run: Path, tmp_path: Path, cache: str = "none") -> tuple[Path, str]:
    """demo_tiny_lars on n3 and n4, one rank each, for 14 steps (an epoch and two steps) with the default 4 loader
    workers; returns the last checkpoint and the job's output."""
    script = tmp_path / f"{run.name}.sbatch"
    made = hpcdl("sbatch", "--profile", "local", "--partition", "fabric", "--nodes", 2, "--tasks-per-node", 1,
                 "--time", 5, "--output", f"{tmp_path}/{run.name}-%j.out", "--python", PYTHON, "--write", script, "--",
                 "train", "demo_tiny_lars", "--set", f"data.train={data / 'train'}", "--set", f"data.val={data / 'val'}",
                 "--set", f"run_dir={run}", "--set", "loop.backend=gloo", "--set", "loop.max_steps=14",
                 "--set", "data.workers=4", "--set", "checkpoint.every_minutes=0", "--set", f"data.cache={cache}")
    assert made.returncode == 0, made.stderr
    job = sbatch_wait(script, f"--chdir={tmp_path}", env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    out = (tmp_path / f"{run.name}-{job}.out").read_text()
    assert "2 node(s) (n[3-4])" in out, out[-3000:]
    return max((run / "checkpoints").glob("ckpt-*.pt")), out


@pytest.mark.timeout(900)
def test_a_dataset_packed_onto_the_shared_filesystem_trains_as_from_the_local_disk(shared_fs, demo_data, tmp_path):
    """Packed onto the shared filesystem by ``hpcdl pack``, read there by two nodes each through its own client, the
    same seed and steps end at the same weights, bit for bit, as from a copy of the same files on the local disk; and
    so through the node cache (data.cache=node), whose agents, one in each node's network namespace, serve each other
    across the shaped fabric: each image read from the filesystem once."""
    remote = shared_fs / f"pytest-{uuid.uuid4().hex[:8]}"
    try:
        for split, src in (("train", "src-train"), ("val", "src-val")):
            packed = hpcdl("pack", demo_data / src, remote / split, "--short-side", 72, "--shard-size", "1MB",
                           "--workers", 2, timeout=300)
            assert packed.returncode == 0, packed.stderr
        assert len(list((remote / "train").glob("*.h5"))) > 1
        # the files are MooseFS's: each shard's chunks are on its storage servers
        info = subprocess.run(["mfsfileinfo", str(next((remote / "train").glob("*.h5")))], capture_output=True,
                              text=True, timeout=30).stdout
        assert "10.77.0.2" in info and "VALID" in info, info
        local = tmp_path / "local"
        shutil.copytree(remote, local)
        a, _ = _train_on_the_fabric(remote, tmp_path / "from-pfs", tmp_path)
        b, _ = _train_on_the_fabric(local, tmp_path / "from-disk", tmp_path)
        c, out = _train_on_the_fabric(remote, tmp_path / "from-pfs-cached", tmp_path, cache="node")
    finally:
        shutil.rmtree(remote, ignore_errors=True)
    assert a.name == b.name == c.name == "ckpt-000000014.pt"
    x, y, z = (torch.load(p, map_location="cpu", weights_only=True)["model"] for p in (a, b, c))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), [k for k in x if not torch.equal(x[k], y[k])]
    assert all(torch.equal(x[k], z[k]) for k in x), out[-3000:]
    assert "data cache: node 0's agent at 10.77.0.3:" in out, out[-3000:]  # n3's own address, not loopback
    # epoch 0 and its start-up read each of the 1,500 images from the filesystem once, and the second epoch none:
    # what it needs of the other node's comes from that node (how much by its start depends on timing)
    read = re.findall(r"data cache, epoch (\d)'s start, since the last: 2 node\(s\): shared filesystem (\d+) samples, "
                      r"[\d.]+ MiB \(0 read again\)", out)
    assert [e for e, _ in read] == ["0", "1"] and sum(int(n) for _, n in read) == 1500, out[-3000:]


@pytest.mark.slurm  # root: namespaces, tc and a cgroup
def test_the_shared_filesystem_s_knobs_shape_its_storage_links_and_cap_its_metadata_server(shared_fs):
    """``pfs.sh rate`` and ``pfs.sh mds-cpu`` change a running filesystem in place (what makes it a loaded Lustre),
    and a rate tc cannot read is refused with the form it wants; the filesystem is left as it was. The fabric's lock
    is held: a test training or measuring across it meanwhile would be slowed."""
    state = shared_fs.parent / "pfs"
    rate, cpu = (state / "rate").read_text().strip(), (state / "mds-cpu").read_text().strip()
    with held("fabric-link"):
        try:
            assert subprocess.run(["bash", PFS_SH, "rate", "200mbit"], capture_output=True, timeout=60).returncode == 0
            for n in (1, 2):
                shaped = subprocess.run(["tc", "-n", f"hpfs-s{n}", "qdisc", "show", "dev", "eth0"],
                                        capture_output=True, text=True).stdout
                assert "tbf" in shaped and "rate 200Mbit" in shaped, shaped
            assert subprocess.run(["bash", PFS_SH, "mds-cpu", "20"], capture_output=True, timeout=60).returncode == 0
            cgroup = Path("/sys/fs/cgroup/cpu/hpcdl-pfs-master")
            assert (cgroup / "cpu.cfs_quota_us").read_text().strip() == "20000"
            master = (cgroup / "cgroup.procs").read_text().split()
            assert master and all("mfsmaster" in Path(f"/proc/{p}/comm").read_text() for p in master)
            bad = subprocess.run(["bash", PFS_SH, "rate", "fast"], capture_output=True, text=True, timeout=60)
            assert bad.returncode != 0 and "rate 'fast'" in bad.stderr, bad.stderr
            assert (shared_fs / ".").stat()  # still answers
        finally:
            subprocess.run(["bash", PFS_SH, "rate", rate], capture_output=True, timeout=60)
            subprocess.run(["bash", PFS_SH, "mds-cpu", cpu], capture_output=True, timeout=60)
