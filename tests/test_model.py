"""The all-reduce cost formulas of ``hpcdl plan`` against values computed by hand.

Omni-Path-like link: alpha = 1 us, 12.5 GB/s (beta = 8e-11 s/B); a 100 MB (1e8 B) gradient, so n beta = 8 ms.
"""

import pytest

from hpcdl.errors import ConfigError
from hpcdl.plan.cost import Link, allreduce_cost, hierarchical, rabenseifner, ring

OPA = Link(latency_s=1e-6, bandwidth_bytes_s=12.5e9)
N = 1e8


@pytest.mark.parametrize("p, latency, bandwidth", [
    (2, 2 * 1e-6, 2 * (1 / 2) * 8e-3),  # 2 us, 8 ms
    (4, 6 * 1e-6, 2 * (3 / 4) * 8e-3),  # 6 us, 12 ms
    (1024, 2046 * 1e-6, 2 * (1023 / 1024) * 8e-3),  # 2.046 ms, 15.984375 ms
])
def test_ring(p, latency, bandwidth):
    cost = ring(N, p, OPA)
    assert cost.latency_s == pytest.approx(latency) and cost.bandwidth_s == pytest.approx(bandwidth)


@pytest.mark.parametrize("p, latency, bandwidth", [
    (2, 2 * 1 * 1e-6, 8e-3),  # 2 log2(2) alpha
    (4, 2 * 2 * 1e-6, 12e-3),
    (1024, 2 * 10 * 1e-6, 15.984375e-3),  # 20 us: log p instead of ring's 2046 us
    (6, 2 * 2 * 1e-6 + 2 * 1e-6, 12e-3 + 2 * 8e-3),  # 4 ranks plus 2 folded in: + 2 (alpha + n beta)
])
def test_rabenseifner(p, latency, bandwidth):
    cost = rabenseifner(N, p, OPA)
    assert cost.latency_s == pytest.approx(latency) and cost.bandwidth_s == pytest.approx(bandwidth)


def test_hierarchical_is_node_reduce_leader_ring_node_broadcast():
    node = Link(latency_s=0.5e-6, bandwidth_bytes_s=50e9)  # n beta_i = 2 ms
    cost = hierarchical(N, nodes=4, ranks_per_node=2, network=OPA, intra=node)
    assert cost.latency_s == pytest.approx(0.5e-6 + 6e-6 + 0.5e-6)
    assert cost.bandwidth_s == pytest.approx(2e-3 + 12e-3 + 2e-3)
    assert allreduce_cost("hierarchical", N, 4, 2, OPA, node) == cost
    assert allreduce_cost("ring", N, 4, 2, OPA) == ring(N, 8, OPA)  # flat: all 8 ranks on the network


def test_one_rank_costs_nothing_and_bad_input_is_named():
    assert ring(N, 1, OPA).total_s == 0 and rabenseifner(N, 1, OPA).total_s == 0
    with pytest.raises(ConfigError, match="choose one of ring, rabenseifner, hierarchical"):
        allreduce_cost("tree", N, 4, 1, OPA)
    with pytest.raises(ConfigError, match="needs the node's own link"):
        allreduce_cost("hierarchical", N, 4, 2, OPA)
    with pytest.raises(ConfigError, match="over 0 ranks"):
        ring(N, 0, OPA)


def test_cluster_profiles_carry_their_fabric():
    from hpcdl.launch.profiles import get_profile

    skx = Link.of(get_profile("stampede2-skx"))
    assert skx == Link(latency_s=1e-6, bandwidth_bytes_s=12.5e9)  # Omni-Path 100 Gb/s
    with pytest.raises(ConfigError, match="profile generic has no network latency and bandwidth"):
        Link.of(get_profile("generic"))


def test_published_rows_count_nodes_from_processors():
    from hpcdl.plan.published import PUBLISHED

    rows = {r.name: r for r in PUBLISHED}
    assert rows["resnet50-skx1024"].nodes == 512 and rows["resnet50-skx1600"].nodes == 800  # 2 sockets a node
    assert rows["resnet50-knl2048"].nodes == 2048  # one Xeon Phi a node
    assert rows["resnet50-skx1024"].batch_per_node == 64
    assert (rows["alexnet-cpu1024"].nodes, rows["alexnet-skx2048"].nodes) == (512, 1024)  # the two counts
    calibration = rows["surfsara-64"]
    assert calibration.nodes == 64 and calibration.batch_per_node == 64
    assert calibration.images_per_s / calibration.nodes == pytest.approx(98.5)
    assert rows["surfsara-448"].nodes == 448 and all(r.source for r in PUBLISHED)


def test_batch_curve_interpolates_and_holds_its_ends():
    from hpcdl.plan.cost import BatchCurve

    curve = BatchCurve(((64, 100.0), (32, 80.0)))
    assert (curve(16), curve(32), curve(48), curve(64), curve(128)) == (80.0, 80.0, 90.0, 100.0, 100.0)
    with pytest.raises(ConfigError, match="give \\(batch, images/s\\) points"):
        BatchCurve(((32, 0.0),))


def test_step_model_terms_by_hand():
    from hpcdl.plan.cost import BatchCurve, StepModel

    curve = BatchCurve(((32, 80.0), (64, 100.0)))
    # 4 nodes, batch 256: 64 a node, 0.64 s of compute; the ring all-reduce of 1e8 B over 4 ranks: 12.006 ms
    free = StepModel(gradient_bytes=N, throughput=curve, network=OPA, overlap=0.0).terms(4, 256)
    assert free["compute_s"] == pytest.approx(0.64) and free["allreduce_s"] == pytest.approx(0.012006)
    assert free["exposed_s"] == pytest.approx(0.012006) and free["step_s"] == pytest.approx(0.652006)
    assert free["efficiency"] == pytest.approx(0.64 / 0.652006) and free["images_s"] == pytest.approx(256 / 0.652006)
    hid = StepModel(gradient_bytes=N, throughput=curve, network=OPA, overlap=0.5).terms(4, 256)
    assert hid["hidden_s"] == pytest.approx(0.012006) and hid["step_s"] == pytest.approx(0.64)  # < 0.5 x 2/3 x 0.64
    fed = StepModel(gradient_bytes=N, throughput=curve, network=OPA, overlap=0.5, data_images_s=50.0)
    assert fed.terms(4, 256)["step_s"] == pytest.approx(64 / 50)  # loading 64 images takes 1.28 s
    assert fed.time_to_train(4, 256, epochs=2, train_images=1000) == pytest.approx(2 * 4 * 1.28)  # 4 steps an epoch
    alone = StepModel(gradient_bytes=N, throughput=curve, network=OPA).terms(1, 64)
    assert alone["allreduce_s"] == 0 and alone["efficiency"] == 1.0
    with pytest.raises(ConfigError, match="overlap=1.5"):
        StepModel(gradient_bytes=N, throughput=curve, network=OPA, overlap=1.5).terms(4, 256)
