"""optimizer.shard: each tensor's update and state on one rank, the updated tensors all-gathered. The weights and
the gathered state are the replicated run's bit for bit; a checkpoint written sharded resumes on another rank
count; a lost rank's share of the state comes from the newest checkpoint into the survivors' just-in-time one, and
the resume from it trains each sample once."""

from __future__ import annotations

import json
import subprocess
from collections import Counter

import pytest
import torch
from conftest import PYTHON, REPO, free_port, rank_env, same_states, start_ranks
from test_train import args_for, start_faulty, wait_all

from hpcdl.errors import ConfigError
from hpcdl.optim.config import OptimConfig
from hpcdl.optim.muon import Muon
from hpcdl.optim.shard import ELEMENTWISE, deal, update_cost
from hpcdl.train.rescue import EXIT_PEER_LOST


def test_tensors_are_dealt_costliest_first_to_the_least_loaded_rank_alike_on_every_rank():
    costs = [5.0, 1.0, 9.0, 3.0, 3.0, 8.0, 2.0]
    owner = deal(costs, 3)
    assert owner == deal(list(costs), 3)  # a function of the costs alone
    loads = [sum(c for c, o in zip(costs, owner) if o == r) for r in range(3)]
    assert sorted(loads) == [10.0, 10.0, 11.0]  # 9+1, 8+2, 5+3+3: within the smallest tensor of even
    assert deal(costs, 1) == [0] * len(costs) and set(deal(costs, 9)) == set(range(7))  # more ranks than tensors
    assert deal([1.0, 1.0], 2) == [0, 1]  # ties: the lower rank, then the tensor's place


def test_a_muon_matrix_costs_its_newton_schulz_an_adamw_tensor_its_elements():
    matrix, flat = torch.nn.Parameter(torch.zeros(64, 32, 3, 3)), torch.nn.Parameter(torch.zeros(64 * 32 * 9))
    muon = Muon([{"params": [matrix], "adapt": True}, {"params": [flat], "adapt": False}])
    adapted, plain = (update_cost(p, g, muon) for g in muon.param_groups for p in g["params"])
    assert plain == ELEMENTWISE * flat.numel()
    m, n = 64, 32 * 9
    assert adapted == ELEMENTWISE * matrix.numel() + muon.orthogonalize_steps * (2 * m * m * n + m ** 3) > 20 * plain


def test_schedule_free_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="optimizer.shard=true with schedulefree.*optimizer.shard=false"):
        OptimConfig(name="schedulefree", shard=True)
    assert OptimConfig(name="muon", shard=True).shard


def test_the_just_in_time_state_counts_each_tensor_and_is_refused_before_any_checkpoint(tmp_path):
    """rescue_shard.compose_parts over a 2-tensor model whose optimizer keeps state (SGD with momentum), rank 0 the
    one survivor holding tensor 0: with a checkpoint on disk, tensor 1's state comes from it and the weights from rank
    0's share; a survivor a step behind is counted so; with no checkpoint, tensor 1 would have no state: refused. The
    writer's all-gather cut mid-way (its flag left up) is said."""
    from types import SimpleNamespace

    from hpcdl.train.rescue_shard import compose_parts, describe
    from hpcdl.train.state import Frozen

    net = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    whole = optimizer.state_dict()
    mine = {"weights": {"weight": torch.full((2, 3), 7.0)}, "state": {0: whole["state"][0]}}
    files = {0: {"step": 5, "rng": None, "shard": mine}}
    older = {1: {"momentum_buffer": torch.full((2,), 3.0)}}
    for newest, steps, kinds in (((str(tmp_path / "ckpt-3.pt"), {"optimizer": {"state": older}}), {0: 5}, (1, 0, 1, 0)),
                                 ((str(tmp_path / "ckpt-3.pt"), {"optimizer": {"state": older}}), {0: 4}, (0, 1, 1, 0)),
                                 (None, {0: 5}, (1, 0, 0, 1))):
        cut = steps == {0: 4}
        ckpt = SimpleNamespace(manager=lambda newest=newest: SimpleNamespace(load_latest=lambda: newest),
                               parts={"optimizer": SimpleNamespace(optimizer=optimizer, gathering=cut)})
        parts, account = compose_parts(ckpt, {"model": Frozen(net.state_dict())}, files, steps, 5)
        assert (account["current"], account["behind"], account["from_checkpoint"], account["fresh"]) == kinds, account
        assert account["cut_gather"] is cut and ("cut mid-way" in describe(account)) is cut
        if newest is None:
            assert parts is None  # fresh momentum under a running counter: the resume takes the newest checkpoint
            continue
        state = parts["optimizer"].state_dict()["state"]
        assert torch.equal(state[1]["momentum_buffer"], older[1]["momentum_buffer"])
        assert torch.equal(state[0]["momentum_buffer"], whole["state"][0]["momentum_buffer"])
        model = parts["model"].state_dict()
        assert torch.equal(model["weight"], mine["weights"]["weight"]) and torch.equal(model["bias"], net.bias)


@pytest.mark.ranks
def test_every_optimizer_sharded_over_three_ranks_updates_and_saves_as_replicated(tmp_path):
    """Three gloo ranks: each optimizer (Schedule-Free refused above) replicated and sharded over the same gradients:
    the same weights and gathered state bit for bit, each tensor's state on one rank only, and a whole state loaded
    back keeps only the rank's share and steps on as the replicated one. With each rank's own gradients
    reduce-scattered (started after backward, or by it, the all-gather taken in by the next forward), the weights of
    the replicated optimizer on their mean."""
    port = free_port()
    procs = [subprocess.Popen([PYTHON, str(REPO / "tests" / "shard_ranks.py"), str(tmp_path), "gloo"],
                              env={**rank_env(r, 3, port), "PYTHONPATH": str(REPO)}) for r in range(3)]
    assert [p.wait(timeout=240) for p in procs] == [0, 0, 0]
    seen = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3)]
    # DDP without its buffer broadcast before each forward (gather_ahead's) still gives every rank rank 0's buffers
    # at construction, through forward_sync_buffers and on a torch without it (a fake: the argument hidden)
    built = [s.pop("construction_buffers") for s in seen]
    assert all(len({r[i][0] for r in built}) == 1 and not any(r[i][1] for r in built) for i in (0, 1)), built
    assert set(seen[0]) == {"sgd", "nesterov", "lars", "larc", "lamb", "adamw", "muon"}
    for name in seen[0]:
        ranks = [s[name] for s in seen]
        assert all(r["weights"] and r["state"] and r["steps"] and r["resumed"] for r in ranks), (name, ranks)
        assert all(r["owners"] == [0, 1, 2] for r in ranks)
        replicated = ranks[0]["replicated_bytes"]
        # each tensor's state on its owner alone (Adam's step counters, 4 bytes a tensor, excepted: they are
        # per tensor too), none on the others
        assert sum(r["bytes"] for r in ranks) <= replicated and all(0 < r["bytes"] < replicated for r in ranks)
        assert [r["resumed_bytes"] for r in ranks] == [r["bytes"] for r in ranks]
        # reduce-scattered, each rank's own gradients: the replicated weights within fp32's rounding of another
        # summation order (a few 1e-9 measured), and the replicas alike
        assert all(r["scatter_diff"] <= 1e-6 for r in ranks) and len({r["scatter_digest"] for r in ranks}) == 1, ranks
        # the same with the reduce-scatters started by backward, in segments that split tensors: backward started
        # some, not those of the tensor it left without a gradient
        assert all(r["overlap_diff"] <= 1e-6 for r in ranks) and len({r["overlap_digest"] for r in ranks}) == 1, ranks
        assert all(0 < s < r["segments"] for r in ranks for s in r["started"]), ranks
        # and with the all-gather at the step's end into the weights, views of its buffer (the default): the same,
        # a tensor given new memory bound again
        assert all(r["bound_diff"] <= 1e-6 for r in ranks) and len({r["bound_digest"] for r in ranks}) == 1, ranks
        assert all(all(r["bound_checks"]["views"]) and not any(r["checks"]["views"]) for r in ranks), ranks
        assert all(r["bound_checks"]["saved"][0] < 1.05 * r["bound_checks"]["saved"][1] for r in ranks), ranks
        # the next forward took the all-gather in before backward: nothing left pending, the replicated weights
        assert all(len(r["checks"]["ahead"]) == 2 for r in ranks), ranks
        assert all(pending == 0 and diff <= 1e-6 for r in ranks for pending, diff in r["checks"]["ahead"]), ranks
        # each rank's forward moved its own batch-norm statistics; each step's end gave every rank rank 0's
        own, buffers = [r["checks"]["own_buffers"] for r in ranks], [r["checks"]["buffers"] for r in ranks]
        assert all(own[0][i] != own[1][i] != own[2][i] != own[0][i] for i in (1, 2)), own
        assert buffers[0] == buffers[1] == buffers[2] == own[0] and len(set(buffers[0][1:])) == 2, (own, buffers)
        # a tensor frozen after the layout was made is refused by name, and close() removes every hook
        assert all("the requires_grad of parameter(s) [0]" in r["checks"]["frozen"] for r in ranks), ranks
        assert all(r["checks"]["hooks_left"] == 0 for r in ranks), ranks


def replicated_and_sharded_alike(data, tmp_path, extra: list[str], steps: tuple[int, ...]) -> dict:
    """Two runs on 2 ranks, optimizer.shard false and true, side by side: their checkpoints of ``steps`` the same bit
    for bit, model and optimizer; the sharded run's last one."""
    runs = {}
    for shard in ("false", "true"):
        (tmp_path / shard).mkdir()
        runs[shard] = start_ranks(2, args_for(data, tmp_path / f"run-{shard}", *extra, "--set",
                                              f"optimizer.shard={shard}"), tmp_path / shard)
    assert wait_all(runs["false"] + runs["true"]) == [0] * 4, (tmp_path / "true" / "rank0.log").read_text()[-3000:]
    for step in steps:
        a, b = (torch.load(tmp_path / f"run-{s}" / "checkpoints" / f"ckpt-{step:09d}.pt", weights_only=True)
                for s in ("false", "true"))
        assert same_states(a["model"], b["model"]) == [] and same_states(a["optimizer"], b["optimizer"]) == []
    return b


@pytest.mark.ranks
def test_a_sharded_run_trains_the_replicated_weights_and_resumes_on_another_rank_count(data, tmp_path):
    """Muon (Newton-Schulz dealt out, its AdamW part per group) on 2 ranks of the default backend, sharded and not,
    6 steps with a checkpoint at 3: the same checkpoints bit for bit, the optimizer state whole in both. The sharded
    checkpoint of step 3 then goes on, sharded, on 3 ranks to the end: the replicas identical. The all-gather is
    taken in by the next forward (optimizer.gather_ahead): the checkpoints and the replicas' check settle it."""
    extra = ["--set", "optimizer.name=muon", "--set", "schedule.base_lr=0.01", "--set", "loop.max_steps=6",
             "--set", "checkpoint.every_steps=3", "--set", "checkpoint.every_minutes=0", "--set", "data.workers=0",
             "--set", "loop.eval_every=0", "--set", "global_batch=24",  # 24: on 2 ranks and on 3
             "--set", "optimizer.gather_ahead=true"]
    b = replicated_and_sharded_alike(data, tmp_path, extra, (3, 6))
    assert set(b["optimizer"]["state"]) == {i for g in b["optimizer"]["param_groups"] for i in g["params"]}  # whole
    run = tmp_path / "run-true"
    for later in (run / "checkpoints").glob("ckpt-000000006*"):
        later.unlink()
    (tmp_path / "three").mkdir()
    again = start_ranks(3, args_for(data, run, *extra, "--set", "optimizer.shard=true"), tmp_path / "three")
    assert wait_all(again) == [0, 0, 0], (tmp_path / "three" / "rank0.log").read_text()[-3000:]
    log = (tmp_path / "three" / "rank0.log").read_text()
    assert "written by 2 ranks, on 3" in log and "replicas: identical on 3 ranks" in log, log[-3000:]
    assert "ipex: not used with optimizer.shard=true" in log, log[-3000:]  # its fused step would replace this one
    assert "reduce-scatters started by backward (segments of 25 MB) to each tensor's owner and an all-gather of the " \
        "updated tensors, in segments taken in by the next forward" in log, log[-3000:]


@pytest.mark.ranks
@pytest.mark.parametrize("victim, phase", [(1, "gather"), (0, "allreduce")])
def test_a_rank_lost_with_the_state_sharded_leaves_a_whole_just_in_time_checkpoint_and_each_sample_once(
        data, tmp_path, victim, phase):
    """A rank SIGKILLed, the optimizer sharded: its share of the state is gone with it. Rank 0 in backward (the 9th
    gradient bucket it hands over: step 5's, or step 9's where a step has one bucket): the survivor writes the
    just-in-time checkpoint of the step before, s. Rank 1 after its update of step 5, before the all-gather: the
    survivor, cut in the all-gather that lands in its weights, writes step 5 and says the lost rank's weights came
    from a cut all-gather. Whole: every weight at step s (the last all-gather brought the victim's), its own
    tensors' state at step s and the victim's from the newest checkpoint (every 3 steps), counted in result.json;
    exit status 4. The resume on 2 ranks starts from it: each sample of steps 1 to s + 2 recorded once. Rank 0 is
    the store's host, the writer of every other checkpoint, and the owner the deal gives the costliest tensor."""
    from hpcdl.train.checkpoint import CheckpointManager

    run = tmp_path / "run"
    common = ("--set", "data.workers=0", "--set", "checkpoint.every_steps=3", "--set", "loop.eval_every=0",
              "--set", "optimizer.shard=true", "--set", "loop.record_samples=true")
    args = args_for(data, run, "--set", "loop.max_steps=20", "--set", "loop.timeout_s=10", *common)
    survivor = 1 - victim
    procs = start_faulty(tmp_path, {"HPCDL_TEST_KILL": f"{phase}:{victim}"}, *args)
    try:
        assert procs[victim].wait(timeout=120) < 0
        code = procs[survivor].wait(timeout=60)
    finally:
        for p in procs:
            p.kill()
    log = (tmp_path / f"rank{survivor}.log").read_text()
    assert code == EXIT_PEER_LOST and "optimizer state of" in log, log[-3000:]
    [result] = [json.loads(p.read_text()) for p in (run / "jit").glob("*/result.json")]
    account, saved = result["optimizer_state"], result["step"]
    assert saved in ((5,) if phase == "gather" else (4, 8)) and result["written"] and result["lost"] == [victim], result
    assert account["current"] > 0 and account["from_checkpoint"] > 0 and account["fresh"] == 0, account
    assert account["cut_gather"] is (phase == "gather") and ("cut mid-way" in log) is (phase == "gather"), account
    assert account["checkpoint"].endswith(f"ckpt-{saved // 3 * 3:09d}.pt") and account["shares"] == [survivor], account
    path, jit = CheckpointManager(str(run / "checkpoints")).load_latest()
    before = torch.load(account["checkpoint"], weights_only=True)
    state, old = jit["optimizer"]["state"], before["optimizer"]["state"]
    assert path == result["checkpoint"] and jit["counters"]["step"] == saved
    assert set(state) == {i for g in jit["optimizer"]["param_groups"] for i in g["params"]}  # whole
    kept = [i for i in state if same_states(state[i], old[i]) == []]  # the victim's, as of the older checkpoint
    assert len(kept) == account["from_checkpoint"] and len(state) - len(kept) == account["current"]
    weights = [k for k, v in jit["model"].items() if v.is_floating_point() and "running" not in k]
    assert weights and all(not torch.equal(jit["model"][k], before["model"][k]) for k in weights)  # all moved on
    records = [line.split() for f in (run / "samples").iterdir() for line in f.read_text().splitlines()]
    assert {int(r[2]) for r in records} == set(range(1, saved + 1)), records  # cut back to the checkpoint
    (tmp_path / "again").mkdir()
    again = start_ranks(2, args_for(data, run, "--set", f"loop.max_steps={saved + 2}", *common), tmp_path / "again")
    assert wait_all(again) == [0, 0], (tmp_path / "again" / "rank0.log").read_text()[-3000:]
    assert f"resuming from {path}" in (tmp_path / "again" / "rank0.log").read_text()
    records = [line.split() for f in (run / "samples").iterdir() for line in f.read_text().splitlines()]
    assert {int(r[2]) for r in records} == set(range(1, saved + 3)), records
    assert set(Counter((r[0], r[1]) for r in records).values()) == {1}


@pytest.mark.ranks
def test_bench_optim_shard_measures_both_layouts_side_by_side_with_each_ranks_state(tmp_path):
    """2 ranks, a small model, SGD and Muon: both layouts timed, the update alone inside each with its exchange, then
    the trainer's whole step, every rank's state measured; each rank holds some of the state, together the replicated state's (Muon's
    counted per tensor alike)."""
    procs = start_ranks(2, ["bench", "optim-shard", "--model", "tiny_cnn", "--optimizers", "sgd,muon", "--rounds", "1",
                            "--steps", "1", "--backend", "gloo", "--json", str(tmp_path / "report.json")], tmp_path)
    assert wait_all(procs) == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["world_size"] == 2 and [r["optimizer"] for r in report["rows"]] == ["sgd", "muon"]
    assert report["scatter"] is False  # gloo: all-reduced, as the trainer does there
    for row in report["rows"]:
        assert 0 < row["replicated_update_ms"] < row["replicated_ms"] and 0 < row["sharded_update_ms"] < row["sharded_ms"]
        assert all(b > 0 for b in row["sharded_state_bytes"]) and sum(row["sharded_state_bytes"]) == \
            row["replicated_state_bytes"], row
        # the trainer's whole step (the default --batch), its optimizer phase inside it
        assert 0 < row["replicated_step_update_ms"] < row["replicated_step_ms"], row
        assert 0 < row["sharded_step_update_ms"] < row["sharded_step_ms"], row
        assert 0 < row["ahead_step_update_ms"] < row["ahead_step_ms"], row
    log = (tmp_path / "rank0.log").read_text()
    assert "sharded max" in log and "the trainer's whole step" in log


@pytest.mark.ranks
@pytest.mark.parametrize("hook, backend", [("chunk_sparse", "gloo"), ("bf16", "auto"), ("none", "gloo"),
                                           ("none", "auto")])
def test_the_comm_hooks_and_gloo_shard_as_they_replicate(data, tmp_path, hook, backend):
    """LARS on 2 ranks, 6 steps, sharded and not: the same checkpoint bit for bit. chunk_sparse all-reduces through
    its hook (a reduce-scatter cannot pick chunks) and keeps the weights and state of the positions it held back
    through hooks around each owner's step (before, the sharded optimizer had no such hooks and the run failed at
    start-up); bf16 reduce-scatters from bf16 on the default backend, as its all-reduce sums on 2 ranks (in 2 KB
    segments that split tensors, over 2 micro-batches a step: DDP's buckets of that size too); gloo, whose
    reduce-scatter is an all-reduce of the whole buffer, keeps DDP's all-reduce. Under bf16 the all-gather is taken
    in by the next forward (optimizer.gather_ahead), in the others waited for at the step's end (the default). The
    defaults on the default backend (the reduce-scatters' output lent to the owners as their gradients, the others'
    dropped in backward, the all-gather in place into the weights), in the same 2 KB segments and 2 micro-batches."""
    extra = ["--set", f"sync.hook={hook}", "--set", "sync.chunk=256", "--set", "sync.dense_warmup_epochs=0.1",
             "--set", "loop.max_steps=6", "--set", "checkpoint.every_minutes=0", "--set", "data.workers=0",
             "--set", "loop.eval_every=0", "--set", f"loop.backend={backend}"]
    if backend == "auto":  # segments of 2 KB (tensors split across them), 2 micro-batches a step
        extra += ["--set", "sync.bucket_cap_mb=0.002", "--set", "loop.accum_steps=2"]
    if hook == "bf16":  # the all-gather in those 2 KB segments, taken in by the next forward (the first micro-batch's)
        extra += ["--set", "optimizer.gather_ahead=true"]
    replicated_and_sharded_alike(data, tmp_path, extra, (6,))
    log = (tmp_path / "true" / "rank0.log").read_text()
    said = {"bf16": "reduce-scatters from bf16 started by backward (segments of 0.002 MB) to each tensor's owner "
                    "and an all-gather of the updated tensors, in segments taken in by the next forward",
            "auto": "reduce-scatters started by backward (segments of 0.002 MB) to each tensor's owner and an "
                    "all-gather of the updated tensors, one per dtype at the step's end, in place in the weights"}
    said = said.get(backend if hook == "none" else hook,
                    "the optimizer sharded (an all-gather after the update, one per dtype at the step's end")
    assert said in log, log[-3000:]
