"""The Ray shell that turns the planner's bundle specs into a real placement group.

Ray 2.60's `ray.util.placement_group` takes `bundle_label_selector` (one selector per bundle), so
each rank's bundle is pinned to the node label of the node the Plan chose; the TP group of a Plan
shares a node, hence its bundles land together. Ray is imported inside the functions.
"""

from __future__ import annotations

from cluster.errors import EnvironmentMissing
from placement.bundles import BundleSpecs


def create_placement_group(specs: BundleSpecs, *, timeout_s: float = 60.0):
    """Create the placement group of `specs` and wait until it is placed.

    Returns the `PlacementGroup`; raises EnvironmentMissing (and removes the group) when the
    cluster cannot place it within `timeout_s` (no node with the label, too few resources).
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if not ray.is_initialized():
        raise EnvironmentMissing("no Ray cluster: call ray.init() (or start one) before placing")
    pg = placement_group(**specs.ray_arguments())
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        wanted = sorted({v for b in specs.bundles for _, v in b.label_selector})
        raise EnvironmentMissing(
            f"placement group {specs.name}: {len(specs.bundles)} bundles on nodes {wanted} "
            f"were not placed within {timeout_s:.0f} s"
        )
    return pg


def bundle_nodes(pg) -> list[str]:
    """[bundles] the Ray node id each bundle of a placed group landed on."""
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(pg)
    mapping = table["bundles_to_node_id"]
    return [mapping[i] for i in range(len(mapping))]


def remove(pg) -> None:
    """Release the group's resources."""
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(pg)
