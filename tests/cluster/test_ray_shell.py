"""Discovery of the session's Ray cluster (head + two fake nodes) and the probe over actors."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray


def test_ray_discovery_finds_three_cpu_nodes(ray_session):
    from cluster.ray_shell import discover_cluster

    topo, unreachable = discover_cluster(timeout_s=60)
    assert unreachable == []
    assert sorted(n.name for n in topo.nodes) == ["fake-a", "fake-b", "head"]
    assert topo.gpus == ()
    assert [d.kind for d in topo.devices] == ["cpu"] * 3


def test_unreachable_node_is_named_after_the_timeout(ray_session):
    from cluster.ray_shell import Target, alive_targets, discover_cluster

    ghost = Target(name="ghost-node", node_id="ab" * 28, address="10.255.255.1")
    topo, unreachable = discover_cluster(timeout_s=5, targets=[*alive_targets(), ghost])
    assert unreachable == ["ghost-node"]
    assert topo.num_nodes == 3


def test_probe_over_ray_actors_checks_results(ray_session):
    from cluster.probe import SweepConfig
    from cluster.ray_shell import probe_ray

    config = SweepConfig(
        ops=("all_reduce", "alltoall"), sizes=(1024, 4096), iters=2, corrupt_rank=1
    )
    runs = probe_ray(3, config)
    by_op = {r.op: r for r in runs}
    for row in by_op["all_reduce"].rows:
        # rank 1's corrupted element spoils element 0 of the sum on all 3 ranks
        assert row.wrong == 3
        assert row.busbw_GBps == pytest.approx(row.algbw_GBps * 2 * 2 / 3)
    for row in by_op["alltoall"].rows:
        assert row.wrong == 1  # only the receiver of rank 1's first block sees it
