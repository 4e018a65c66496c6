"""Write measured bandwidth back into a Topology (links and fabric marked `measured`).

The figure taken from a run is its peak bus bandwidth (the largest-message plateau, as nccl-tests
reports it), which is what a link delivers to a collective.
"""

from __future__ import annotations

import dataclasses

from cluster.errors import InputError
from cluster.nccl_tests import NcclRun
from cluster.topology import Topology


def peak_busbw_GBps(run: NcclRun) -> float:
    if not run.rows:
        raise InputError(f"{run.op} run has no rows to take a bandwidth from")
    return max(max(r.busbw_GBps, r.inplace_busbw_GBps or 0.0) for r in run.rows)


def with_intra_node_bandwidth(topo: Topology, gbps: float) -> Topology:
    """Every GPU-GPU link of every node template set to `gbps`, marked measured."""
    templates = []
    for tpl in topo.templates:
        links = tuple(
            dataclasses.replace(link, bandwidth_GBps=gbps, source="measured")
            if link.a.startswith("GPU") and link.b.startswith("GPU")
            else link
            for link in tpl.links
        )
        templates.append(dataclasses.replace(tpl, links=links))
    return dataclasses.replace(topo, templates=tuple(templates))


def with_inter_node_bandwidth(topo: Topology, gbps: float) -> Topology:
    """The fabric's per-GPU bandwidth set to `gbps`, marked measured."""
    fabric = dataclasses.replace(topo.fabric, bandwidth_GBps=gbps, source="measured")
    return dataclasses.replace(topo, fabric=fabric)


def apply_runs(topo: Topology, runs: list[NcclRun]) -> Topology:
    """One node: the intra-node GPU links; several nodes: the fabric. all_reduce preferred."""
    usable = [r for r in runs if r.rows and r.complete and not r.total_wrong]
    if not usable:
        raise InputError("no complete, correct run to take a measured bandwidth from")
    run = next((r for r in usable if r.op == "all_reduce"), usable[0])
    gbps = peak_busbw_GBps(run)
    if topo.num_nodes == 1:
        return with_intra_node_bandwidth(topo, gbps)
    return with_inter_node_bandwidth(topo, gbps)
