"""Published nominal figures: a GPU catalog and the nominal bandwidth of each link type.

Every figure here is a vendor datasheet number (dense, no sparsity), used only until a probe
measures the real thing. Sources:
- H100 / H200 SXM: NVIDIA H100 and H200 Tensor Core GPU datasheets (bf16 dense 989.4 TFLOP/s;
  HBM3 80 GB at 3.35 TB/s, HBM3e 141 GB at 4.8 TB/s; NVLink4 18 links, 900 GB/s bidirectional,
  i.e. 25 GB/s per link per direction; PCIe Gen5 x16, 64 GB/s per direction).
- H800 SXM: NVLink 400 GB/s bidirectional (8 links), otherwise as H100.
- A100 SXM4: A100 datasheet (bf16 dense 312 TFLOP/s; 40 GB at 1,555 GB/s, 80 GB at 2,039 GB/s;
  NVLink3 12 links, 600 GB/s bidirectional; PCIe Gen4 x16, 32 GB/s).
- L40S: L40S datasheet (48 GB GDDR6 at 864 GB/s, bf16 dense 362 TFLOP/s, PCIe Gen4 x16, no NVLink).
- GB200 NVL72: rack datasheet (72 GPUs, 13.4 TB HBM3e => 186 GB per GPU at 8 TB/s, 180 PFLOP/s
  dense bf16 per rack => 2.5 PFLOP/s per GPU, NVLink5 18 links at 50 GB/s per direction = 900 GB/s).
- V100 PCIe 32 GB: 900 GB/s HBM2, no bf16 (None), PCIe Gen3 x16 16 GB/s.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.topology import NOMINAL_LATENCY_US, GpuSpec, Link, NicSpec

GB = 10**9


@dataclass(frozen=True, kw_only=True)
class GpuModel:
    """Catalog entry: matched against a GPU name by `match` (a lower-case substring)."""

    match: tuple[str, ...]
    hbm_bytes: int
    peak_bf16_flops: float | None
    hbm_bandwidth_GBps: float
    nvlink_links: int
    nvlink_link_GBps: float
    pcie_GBps: float


# Most specific first: the first entry whose every substring occurs in the name wins.
CATALOG: tuple[GpuModel, ...] = (
    GpuModel(
        match=("gb200",),
        hbm_bytes=186 * GB,
        peak_bf16_flops=2.5e15,
        hbm_bandwidth_GBps=8000,
        nvlink_links=18,
        nvlink_link_GBps=50,
        pcie_GBps=64,
    ),
    GpuModel(
        match=("h200",),
        hbm_bytes=141 * GB,
        peak_bf16_flops=989.4e12,
        hbm_bandwidth_GBps=4800,
        nvlink_links=18,
        nvlink_link_GBps=25,
        pcie_GBps=64,
    ),
    GpuModel(
        match=("h800",),
        hbm_bytes=80 * GB,
        peak_bf16_flops=989.4e12,
        hbm_bandwidth_GBps=3350,
        nvlink_links=8,
        nvlink_link_GBps=25,
        pcie_GBps=64,
    ),
    GpuModel(
        match=("h100", "hbm3"),
        hbm_bytes=80 * GB,
        peak_bf16_flops=989.4e12,
        hbm_bandwidth_GBps=3350,
        nvlink_links=18,
        nvlink_link_GBps=25,
        pcie_GBps=64,
    ),
    GpuModel(
        match=("a100", "40g"),
        hbm_bytes=40 * GB,
        peak_bf16_flops=312e12,
        hbm_bandwidth_GBps=1555,
        nvlink_links=12,
        nvlink_link_GBps=25,
        pcie_GBps=32,
    ),
    GpuModel(
        match=("a100",),
        hbm_bytes=80 * GB,
        peak_bf16_flops=312e12,
        hbm_bandwidth_GBps=2039,
        nvlink_links=12,
        nvlink_link_GBps=25,
        pcie_GBps=32,
    ),
    GpuModel(
        match=("l40s",),
        hbm_bytes=48 * GB,
        peak_bf16_flops=362e12,
        hbm_bandwidth_GBps=864,
        nvlink_links=0,
        nvlink_link_GBps=0,
        pcie_GBps=32,
    ),
    GpuModel(
        match=("v100", "pcie"),
        hbm_bytes=32 * GB,
        peak_bf16_flops=None,
        hbm_bandwidth_GBps=900,
        nvlink_links=0,
        nvlink_link_GBps=0,
        pcie_GBps=16,
    ),
)

DEFAULT_PCIE_GBPS = 32.0
"""PCIe Gen4 x16, assumed for a GPU the catalog does not know."""
DEFAULT_NIC_GBPS = 50.0
"""ConnectX-7 400 Gb/s, assumed for a NIC whose rate is not known."""
NVLINK_PER_LINK_GBPS = 25.0
"""NVLink3/4 per link per direction, used for `NV#` cells of an unknown GPU."""


def lookup(name: str | None) -> GpuModel | None:
    """The catalog entry for a GPU name such as 'NVIDIA H100 80GB HBM3', or None."""
    if not name:
        return None
    low = name.lower()
    for model in CATALOG:
        if all(part in low for part in model.match):
            return model
    return None


def gpu_spec(
    name: str | None,
    *,
    numa_node: int | None = None,
    cpu_affinity: str | None = None,
    hbm_bytes: int | None = None,
) -> GpuSpec:
    """A GpuSpec from the catalog; unknown models keep None for the figures we cannot know."""
    model = lookup(name)
    if model is None:
        return GpuSpec(
            model=name,
            hbm_bytes=hbm_bytes,
            peak_bf16_flops=None,
            hbm_bandwidth_GBps=None,
            pcie_GBps=DEFAULT_PCIE_GBPS,
            numa_node=numa_node,
            cpu_affinity=cpu_affinity,
        )
    return GpuSpec(
        model=name,
        hbm_bytes=hbm_bytes if hbm_bytes is not None else model.hbm_bytes,
        peak_bf16_flops=model.peak_bf16_flops,
        hbm_bandwidth_GBps=model.hbm_bandwidth_GBps,
        nvlink_links=model.nvlink_links,
        nvlink_link_GBps=model.nvlink_link_GBps,
        pcie_GBps=model.pcie_GBps,
        numa_node=numa_node,
        cpu_affinity=cpu_affinity,
    )


def nominal_link(a: str, b: str, path: str, specs: dict[str, GpuSpec | NicSpec]) -> Link:
    """The nominal link for an `nvidia-smi topo -m` cell between local devices a and b.

    `NV#`: # links x the GPU's per-link rate (25 GB/s when unknown). PCIe codes: the slower
    end's PCIe rate (a NIC counts at its line rate); latency grows with the hops crossed.
    """
    sa, sb = specs[a], specs[b]
    if path.startswith("NV"):
        links = int(path[2:])
        per = [
            s.nvlink_link_GBps for s in (sa, sb) if isinstance(s, GpuSpec) and s.nvlink_link_GBps
        ]
        rate = min(per) if per else NVLINK_PER_LINK_GBPS
        return Link(
            a=a,
            b=b,
            kind="nvlink",
            path=path,
            nvlinks=links,
            bandwidth_GBps=links * rate,
            latency_us=NOMINAL_LATENCY_US["NV"],
            source="nominal",
        )
    rates = [s.pcie_GBps if isinstance(s, GpuSpec) else s.bandwidth_GBps for s in (sa, sb)]
    kind = "nic" if isinstance(sa, NicSpec) or isinstance(sb, NicSpec) else "pcie"
    return Link(
        a=a,
        b=b,
        kind=kind,
        path=path,
        nvlinks=0,
        bandwidth_GBps=min(rates),
        latency_us=NOMINAL_LATENCY_US[path],
        source="nominal",
    )
