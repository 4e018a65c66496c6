"""Discovery of the local node: `nvidia-smi topo -m`, NVML (nvidia-ml-py, optional), the OS.

`node_facts()` gathers plain, JSON-able facts about this machine (run on every node by
cluster/ray_shell.py); `template_from_facts()` turns them into a NodeTemplate; `discover_local()`
is both for this machine. A machine without a GPU yields a CPU-only node, so every downstream
command also runs on a laptop.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

from cluster.errors import InputError
from cluster.nominal import DEFAULT_NIC_GBPS, gpu_spec, nominal_link
from cluster.smi_topo import SmiTopo, parse_smi_topo
from cluster.topology import Fabric, GpuSpec, NicSpec, Node, NodeTemplate, Topology

SMI_TIMEOUT_S = 20


def host_facts() -> dict:
    """CPU cores, NUMA nodes, memory bytes and CPU model of this machine, from the OS."""
    numa = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "hostname": socket.gethostname(),
        "cpu_cores": os.cpu_count() or 1,
        "numa_nodes": numa,
        "memory_bytes": memory,
        "cpu_model": model,
    }


def nvml_facts() -> list[dict] | None:
    """Per GPU: name, memory bytes, active NVLink links; None when NVML is absent or fails."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            active = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    active += bool(pynvml.nvmlDeviceGetNvLinkState(handle, link))
                except pynvml.NVMLError:
                    break
            gpus.append(
                {
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                    "nvlinks_active": active,
                }
            )
        return gpus
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def smi_topo_text() -> str | None:
    """The output of `nvidia-smi topo -m`, or None where nvidia-smi is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, "topo", "-m"], capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 and "GPU0" in done.stdout else None


def nic_facts(names: list[str]) -> dict[str, dict]:
    """Kind and line rate of RDMA NICs from /sys/class/infiniband (absent ones are skipped)."""
    out = {}
    for name in names:
        port = Path("/sys/class/infiniband") / name / "ports" / "1"
        try:
            rate = port.joinpath("rate").read_text()  # "400 Gb/sec (4X NDR)"
            layer = port.joinpath("link_layer").read_text().strip().lower()
        except OSError:
            continue
        m = re.match(r"\s*([\d.]+)\s*Gb/sec", rate)
        out[name] = {
            "kind": "infiniband" if layer == "infiniband" else "roce",
            "bandwidth_GBps": float(m.group(1)) / 8 if m else DEFAULT_NIC_GBPS,
        }
    return out


def node_facts() -> dict:
    """Everything discovery needs about this machine, as plain JSON-able values."""
    smi = smi_topo_text()
    facts = {**host_facts(), "smi_topo": smi, "nvml": nvml_facts(), "nics": {}}
    if smi is not None:
        facts["nics"] = nic_facts([n.name for n in parse_smi_topo(smi).nics if n.name])
    return facts


def template_from_smi(
    smi: SmiTopo,
    *,
    name: str,
    host: dict,
    nvml: list[dict] | None = None,
    nics: dict[str, dict] | None = None,
) -> NodeTemplate:
    """A NodeTemplate from a parsed matrix plus what NVML and sysfs add (names, memory, rates)."""
    nvml = nvml or []
    nics = nics or {}
    gpus = []
    for i, dev in enumerate(smi.gpus):
        info = nvml[i] if i < len(nvml) else {}
        spec = gpu_spec(
            info.get("name"),
            numa_node=dev.numa_node,
            cpu_affinity=dev.cpu_affinity,
            hbm_bytes=info.get("memory_bytes"),
        )
        links = max(
            (int(p[2:]) for k, p in smi.paths.items() if dev.id in k and p[:2] == "NV"), default=0
        )
        if info.get("nvlinks_active"):
            links = info["nvlinks_active"]
        if links and not spec.nvlink_links:
            spec = dataclasses.replace(spec, nvlink_links=links, nvlink_link_GBps=25.0)
        gpus.append(spec)
    nic_specs = [
        NicSpec(
            name=dev.name or dev.id,
            kind=nics.get(dev.name, {}).get("kind", "unknown"),
            bandwidth_GBps=nics.get(dev.name, {}).get("bandwidth_GBps", DEFAULT_NIC_GBPS),
        )
        for dev in smi.nics
    ]
    specs: dict[str, GpuSpec | NicSpec] = {f"GPU{i}": g for i, g in enumerate(gpus)}
    specs.update({f"NIC{i}": n for i, n in enumerate(nic_specs)})
    links = tuple(nominal_link(a, b, path, specs) for (a, b), path in smi.paths.items())
    return NodeTemplate(
        name=name,
        cpu_cores=host["cpu_cores"],
        numa_nodes=host["numa_nodes"],
        memory_bytes=host["memory_bytes"],
        cpu_model=host.get("cpu_model"),
        gpus=tuple(gpus),
        nics=tuple(nic_specs),
        links=links,
    )


def template_from_facts(facts: dict, *, name: str) -> NodeTemplate:
    """NodeTemplate of one node from `node_facts()` output (GPU-less -> CPU-only template)."""
    if facts.get("smi_topo"):
        smi = parse_smi_topo(facts["smi_topo"], origin=f"nvidia-smi topo -m on {name}")
        return template_from_smi(
            smi, name=name, host=facts, nvml=facts.get("nvml"), nics=facts.get("nics")
        )
    gpus = tuple(gpu_spec(g["name"], hbm_bytes=g["memory_bytes"]) for g in facts.get("nvml") or [])
    return NodeTemplate(
        name=name,
        cpu_cores=facts["cpu_cores"],
        numa_nodes=facts["numa_nodes"],
        memory_bytes=facts["memory_bytes"],
        cpu_model=facts.get("cpu_model"),
        gpus=gpus,
        nics=(),
        links=(),
    )


def assemble(name: str, per_node: list[tuple[str, str | None, NodeTemplate]]) -> Topology:
    """A Topology from (node name, address, template) triples; equal templates are shared."""
    if not per_node:
        raise InputError(f"topology {name}: no node answered")
    templates: list[NodeTemplate] = []
    nodes = []
    for index, (node_name, address, tpl) in enumerate(per_node):
        match = next((t for t in templates if dataclasses.replace(t, name=tpl.name) == tpl), None)
        if match is None:
            match = dataclasses.replace(tpl, name=f"node-type-{len(templates)}")
            templates.append(match)
        nodes.append(Node(name=node_name, index=index, template=match.name, address=address))
    has_nics = all(t.nics for t in templates)
    fabric = Fabric(kind="infiniband" if has_nics and len(nodes) > 1 else "none")
    return Topology(name=name, templates=tuple(templates), nodes=tuple(nodes), fabric=fabric)


def topology_from_smi_text(text: str, *, origin: str, node_name: str = "node0") -> Topology:
    """A one-node Topology from saved `nvidia-smi topo -m` text (no NVML: models unknown)."""
    smi = parse_smi_topo(text, origin=origin)
    host = {"cpu_cores": 1, "numa_nodes": 1, "memory_bytes": 0}
    numa = {d.numa_node for d in smi.gpus if d.numa_node is not None}
    host["numa_nodes"] = max(len(numa), 1)
    tpl = template_from_smi(smi, name="smi", host=host)
    return assemble(node_name, [(node_name, None, tpl)])


def discover_local() -> Topology:
    """This machine as a one-node Topology (CPU-only where there is no GPU)."""
    facts = node_facts()
    tpl = template_from_facts(facts, name="local")
    return assemble(facts["hostname"], [(facts["hostname"], None, tpl)])
