"""Gradient accumulation at an epoch's end: a last step of fewer micro-batches than loop.accum_steps exchanges
the gradients at its own last micro-batch and divides by what it trained, on real gloo ranks."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import PYTHON, REPO, free_port, rank_env

from hpcdl.train.step import step_shape


def test_a_step_ends_with_the_epoch_on_every_rank_alike():
    assert step_shape(4, 3, None) == (4, 12)  # hpcdl bench: whole steps
    assert step_shape(4, 3, 20) == (4, 12)
    assert step_shape(4, 3, 8) == (3, 8)  # 3, 3 and 2 images: the last micro-batch exchanges
    assert step_shape(4, 2, 2) == (1, 2)  # the epoch's last micro-batch, short or not, alone
    assert step_shape(2, 5, 5) == (1, 5)


@pytest.mark.ranks
@pytest.mark.parametrize("mode", ["global", "shard"])
def test_an_epochs_short_last_step_keeps_the_replicas_equal_and_divides_by_what_it_trained(mode, tmp_path):
    """2 ranks, 39 samples, micro-batches of 3, accum 4: each epoch's last step has 3 micro-batches (3, 3, 2
    images), the shard sampler's deal padded to the fuller rank. After every step the replicas are bitwise equal
    and the update is SGD's on the mean loss over every rank's images of the step."""
    port = free_port()
    procs = [subprocess.Popen([PYTHON, str(REPO / "tests" / "accum_ranks.py"), mode, str(tmp_path)],
                              env=rank_env(r, 2, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["steps"] and [s["micro"] for s in ranks[0]["steps"]] == [s["micro"] for s in ranks[1]["steps"]]
    per_rank = ranks[0]["per_rank"]
    for epoch in (0, 1):
        micro = [s["micro"] for s in ranks[0]["steps"] if s["epoch"] == epoch]
        assert sum(map(sum, micro)) == per_rank and all(len(m) == 4 for m in micro[:-1])
        assert len(micro[-1]) < 4, micro  # the case: a short last step
    for rank in ranks:
        for s in rank["steps"]:
            assert s["replicas_equal"], s
            assert s["from_reference"] < 1e-5, s
