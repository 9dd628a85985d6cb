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


# -- the one owner of a checkpoint, and the just-in-time one through it ------------------------------------------------

class _LostPeer:
    """A stand-in for a 2-rank job's context whose rank 1 is lost (its heartbeat found stopped): the rescue's own
    code runs on it, without a second process (the multi-rank tests lose real ranks: test_train, test_rescue)."""

    rank, world_size, store = 0, 2, None
    env = type("Env", (), {"master_port": 29500})()
    heartbeat = type("Heartbeat", (), {"interval_s": 0.1, "recent": lambda self, fresh_s: [1],
                                       "who": lambda self, r: f"rank {r}'s host"})()


def _trained(optimizer: str, steps: int = 3):
    """own_models.tiny_swin (timm's Swin: non-persistent buffers) and its optimizer after ``steps`` steps."""
    from own_models import tiny_swin

    from hpcdl.optim.config import OptimConfig
    from hpcdl.optim.factory import build_optimizer
    from hpcdl.optim.modes import training_weights

    torch.manual_seed(0)
    model = tiny_swin(10)
    opt = build_optimizer(model, OptimConfig(name=optimizer, lr=0.01))
    training_weights(opt)
    for _ in range(steps):
        torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.arange(4)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _rescue_of(tmp_path, model, opt, steps: int):
    """A Rescue on rank 0 of 2 with the start's Checkpointer, its boundary taken after ``steps`` steps."""
    from hpcdl.optim.modes import ModelWeights
    from hpcdl.runs.folder import RunFolder
    from hpcdl.train.checkpoint import Checkpointer
    from hpcdl.train.rescue import Rescue
    from hpcdl.train.state import Frozen, Progress

    rescue = Rescue(_LostPeer(), str(tmp_path))
    ckpt = Checkpointer(RunFolder(str(tmp_path)), keep=2, rank=0, lock=rescue.lock)
    ckpt.attach({"model": ModelWeights(model, opt, ckpt.lock), "optimizer": opt, "sampler": Frozen({"epoch": 0}),
                 "counters": Progress(step=steps), "rng": Frozen([None, None])}, lambda: {"format": 2})
    rescue.attach(ckpt)
    with ckpt.lock:
        rescue.take_boundary()
    return rescue, ckpt


@pytest.mark.parametrize("during_evaluation", [False, True])
def test_a_just_in_time_checkpoint_of_a_model_with_non_persistent_buffers_loads_and_holds_eval_model(
        tmp_path, during_evaluation):
    """timm's Swin registers relative_position_index with persistent=False: the rescue's boundary copied every
    named_buffers() entry and the strict load of the checkpoint refused the extra keys (issue 44, item 2). Of a
    Schedule-Free run it holds eval_model, the averaged x (item 9); during an evaluation, whose x is in the model,
    the model saved is the training y all the same (item 5)."""
    from hpcdl.optim.modes import eval_state
    from own_models import tiny_swin

    model, opt = _trained("schedulefree")
    y = {k: v.clone() for k, v in model.state_dict().items()}
    x = eval_state(model, opt)
    rescue, ckpt = _rescue_of(tmp_path, model, opt, steps=3)
    evaluation = ckpt.parts["model"].evaluating()
    if during_evaluation:
        evaluation.__enter__()
        assert any(not torch.equal(model.state_dict()[k], y[k]) for k in y)  # x is in the model
    with rescue.lock:
        rescue._rescue("rank 1 lost (a stand-in)")
    if during_evaluation:
        evaluation.__exit__(None, None, None)
    result = json.loads((tmp_path / "jit" / os.path.basename(rescue.folder) / "result.json").read_text())
    assert result["written"] and result["step"] == 3, result
    state = torch.load(result["checkpoint"], map_location="cpu", weights_only=True)
    fresh = tiny_swin(10)
    fresh.load_state_dict(state["model"])  # strict: no key the model does not save
    assert all(torch.equal(state["model"][k], y[k]) for k in y)
    assert "eval_model" in state and all(torch.equal(state["eval_model"][k], x[k]) for k in x)
    fresh.load_state_dict(state["eval_model"])
    assert all(torch.equal(model.state_dict()[k], y[k]) for k in y)  # the training weights are back


def test_a_rescue_waits_for_a_write_in_flight_and_both_checkpoints_load(tmp_path, monkeypatch):
    """Rank 0's periodic write and its rescue (from the watch thread) go through one Checkpointer under one lock:
    the rescue's write waits for the periodic one (a new CheckpointManager used to delete its temporary file and
    write the same temporary name: both could be lost; issue 44, item 5), then finds it on disk."""
    import threading

    model, opt = _trained("sgd", steps=1)
    rescue, ckpt = _rescue_of(tmp_path, model, opt, steps=4)
    monkeypatch.setenv("HPCDL_TEST_SLOW_SAVE", "periodic:1.5")
    periodic = threading.Thread(target=ckpt.write, args=(4, ckpt.compose(), "periodic"))
    periodic.start()
    time.sleep(0.3)
    started = time.monotonic()
    with rescue.lock:  # as Rescue.run takes it
        waited = time.monotonic() - started
        assert ckpt.has(4)  # the rescue finds the periodic checkpoint of its step and writes none
        ckpt.write_locked(5, ckpt.compose(), "just in time")
    periodic.join()
    assert waited > 1.0
    assert [os.path.basename(p) for p in ckpt.folder.checkpoint_list()] == ["ckpt-000000005.pt", "ckpt-000000004.pt"]
    for path in ckpt.folder.checkpoint_list():
        assert torch.load(path, weights_only=True)["model"].keys() == model.state_dict().keys()
    assert not list((tmp_path / "checkpoints").glob(".ckpt-*.tmp"))


def test_a_rescue_written_by_another_rank_leaves_rank_0s_write_in_flight_alone(tmp_path):
    """A survivor other than rank 0 writes the just-in-time checkpoint when rank 0's report does not come in time
    (rank 0's rescue waits for its own periodic write, which may outlast the survivors' bound). Its first manager
    removed every .ckpt-*.tmp: rank 0's write in flight, which then failed as a disk error (exit 2, and under
    --kill-on-bad-exit the writer killed). Only rank 0 at a start removes them; the file stands in for rank 0's
    write on another node."""
    from hpcdl.optim.modes import ModelWeights
    from hpcdl.runs.folder import RunFolder
    from hpcdl.train.checkpoint import Checkpointer, CheckpointManager
    from hpcdl.train.state import Frozen, Progress

    model, opt = _trained("sgd", steps=1)
    folder = RunFolder(str(tmp_path))
    os.makedirs(folder.checkpoints)
    in_flight = os.path.join(folder.checkpoints, ".ckpt-000000004.pt.node1.4242.tmp")
    with open(in_flight, "wb") as f:
        f.write(b"rank 0 is writing")
    ckpt = Checkpointer(folder, keep=2, rank=1)
    ckpt.attach({"model": ModelWeights(model, opt, ckpt.lock), "optimizer": opt, "sampler": Frozen({"epoch": 0}),
                 "counters": Progress(step=5), "rng": Frozen([None, None])}, lambda: {"format": 2})
    with ckpt.lock:
        ckpt.write_locked(5, ckpt.compose(), "just in time")
    assert os.path.exists(in_flight) and ckpt.has(5)
    CheckpointManager(folder.checkpoints)  # rank 0's at the next start: a killed write's file goes
    assert not os.path.exists(in_flight)


def test_every_start_gets_its_own_rescue_folder(monkeypatch):
    """The unsupervised name (job, Slurm step, port) repeats across starts (mpiexec or torchrun with the default
    port): one rescue's reports made every later start in that run folder rescue at once (issue 44, item 1). Rank 0
    makes a token and the ranks share it through the rendezvous store; the supervisor's HPCDL_ATTEMPT is taken as is."""
    import torch.distributed as dist

    from hpcdl.train.rescue import attempt_name

    monkeypatch.delenv("HPCDL_ATTEMPT", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    store = dist.HashStore()
    first = attempt_name(29500, store, rank=0)
    assert attempt_name(29500, store, rank=1) == first and first.startswith("local.0.29500.")
    assert attempt_name(29500, dist.HashStore(), rank=0) != first
    assert attempt_name(29500) != attempt_name(29500)
    monkeypatch.setenv("HPCDL_ATTEMPT", "123-a2")
    assert attempt_name(29500, store, rank=0) == "123-a2"


def test_the_run_folder_names_its_paths_without_torch(tmp_path):
    """RunFolder is torch-free: the login node and the supervisor read a run folder with the trainer's names."""
    code = ("import sys; from hpcdl.runs.folder import RunFolder; f = RunFolder(sys.argv[1]); "
            "print(f.checkpoint(7), f.rank_part(7, 3), f.rescue('j-a1'), f.newest_checkpoint()); "
            "assert 'torch' not in sys.modules")
    (tmp_path / "checkpoints").mkdir()
    for name in ("ckpt-000000007.pt", "ckpt-000000009.rank00001.pt", ".ckpt-000000011.pt.42.tmp"):
        (tmp_path / "checkpoints" / name).write_bytes(b"")
    out = subprocess.run([PYTHON, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    c = tmp_path / "checkpoints"
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(c / "ckpt-000000007.pt"), str(c / "ckpt-000000007.rank00003.pt"),
                                  str(tmp_path / "jit" / "j-a1"), str(c / "ckpt-000000007.pt")]


def test_the_time_to_target_belongs_to_its_target_across_a_resume():
    """Progress (the checkpoint's counters) keeps the target its time was taken for: resumed with another target,
    the time is taken anew; a checkpoint from before the target was saved keeps its time."""
    from hpcdl.train.state import Progress

    first = Progress()
    first.start_clock()
    assert not first.evaluated({"top1": 90.0}, 95.0) and first.time_to_target_s is None
    assert first.evaluated({"top1": 96.0}, 95.0) and first.time_to_target_s is not None
    first.stopped_at = 48
    saved = first.state_dict()
    same = Progress()
    same.load_state_dict(saved)
    assert (same.target_top1, same.time_to_target_s, same.stopped_at) == (95.0, first.time_to_target_s, 48)
    higher = Progress()
    higher.load_state_dict(saved)
    higher.start_clock()
    assert not higher.evaluated({"top1": 96.5}, 98.0) and higher.time_to_target_s is None
    older = Progress()
    older.load_state_dict({k: v for k, v in saved.items() if k not in ("target_top1", "stopped_at")})
    older.start_clock()
    older.evaluated({"top1": 91.0}, 95.0)
    assert older.time_to_target_s == first.time_to_target_s and older.stopped_at is None


def test_an_epochs_evaluation_lost_with_a_rank_is_made_on_resume():
    """A rank lost during the evaluation after an epoch's turn: the just-in-time checkpoint is the turn's, taken
    before the evaluation (the counters say so), and the resume evaluates before it trains; under the same config
    a checkpoint taken after the evaluation, mid-epoch, or at an epoch that loop.eval_every skips does not; nor
    does one written before the counters held this (as if evaluated). The step last evaluated is kept too: a
    finished run started again is not evaluated again (older checkpoints: the best's step)."""
    from hpcdl.train.state import Progress

    turned = Progress(step=30, epoch=2, evaluated_epoch=1)  # the turn to epoch 2, its evaluation in flight
    resumed = Progress()
    resumed.load_state_dict(turned.state_dict())
    assert resumed.evaluation_due(every=1, last_step=60) and resumed.evaluation_due(every=2, last_step=60)
    assert not resumed.evaluation_due(every=0, last_step=60) and not resumed.evaluation_due(every=1, last_step=30)
    resumed.evaluated({"top1": 50.0}, 95.0)
    assert (resumed.evaluated_epoch, resumed.evaluated_step) == (2, 30)
    assert not resumed.evaluation_due(every=1, last_step=60)
    again = Progress()
    again.load_state_dict(resumed.state_dict())
    assert not again.evaluation_due(every=1, last_step=60) and again.evaluations == 0  # counted per process
    assert not Progress(step=45, epoch=3, evaluated_epoch=2).evaluation_due(every=2, last_step=60)
    older = Progress()
    older.load_state_dict({k: v for k, v in turned.state_dict().items() if k != "evaluated_epoch"})
    assert older.evaluated_epoch == 2 and not older.evaluation_due(every=1, last_step=60)
    best_earlier = {k: v for k, v in resumed.state_dict().items() if k not in ("evaluated_epoch", "evaluated_step")}
    older.load_state_dict({**best_earlier, "best": {"step": 15, "top1": 60.0}})
    assert older.evaluated_step == 15
