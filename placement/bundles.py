"""Plan -> placement-group bundle specs: plain data that `actors/executor/placement_group.py` hands to Ray.

One bundle per rank of one replica, in rank order (bundle i runs rank i), with its GPU and CPU
resources and a label selector naming the rank's node, so the ranks of a TP group (which the Plan
already keeps on one node) land together on that node. The planner never imports Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.errors import InputError

NODE_LABEL = "moe.io/node"
"""Node label every node of the cluster carries (its Topology node name)."""


@dataclass(frozen=True, kw_only=True)
class Bundle:
    """The resources and node constraint of one rank."""

    rank: int
    """Rank in the replica's world (bundle index == rank)."""
    resources: tuple[tuple[str, float], ...]
    """(resource, amount), e.g. (("CPU", 4.0), ("GPU", 1.0))."""
    label_selector: tuple[tuple[str, str], ...]
    """(label, value) the node must carry, e.g. (("moe.io/node", "node0"),)."""
    device: str
    """GPU id in the Topology the rank is meant for (informational: Ray picks the GPU)."""


@dataclass(frozen=True, kw_only=True)
class BundleSpecs:
    """A placement group for one replica."""

    name: str
    """Placement-group name (unique per model, topology and replica)."""
    strategy: str
    """Ray strategy: PACK keeps bundles on as few nodes as the selectors allow."""
    bundles: tuple[Bundle, ...]

    def ray_arguments(self) -> dict:
        """Keyword arguments of `ray.util.placement_group` (plain dicts and lists)."""
        return {
            "bundles": [dict(b.resources) for b in self.bundles],
            "strategy": self.strategy,
            "name": self.name,
            "bundle_label_selector": [dict(b.label_selector) for b in self.bundles],
        }


def bundle_specs(
    plan,
    *,
    replica: int = 0,
    topology=None,
    gpus_per_rank: float = 1.0,
    cpus_per_rank: float = 1.0,
    label: str = NODE_LABEL,
    node_names: dict[str, str] | None = None,
) -> BundleSpecs:
    """Bundles of replica `replica` of `plan` (a placement.plan.Plan).

    Replica k runs on the GPUs after replica k-1 (rank r on topology GPU k x world + r), so
    replica > 0 needs the `topology`. node_names maps Topology node names to the label values the
    live nodes carry (default: the same names).
    """
    if not 0 <= replica < plan.replicas:
        raise InputError(f"replica {replica} is outside the plan's {plan.replicas} replicas")
    if gpus_per_rank < 0 or cpus_per_rank < 0:
        raise InputError("gpus_per_rank and cpus_per_rank must be >= 0")
    if replica and topology is None:
        raise InputError(f"replica {replica}: pass the topology to find its nodes")
    names = node_names or {}
    bundles = []
    for r in plan.ranks:
        node, device = r.node, r.device
        if replica:
            gpu = topology.gpus[replica * plan.num_gpus + r.rank]
            node, device = gpu.node, gpu.id
        resources = [("CPU", float(cpus_per_rank))]
        if gpus_per_rank:
            resources.append(("GPU", float(gpus_per_rank)))
        bundles.append(
            Bundle(
                rank=r.rank,
                resources=tuple(resources),
                label_selector=((label, names.get(node, node)),),
                device=device,
            )
        )
    d = plan.dims
    return BundleSpecs(
        name=f"moe-{d.shorthand}-r{replica}",
        strategy="PACK",
        bundles=tuple(bundles),
    )


def layout_bundle_specs(
    dims,
    *,
    name: str,
    cpus_per_rank: float,
    gpus_per_rank: float = 0.0,
    strategy: str = "PACK",
    extra_resources: dict[str, float] | None = None,
):
    """Bundle specs of a layout without a topology (no Plan): one bundle per rank, in rank
    order, with the worker's CPU/GPU request (plus `extra_resources`, e.g. the Ray resource of
    a disaggregated pool's worker group) and no node constraint (Ray places the group; PACK
    keeps it on as few nodes as fit). `dims`: placement.parallel_dims.ParallelDims."""
    if cpus_per_rank < 0 or gpus_per_rank < 0 or cpus_per_rank + gpus_per_rank <= 0:
        raise InputError(
            f"cpus_per_rank={cpus_per_rank}, gpus_per_rank={gpus_per_rank}: both >= 0, one > 0"
        )
    resources = [("CPU", float(cpus_per_rank))]
    if gpus_per_rank:
        resources.append(("GPU", float(gpus_per_rank)))
    resources += [(name, float(amount)) for name, amount in sorted((extra_resources or {}).items())]
    bundles = tuple(
        Bundle(rank=r, resources=tuple(resources), label_selector=(), device="")
        for r in range(dims.world)
    )
    return BundleSpecs(name=name, strategy=strategy, bundles=bundles)
