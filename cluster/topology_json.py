"""The JSON view of a Topology printed by `moectl topology show --json`.

{"name": str,
 "nodes": [{"name", "index", "template", "address", "cpu_cores", "numa_nodes",
            "memory_bytes", "gpus": int, "nics": int}],
 "devices": [{"id": "GPU0" | "NIC0" | "CPU0", "kind": "gpu" | "nic" | "cpu",
              "name": model or NIC device (mlx5_0), "node", "local_id", "hbm_bytes",
              "peak_bf16_flops", "hbm_bandwidth_GBps", "numa_node", "cpu_affinity",
              "bandwidth_GBps"}],
 "links": [{"a", "b", "node", "kind": "nvlink" | "pcie" | "nic",
            "path": "NV18" | "PIX" | "PXB" | "PHB" | "NODE" | "SYS", "nvlinks",
            "bandwidth_GBps" (one direction), "latency_us", "source": "nominal" | "measured"}],
 "nvlink_domains": [[GPU ids]],
 "fabric": {"kind", "bandwidth_GBps", "latency_us", "source"},
 "inter_node_bandwidth_GBps": float | null}
"""

from __future__ import annotations

from dataclasses import asdict

from cluster.topology import Topology


def topology_to_json(topo: Topology) -> dict:
    nodes = []
    for node in topo.nodes:
        tpl = topo.template_of(node)
        nodes.append(
            {
                "name": node.name,
                "index": node.index,
                "template": node.template,
                "address": node.address,
                "cpu_cores": tpl.cpu_cores,
                "numa_nodes": tpl.numa_nodes,
                "memory_bytes": tpl.memory_bytes,
                "gpus": len(tpl.gpus),
                "nics": len(tpl.nics),
            }
        )
    links = [
        {
            "a": gl.a,
            "b": gl.b,
            "node": gl.node,
            "kind": gl.link.kind,
            "path": gl.link.path,
            "nvlinks": gl.link.nvlinks,
            "bandwidth_GBps": gl.link.bandwidth_GBps,
            "latency_us": gl.link.latency_us,
            "source": gl.link.source,
        }
        for gl in topo.links()
    ]
    return {
        "name": topo.name,
        "nodes": nodes,
        "devices": [asdict(d) for d in topo.devices],
        "links": links,
        "nvlink_domains": [list(d) for d in topo.nvlink_domains],
        "fabric": asdict(topo.fabric),
        "inter_node_bandwidth_GBps": topo.inter_node_bandwidth_GBps(),
    }
