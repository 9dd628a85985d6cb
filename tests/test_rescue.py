"""The just-in-time checkpoint off the supervisor's path: a run folder after a rescue takes the next start (mpiexec's
default port), a JIT checkpoint of a model with non-persistent buffers resumes, one of Schedule-Free holds its
averaged weights, survivors that are not the writer wait for its write under ``srun --kill-on-bad-exit=1``, and a
slow final checkpoint is no lost peer (issue 44). Real ranks, real launchers; a rank is lost by a real SIGSTOP
(tests/fault_ranks.py), a slow write is HPCDL_TEST_SLOW_SAVE (a test hook: the write sleeps)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PYTHON, REPO, sbatch_wait, start_ranks
from test_train import args_for

SWIN_SCHEDULE_FREE = ["--set", "model=own_models:tiny_swin", "--set", "optimizer.name=schedulefree", "--set",
                      "schedule.base_lr=0.005", "--set", "schedule.decay=constant", "--set", "data.workers=0",
                      "--set", "checkpoint.every_minutes=0", "--set", "loop.eval_every=0"]


def _mpiexec(mpiexec: str, log: Path, argv: list, env: dict, on_result: Path | None = None,
             timeout: float = 150) -> subprocess.CompletedProcess:
    """``mpiexec -n 2 PYTHON ARGV``, its output in ``log`` (read back as stderr, also after a timeout). With
    ``on_result`` (a run folder): once a rescue's result.json is there, the SIGSTOPped rank is killed, as its
    operator would (hydra's SIGTERM waits on a stopped process)."""
    with open(log, "w") as out:
        proc = subprocess.Popen([mpiexec, "-n", "2", PYTHON, *map(str, argv)], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                raise AssertionError(f"mpiexec ran past {timeout} s: {log.read_text()[-4000:]}")
            stopped = re.search(r"\(pid (\d+)\) SIGSTOPped", log.read_text())
            if on_result is not None and stopped and list(on_result.glob("jit/*/result.json")):
                time.sleep(1.0)  # the survivors' exit
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(stopped.group(1)), signal.SIGKILL)
            time.sleep(0.2)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", log.read_text())


def _launcher_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_", "PMI_",
                                                                     "HPCDL_"))}
    return {**env, "PYTHONPATH": f"{REPO / 'tests'}:{REPO}", "PYTHONUNBUFFERED": "1", **extra}


def test_two_starts_under_mpiexec_with_the_default_port_the_first_rescued_the_second_trains_on(mpiexec, default_port,
                                                                                                 data, tmp_path):
    """mpiexec -n 2 twice in one run folder, no MASTER_PORT (the default port): the first start's rank 1 is stopped
    at step 3, rank 0 saves step 2 just in time; the second start resumes it and finishes. Before, every start
    named its rescue folder local.0.29500, and the second read the first's reports and exited 4 at once. The model
    is timm's Swin (non-persistent buffers: the JIT checkpoint's strict load failed) trained by Schedule-Free (the
    JIT checkpoint held no eval_model)."""
    run = tmp_path / "run"
    args = args_for(data, run, "--set", "loop.max_steps=8", *SWIN_SCHEDULE_FREE)
    first = _mpiexec(mpiexec, tmp_path / "first.log", [REPO / "tests" / "fault_ranks.py", *args],
                     _launcher_env(HPCDL_TEST_STOP="step3:1"), on_result=run)
    assert first.returncode != 0 and "SIGSTOPped in step3" in first.stderr, first.stderr[-3000:]
    [result] = [json.loads(p.read_text()) for p in (run / "jit").glob("*/result.json")]
    assert result["written"] and result["step"] == 2 and result["lost"] == [1], result
    saved = torch.load(result["checkpoint"], map_location="cpu", weights_only=True)
    assert "eval_model" in saved and saved["eval_model"].keys() == saved["model"].keys()
    assert not any("relative_position_index" in k for k in saved["model"])  # persistent=False: in no state dict
    second = _mpiexec(mpiexec, tmp_path / "second.log", ["-m", "hpcdl", *args], _launcher_env())
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resuming from {result['checkpoint']} (step 2" in second.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] == 8
    assert len(list((run / "jit").iterdir())) == 1  # the second start made no rescue


@pytest.mark.ranks
def test_a_slow_final_checkpoint_is_no_lost_peer(data, tmp_path):
    """The final checkpoint's write slowed by 20 s on rank 0 of 2: rank 1 leaves once the RNG streams are gathered
    (its heartbeat stops), and rank 0's watch found that heartbeat stopped, rescued, exited 4 and skipped
    summary.json. Its watch now stops once the final checkpoint's collectives are over."""
    run = tmp_path / "run"
    args = args_for(data, run, "--set", "loop.max_steps=4", "--set", "data.workers=0", "--set", "loop.eval_every=0",
                    "--set", "checkpoint.every_minutes=0")
    os.environ["HPCDL_TEST_SLOW_SAVE"] = "end:20"
    try:
        procs = start_ranks(2, args, tmp_path)
    finally:
        del os.environ["HPCDL_TEST_SLOW_SAVE"]
    codes = [p.wait(timeout=180) for p in procs]
    log = (tmp_path / "rank0.log").read_text()
    assert codes == [0, 0], (codes, log[-3000:])
    assert "the end checkpoint's write takes 20 s longer" in log
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outcome"] == "finished" and summary["steps"] == 4
    assert not (run / "jit").exists() or not list((run / "jit").glob("*/report-*.json"))


def test_survivors_wait_for_the_writer_under_srun_kill_on_bad_exit(slurm, data, tmp_path):
    """4 ranks under a plain sbatch script's ``srun --kill-on-bad-exit=1``, rank 3 stopped at step 3: ranks 1 and
    2 are not the writer; they exited 4 as soon as rank 0 was chosen, and srun killed rank 0 in the middle of its
    (here slowed, 5 s) write. They now wait for its result: the checkpoint is whole and result.json written."""
    run = tmp_path / "run"
    args = args_for(data, run, "--set", "loop.max_steps=8", "--set", "data.workers=0", "--set", "loop.eval_every=0",
                    "--set", "checkpoint.every_minutes=0")
    script = tmp_path / "plain.sbatch"
    script.write_text("#!/bin/bash\n"
                      f"#SBATCH --nodes=2 --ntasks-per-node=2 --time=5 --output={tmp_path}/job-%j.out\n"
                      f"export PYTHONPATH={REPO / 'tests'}:{REPO} HPCDL_TEST_STOP=step3:3\n"
                      "export HPCDL_TEST_SLOW_SAVE='just in time:5'\n"
                      f"srun --kill-on-bad-exit=1 {PYTHON} {REPO / 'tests' / 'fault_ranks.py'} "
                      + " ".join(f"'{a}'" for a in args) + "\n")
    with pytest.raises(AssertionError, match="FAILED"):  # the step ends with the survivors' status 4
        sbatch_wait(script, env=_launcher_env(), timeout=180)
    out = "".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    [result] = [json.loads(p.read_text()) for p in (run / "jit").glob("*/result.json")]
    assert result["written"] and result["writer"] == 0 and result["survivors"] == [0, 1, 2], (result, out[-3000:])
    saved = torch.load(result["checkpoint"], map_location="cpu", weights_only=True)
    assert saved["counters"]["step"] == result["step"] == 2 and saved["jit"]["lost"] == [3]
    assert Path(result["checkpoint"]).name == "ckpt-000000002.pt"


@pytest.mark.ranks
@pytest.mark.parametrize("bad, backend", [(0, "auto"), (2, "gloo")])
def test_an_image_that_fails_its_crc_mid_epoch_stops_every_rank_with_status_2_naming_it(data, tmp_path, bad, backend):
    """3 ranks with the default 4 loader workers; one image of the training set is damaged (the start-up's quick
    check does not read images), the 7th batch of rank ``bad`` holds it. That rank stops with status 2 naming the
    shard and the image; the two others, blocked in step 7's collectives, stop with status 2 too, naming its error,
    after saving step 6 just in time (before, they stopped as after a lost peer, status 4, which a supervisor
    restarts into the same image). Rank 0 the victim serves the store; on gloo, rank 2."""
    from hpcdl.data.format import open_h5
    from hpcdl.data.verify import load_manifest
    from hpcdl.train.loader_sizing import PROBE_IMAGES
    from hpcdl.data.sampler import DistributedShardSampler

    damaged = tmp_path / "data"
    shutil.copytree(data, damaged)  # the damaged image: one of rank BAD's 7th batch, not one the loader probe reads
    manifest = load_manifest(str(damaged / "train"))
    sampler = DistributedShardSampler([s.count for s in manifest.shards], 3, bad, "global", shuffle=True, seed=0)
    total = sum(s.count for s in manifest.shards)
    stride = max(1, total // PROBE_IMAGES[1])  # the loader's probe reads these on every rank at start-up
    probed = {0, *((1 + d) * stride % total for d in range(PROBE_IMAGES[1]))}
    index = next(int(i) for i in list(sampler)[36:42] if int(i) not in probed)  # micro-batch 6: the 7th batch
    starts = np.cumsum([0] + [s.count for s in manifest.shards])
    shard_no = int(np.searchsorted(starts, index, side="right")) - 1
    shard, record = damaged / "train" / manifest.shards[shard_no].file, index - int(starts[shard_no])
    with open_h5(str(shard)) as f:
        at = f["images"].id.get_offset() + int(f["offsets"][record]) + 40
    raw = bytearray(shard.read_bytes())
    raw[at] ^= 0xFF
    shard.write_bytes(bytes(raw))
    run = tmp_path / "run"
    args = args_for(damaged, run, "--set", "global_batch=18", "--set", f"loop.backend={backend}",
                    "--set", "checkpoint.every_minutes=0")
    codes = [p.wait(timeout=180) for p in start_ranks(3, args, tmp_path)]
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(3)]
    named = f"{shard}: image {record} ("
    assert codes == [2, 2, 2], (codes, logs[bad][-3000:])
    assert named in logs[bad] and "fails its CRC32" in logs[bad], logs[bad][-3000:]
    others = [r for r in range(3) if r != bad]
    for r in others:
        assert re.search(rf"rank {r} stops \(status 2\), a rank's input failed: rank {bad}'s input failed: "
                         + re.escape(named), logs[r]), logs[r][-3000:]
    [result] = [json.loads(p.read_text()) for p in (run / "jit").glob("*/result.json")]
    assert result["step"] == 6 and result["survivors"] == others, result
    saved = torch.load(result["checkpoint"], map_location="cpu", weights_only=True)
    assert saved["counters"]["step"] == 6 and bad in saved["jit"]["rng_lost"]
