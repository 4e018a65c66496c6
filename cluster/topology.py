"""The cluster's topology: nodes, devices, links, NVLink domains, and the bandwidth between GPUs.

A `Topology` is built from node *templates* (the devices and intra-node links of one kind of
machine) and a list of nodes that each name a template, plus the inter-node fabric. A 512-node
fleet therefore holds one template and 512 small `Node` records, never 4096^2 GPU pairs; every
query below is O(1) (dictionary look-ups) except where noted.

Public API (what `placement` codes against)
-------------------------------------------
Loading: `cluster.topology_file.load_topology(path) -> Topology`, `dump_topology(topo) -> str`
(YAML), `load_example(name)` for `cluster/examples/<name>.yaml`; `Topology.to_json() -> dict`.

Device ids are global: `GPU{g}` numbers GPUs over all nodes in node order (node 1's first GPU
of an 8-GPU fleet is `GPU8`), `NIC{k}` likewise for NICs, `CPU{n}` is the host of node n.

    topo.name: str
    topo.nodes: tuple[Node, ...]                  # Node.name, Node.index, Node.template
    topo.num_nodes: int
    topo.gpus: tuple[Device, ...]                 # kind == "gpu", in global id order
    topo.devices: tuple[Device, ...]              # GPUs, NICs, then one CPU per node
    topo.device(id) -> Device                     # KeyError-free: raises InputError if unknown
    topo.gpus_of(node_name) -> tuple[Device, ...]
    topo.gpus_per_node: int                       # InputError if nodes differ
    topo.nvlink_domains: tuple[tuple[str, ...], ...]   # GPU ids; only domains of >= 2 GPUs
    topo.nvlink_domain_of(gpu_id) -> int | None   # index into nvlink_domains
    topo.bandwidth_GBps(a, b) -> float            # 10^9 B/s one direction, slowest hop
    topo.latency_us(a, b) -> float
    topo.intra_node_bandwidth_GBps() -> float     # slowest GPU pair inside any node
    topo.inter_node_bandwidth_GBps() -> float | None   # per GPU; None for one node
    topo.links() -> Iterator[GlobalLink]          # intra-node links with global ids (O(links))

`Device` fields: id, kind ("gpu" | "nic" | "cpu"), node, local_id ("GPU3"), name (GPU model,
NIC device name such as mlx5_0, or "host"), hbm_bytes, peak_bf16_flops (FLOP/s),
hbm_bandwidth_GBps, numa_node, cpu_affinity, bandwidth_GBps (NICs: line rate). Figures that are
unknown (a topology parsed from `nvidia-smi topo -m` text alone names no GPU model) are None.
For `cpu` devices hbm_bytes is the host memory.

How `bandwidth_GBps(a, b)` is computed (measured figures win over nominal ones everywhere):
1. same node: the intra-node link between the two (NVLink `NV#`: links x per-link rate, or the
   PCIe path PIX/PXB/PHB/NODE/SYS at the slower device's PCIe rate);
2. different nodes in one multi-node NVLink domain (GB200 NVL72): the smaller NVLink rate of
   the two GPUs;
3. otherwise the network: per GPU, the node's NIC bandwidth divided by its GPUs, capped by the
   GPU's PCIe rate and by the fabric's per-GPU figure if one is set (a measured fabric figure
   replaces the computation).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Literal

from cluster.errors import InputError

LinkKind = Literal["nvlink", "pcie", "nic"]
Source = Literal["nominal", "measured"]
PCIE_PATHS = ("PIX", "PXB", "PHB", "NODE", "SYS")

# Nominal one-way latency per hop type, in microseconds. Order-of-magnitude assumptions (NCCL's
# small-message latency on each path), not published figures: a probe replaces them.
NOMINAL_LATENCY_US = {
    "NV": 2.0,
    "PIX": 3.0,
    "PXB": 3.5,
    "PHB": 4.0,
    "NODE": 4.5,
    "SYS": 6.0,
}


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One GPU of a node template. Units: bytes, FLOP/s, 10^9 B/s one direction."""

    model: str | None
    hbm_bytes: int | None
    peak_bf16_flops: float | None
    hbm_bandwidth_GBps: float | None
    nvlink_links: int = 0
    """NVLink links of this GPU (to peers or to an NVSwitch); 0 without NVLink."""
    nvlink_link_GBps: float = 0.0
    """One NVLink link, one direction (NVLink4: 25, NVLink5: 50)."""
    pcie_GBps: float
    """The GPU's PCIe link, one direction (Gen4 x16 ~ 32, Gen5 x16 ~ 64)."""
    numa_node: int | None = None
    cpu_affinity: str | None = None


@dataclass(frozen=True, kw_only=True)
class NicSpec:
    """One network adapter of a node template."""

    name: str
    """The OS device name (mlx5_0, rocep49s0, eth0)."""
    kind: Literal["infiniband", "roce", "ethernet", "unknown"]
    bandwidth_GBps: float
    """Line rate, one direction (ConnectX-7 400 Gb/s = 50)."""
    numa_node: int | None = None


@dataclass(frozen=True, kw_only=True)
class Link:
    """A link between two devices of one node, named by local ids (GPU0, NIC3)."""

    a: str
    b: str
    kind: LinkKind
    path: str
    """`NV18` or a PCIe path code: PIX, PXB, PHB, NODE, SYS."""
    nvlinks: int
    bandwidth_GBps: float
    latency_us: float
    source: Source


@dataclass(frozen=True, kw_only=True)
class NodeTemplate:
    """The devices and intra-node links of one kind of machine."""

    name: str
    cpu_cores: int
    numa_nodes: int
    memory_bytes: int
    cpu_model: str | None = None
    gpus: tuple[GpuSpec, ...]
    nics: tuple[NicSpec, ...]
    links: tuple[Link, ...]
    _by_pair: dict[tuple[str, str], Link] = field(init=False, repr=False, compare=False)
    _domains: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        local = {f"GPU{i}" for i in range(len(self.gpus))} | {
            f"NIC{i}" for i in range(len(self.nics))
        }
        by_pair: dict[tuple[str, str], Link] = {}
        for link in self.links:
            for end in (link.a, link.b):
                if end not in local:
                    raise InputError(
                        f"template {self.name}: link {link.a}-{link.b} names {end}, "
                        f"which is not one of its {len(self.gpus)} GPUs / {len(self.nics)} NICs"
                    )
            by_pair[(link.a, link.b)] = link
            by_pair[(link.b, link.a)] = link
        object.__setattr__(self, "_by_pair", by_pair)
        object.__setattr__(self, "_domains", self._nvlink_components())

    def link(self, a: str, b: str) -> Link | None:
        """The link between local devices a and b, or None when the template lists none."""
        return self._by_pair.get((a, b))

    def _nvlink_components(self) -> tuple[tuple[int, ...], ...]:
        # Step 1: union-find over GPU pairs joined by NVLink.
        parent = list(range(len(self.gpus)))

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for link in self.links:
            if link.kind == "nvlink" and link.a.startswith("GPU") and link.b.startswith("GPU"):
                parent[root(int(link.a[3:]))] = root(int(link.b[3:]))
        # Step 2: components of two or more GPUs, in GPU order.
        groups: dict[int, list[int]] = {}
        for i in range(len(self.gpus)):
            groups.setdefault(root(i), []).append(i)
        return tuple(tuple(g) for g in groups.values() if len(g) >= 2)

    def nic_share_GBps(self) -> float | None:
        """Network bandwidth per GPU: all NICs' line rate over the GPUs (None without NICs)."""
        if not self.nics or not self.gpus:
            return None
        return sum(n.bandwidth_GBps for n in self.nics) / len(self.gpus)


@dataclass(frozen=True, kw_only=True)
class Node:
    name: str
    index: int
    template: str
    address: str | None = None
    """Where the node was found (Ray node IP); None for a file-described node."""


@dataclass(frozen=True, kw_only=True)
class Fabric:
    """The network between nodes."""

    kind: Literal["none", "infiniband", "roce", "ethernet"]
    bandwidth_GBps: float | None = None
    """Per-GPU cap (nominal: switch port rate), or the measured inter-node bus bandwidth."""
    latency_us: float = 5.0
    source: Source = "nominal"


@dataclass(frozen=True, kw_only=True)
class Device:
    """One device of the expanded view; see the module docstring for the fields."""

    id: str
    kind: Literal["gpu", "nic", "cpu"]
    name: str | None
    node: str
    local_id: str
    hbm_bytes: int | None = None
    peak_bf16_flops: float | None = None
    hbm_bandwidth_GBps: float | None = None
    numa_node: int | None = None
    cpu_affinity: str | None = None
    bandwidth_GBps: float | None = None


@dataclass(frozen=True, kw_only=True)
class GlobalLink:
    a: str
    b: str
    node: str
    link: Link


@dataclass(frozen=True, kw_only=True)
class Topology:
    """A whole cluster. Validated at construction; see the module docstring for the API."""

    name: str
    templates: tuple[NodeTemplate, ...]
    nodes: tuple[Node, ...]
    fabric: Fabric
    nodes_per_nvlink_domain: int = 1
    """Consecutive nodes sharing one NVLink domain (GB200 NVL72: 18 trays of 4 GPUs)."""
    _index: _Index = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", _Index.build(self))

    # ---- devices -------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def gpus(self) -> tuple[Device, ...]:
        return self._index.gpus

    @property
    def devices(self) -> tuple[Device, ...]:
        return self._index.devices

    def device(self, device_id: str) -> Device:
        try:
            return self._index.by_id[device_id]
        except KeyError:
            raise InputError(f"topology {self.name}: no device {device_id!r}") from None

    def template_of(self, node: Node) -> NodeTemplate:
        return self._index.templates[node.template]

    def gpus_of(self, node_name: str) -> tuple[Device, ...]:
        return tuple(d for d in self._index.gpus if d.node == node_name)

    @property
    def gpus_per_node(self) -> int:
        counts = {len(self.template_of(n).gpus) for n in self.nodes}
        if len(counts) != 1:
            raise InputError(f"topology {self.name}: nodes differ in GPU count {sorted(counts)}")
        return counts.pop()

    # ---- NVLink domains ------------------------------------------------------------------
    @property
    def nvlink_domains(self) -> tuple[tuple[str, ...], ...]:
        return self._index.domains

    def nvlink_domain_of(self, gpu_id: str) -> int | None:
        return self._index.domain_of.get(gpu_id)

    # ---- bandwidth and latency -----------------------------------------------------------
    def bandwidth_GBps(self, a: str, b: str) -> float:
        """Bandwidth between two devices, 10^9 B/s one direction, through the slowest hop."""
        return self._path(a, b)[0]

    def latency_us(self, a: str, b: str) -> float:
        return self._path(a, b)[1]

    def _path(self, a: str, b: str) -> tuple[float, float]:
        node_a, local_a, spec_a = self._locate(a)
        node_b, local_b, spec_b = self._locate(b)
        if a == b:
            return float("inf"), 0.0
        if spec_a is None or spec_b is None:
            raise InputError(
                f"topology {self.name}: bandwidth is defined between GPUs and NICs, not {a}-{b}"
            )
        tpl_a = self.template_of(node_a)
        # Step 1: inside one node, the listed link (or the slower PCIe link if none is listed).
        if node_a.index == node_b.index:
            link = tpl_a.link(local_a, local_b)
            if link is not None:
                return link.bandwidth_GBps, link.latency_us
            return _pcie_GBps(spec_a, spec_b), NOMINAL_LATENCY_US["SYS"]
        # Step 2: one multi-node NVLink domain.
        if (
            self.nodes_per_nvlink_domain > 1
            and node_a.index // self.nodes_per_nvlink_domain
            == node_b.index // self.nodes_per_nvlink_domain
            and isinstance(spec_a, GpuSpec)
            and isinstance(spec_b, GpuSpec)
            and spec_a.nvlink_links
            and spec_b.nvlink_links
        ):
            bw = min(
                spec_a.nvlink_links * spec_a.nvlink_link_GBps,
                spec_b.nvlink_links * spec_b.nvlink_link_GBps,
            )
            return bw, NOMINAL_LATENCY_US["NV"]
        # Step 3: the network.
        return self._network_GBps(node_a, spec_a, node_b, spec_b), self.fabric.latency_us

    def _network_GBps(self, node_a: Node, spec_a, node_b: Node, spec_b) -> float:
        if self.fabric.source == "measured" and self.fabric.bandwidth_GBps is not None:
            return self.fabric.bandwidth_GBps
        shares = []
        for node, spec in ((node_a, spec_a), (node_b, spec_b)):
            tpl = self.template_of(node)
            share = spec.bandwidth_GBps if isinstance(spec, NicSpec) else tpl.nic_share_GBps()
            if share is None:
                raise InputError(
                    f"topology {self.name}: node {node.name} has no NIC, so it cannot reach "
                    f"other nodes"
                )
            if isinstance(spec, GpuSpec):
                share = min(share, spec.pcie_GBps)
            shares.append(share)
        if self.fabric.bandwidth_GBps is not None:
            shares.append(self.fabric.bandwidth_GBps)
        return min(shares)

    def _locate(self, device_id: str) -> tuple[Node, str, GpuSpec | NicSpec | None]:
        try:
            return self._index.where[device_id]
        except KeyError:
            raise InputError(f"topology {self.name}: no device {device_id!r}") from None

    def intra_node_bandwidth_GBps(self) -> float | None:
        """The slowest GPU pair inside any node (None when no node has two GPUs)."""
        worst = None
        for tpl in {self.template_of(n).name: self.template_of(n) for n in self.nodes}.values():
            n = len(tpl.gpus)
            for i in range(n):
                for j in range(i + 1, n):
                    link = tpl.link(f"GPU{i}", f"GPU{j}")
                    bw = link.bandwidth_GBps if link else _pcie_GBps(tpl.gpus[i], tpl.gpus[j])
                    worst = bw if worst is None else min(worst, bw)
        return worst

    def inter_node_bandwidth_GBps(self) -> float | None:
        """Per-GPU network bandwidth between nodes outside one NVLink domain (None: one node)."""
        if self.num_nodes < 2:
            return None
        first = self.nodes[0]
        step = max(self.nodes_per_nvlink_domain, 1)
        if step >= self.num_nodes:
            return None
        other = self.nodes[step]
        a = self._first_device(first)
        b = self._first_device(other)
        return self._network_GBps(first, self._locate(a)[2], other, self._locate(b)[2])

    def _first_device(self, node: Node) -> str:
        for dev in self._index.devices:
            if dev.node == node.name and dev.kind != "cpu":
                return dev.id
        raise InputError(f"topology {self.name}: node {node.name} has no GPU or NIC")

    def links(self) -> Iterator[GlobalLink]:
        """Every intra-node link, with global device ids (O(number of links))."""
        for node in self.nodes:
            tpl = self.template_of(node)
            ids = self._index.local_to_global[node.index]
            for link in tpl.links:
                yield GlobalLink(a=ids[link.a], b=ids[link.b], node=node.name, link=link)

    def to_json(self) -> dict:
        """The `moectl topology show --json` object (see cluster/cli.py):

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
        nodes = []
        for node in self.nodes:
            tpl = self.template_of(node)
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
            for gl in self.links()
        ]
        return {
            "name": self.name,
            "nodes": nodes,
            "devices": [asdict(d) for d in self.devices],
            "links": links,
            "nvlink_domains": [list(d) for d in self.nvlink_domains],
            "fabric": asdict(self.fabric),
            "inter_node_bandwidth_GBps": self.inter_node_bandwidth_GBps(),
        }


def _pcie_GBps(a, b) -> float:
    rates = [s.pcie_GBps if isinstance(s, GpuSpec) else s.bandwidth_GBps for s in (a, b)]
    return min(rates)


@dataclass(frozen=True, kw_only=True)
class _Index:
    """Look-up tables derived once from a Topology."""

    templates: dict[str, NodeTemplate]
    devices: tuple[Device, ...]
    gpus: tuple[Device, ...]
    by_id: dict[str, Device]
    where: dict[str, tuple[Node, str, GpuSpec | NicSpec | None]]
    local_to_global: list[dict[str, str]]
    domains: tuple[tuple[str, ...], ...]
    domain_of: dict[str, int]

    @staticmethod
    def build(topo: Topology) -> _Index:
        # Step 1: templates by name, nodes checked against them.
        templates = {t.name: t for t in topo.templates}
        if len(templates) != len(topo.templates):
            raise InputError(f"topology {topo.name}: two templates share a name")
        if not topo.nodes:
            raise InputError(f"topology {topo.name}: no nodes")
        if topo.nodes_per_nvlink_domain < 1:
            raise InputError(
                f"topology {topo.name}: nodes_per_nvlink_domain={topo.nodes_per_nvlink_domain} "
                f"must be >= 1"
            )
        names = set()
        for i, node in enumerate(topo.nodes):
            if node.template not in templates:
                raise InputError(
                    f"topology {topo.name}: node {node.name} names template {node.template!r}; "
                    f"known: {sorted(templates)}"
                )
            if node.index != i:
                raise InputError(
                    f"topology {topo.name}: node {node.name} has index {node.index}, expected {i}"
                )
            if node.name in names:
                raise InputError(f"topology {topo.name}: node name {node.name} appears twice")
            names.add(node.name)
        # Step 2: global ids in node order (GPU{g}, NIC{k}, CPU{n}).
        gpus: list[Device] = []
        nics: list[Device] = []
        cpus: list[Device] = []
        where: dict = {}
        local_to_global: list[dict[str, str]] = []
        for node in topo.nodes:
            tpl = templates[node.template]
            mapping: dict[str, str] = {}
            for i, g in enumerate(tpl.gpus):
                gid = f"GPU{len(gpus)}"
                mapping[f"GPU{i}"] = gid
                where[gid] = (node, f"GPU{i}", g)
                gpus.append(
                    Device(
                        id=gid,
                        kind="gpu",
                        node=node.name,
                        local_id=f"GPU{i}",
                        name=g.model,
                        hbm_bytes=g.hbm_bytes,
                        peak_bf16_flops=g.peak_bf16_flops,
                        hbm_bandwidth_GBps=g.hbm_bandwidth_GBps,
                        numa_node=g.numa_node,
                        cpu_affinity=g.cpu_affinity,
                    )
                )
            for i, n in enumerate(tpl.nics):
                nid = f"NIC{len(nics)}"
                mapping[f"NIC{i}"] = nid
                where[nid] = (node, f"NIC{i}", n)
                nics.append(
                    Device(
                        id=nid,
                        kind="nic",
                        node=node.name,
                        local_id=f"NIC{i}",
                        name=n.name,
                        numa_node=n.numa_node,
                        bandwidth_GBps=n.bandwidth_GBps,
                    )
                )
            cid = f"CPU{node.index}"
            where[cid] = (node, "CPU", None)
            cpus.append(
                Device(
                    id=cid,
                    kind="cpu",
                    node=node.name,
                    local_id="CPU",
                    name=tpl.cpu_model or "host",
                    hbm_bytes=tpl.memory_bytes,
                )
            )
            local_to_global.append(mapping)
        devices = (*gpus, *nics, *cpus)
        # Step 3: NVLink domains, per node or per group of nodes.
        domains: list[tuple[str, ...]] = []
        if topo.nodes_per_nvlink_domain > 1:
            step = topo.nodes_per_nvlink_domain
            for start in range(0, len(topo.nodes), step):
                group = [
                    local_to_global[n.index][f"GPU{i}"]
                    for n in topo.nodes[start : start + step]
                    for i, g in enumerate(templates[n.template].gpus)
                    if g.nvlink_links
                ]
                if len(group) >= 2:
                    domains.append(tuple(group))
        else:
            for node in topo.nodes:
                mapping = local_to_global[node.index]
                for comp in templates[node.template]._domains:
                    domains.append(tuple(mapping[f"GPU{i}"] for i in comp))
        domain_of = {gid: k for k, dom in enumerate(domains) for gid in dom}
        return _Index(
            templates=templates,
            devices=devices,
            gpus=tuple(gpus),
            by_id={d.id: d for d in devices},
            where=where,
            local_to_global=local_to_global,
            domains=tuple(domains),
            domain_of=domain_of,
        )
