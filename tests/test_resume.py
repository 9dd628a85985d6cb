"""The resume plan as data, without processes: the same number of ranks, fewer, more, a count that does not
divide the global batch, and checkpoint.resume_ranks=same; then the plan applied to samplers through a chain of
cuts, and the residuals folded by it from real per-rank files."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hpcdl.presets import get_preset
from hpcdl.data.sampler import DistributedShardSampler
from hpcdl.errors import ConfigError
from hpcdl.train.checkpoint import save_rank_state
from hpcdl.train.resume import Saved, fold_residuals, plan_resume


def config(global_batch: int = 32, accum: int = 1, resume_ranks: str = "any"):
    cfg = get_preset("demo_tiny_lars")
    return dataclasses.replace(cfg, global_batch=global_batch, ranks=1,
                               loop=dataclasses.replace(cfg.loop, accum_steps=accum),
                               checkpoint=dataclasses.replace(cfg.checkpoint, resume_ranks=resume_ranks))


def saved(world: int, *, global_batch: int = 32, accum: int = 1, remapped: bool = False, position: int = 3,
          cuts=(), rank_states: bool = True) -> Saved:
    sampler = {"epoch": 2, "position": position, "num_replicas": world, "cuts": [list(c) for c in cuts]}
    return Saved("ckpt-000000007.pt", world, global_batch, accum, remapped, sampler, rank_states)


def test_the_same_number_of_ranks_takes_everything_as_it_was():
    plan = plan_resume(saved(4), 4, config())
    assert (plan.accum_steps, plan.accum_remapped, plan.remapped, plan.lines) == (1, False, False, ())
    assert plan.rng_from == (0, 1, 2, 3) and plan.residuals_from == ((0,), (1,), (2,), (3,))
    assert plan.cuts == ()  # the position goes on; no cut


def test_fewer_ranks_keep_the_micro_batch_fold_residuals_and_cut_the_epoch():
    plan = plan_resume(saved(8, accum=2, cuts=[(16, 1)]), 2, config(accum=2))  # micro-batch 32 / 8 / 2 = 2
    assert (plan.accum_steps, plan.accum_remapped) == (8, True)  # 16 per rank in micro-batches of 2
    assert plan.rng_from == (0, 1)
    assert plan.residuals_from == ((0, 2, 4, 6), (1, 3, 5, 7)) and plan.residual_scale == 2 / 8
    assert plan.cuts == ((16, 1), (8, 3))  # the saved position is one more cut
    assert "loop.accum_steps 2 -> 8 keeps the micro-batch of 2 images" in plan.lines[0]
    assert "written by 8 ranks, on 2: global batch 32 = 2 x 16 per rank (was 8 x 4)" in plan.lines[1]


def test_more_ranks_seed_the_new_ones_by_the_rule_of_the_start_and_own_no_residuals():
    plan = plan_resume(saved(2), 8, config())  # micro-batch 16 does not divide the 4 per rank now
    assert plan.rng_from == (0, 1, None, None, None, None, None, None)
    assert plan.residuals_from == ((0,), (1,), (), (), (), (), (), ()) and plan.residual_scale == 4.0
    assert (plan.accum_steps, plan.accum_remapped) == (1, False)
    assert "the saved micro-batch of 16 images does not divide the 4 per rank, so loop.accum_steps stays 1" \
        in plan.lines[0]
    assert "seeded by the start's rule on the others" in plan.lines[1]


def test_a_run_whose_accumulation_a_resume_set_keeps_it_on_its_own_count():
    plan = plan_resume(saved(2, accum=4, remapped=True), 2, config(accum=1))
    assert (plan.accum_steps, plan.accum_remapped) == (4, True)
    assert plan.lines == ("resuming on 2 ranks (saved: 2): loop.accum_steps 1 -> 4 keeps the micro-batch of 4 images",)


def test_a_count_that_does_not_divide_the_global_batch_is_refused_naming_the_largest_that_does():
    with pytest.raises(ConfigError, match="global_batch=32 does not split over 6 ranks, and a resume keeps the "
                                          "global batch .* run on 4 ranks"):
        plan_resume(saved(8), 6, config())


def test_resume_ranks_same_refuses_another_count():
    with pytest.raises(ConfigError, match="written by 8 ranks, this job has 4 and checkpoint.resume_ranks=same"):
        plan_resume(saved(8), 4, config(resume_ranks="same"))
    assert plan_resume(saved(8), 8, config(resume_ranks="same")).cuts == ()


@pytest.mark.parametrize("chain", [(4, 2, 2, 1, 4), (1, 3, 2), (6, 6, 2, 4)])
def test_the_plans_cuts_deal_each_sample_of_the_epoch_once_through_a_chain_of_cuts(chain):
    """96 images; each leg trains 2 global steps of 12 (the batch divides every count here) and is cut; the
    last trains to the epoch's end. The samplers load what the plan says; together they train the epoch."""
    sizes, batch, seen, state = [12] * 8, 12, [], None
    for leg, world in enumerate(chain):
        ranks = [DistributedShardSampler(sizes, world, r, "global", seed=5) for r in range(world)]
        if state is not None:
            plan = plan_resume(saved(state["num_replicas"], global_batch=batch, position=state["position"],
                                     cuts=state["cuts"]), world, config(global_batch=batch))
            for r in ranks:
                r.load_state_dict({**state, "epoch": 1}, remap=True)
            assert tuple(ranks[0].cuts) == plan.cuts
        for r in ranks:
            r.set_epoch(1)
        for r in ranks:
            seen += r.advance(2 * batch // world if leg < len(chain) - 1 else len(r))
        state = ranks[0].state_dict()
    real = sorted(int(i) for i in seen if not i.padding)
    assert real == list(range(96))


def test_residuals_are_folded_from_the_files_one_at_a_time_and_scaled(tmp_path):
    for r in range(4):
        save_rank_state(str(tmp_path), 7, r, {"residuals": {"b0": torch.full((3,), float(r + 1))}, "step": 7,
                                              "bucketed": True, "last_step_sent": [6]})
    plan = plan_resume(saved(4), 2, config())
    ckpt = str(tmp_path / "ckpt-000000007.pt")
    assert torch.equal(fold_residuals(plan, ckpt, 0, None)["residuals"]["b0"], torch.full((3,), (1 + 3) * 0.5))
    assert torch.equal(fold_residuals(plan, ckpt, 1, None)["residuals"]["b0"], torch.full((3,), (2 + 4) * 0.5))
    more = plan_resume(saved(4), 8, config())
    assert fold_residuals(more, ckpt, 1, None)["residuals"]["b0"].tolist() == [2 * 2.0] * 3
    shared = {"step": 7, "bucketed": True, "last_step_sent": [6]}
    assert fold_residuals(more, ckpt, 6, shared) == {**shared, "residuals": {}}  # no file read
    same = plan_resume(saved(4), 4, config())
    assert fold_residuals(same, ckpt, 3, None)["residuals"]["b0"].tolist() == [4.0] * 3
