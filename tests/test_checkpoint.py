"""Checkpoints: atomic writes, the last K kept, fallback past a corrupt newest one, RNG states."""

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import PYTHON, REPO, free_port, mpi_run, rank_env

from hpcdl.errors import ConfigError
from hpcdl.train.checkpoint import CheckpointManager, rng_state, set_rng_state


def state_of(step: int) -> dict:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state(),
            "config": {"name": "test", "lr": 0.1, "milestones": [30, 60]}}


def test_round_trip_loads_weights_only_and_restores_rng(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    saved = state_of(7)
    path = mgr.save(7, saved)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    found, state = mgr.load_latest()
    assert found == path and state["step"] == 7 and state["config"] == saved["config"]
    assert torch.equal(state["model"]["weight"], saved["model"]["weight"])
    set_rng_state(state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    torch.load(path, weights_only=True)  # no pickled code needed


def test_keeps_the_last_k(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep=2)
    for step in (10, 20, 30):
        mgr.save(step, {"step": step})
    assert [os.path.basename(p) for p in mgr.checkpoints()] == ["ckpt-000000030.pt", "ckpt-000000020.pt"]
    with pytest.raises(ConfigError, match="keep"):
        CheckpointManager(str(tmp_path), keep=0)


def test_corrupt_newest_falls_back_and_says_so(tmp_path, caplog):
    mgr = CheckpointManager(str(tmp_path))
    mgr.save(1, state_of(1))
    newest = mgr.save(2, state_of(2))
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) // 2)
    with caplog.at_level(logging.WARNING):
        path, state = mgr.load_latest()
    assert state["step"] == 1 and path.endswith("ckpt-000000001.pt")
    assert "ckpt-000000002.pt" in caplog.text and "resuming from" in caplog.text


WRITER = """
import sys, torch
from hpcdl.train.checkpoint import CheckpointManager
mgr = CheckpointManager(sys.argv[1])
mgr.save(1, {"step": 1, "w": torch.ones(4)})
print("saved 1", flush=True)
mgr.save(2, {"step": 2, "w": torch.ones(150_000_000)})  # 600 MB: long enough to be killed mid-write
"""


@pytest.mark.ranks
def test_sigkill_during_a_write_leaves_the_previous_checkpoint(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "saved 1"
    deadline = time.monotonic() + 60
    while not any(n.endswith(".tmp") for n in os.listdir(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "ckpt-000000002.pt").exists(), "the write finished before the kill"
    mgr = CheckpointManager(str(tmp_path))
    path, state = mgr.load_latest()
    assert state["step"] == 1 and path.endswith("ckpt-000000001.pt")
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path))  # the dead write's file is gone


def test_a_format_1_checkpoint_reads_as_the_parts_layout():
    from hpcdl.train.state import FORMAT, upgrade

    counters = {"step": 7, "epoch": 2, "elapsed_s": 3.5, "best": {"step": 5, "top1": 50.0}, "time_to_target_s": None}
    old = {"format": 1, **counters, "model": {}, "sampler": {"position": 3}}
    assert upgrade(old) == {**old, "format": FORMAT, "counters": counters}
    assert upgrade(upgrade(old)) == upgrade(old)  # the current format passes as it is


def test_a_checkpoint_above_2_gib_restarts_on_each_backend_with_one_copy_per_rank(mpiexec, ccl, tmp_path):
    """2 GiB and 1 MiB of float32 in one tensor, beside bf16 and int64 ones: rank 0 reads it and streams it in
    64 MiB chunks (a pickled whole overflowed MPI's 32-bit count and held 3-5 copies). On gloo, MPI and
    oneCCL each rank gets every value, and its resident memory grows by at most 1.3x the checkpoint's size."""
    folder = tmp_path / "checkpoints"
    big = torch.full(((2 ** 31 + 2 ** 20) // 4,), 1.0)
    CheckpointManager(str(folder)).save(5, {"model": {"t01": big, "t02": torch.full((3, 5), 2, dtype=torch.bfloat16),
                                                      "t03": torch.full((7,), 3, dtype=torch.int64)},
                                            "counters": {"step": 5}})
    size = big.numel() * 4 + 15 * 2 + 7 * 8
    del big
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    script = REPO / "tests" / "state_ranks.py"
    peaks = {}
    for backend in ("gloo", "mpi", "ccl"):
        out = tmp_path / backend
        out.mkdir()
        if backend == "gloo":
            port = free_port()
            procs = [subprocess.Popen([PYTHON, script, folder, out, backend], env={**env, **rank_env(r, 2, port)},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
            said = [p.communicate(timeout=240)[0] for p in procs]
            assert [p.returncode for p in procs] == [0, 0], said[0][-3000:]
        else:
            run = mpi_run(mpiexec, script, folder, out, backend, timeout=240)
            assert run.returncode == 0, run.stderr[-3000:]
        for r in range(2):
            found = json.loads((out / f"rank{r}.json").read_text())
            assert found["wrong"] == [] and found["step"] == 5 and found["bytes"] == size, (backend, found)
            assert found["dtypes"] == ["torch.bfloat16", "torch.float32", "torch.int64"]
            peaks[backend, r] = found["peak_over_start"] / size
            assert peaks[backend, r] <= 1.3, (backend, r, peaks)
    print("peak memory over the start / checkpoint size:", {f"{b} rank {r}": round(v, 3) for (b, r), v in peaks.items()})
