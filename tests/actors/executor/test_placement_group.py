"""Bundle specs from a real Plan placed by the real (session) Ray cluster on labelled nodes."""

from __future__ import annotations

import pytest

from cluster.errors import EnvironmentMissing
from cluster.topology_file import load_example
from placement.bundles import NODE_LABEL, bundle_specs
from placement.model_types import load_model_spec
from placement.parallel_dims import Axis
from placement.plan import plan
from placement.strategy import Workload

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_node_plan(shared_dir):
    # Kimi-K3 needs both 8-GPU nodes of the 2-node topology: its ranks span node0 and node1.
    spec = load_model_spec(shared_dir / "models" / "kimi-k3.config.json")
    p = plan(spec, load_example("hgx-h200-2node-ib"), Workload(context=4096))
    assert {r.node for r in p.ranks} == {"node0", "node1"}
    return p


def _label_to_node_id(ray) -> dict[str, str]:
    out = {}
    for node in ray.nodes():
        labels = node.get("Labels") or node.get("labels") or {}
        if NODE_LABEL in labels and node.get("Alive", True):
            out[labels[NODE_LABEL]] = node["NodeID"]
    return out


def test_bundles_follow_the_plans_nodes_and_keep_tp_groups_together(ray_session, two_node_plan):
    from actors.executor.placement_group import bundle_nodes, create_placement_group, remove

    specs = bundle_specs(
        two_node_plan, gpus_per_rank=0, cpus_per_rank=0.1,
        node_names={"node0": "fake-a", "node1": "fake-b"},
    )  # fmt: skip
    assert len(specs.bundles) == two_node_plan.num_gpus
    pg = create_placement_group(specs, timeout_s=60)
    try:
        placed = bundle_nodes(pg)
        ids = _label_to_node_id(ray_session)
        for rank, node_id in enumerate(placed):
            expected = "fake-a" if two_node_plan.ranks[rank].node == "node0" else "fake-b"
            assert node_id == ids[expected], (rank, expected)
        for group in two_node_plan.dims.groups(Axis.TP):
            assert len({placed[r] for r in group}) == 1
    finally:
        remove(pg)


def test_a_selector_no_node_matches_is_reported(ray_session, two_node_plan):
    from actors.executor.placement_group import create_placement_group

    specs = bundle_specs(
        two_node_plan, gpus_per_rank=0, cpus_per_rank=0.01,
        node_names={"node0": "no-such-node", "node1": "fake-b"},
    )  # fmt: skip
    with pytest.raises(EnvironmentMissing, match="no-such-node"):
        create_placement_group(specs, timeout_s=3)
