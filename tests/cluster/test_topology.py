"""Topology model, compact YAML round-trip, and the shipped examples (figures from datasheets)."""

from __future__ import annotations

import time

import pytest

from cluster.errors import InputError
from cluster.topology_file import (
    dump_topology,
    example_names,
    load_example,
    load_topology,
    parse_topology,
)

REQUIRED_EXAMPLES = {
    "hgx-h200-8gpu",
    "hgx-h200-2node-ib",
    "hgx-h200-4node-ib",
    "pcie-l40s-4gpu",
    "gb200-nvl72",
    "fleet-h200-4096gpu",
    "cpu-only",
}


def test_every_named_example_ships():
    assert set(example_names()) >= REQUIRED_EXAMPLES


@pytest.mark.parametrize("name", sorted(REQUIRED_EXAMPLES))
def test_examples_round_trip(name):
    topo = load_example(name)
    text = dump_topology(topo)
    again = parse_topology(text)
    assert again == topo
    assert again.to_json() == topo.to_json()


def test_h200_node_matches_datasheet():
    topo = load_example("hgx-h200-8gpu")
    assert topo.num_nodes == 1 and topo.gpus_per_node == 8
    gpu = topo.gpus[0]
    assert gpu.hbm_bytes == 141 * 10**9
    assert gpu.hbm_bandwidth_GBps == 4800
    assert gpu.peak_bf16_flops == pytest.approx(989.4e12)
    # NVLink4: 18 links x 25 GB/s per direction; every pair joined through the NVSwitches.
    assert topo.bandwidth_GBps("GPU0", "GPU7") == 18 * 25
    assert topo.nvlink_domains == (tuple(f"GPU{i}" for i in range(8)),)
    # GPU0 shares a PCIe switch with its NIC; the NIC is the slower end (400 Gb/s = 50 GB/s).
    assert topo.bandwidth_GBps("GPU0", "NIC0") == 400 / 8
    assert topo.device("NIC3").name == "mlx5_3"
    assert topo.inter_node_bandwidth_GBps() is None


def test_two_nodes_cross_the_fabric_at_the_nic_rate():
    topo = load_example("hgx-h200-2node-ib")
    assert topo.num_nodes == 2 and len(topo.gpus) == 16
    assert topo.gpus[8].node == topo.nodes[1].name and topo.gpus[8].local_id == "GPU0"
    assert topo.bandwidth_GBps("GPU1", "GPU6") == 450
    # 8 NICs x 50 GB/s shared by 8 GPUs.
    assert topo.bandwidth_GBps("GPU1", "GPU9") == 50
    assert topo.inter_node_bandwidth_GBps() == 50
    assert len(topo.nvlink_domains) == 2
    assert topo.nvlink_domain_of("GPU3") != topo.nvlink_domain_of("GPU11")


def test_nvl72_is_one_domain_across_trays():
    topo = load_example("gb200-nvl72")
    assert len(topo.gpus) == 72
    assert len(topo.nvlink_domains) == 1 and len(topo.nvlink_domains[0]) == 72
    # NVLink5: 18 links x 50 GB/s per direction, also between GPUs of different trays.
    assert topo.bandwidth_GBps("GPU0", "GPU71") == 900
    assert topo.inter_node_bandwidth_GBps() is None


def test_pcie_box_has_no_nvlink_domain():
    topo = load_example("pcie-l40s-4gpu")
    assert topo.nvlink_domains == ()
    assert topo.bandwidth_GBps("GPU0", "GPU3") == 32  # PCIe Gen4 x16
    assert topo.gpus[0].hbm_bytes == 48 * 10**9


def test_fleet_loads_fast_and_answers_any_pair():
    start = time.perf_counter()
    topo = load_example("fleet-h200-4096gpu")
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"fleet took {elapsed:.2f} s to load"
    assert len(topo.gpus) == 4096 and topo.num_nodes == 512 and topo.gpus_per_node == 8
    assert topo.bandwidth_GBps("GPU0", "GPU4095") == 50
    assert topo.bandwidth_GBps("GPU4088", "GPU4095") == 450
    assert topo.gpus[4095].node == topo.nodes[511].name


def test_cpu_only_has_a_host_and_no_gpu():
    topo = load_example("cpu-only")
    assert topo.gpus == ()
    assert [d.kind for d in topo.devices] == ["cpu"]


def test_measured_link_survives_round_trip(tmp_path):
    text = dump_topology(load_example("hgx-h200-8gpu")).replace(
        "links: []",
        "links:\n  - {a: GPU0, b: GPU1, bandwidth_GBps: 371.5, source: measured}",
    )
    topo = parse_topology(text)
    assert topo.bandwidth_GBps("GPU1", "GPU0") == 371.5
    assert topo.bandwidth_GBps("GPU0", "GPU2") == 450
    path = tmp_path / "t.yaml"
    path.write_text(dump_topology(topo))
    again = load_topology(path)
    assert again == topo
    link = next(gl.link for gl in again.links() if {gl.a, gl.b} == {"GPU0", "GPU1"})
    assert link.source == "measured"


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (("hbm_bytes: 141000000000", "hbm_bytes: lots"), "hbm_bytes"),
        (("kind: infiniband\n", "kind: carrier-pigeon\n"), "fabric.kind"),
        (("template: hgx-h200", "template: nope"), "nope"),
        (("NV18  NV18  X", "NV18  QQ    X"), "QQ"),
        (("name: hgx-h200-8gpu", "name: [unclosed"), "invalid YAML: "),
    ],
)
def test_bad_yaml_names_the_field(edit, needle):
    text = dump_topology(load_example("hgx-h200-8gpu"))
    old, new = edit
    assert old in text
    with pytest.raises(InputError) as info:
        parse_topology(text.replace(old, new, 1))
    message = str(info.value)
    assert needle in message and "\n" not in message
