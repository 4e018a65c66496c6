"""`moectl topology ...` end to end (in-process), exit codes and JSON shapes."""

from __future__ import annotations

import json
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "cluster" / "examples"


def test_show_from_smi_json(moectl, shared_dir):
    path = (
        shared_dir / "fixtures" / "topo" / "a100_sxm4_40g_8x_dgx_nic10_8numa_tabs_no_gpunumaid.txt"
    )
    code, out, _ = moectl("topology", "show", "--from-smi", path, "--json")
    assert code == 0
    data = json.loads(out)
    kinds = [d["kind"] for d in data["devices"]]
    assert kinds.count("gpu") == 8 and kinds.count("nic") == 10
    nic9 = next(d for d in data["devices"] if d["id"] == "NIC9")
    assert nic9["name"] == "mlx5_9"
    nv = next(x for x in data["links"] if {x["a"], x["b"]} == {"GPU1", "GPU6"})
    assert (nv["kind"], nv["path"], nv["nvlinks"]) == ("nvlink", "NV12", 12)
    assert data["nvlink_domains"] == [[f"GPU{i}" for i in range(8)]]


def test_show_table_and_discover_cpu_only(moectl):
    code, out, _ = moectl("topology", "show", "--from", EXAMPLES / "pcie-l40s-4gpu.yaml")
    assert code == 0 and "NODE" in out and "L40S" in out
    code, out, _ = moectl("topology", "show", "--discover", "--json")
    assert code == 0
    data = json.loads(out)
    assert [d["kind"] for d in data["devices"]] == ["cpu"] and data["links"] == []


def test_export_round_trips(moectl, tmp_path):
    target = tmp_path / "topo.yaml"
    code, _, _ = moectl("topology", "export", "-o", target, "--from", EXAMPLES / "gb200-nvl72.yaml")
    assert code == 0
    _, first, _ = moectl("topology", "show", "--from", EXAMPLES / "gb200-nvl72.yaml", "--json")
    _, again, _ = moectl("topology", "show", "--from", target, "--json")
    assert json.loads(first) == json.loads(again)


def test_bad_inputs_exit_2_with_one_line(moectl, tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text(
        (EXAMPLES / "hgx-h200-8gpu.yaml").read_text().replace("cores: 112", "cores: -3")
    )
    code, out, err = moectl("topology", "show", "--from", bad_yaml)
    assert code == 2 and out == "" and "cpu.cores" in err and len(err.strip().splitlines()) == 1
    bad_smi = tmp_path / "smi.txt"
    bad_smi.write_text("\tGPU0\tGPU1\nGPU0\t X \tNV9Q\nGPU1\tNV4\t X \n")
    code, _, err = moectl("topology", "show", "--from-smi", bad_smi)
    assert code == 2 and "line 2" in err and "NV9Q" in err
    not_nccl = tmp_path / "x.txt"
    not_nccl.write_text("nothing here\n")
    code, _, err = moectl("topology", "parse-nccl", not_nccl, "--json")
    assert code == 2 and "table header" in err


def test_parse_nccl_complete_and_incomplete(moectl, shared_dir):
    ok = shared_dir / "fixtures" / "nccl" / "h100_8x_1node_all_reduce_nccltests290.txt"
    code, out, _ = moectl("topology", "parse-nccl", ok, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["op"] == "all_reduce"  # from the file name
    assert data["complete"] is True and data["avg_busbw_GBps"] == 439.369
    assert data["rows"][0]["busbw_GBps"] == 382.99 and data["rows"][0]["inplace_time_us"] == 614.3
    cut = shared_dir / "fixtures" / "nccl" / "h800_16x_2node_alltoall_cuda_error_nccltests355.txt"
    code, out, err = moectl("topology", "parse-nccl", cut, "--json")
    assert code == 1
    data = json.loads(out)
    assert data["complete"] is False and data["errors"][0]["line"] == 28
    assert "incomplete" in err


def test_probe_cli_gloo_two_ranks(moectl, tmp_path):
    topo = tmp_path / "t.yaml"
    topo.write_text((EXAMPLES / "hgx-h200-8gpu.yaml").read_text())
    code, out, _ = moectl(
        "topology",
        "probe",
        "--ops",
        "all_reduce,alltoall",
        "--min",
        "1K",
        "--max",
        "2K",
        "--iters",
        "2",
        "--ranks",
        "2",
        "--update",
        topo,
        "--json",
    )
    assert code == 0
    runs = {r["op"]: r for r in json.loads(out)["runs"]}
    assert [row["size"] for row in runs["all_reduce"]["rows"]] == [1024, 2048]
    assert all(row["wrong"] == 0 for r in runs.values() for row in r["rows"])
    code, out, _ = moectl("topology", "show", "--from", topo, "--json")
    links = json.loads(out)["links"]
    gpu_links = [x for x in links if x["kind"] == "nvlink"]
    assert {x["source"] for x in gpu_links} == {"measured"}
    peak = max(row["busbw_GBps"] for row in runs["all_reduce"]["rows"])
    assert gpu_links[0]["bandwidth_GBps"] == peak
