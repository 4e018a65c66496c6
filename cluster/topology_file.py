"""The compact YAML/JSON form of a Topology (pydantic at the edge), and its load/dump.

A file describes node templates once and nodes by (name pattern, count, template), so a
4096-GPU fleet stays a few dozen lines:

    name: two-nodes
    fabric: {kind: infiniband, latency_us: 5.0}
    nodes_per_nvlink_domain: 1          # GB200 NVL72: 18
    templates:
      - name: hgx
        cpu: {cores: 224, numa_nodes: 2, memory_bytes: 2_199_023_255_552}
        gpus:                            # groups of identical GPUs, in GPU order
          - {count: 4, model: NVIDIA H200, hbm_bytes: 141_000_000_000, ..., numa_node: 0}
        nics:
          - {count: 4, names: "mlx5_{i}", kind: infiniband, bandwidth_GBps: 50, numa_node: 0}
        matrix:                          # `nvidia-smi topo -m` cells, rows GPU0.. then NIC0..
          - "GPU0 X    NV18 ..."
        links:                           # optional: measured or corrected links
          - {a: GPU0, b: GPU1, bandwidth_GBps: 371.2, source: measured}
    nodes:
      - {name: "node{i:03d}", count: 2, template: hgx}

Links not in `links` get the nominal figures of their matrix cell (cluster/nominal.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.errors import InputError
from cluster.nominal import nominal_link
from cluster.topology import Fabric, GpuSpec, Link, NicSpec, Node, NodeTemplate, Topology

EXAMPLES = Path(__file__).resolve().parent / "examples"
_CELL = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS)$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CpuModel(_Strict):
    cores: int = Field(ge=1)
    numa_nodes: int = Field(ge=1)
    memory_bytes: int = Field(ge=0)
    model: str | None = None


class GpuGroup(_Strict):
    count: int = Field(default=1, ge=1)
    model: str | None
    hbm_bytes: int | None = Field(ge=0)
    peak_bf16_flops: float | None = Field(ge=0)
    hbm_bandwidth_GBps: float | None = Field(ge=0)
    nvlink_links: int = Field(default=0, ge=0)
    nvlink_link_GBps: float = Field(default=0.0, ge=0)
    pcie_GBps: float = Field(gt=0)
    numa_node: int | None = None
    cpu_affinity: str | None = None


class NicGroup(_Strict):
    count: int = Field(default=1, ge=1)
    names: str | list[str]
    """A pattern with `{i}` (the NIC's local index) or one name per NIC."""
    kind: Literal["infiniband", "roce", "ethernet", "unknown"]
    bandwidth_GBps: float = Field(gt=0)
    numa_node: int | None = None


class LinkOverride(_Strict):
    a: str
    b: str
    bandwidth_GBps: float = Field(gt=0)
    latency_us: float | None = Field(default=None, gt=0)
    source: Literal["nominal", "measured"] = "measured"


class TemplateModel(_Strict):
    name: str
    cpu: CpuModel
    gpus: list[GpuGroup] = []
    nics: list[NicGroup] = []
    matrix: list[str] = []
    links: list[LinkOverride] = []


class NodeGroup(_Strict):
    name: str
    """A name, or a pattern with `{i}` (start, start+1, ...), e.g. `node{i:03d}`."""
    count: int = Field(default=1, ge=1)
    start: int = Field(default=0, ge=0)
    template: str
    address: str | None = None


class FabricModel(_Strict):
    kind: Literal["none", "infiniband", "roce", "ethernet"]
    bandwidth_GBps: float | None = Field(default=None, gt=0)
    latency_us: float = Field(default=5.0, gt=0)
    source: Literal["nominal", "measured"] = "nominal"


class TopologyModel(_Strict):
    name: str
    fabric: FabricModel
    nodes_per_nvlink_domain: int = Field(default=1, ge=1)
    templates: list[TemplateModel] = Field(min_length=1)
    nodes: list[NodeGroup] = Field(min_length=1)


# ---- model -> Topology ------------------------------------------------------------------------
def _template(m: TemplateModel) -> NodeTemplate:
    gpus = tuple(GpuSpec(**g.model_dump(exclude={"count"})) for g in m.gpus for _ in range(g.count))
    nics: list[NicSpec] = []
    for group in m.nics:
        if isinstance(group.names, list) and len(group.names) != group.count:
            raise InputError(
                f"template {m.name}: nics group lists {len(group.names)} names for count={group.count}"
            )
        for k in range(group.count):
            name = (
                group.names[k] if isinstance(group.names, list) else group.names.format(i=len(nics))
            )
            nics.append(
                NicSpec(
                    name=name,
                    kind=group.kind,
                    bandwidth_GBps=group.bandwidth_GBps,
                    numa_node=group.numa_node,
                )
            )
    ids = [f"GPU{i}" for i in range(len(gpus))] + [f"NIC{i}" for i in range(len(nics))]
    specs: dict[str, GpuSpec | NicSpec] = dict(zip(ids, (*gpus, *nics), strict=True))
    links = _matrix_links(m.name, m.matrix, ids, specs)
    for o in m.links:
        key = (o.a, o.b) if (o.a, o.b) in links else (o.b, o.a)
        if key not in links:
            raise InputError(f"template {m.name}: links: {o.a}-{o.b} is not in the matrix")
        old = links[key]
        links[key] = Link(
            a=old.a,
            b=old.b,
            kind=old.kind,
            path=old.path,
            nvlinks=old.nvlinks,
            bandwidth_GBps=o.bandwidth_GBps,
            latency_us=o.latency_us if o.latency_us is not None else old.latency_us,
            source=o.source,
        )
    return NodeTemplate(
        name=m.name,
        cpu_cores=m.cpu.cores,
        numa_nodes=m.cpu.numa_nodes,
        memory_bytes=m.cpu.memory_bytes,
        cpu_model=m.cpu.model,
        gpus=gpus,
        nics=tuple(nics),
        links=tuple(links.values()),
    )


def _matrix_links(
    template: str, rows: list[str], ids: list[str], specs: dict[str, GpuSpec | NicSpec]
) -> dict[tuple[str, str], Link]:
    if len(ids) >= 2 and len(rows) != len(ids):
        raise InputError(
            f"template {template}: matrix has {len(rows)} rows, expected {len(ids)} "
            f"({', '.join(ids)})"
        )
    cells: list[list[str]] = []
    for r, row in enumerate(rows):
        parts = row.split()
        if not parts or parts[0] != ids[r] or len(parts) != len(ids) + 1:
            raise InputError(
                f"template {template}: matrix row {r}: expected '{ids[r]}' then {len(ids)} cells, "
                f"got {row!r}"
            )
        bad = [c for k, c in enumerate(parts[1:]) if not _CELL.match(c) or (c == "X") != (k == r)]
        if bad:
            raise InputError(
                f"template {template}: matrix row {ids[r]}: cell {bad[0]!r} "
                f"(expected X on the diagonal and NV#/PIX/PXB/PHB/NODE/SYS elsewhere)"
            )
        cells.append(parts[1:])
    links: dict[tuple[str, str], Link] = {}
    for i in range(len(cells)):
        for j in range(i + 1, len(cells)):
            links[(ids[i], ids[j])] = nominal_link(ids[i], ids[j], cells[i][j], specs)
    return links


def from_model(m: TopologyModel) -> Topology:
    templates = tuple(_template(t) for t in m.templates)
    nodes: list[Node] = []
    for group in m.nodes:
        for k in range(group.count):
            name = group.name.format(i=group.start + k) if "{" in group.name else group.name
            if group.count > 1 and "{" not in group.name:
                raise InputError(f"nodes: {group.name!r} has count={group.count} but no {{i}}")
            nodes.append(
                Node(name=name, index=len(nodes), template=group.template, address=group.address)
            )
    return Topology(
        name=m.name,
        templates=templates,
        nodes=tuple(nodes),
        fabric=Fabric(**m.fabric.model_dump()),
        nodes_per_nvlink_domain=m.nodes_per_nvlink_domain,
    )


# ---- Topology -> model ------------------------------------------------------------------------
def _runs(items: list) -> list[tuple[object, int]]:
    out: list[list] = []
    for it in items:
        if out and out[-1][0] == it:
            out[-1][1] += 1
        else:
            out.append([it, 1])
    return [(a, n) for a, n in out]


def _template_model(t: NodeTemplate) -> dict:
    gpus = [
        {"count": n, **{k: getattr(g, k) for k in GpuGroup.model_fields if k != "count"}}
        for g, n in _runs(list(t.gpus))
    ]
    nics = []
    start = 0
    for key, n in _runs([(x.kind, x.bandwidth_GBps, x.numa_node) for x in t.nics]):
        kind, bw, numa = key
        names = [x.name for x in t.nics[start : start + n]]
        nics.append(
            {"count": n, "names": names, "kind": kind, "bandwidth_GBps": bw, "numa_node": numa}
        )
        start += n
    ids = [f"GPU{i}" for i in range(len(t.gpus))] + [f"NIC{i}" for i in range(len(t.nics))]
    specs = dict(zip(ids, (*t.gpus, *t.nics), strict=True))
    matrix, overrides = [], []
    if len(ids) >= 2:
        width = max(5, *(len(i) + 1 for i in ids))
        for a in ids:
            row = [a.ljust(width)]
            for b in ids:
                link = t.link(a, b)
                row.append("X" if a == b else (link.path if link else "SYS"))
            matrix.append(" ".join(c.ljust(width) for c in row).rstrip())
        for link in t.links:
            nominal = nominal_link(link.a, link.b, link.path, specs)
            if (link.bandwidth_GBps, link.latency_us, link.source) != (
                nominal.bandwidth_GBps,
                nominal.latency_us,
                nominal.source,
            ):
                overrides.append(
                    {
                        "a": link.a,
                        "b": link.b,
                        "bandwidth_GBps": link.bandwidth_GBps,
                        "latency_us": link.latency_us,
                        "source": link.source,
                    }
                )
    cpu = {
        "cores": t.cpu_cores,
        "numa_nodes": t.numa_nodes,
        "memory_bytes": t.memory_bytes,
        "model": t.cpu_model,
    }
    return {
        "name": t.name,
        "cpu": cpu,
        "gpus": gpus,
        "nics": nics,
        "matrix": matrix,
        "links": overrides,
    }


_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def _node_groups(nodes: tuple[Node, ...]) -> list[dict]:
    groups: list[dict] = []
    for node in nodes:
        m = _NUMBERED.match(node.name)
        last = groups[-1] if groups else None
        if (
            m
            and last is not None
            and last.get("_prefix") == m.group(1)
            and last["_width"] == len(m.group(2))
            and last["template"] == node.template
            and int(m.group(2)) == last["start"] + last["count"]
            and node.address is None
            and last.get("address") is None
        ):
            last["count"] += 1
            continue
        group = {
            "name": node.name,
            "count": 1,
            "start": 0,
            "template": node.template,
            "address": node.address,
        }
        if m and node.address is None:
            group.update(_prefix=m.group(1), _width=len(m.group(2)), start=int(m.group(2)))
        groups.append(group)
    out = []
    for g in groups:
        prefix, width = g.pop("_prefix", None), g.pop("_width", None)
        if g["count"] > 1:
            pad = f":0{width}d" if width > 1 else ""
            g["name"] = prefix.replace("{", "{{").replace("}", "}}") + "{i" + pad + "}"
        else:
            g.pop("start")
        out.append({k: v for k, v in g.items() if v is not None})
    return out


def to_model(topo: Topology) -> TopologyModel:
    fabric = topo.fabric
    data = {
        "name": topo.name,
        "fabric": {
            "kind": fabric.kind,
            "bandwidth_GBps": fabric.bandwidth_GBps,
            "latency_us": fabric.latency_us,
            "source": fabric.source,
        },
        "nodes_per_nvlink_domain": topo.nodes_per_nvlink_domain,
        "templates": [_template_model(t) for t in topo.templates],
        "nodes": _node_groups(topo.nodes),
    }
    return TopologyModel.model_validate(data)


# ---- files --------------------------------------------------------------------------------------
def parse_topology(text: str, *, origin: str = "<text>") -> Topology:
    """A Topology from YAML (or JSON) text; InputError naming the line or field on bad input."""
    try:
        data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "?"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{origin}: {where}: invalid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise InputError(f"{origin}: expected a mapping with name/fabric/templates/nodes")
    try:
        model = TopologyModel.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise InputError(
            f"{origin}: field {loc}: {err['msg']} (got {err.get('input')!r:.60})"
        ) from None
    try:
        return from_model(model)
    except InputError as exc:
        raise InputError(f"{origin}: {exc}") from None


def load_topology(path: str | Path) -> Topology:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror}") from None
    return parse_topology(text, origin=str(path))


def dump_topology(topo: Topology) -> str:
    """The compact YAML of a Topology; `parse_topology(dump_topology(t)) == t`."""
    data = to_model(topo).model_dump(exclude_defaults=False)
    return yaml.dump(
        data, sort_keys=False, width=200, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    )


def example_names() -> list[str]:
    return sorted(p.stem for p in EXAMPLES.glob("*.yaml"))


def load_example(name: str) -> Topology:
    """`cluster/examples/<name>.yaml` (name with or without `.yaml`)."""
    stem = name.removesuffix(".yaml")
    path = EXAMPLES / f"{stem}.yaml"
    if not path.is_file():
        raise InputError(f"no example topology {name!r}; known: {', '.join(example_names())}")
    return load_topology(path)
