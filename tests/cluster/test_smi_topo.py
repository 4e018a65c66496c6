"""`nvidia-smi topo -m` parsing: every real fixture in ../shared, our own variants, bad input.

Expected values are read off the fixture text by eye (the independent source), not from the
parser's output.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.discovery import topology_from_smi_text
from cluster.errors import InputError
from cluster.smi_topo import parse_smi_topo

DATA = Path(__file__).resolve().parent.parent / "data"


def _read(shared_dir, name):
    return (shared_dir / "fixtures" / "topo" / name).read_text()


def test_every_shared_topo_fixture_parses(shared_dir):
    files = sorted((shared_dir / "fixtures" / "topo").glob("*.txt"))
    assert files
    for path in files:
        smi = parse_smi_topo(path.read_text(), origin=path.name)
        n = len(smi.gpus) + len(smi.nics)
        assert len(smi.paths) == n * (n - 1) // 2, path.name
        assert set(smi.paths.values()) <= {
            "NV4",
            "NV12",
            "NV18",
            "PIX",
            "PXB",
            "PHB",
            "NODE",
            "SYS",
        }


def test_dgx_a100_tabs_ten_nics_legend(shared_dir):
    smi = parse_smi_topo(
        _read(shared_dir, "a100_sxm4_40g_8x_dgx_nic10_8numa_tabs_no_gpunumaid.txt")
    )
    assert len(smi.gpus) == 8 and len(smi.nics) == 10
    assert [n.name for n in smi.nics] == [f"mlx5_{i}" for i in range(10)]
    assert smi.paths[("GPU0", "GPU7")] == "NV12"
    assert smi.paths[("GPU2", "NIC2")] == "PXB" and smi.paths[("GPU2", "NIC0")] == "SYS"
    assert smi.paths[("NIC8", "NIC9")] == "PIX"
    assert smi.gpus[4].cpu_affinity == "112-127,240-255" and smi.gpus[4].numa_node == 7
    assert smi.gpus[0].gpu_numa_id is None


def test_h100_space_aligned_nic_rows_without_affinity(shared_dir):
    topo = topology_from_smi_text(
        _read(shared_dir, "h100_sxm_8x_nic8_sglang30401.txt"), origin="h100"
    )
    data = topo.to_json()
    nics = [d for d in data["devices"] if d["kind"] == "nic"]
    assert [(d["id"], d["name"]) for d in nics] == [(f"NIC{i}", f"mlx5_{i}") for i in range(8)]
    gpu5 = topo.device("GPU5")
    assert gpu5.cpu_affinity == "48-95,144-191" and gpu5.numa_node == 1
    link = next(x for x in data["links"] if {x["a"], x["b"]} == {"GPU0", "GPU3"})
    assert (link["kind"], link["path"], link["nvlinks"]) == ("nvlink", "NV18", 18)
    assert link["bandwidth_GBps"] == 18 * 25  # NVLink4 per-link rate, one direction
    pix = next(x for x in data["links"] if {x["a"], x["b"]} == {"GPU5", "NIC5"})
    assert (pix["kind"], pix["path"]) == ("nic", "PIX")
    assert data["nvlink_domains"] == [[f"GPU{i}" for i in range(8)]]


def test_h200_single_gpu_with_ansi_header(shared_dir):
    smi = parse_smi_topo(_read(shared_dir, "h200_1x_ansi_header.txt"))
    assert [g.id for g in smi.gpus] == ["GPU0"] and smi.nics == ()
    gpu = smi.gpus[0]
    assert (gpu.cpu_affinity, gpu.numa_affinity, gpu.gpu_numa_id) == ("0-15", "0", "N/A")


def test_l40s_pcie_node_and_sys(shared_dir):
    smi = parse_smi_topo(_read(shared_dir, "l40s_4x_pcie_node_sys_nic2_missalignment106.txt"))
    assert smi.paths[("GPU0", "GPU1")] == "NODE" and smi.paths[("GPU1", "GPU2")] == "SYS"
    assert smi.paths[("NIC0", "NIC1")] == "PIX"
    assert smi.gpus[3].cpu_affinity == "96-191,288-383"
    assert (
        topology_from_smi_text(
            _read(shared_dir, "l40s_4x_pcie_node_sys_nic2_missalignment106.txt"), origin="l40s"
        ).nvlink_domains
        == ()
    )


def test_rtx5090_tabs_phb(shared_dir):
    smi = parse_smi_topo(_read(shared_dir, "rtx5090_2x_workstation_phb_tabs_club3090_1229.txt"))
    assert smi.paths == {("GPU0", "GPU1"): "PHB"}
    assert smi.gpus[1].cpu_affinity == "0-63" and smi.gpus[1].gpu_numa_id == "N/A"


def test_named_nic_columns_leading_text_blank_affinity():
    smi = parse_smi_topo((DATA / "smi_named_nic_columns_space.txt").read_text())
    assert [(n.id, n.name) for n in smi.nics] == [("NIC0", "mlx5_0"), ("NIC1", "mlx5_1")]
    assert smi.paths[("GPU0", "GPU3")] == "SYS"  # SOC is the old name of SYS
    assert smi.paths[("GPU2", "NIC1")] == "PXB"
    assert smi.gpus[0].cpu_affinity is None and smi.gpus[0].numa_affinity == "0"
    assert smi.gpus[3].cpu_affinity == "10-19" and smi.gpus[3].numa_node == 1


def test_ansi_without_esc_and_no_legend():
    smi = parse_smi_topo((DATA / "smi_ansi_no_esc_no_legend.txt").read_text())
    assert smi.paths[("GPU0", "GPU1")] == "NV4"
    assert smi.nics[0].name == "NIC0"  # no legend: the column name is all we know
    assert smi.gpus[1].gpu_numa_id == "N/A" and smi.gpus[1].numa_affinity == "0"


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (("NV18    NV18     X      NV18", "NV18    NVX      X      NV18"), "line 5"),
        (("GPU7    NV18", "GPU9    NV18"), "line 10"),
        (
            ("NIC7    SYS     SYS     SYS     SYS     NODE    NODE    NODE    PIX", "NIC7    SYS"),
            "line 18",
        ),
        (("        GPU0    GPU1", "        GPZ0    GPU1"), "header"),
    ],
)
def test_malformed_smi_names_the_line(shared_dir, edit, needle):
    text = _read(shared_dir, "h100_sxm_8x_nic8_sglang30401.txt")
    old, new = edit
    assert old in text
    with pytest.raises(InputError) as info:
        parse_smi_topo(text.replace(old, new, 1))
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_truncated_table_is_an_error(shared_dir):
    lines = _read(shared_dir, "h100_sxm_8x_nic8_sglang30401.txt").splitlines()
    with pytest.raises(InputError, match="ends before the row of NIC4"):
        parse_smi_topo("\n".join(lines[:14]))
